"""What the benchmarks share: a server to measure, a client load to drive it, the statistics
and the table syntax of their reports. The machine header lives beside it (machine.py).

    from benchmarks.tts.harness import TEXTS, pct, server

    with server(model, ["--max-streams", "4"], out.with_suffix(".server.log")) as url:
        rows = asyncio.run(stream_level(url, 2, args, first_voice(url)))
    print(level_summary(2, rows))

- ``server()`` starts ``omni-stream serve`` on a free port, waits for /health and stops it at
  the end (a server that dies or never comes up ends the benchmark, naming its log).
- ``stream_one`` / ``stream_level`` / ``level_summary``: the streaming measurement of
  stream_latency_bench.py (TTFA, RTF, a simulated real-time player's underruns per stream; one
  concurrency level over the fixed ``TEXTS``), which cpu_thread_sweep.py repeats per setting.
- ``pct`` (linear interpolation between the two nearest ranks, numpy's default; nan for no
  samples) and ``median_ms`` (a callable's median wall time): one definition for every table.
- ``markdown_table``: the ``| a | b |`` table the Markdown reports write.

Importing this module starts nothing; ``clients.stream_client`` is imported by the functions
that stream, so a frame benchmark that only needs ``pct`` does not load aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["SAMPLES_PER_FRAME", "TEXTS", "first_voice", "free_port", "level_summary",
           "markdown_table", "median_ms", "pct", "server", "stream_level", "stream_one"]

TEXTS = [
    "Hello there! This is a short sentence.",
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest.",
    "Streaming speech means the first words play while the rest is still being made.",
    "Numbers like 42 and 2026, names like OpenAI, and punctuation: all read aloud.",
    "Good morning. Today the weather is sunny with a light breeze from the west.",
    "A ten word sentence is what a voice assistant usually answers.",
    "Please hold while I look that up for you in the catalogue.",
    "Thank you for calling; your request has been received and will be processed.",
]
# The variables that make this machine run as one of another kernel level: the native runtime
# capped by OMNI_STREAM_CPU_ISA, torch / oneDNN / MKL alike (docs/configuration.md). The AVX2
# emulation is a typical laptop's, desktop's or Zen 2/3 server's instruction set on this
# machine's cores and memory.
ISA_ENV = {
    "avx2": {"OMNI_STREAM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OMNI_STREAM_HW_PROFILE": '{"isa": ["avx", "avx2", "fma", "f16c"]}'},
    "scalar": {"OMNI_STREAM_CPU_ISA": "scalar", "ATEN_CPU_CAPABILITY": "default"},
    "avx512": {"OMNI_STREAM_CPU_ISA": "avx512"},
}

# every variable ISA_ENV sets: a run that finds one in its environment ran as another machine
EMULATION_VARS = tuple(sorted({k for env in ISA_ENV.values() for k in env}))


def emulation() -> dict[str, str]:
    """The ISA_ENV variables set in this environment (empty: the machine as it is)."""
    return {k: os.environ[k] for k in EMULATION_VARS if k in os.environ}


SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz: a stream returns a whole number of frames


# ------------------------------------------------------------ statistics
def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, interpolated between the two nearest ranks."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median_ms(fn: Callable[[], Any], n: int, warmup: int = 0) -> float:
    """Median wall time of ``n`` calls of ``fn`` in ms, after ``warmup`` untimed calls
    (allocator, oneDNN primitive caches)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


# ------------------------------------------------------------ tables
def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of already formatted cells (no trailing newline)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------ the server under test
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_voice(url: str) -> str | None:
    """The server's first voice (None: the model has none), the benchmarks' default voice."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/audio/voices", timeout=10) as r:
        voices = [v["name"] if isinstance(v, dict) else v for v in json.load(r).get("voices", [])]
    return voices[0] if voices else None


@contextlib.contextmanager
def server(model: str, extra: list[str], log_path: Path) -> Iterator[str]:
    """``omni-stream serve --model model *extra`` on a free port, its output in ``log_path``;
    yields its URL once /health answers 200 (10 minutes at most), terminates it at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "omni_stream.cli", "serve", "--model", model, "--port", str(port),
           *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise SystemExit(f"server exited with {p.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"server did not come up; see {log_path}")
        yield url
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


# ------------------------------------------------------------ the streaming load
async def stream_one(url: str, text: str, voice: str | None, i: int, args, start_at: float) -> dict:
    """One stream, started at ``start_at`` (monotonic): TTFA, RTF, the player's underruns
    (``args.prebuffer`` s of start-up buffer) and every chunk's arrival. ``args`` carries
    max_new_tokens, greedy, language, served_model, timeout and prebuffer."""
    from clients.stream_client import ClientError, stream_speech

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    extra = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}
    if args.greedy:
        extra["greedy"] = True
    res = await stream_speech(url, text, voice, args.language, seed=i, model=args.served_model,
                              extra=extra, timeout=args.timeout)
    if len(res.pcm) == 0 or len(res.pcm) % SAMPLES_PER_FRAME:
        raise ClientError(f"stream {i} returned {len(res.pcm)} samples: not a whole number of "
                          f"{SAMPLES_PER_FRAME}-sample frames")
    pb = res.playback(args.prebuffer)
    t0 = res.arrivals[0] - res.ttfa_s
    return dict(ttfa_ms=res.ttfa_s * 1e3, rtf=res.rtf, audio_s=res.audio_s,
                underruns=pb.underruns, underrun_s=pb.underrun_s, max_gap_ms=pb.max_gap_s * 1e3,
                chunks=len(res.arrivals), arrivals_s=[a - t0 for a in res.arrivals],
                durations_s=res.durations, text_words=len(text.split()))


async def stream_level(url: str, c: int, args, voice: str | None, progress=None) -> list[dict]:
    """``max(c, args.requests_per_level)`` streams over ``TEXTS``, ``c`` at a time."""
    n = max(c, args.requests_per_level)
    sem = asyncio.Semaphore(c)
    t0 = time.monotonic()

    async def run(i: int):
        async with sem:
            r = await stream_one(url, TEXTS[i % len(TEXTS)], voice, i, args, t0)
            if progress is not None:
                progress()
            return r

    return await asyncio.gather(*[run(i) for i in range(n)])


def level_summary(c: int, rows: list[dict]) -> dict:
    """One concurrency level's row of the stream-latency table (and JSON ``summaries``)."""
    t = [r["ttfa_ms"] for r in rows]
    return dict(concurrency=c, streams=len(rows), ttfa_ms_p50=pct(t, 0.5), ttfa_ms_p95=pct(t, 0.95),
                ttfa_ms_p99=pct(t, 0.99), rtf_mean=statistics.fmean(r["rtf"] for r in rows),
                rtf_p50=pct([r["rtf"] for r in rows], 0.5),
                max_gap_ms=max(r["max_gap_ms"] for r in rows),
                underruns=sum(r["underruns"] for r in rows),
                underrun_s=sum(r["underrun_s"] for r in rows),
                realtime_streams=sum(1 for r in rows if r["underruns"] == 0))
