"""Does the server keep the capacity it advertises? Load levels around /health's capacity_streams.

Starts ``omni-stream serve`` with the default profile on ``--model DIR`` (``--max-queue 0`` by
default: a request past the capacity is refused at once, never queued), reads /health
(capacity_streams, rtf_estimate, realtime, bandwidth_gbs: what the server measured at start-up),
then offers load levels from 1 concurrent client up to 2 x capacity (``--levels`` to choose).
A level is rounds of N requests sent at once, each streaming pcm (``max_new_tokens``
``--frames``) into a player that starts at the first byte; rounds repeat until ``--samples``
admitted streams have been measured (at most ``--max-rounds``). Per level: offered, admitted,
refused (429 / 503, and whether each refusal carried Retry-After), any other status (5xx are
reported loudly and fail the run), the underruns of admitted streams, their TTFA p50/p95 and
RTF p50/max, and the capacity /health reports after the level. Below or at the capacity every
request should be admitted and play without an underrun; above it the extra requests should be
refused with Retry-After while the admitted ones still play clean.

With ``--steady-s S`` it first checks the promise the capacity makes (issue 37), on the
fresh server before any level:

1. single-stream TTFA: ``--single-runs`` requests one after the other (p50 is the reference);
2. steady load: as many clients as /health's capacity at start, each sending its next request
   as soon as the previous one ends, for S seconds, while /health is read every second;
3. three checks, printed PASS / FAIL: the capacity /health reported at start equals the one
   it reports after the S seconds; every admitted stream played gap-free; the TTFA of each
   request of those clients is at most 2x the single-stream TTFA p50. Beside them, the CPU
   that processes other than the server and this client used meanwhile (a busy host is named,
   not hidden).

    python benchmarks/tts/capacity_bench.py --model /tmp/ck-06b
    python benchmarks/tts/capacity_bench.py --model /tmp/ck-06b --steady-s 60 --levels none
    python benchmarks/tts/capacity_bench.py --model /tmp/tiny --samples 3 --frames 20   # smoke

Prints a table under the machine header, writes JSON (default
benchmarks/tts/results/capacity_bench.json) with the machine, the server's /health before and
after every level, and every request, and a Markdown summary beside it (``.md``). Exit 1 when a
5xx other than a 503 refusal, a transport error or a broken stream occurred, the server never
reported a capacity, or (``--steady-s``) a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.capacity.offers import get_json, idle, response_headers, round_of  # noqa: E402
from benchmarks.tts.capacity.report import (print_table, run_failures, run_notes,  # noqa: E402
                                            summarize, write_md)
from benchmarks.tts.capacity.steady import run_steady  # noqa: E402
from benchmarks.tts.harness import first_voice, server  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder for `omni-stream serve`")
    ap.add_argument("--server-args", default="", help="extra args for omni-stream serve")
    ap.add_argument("--levels", default=None,
                    help="concurrent clients per level, e.g. 1,2,3,4 (default: 1 .. 2 x capacity; "
                         "'none': no levels)")
    ap.add_argument("--steady-s", type=float, default=0.0,
                    help="first check the capacity under this many seconds of steady load at "
                         "capacity (the module docstring; 0: skip)")
    ap.add_argument("--single-runs", type=int, default=5,
                    help="single-stream requests whose TTFA p50 the steady check compares with")
    ap.add_argument("--frames", type=int, default=100, help="max_new_tokens per request")
    ap.add_argument("--samples", type=int, default=20,
                    help="admitted streams to measure per level (rounds of N repeat until then)")
    ap.add_argument("--max-rounds", type=int, default=20, help="cap on rounds per level")
    ap.add_argument("--max-queue", type=int, default=0,
                    help="serve --max-queue (0: past the capacity is refused at once)")
    ap.add_argument("--queue-timeout", type=float, default=None, help="serve --queue-timeout")
    ap.add_argument("--prebuffer", type=float, default=0.0, help="player start-up buffer (s)")
    ap.add_argument("--language", default="english")
    ap.add_argument("--voice", default=None)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed 4-frame request before the first level")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    ap.add_argument("--label", default=None, help="name of this run in the JSON")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/capacity_bench.json"))
    args = ap.parse_args(argv)
    if args.frames < 1 or args.samples < 1 or args.max_rounds < 1 or args.max_queue < 0:
        ap.error("--frames, --samples and --max-rounds must be >= 1, --max-queue >= 0")
    if args.steady_s < 0 or args.single_runs < 1:
        ap.error("--steady-s must be >= 0 and --single-runs >= 1")
    no_levels = args.levels is not None and args.levels.strip().lower() == "none"
    try:
        fixed = [int(x) for x in args.levels.split(",") if x.strip()] \
            if args.levels and not no_levels else None
    except ValueError:
        ap.error("--levels: comma-separated positive integers, e.g. 1,2,3,4, or none")
    if fixed is not None and (not fixed or min(fixed) < 1):
        ap.error("--levels: comma-separated positive integers, e.g. 1,2,3,4, or none")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    serve = ["--max-queue", str(args.max_queue), *shlex.split(args.server_args)]
    if args.queue_timeout is not None:
        serve += ["--queue-timeout", str(args.queue_timeout)]
    t_start = time.monotonic()
    summaries: list[dict] = []
    requests: dict[str, list[dict]] = {}
    health_after: dict[str, dict] = {}
    not_idle: list[int] = []
    steady = None
    check_failures: list[str] = []
    with server(args.model, serve, out.with_suffix(".server.log")) as url, response_headers():
        health = get_json(url + "/health")
        cap = health.get("capacity_streams")
        if not isinstance(cap, int) and fixed is None:
            print(f"benchmark failed: /health reports no capacity_streams ({health}); pass "
                  "--levels to offer load anyway", file=sys.stderr)
            return 1
        levels = [] if no_levels else (fixed or list(range(1, 2 * cap + 1)))
        print(f"/health: capacity_streams {cap}, rtf_estimate {health.get('rtf_estimate')}, "
              f"realtime {health.get('realtime')}, bandwidth {health.get('bandwidth_gbs')} GB/s, "
              f"slots {health.get('slots')}; levels {levels}", flush=True)
        voice = args.voice or first_voice(url)
        if args.warmup:
            w = argparse.Namespace(**{**vars(args), "frames": 4})
            r = asyncio.run(round_of(url, 1, 10_000, voice, w))[0]
            if r["outcome"] != "admitted":
                print(f"benchmark failed: warm-up request {r['outcome']} (status {r['status']}): "
                      f"{r.get('error')}", file=sys.stderr)
                return 1
        i = 0
        if args.steady_s > 0:
            if not isinstance(cap, int) or cap < 1:
                print(f"benchmark failed: no capacity to hold ({health})", file=sys.stderr)
                return 1
            steady, check_failures = run_steady(url, cap, voice, args)
        for n in levels:
            rows: list[dict] = []
            rounds = 0
            while rounds < args.max_rounds and sum(r["outcome"] == "admitted" for r in rows) < args.samples:
                if not idle(url):
                    not_idle.append(n)
                got = asyncio.run(round_of(url, n, i, voice, args))
                for r in got:
                    r["round"] = rounds
                rows += got
                i += n
                rounds += 1
                if not any(r["outcome"] == "admitted" for r in got) and rounds >= 3:
                    break  # nothing gets in: more rounds would measure nothing
            after = get_json(url + "/health")
            health_after[str(n)] = after
            s = summarize(n, rows, rounds, cap, after)
            summaries.append(s)
            requests[str(n)] = rows
            print(f"  concurrency {n}: {s['admitted']}/{s['offered']} admitted in {rounds} rounds, "
                  f"{s['refused']} refused, {s['underruns']} underruns, capacity now "
                  f"{after.get('capacity_streams')}", flush=True)
    wall = time.monotonic() - t_start
    print()
    print_machine(machine)
    if summaries:
        print_table(summaries)
    loud = run_failures(summaries)
    notes = run_notes(summaries, cap, not_idle)
    for line in loud:
        print(f"!!! {line}", file=sys.stderr)
    for line in notes:
        print(f"note: {line}")
    doc = dict(benchmark="capacity_bench", label=args.label, model=args.model,
               server_args=shlex.join(serve), max_queue=args.max_queue,
               queue_timeout=args.queue_timeout, frames=args.frames, samples=args.samples,
               max_rounds=args.max_rounds, prebuffer_s=args.prebuffer, levels=levels,
               machine=machine, health=health, health_after=health_after,
               capacity_streams=cap, rtf_estimate=health.get("rtf_estimate"),
               realtime=health.get("realtime"), bandwidth_gbs=health.get("bandwidth_gbs"),
               underruns_admitted=sum(s["underruns"] for s in summaries),
               underruns_within_capacity=sum(s["underruns"] for s in summaries
                                             if s["within_capacity"]),
               failures=loud, notes=notes, summaries=summaries, requests=requests,
               steady=steady, checks_failed=check_failures, wall_s=round(wall, 1),
               command="python benchmarks/tts/capacity_bench.py " + shlex.join(
                   argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    write_md(out.with_suffix(".md"), doc)
    print(f"wrote {out} and {out.with_suffix('.md').name} ({doc['wall_s']} s)")
    return 1 if loud or check_failures else 0


if __name__ == "__main__":
    sys.exit(main())
