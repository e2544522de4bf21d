"""Streaming latency under concurrency: TTFA, RTF, chunk gaps and underruns per stream.

Drives a running server (``--url``) or starts one (``--model DIR|default``) with a concurrency
sweep over a fixed set of texts. Per stream it records time to first audio at the client
socket, every chunk's arrival, the real-time factor and the underruns of a simulated real-time
player (``--prebuffer`` seconds of start-up buffer). Prints a table, writes JSON.

    python benchmarks/tts/stream_latency_bench.py --model default --concurrency 1,2,4,8

Fails loudly (exit 1) when the server is unreachable or a stream returns a wrong sample count:
no numbers from broken runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from clients.stream_client import ClientError, stream_speech  # noqa: E402

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
SAMPLES_PER_FRAME = 1920


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


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
def server(model: str, extra: list[str], log_path: Path):
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


async def one(url: str, text: str, voice: str | None, i: int, args, start_at: float) -> dict:
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


async def level(url: str, c: int, args, voice: str | None, progress=None) -> list[dict]:
    n = max(c, args.requests_per_level)
    sem = asyncio.Semaphore(c)
    t0 = time.monotonic()

    async def run(i: int):
        async with sem:
            r = await one(url, TEXTS[i % len(TEXTS)], voice, i, args, t0)
            if progress is not None:
                progress()
            return r

    return await asyncio.gather(*[run(i) for i in range(n)])


def summarize(c: int, rows: list[dict]) -> dict:
    t = [r["ttfa_ms"] for r in rows]
    return dict(concurrency=c, streams=len(rows), ttfa_ms_p50=pct(t, 0.5), ttfa_ms_p95=pct(t, 0.95),
                ttfa_ms_p99=pct(t, 0.99), rtf_mean=statistics.fmean(r["rtf"] for r in rows),
                rtf_p50=pct([r["rtf"] for r in rows], 0.5),
                max_gap_ms=max(r["max_gap_ms"] for r in rows),
                underruns=sum(r["underruns"] for r in rows),
                underrun_s=sum(r["underrun_s"] for r in rows),
                realtime_streams=sum(1 for r in rows if r["underruns"] == 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url")
    src.add_argument("--model", help="start a server on this checkpoint ('default' = embedded)")
    ap.add_argument("--server-args", default="", help="extra args for omni-stream serve")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--requests-per-level", type=int, default=4)
    ap.add_argument("--voice", default=None)
    ap.add_argument("--language", default="english")
    ap.add_argument("--served-model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--prebuffer", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--label", default=None, help="name of this run in the JSON")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/stream_latency.json"))
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    ctx = server(args.model, args.server_args.split(), out.with_suffix(".server.log")) if args.model \
        else contextlib.nullcontext(args.url)
    from rich.progress import Progress

    results, summaries = {}, []
    try:
        with ctx as url:
            voice = args.voice or first_voice(url)
            with Progress() as prog:
                for c in levels:
                    n = max(c, args.requests_per_level)
                    task = prog.add_task(f"concurrency {c}", total=n)
                    rows = asyncio.run(level(url, c, args, voice, lambda: prog.advance(task)))
                    results[str(c)] = rows
                    summaries.append(summarize(c, rows))
    except ClientError as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"benchmark failed: server unreachable: {e}", file=sys.stderr)
        return 1
    print_machine(machine)
    print(f"{'conc':>4} {'n':>3} | {'TTFA p50':>8} {'p95':>7} {'p99':>7} ms | {'RTF':>5} | "
          f"{'max gap':>8} ms | {'underruns':>9} {'(s)':>6} | realtime")
    for s in summaries:
        print(f"{s['concurrency']:>4} {s['streams']:>3} | {s['ttfa_ms_p50']:8.0f} {s['ttfa_ms_p95']:7.0f} "
              f"{s['ttfa_ms_p99']:7.0f}    | {s['rtf_mean']:5.2f} | {s['max_gap_ms']:8.0f}    | "
              f"{s['underruns']:>9} {s['underrun_s']:6.2f} | {s['realtime_streams']}/{s['streams']}")
    profile = {}
    log_path = out.with_suffix(".server.log")
    if args.model and log_path.is_file():  # the effective profile the server logged at start
        import re

        for key in ("weight_path", "dtype", "talker_threads", "codec_threads", "placement",
                    "compile", "engine", "steady_chunk"):
            m = re.search(rf"^{key}\s+(\S+)\s+(\S+)$", log_path.read_text(), re.M)
            if m:
                profile[key] = m.group(1)
    doc = dict(label=args.label, model=args.model or args.url, prebuffer_s=args.prebuffer,
               server_args=args.server_args, profile=profile, machine=machine,
               summaries=summaries, streams=results,
               command="python benchmarks/tts/stream_latency_bench.py " + shlex.join(argv or sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
