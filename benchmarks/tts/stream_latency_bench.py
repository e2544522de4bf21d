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
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.harness import first_voice, level_summary, server, stream_level  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from clients.stream_client import ClientError  # noqa: E402


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
                    rows = asyncio.run(stream_level(url, c, args, voice, lambda: prog.advance(task)))
                    results[str(c)] = rows
                    summaries.append(level_summary(c, rows))
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
    from benchmarks.tts.harness import emulation

    # a run on this machine told it is another (harness.ISA_ENV): its figures are that kind's,
    # not this machine's (summary/headline.py leaves it out of this machine's headlines)
    doc = dict(label=args.label, model=args.model or args.url, prebuffer_s=args.prebuffer,
               server_args=args.server_args, profile=profile, machine=machine, emulation=emulation(),
               summaries=summaries, streams=results,
               command="python benchmarks/tts/stream_latency_bench.py " + shlex.join(argv or sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
