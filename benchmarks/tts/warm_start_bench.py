"""Cold vs warm start of ``omni-stream serve --compile``, beside the eager start.

Three server starts on the same checkpoint, each a fresh process tree:
  eager  no compilation;
  cold   --compile with an empty compile cache (OMNI_STREAM_CACHE_DIR in a temp folder);
  warm   --compile again with the cache the cold start left.
For each: seconds from launch until /health answers (stages loaded, compiled or loaded from the
cache, and warmed up), the time to first audio of one request after that, and the stage log's
compile counters (graphs compiled vs loaded from the cache).

    python benchmarks/tts/warm_start_bench.py --model /tmp/ck-06b --server-args "--weight-path int8"

``--no-compile``: the server as its profile picks it (no --compile): cold is an empty cache (the
CPU runtime built, its weights packed and written to the pack cache, no chunk calibration),
warm the same start again with that cache; there is no eager row.

    python benchmarks/tts/warm_start_bench.py --model /tmp/ck-06b --no-compile

Prints a table, writes benchmarks/tts/results/warm_start_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import server  # noqa: E402
from clients.stream_client import stream_speech  # noqa: E402

STATS = re.compile(r"'graphs_compiled': (\d+), 'graphs_from_cache': (\d+)")


def start(label: str, model: str, extra: list[str], cache: Path, logdir: Path, voice) -> dict:
    import os

    os.environ["OMNI_STREAM_CACHE_DIR"] = str(cache)
    log = logdir / f"{label}.log"
    t0 = time.monotonic()
    with server(model, extra, log) as url:
        ready = time.monotonic() - t0
        res = asyncio.run(stream_speech(url, "Hello there, this is the first request.",
                                        voice=voice, language="english", seed=0,
                                        extra={"max_new_tokens": 8}))
    text = log.read_text()
    counts = [tuple(map(int, m)) for m in STATS.findall(text)]
    return dict(start=label, ready_s=ready, first_ttfa_ms=res.ttfa_s * 1e3,
                graphs_compiled=sum(c for c, _ in counts) if counts else None,
                graphs_from_cache=sum(h for _, h in counts) if counts else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--no-compile", action="store_true",
                    help="cold and warm starts of the profile's own engine (no --compile)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/warm_start_bench.json"))
    a = ap.parse_args()
    extra = shlex.split(a.server_args)
    machine = machine_info()
    rows = []
    with tempfile.TemporaryDirectory() as td:
        cache, logs = Path(td) / "cache", Path(td)
        if a.no_compile:
            rows.append(start("cold", a.model, extra, cache, logs, a.voice))
            rows.append(start("warm", a.model, extra, cache, logs, a.voice))
        else:
            # the embedded default model is written into the cache on first use: do it once, up front
            rows.append(start("eager", a.model, extra, cache, logs, a.voice))
            rows.append(start("cold", a.model, extra + ["--compile"], cache, logs, a.voice))
            rows.append(start("warm", a.model, extra + ["--compile"], cache, logs, a.voice))
    print_machine(machine)
    print(f"{'start':6} | {'ready s':>8} {'1st TTFA ms':>11} {'compiled':>8} {'from cache':>10}")
    for r in rows:
        print(f"{r['start']:6} | {r['ready_s']:8.1f} {r['first_ttfa_ms']:11.0f} "
              f"{str(r['graphs_compiled']):>8} {str(r['graphs_from_cache']):>10}")
    by = {r["start"]: r for r in rows}
    doc = dict(model=a.model, server_args=a.server_args, compile=not a.no_compile, rows=rows,
               machine=machine,
               cold_start_s=by["cold"]["ready_s"], warm_start_s=by["warm"]["ready_s"],
               eager_start_s=by["eager"]["ready_s"] if "eager" in by else None,
               command=" ".join(["python", "benchmarks/tts/warm_start_bench.py"]
                                + [shlex.quote(x) for x in sys.argv[1:]]))
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
