"""Screenshots of the pages for docs/: a real server on the tiny random model (written to a
temporary folder, nothing downloaded), a little load on it, and headless Chromium (Debian's,
driven by Playwright, as the browser tests run it).

    .venv/bin/python scripts/screenshots.py             # every page
    .venv/bin/python scripts/screenshots.py dashboard   # docs/dashboard.png only
    .venv/bin/python scripts/screenshots.py playground  # docs/playground.png only

Each page has one function in ``SHOTS``: ``shot(browser, url, out_dir) -> Path``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # browser_harness: the tests' Chromium, one setup

log = logging.getLogger("screenshots")
VIEWPORT = {"width": 1200, "height": 820}
LOAD_TEXT = ("A little load for the screenshot: two streams at a time, one sentence after "
             "another, so that the chart shows where each frame step's time goes.")


@contextlib.contextmanager
def tiny_server(tmp: Path) -> Iterator[str]:
    """The browser tests' server (tests/conftest.py ui_server): the tiny custom-voice model."""
    from omni_stream.checkpoints.io import write_random_checkpoint
    from omni_stream.orchestrator import PipelineBackend, PipelineSettings
    from omni_stream.scheduling.chunking import ChunkPolicy
    from omni_stream.server.app import start_server
    from omni_stream.server.settings import ServerSettings
    from omni_stream.server.testing import serving_in_thread

    ckpt = write_random_checkpoint(tmp / "tiny", "tiny", "custom_voice", seed=0)
    settings = PipelineSettings(model_path=str(ckpt), max_streams=2, max_seq_len=1024,
                                max_queue=8, queue_timeout_s=60,
                                schedule=ChunkPolicy(first=1, steady=4))
    with serving_in_thread(lambda: start_server(PipelineBackend(settings), "127.0.0.1", 0,
                                                ServerSettings(voice_dir=str(tmp / "voices"))),
                           timeout=180) as url:
        yield url


@contextlib.contextmanager
def load(url: str, streams: int = 2) -> Iterator[None]:
    """``streams`` clients speaking one request after another for the block."""
    stop = threading.Event()
    body = json.dumps({"input": LOAD_TEXT, "voice": "vivian", "response_format": "pcm",
                       "max_new_tokens": 100}).encode()  # 8 s each: the load stops soon

    def client() -> None:
        while not stop.is_set():
            req = urllib.request.Request(url + "/v1/audio/speech", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def dashboard(browser, url: str, out_dir: Path, seconds: float = 25.0) -> Path:
    """docs/dashboard.png: the dashboard after ``seconds`` of two streams at a time."""
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(url + "/dashboard")
        page.wait_for_function("window.omniDashboard && window.omniDashboard.polls >= 1")
        with load(url):
            time.sleep(seconds)
            page.wait_for_function("window.omniDashboard.last.step_ms !== null",
                                   timeout=30_000)
            out = out_dir / "dashboard.png"
            page.screenshot(path=str(out), full_page=True)
    finally:
        page.close()
    return out


def playground(browser, url: str, out_dir: Path) -> Path:
    """docs/playground.png: the playground while it plays a request, after its last chunk came
    (TTFA and RTF shown, the waveform moving)."""
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(url + "/")
        page.wait_for_function("document.getElementById('voice').options.length > 0")
        page.select_option("#voice", "ryan")
        page.select_option("#language", "english")
        page.fill("#seed", "7")
        page.click("#speak")
        page.wait_for_function("omniPlayground.events.some(e => e.type === 'audio.done') && "
                               "omniPlayground.stats.state === 'playing'", timeout=60_000)
        page.evaluate("document.activeElement.blur()")
        time.sleep(0.3)  # a few waveform frames
        out = out_dir / "playground.png"
        page.screenshot(path=str(out), full_page=True)
    finally:
        page.close()
    return out


SHOTS: dict[str, Callable[..., Path]] = {"dashboard": dashboard, "playground": playground}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pages", nargs="*", help=f"which pages (default: all of {', '.join(SHOTS)})")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    a = p.parse_args()
    unknown = [n for n in a.pages if n not in SHOTS]
    if unknown:
        p.error(f"no page {', '.join(unknown)}: choose from {', '.join(SHOTS)}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from browser_harness import launch

    with tempfile.TemporaryDirectory() as tmp, tiny_server(Path(tmp)) as url, launch() as b:
        for name in a.pages or list(SHOTS):
            out = SHOTS[name](b, url, a.out)
            log.info("%s: %s (%.0f KB)", name, out, out.stat().st_size / 1024)


if __name__ == "__main__":
    main()
