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

    python benchmarks/tts/capacity_bench.py --model /tmp/ck-06b
    python benchmarks/tts/capacity_bench.py --model /tmp/tiny --samples 3 --frames 20   # smoke

Prints a table under the machine header, writes JSON (default
benchmarks/tts/results/capacity_bench.json) with the machine, the server's /health before and
after every level, and every request. Exit 1 when a 5xx other than a 503 refusal, a transport
error or a broken stream occurred, or the server never reported a capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import re
import shlex
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.stream_latency_bench import (SAMPLES_PER_FRAME, TEXTS, first_voice,  # noqa: E402
                                                 pct, server)
from clients.stream_client import ClientError, stream_speech  # noqa: E402

REFUSAL = (429, 503)
HEALTH_KEYS = ("capacity_streams", "rtf_estimate", "realtime", "contention", "bandwidth_gbs",
               "margin", "slots")
_ANSWERED = re.compile(r"server answered (\d{3}): ?(.*)", re.S)

# ------------------------------------------------------------ status and Retry-After per request
# stream_speech opens its own aiohttp session and reports a non-200 answer only as
# ClientError("server answered N: <message>"): the headers are gone. While the benchmark runs,
# every aiohttp session gets one trace hook that copies the status and Retry-After of each
# response into the record of the asyncio task that sent it (a context variable).
_RECORD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("capacity_bench_record",
                                                                      default=None)


async def _on_response(session, ctx, params) -> None:
    rec = _RECORD.get()
    if rec is not None:
        rec["status"] = params.response.status
        rec["retry_after"] = params.response.headers.get("Retry-After")


@contextlib.contextmanager
def response_headers():
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(_on_response)
    plain = aiohttp.ClientSession

    def session(*a, **kw):
        kw["trace_configs"] = [*(kw.get("trace_configs") or []), trace]
        return plain(*a, **kw)

    aiohttp.ClientSession = session
    try:
        yield
    finally:
        aiohttp.ClientSession = plain


# ------------------------------------------------------------ requests
async def offer(url: str, i: int, voice: str | None, args) -> dict:
    """One request: its outcome (admitted / refused / other_status / error) and figures."""
    rec: dict = dict(i=i, status=None, retry_after=None)
    _RECORD.set(rec)
    t0 = time.monotonic()
    try:
        res = await stream_speech(url, TEXTS[i % len(TEXTS)], voice, args.language, seed=i,
                                  extra={"max_new_tokens": args.frames}, timeout=args.timeout)
    except ClientError as e:
        msg = str(e)
        m = _ANSWERED.match(msg)
        if m and rec["status"] is None:
            rec["status"] = int(m.group(1))
        status = rec["status"]
        kind = ("error" if status in (None, 200) else "refused" if status in REFUSAL
                else "other_status")
        rec.update(outcome=kind, error=(m.group(2) if m else msg)[:300],
                   answered_ms=round((time.monotonic() - t0) * 1e3, 1))
        return rec
    pb = res.playback(args.prebuffer)
    whole = len(res.pcm) > 0 and len(res.pcm) % SAMPLES_PER_FRAME == 0
    rec.update(outcome="admitted" if whole else "error", ttfa_ms=round(res.ttfa_s * 1e3, 1),
               rtf=round(res.rtf, 4), audio_s=round(res.audio_s, 3), underruns=pb.underruns,
               underrun_s=round(pb.underrun_s, 3), max_gap_ms=round(pb.max_gap_s * 1e3, 1))
    if not whole:
        rec["error"] = (f"{len(res.pcm)} samples: not a whole number of {SAMPLES_PER_FRAME}-"
                        "sample frames")
    return rec


async def round_of(url: str, n: int, first: int, voice: str | None, args) -> list[dict]:
    return await asyncio.gather(*[offer(url, first + k, voice, args) for k in range(n)])


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def idle(url: str, wait_s: float = 10.0) -> bool:
    """Wait until the server runs no stream (its slots are back) before the next round."""
    from benchmarks.tts.soak import metrics

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        m = metrics(url)
        if m.get("active_streams", 0) == 0 and m.get("slots_free") == m.get("slots_total"):
            return True
        time.sleep(0.05)
    return False


def summarize(n: int, rows: list[dict], rounds: int, capacity: int | None, after: dict) -> dict:
    ok = [r for r in rows if r["outcome"] == "admitted"]
    refused = [r for r in rows if r["outcome"] == "refused"]
    other = [r for r in rows if r["outcome"] == "other_status"]
    errors = [r for r in rows if r["outcome"] == "error"]
    t, rtf = [r["ttfa_ms"] for r in ok], [r["rtf"] for r in ok]
    by_status: dict[str, int] = {}
    for r in other:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
    retry = [float(r["retry_after"]) for r in refused if r["retry_after"] is not None]
    return dict(
        concurrency=n, rounds=rounds, offered=len(rows), admitted=len(ok),
        refused=len(refused), refused_429=sum(r["status"] == 429 for r in refused),
        refused_503=sum(r["status"] == 503 for r in refused),
        refused_with_retry_after=len(retry), refused_without_retry_after=len(refused) - len(retry),
        retry_after_s=[min(retry), max(retry)] if retry else None,
        other_status=by_status, other_5xx=sum(c for s, c in by_status.items() if int(s) >= 500),
        errors=len(errors), error_messages=sorted({r.get("error", "") for r in errors + other})[:5],
        underruns=sum(r["underruns"] for r in ok), underrun_s=round(sum(r["underrun_s"] for r in ok), 3),
        streams_with_underruns=sum(1 for r in ok if r["underruns"]),
        ttfa_n=len(t), ttfa_ms_p50=pct(t, 0.5) if t else None, ttfa_ms_p95=pct(t, 0.95) if t else None,
        rtf_p50=pct(rtf, 0.5) if rtf else None, rtf_max=max(rtf) if rtf else None,
        within_capacity=capacity is not None and n <= capacity,
        refused_within_capacity=capacity is not None and n <= capacity and len(refused) > 0,
        capacity_after=after.get("capacity_streams"), rtf_estimate_after=after.get("rtf_estimate"),
        realtime_after=after.get("realtime"), contention_after=after.get("contention"))


def fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def print_table(summaries: list[dict]) -> None:
    print(f"{'conc':>4} {'rnd':>3} | {'offer':>5} {'admit':>5} {'refused':>7} {'429':>4} {'503':>4} "
          f"{'R-A':>4} {'other':>5} {'err':>3} | {'underruns':>9} {'(s)':>6} | {'TTFA p50':>8} "
          f"{'p95':>6} {'n':>3} ms | {'RTF p50':>7} {'max':>5} | {'cap after':>9} {'RTF est':>7}")
    for s in summaries:
        other = sum(s["other_status"].values())
        print(f"{s['concurrency']:>4} {s['rounds']:>3} | {s['offered']:>5} {s['admitted']:>5} "
              f"{s['refused']:>7} {s['refused_429']:>4} {s['refused_503']:>4} "
              f"{s['refused_with_retry_after']:>4} {other:>5} {s['errors']:>3} | "
              f"{s['underruns']:>9} {s['underrun_s']:6.2f} | {fmt(s['ttfa_ms_p50'], '8.0f')} "
              f"{fmt(s['ttfa_ms_p95'], '6.0f')} {s['ttfa_n']:>3}    | {fmt(s['rtf_p50'], '7.2f')} "
              f"{fmt(s['rtf_max'], '5.2f')} | {str(s['capacity_after']):>9} "
              f"{fmt(s['rtf_estimate_after'], '7.3f')}")
    print("(R-A: refusals that carried a Retry-After header; other: any status but 200/429/503; "
          "err: transport errors and broken streams)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder for `omni-stream serve`")
    ap.add_argument("--server-args", default="", help="extra args for omni-stream serve")
    ap.add_argument("--levels", default=None,
                    help="concurrent clients per level, e.g. 1,2,3,4 (default: 1 .. 2 x capacity)")
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
    try:
        fixed = [int(x) for x in args.levels.split(",") if x.strip()] if args.levels else None
    except ValueError:
        ap.error("--levels: comma-separated positive integers, e.g. 1,2,3,4")
    if fixed is not None and (not fixed or min(fixed) < 1):
        ap.error("--levels: comma-separated positive integers, e.g. 1,2,3,4")
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
    with server(args.model, serve, out.with_suffix(".server.log")) as url, response_headers():
        health = get_json(url + "/health")
        cap = health.get("capacity_streams")
        if not isinstance(cap, int) and fixed is None:
            print(f"benchmark failed: /health reports no capacity_streams ({health}); pass "
                  "--levels to offer load anyway", file=sys.stderr)
            return 1
        levels = fixed or list(range(1, 2 * cap + 1))
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
    print_table(summaries)
    loud = []
    for s in summaries:
        if s["other_5xx"]:
            loud.append(f"concurrency {s['concurrency']}: {s['other_5xx']} responses with a 5xx "
                        f"status other than a 503 refusal: {s['other_status']} "
                        f"{s['error_messages']}")
        elif s["other_status"]:
            loud.append(f"concurrency {s['concurrency']}: unexpected statuses {s['other_status']} "
                        f"{s['error_messages']}")
        if s["errors"]:
            loud.append(f"concurrency {s['concurrency']}: {s['errors']} transport errors or broken "
                        f"streams: {s['error_messages']}")
        if s["refused_without_retry_after"]:
            loud.append(f"concurrency {s['concurrency']}: {s['refused_without_retry_after']} "
                        "refusals without a Retry-After header")
    notes = []
    for s in summaries:
        if s["refused_within_capacity"]:
            notes.append(f"concurrency {s['concurrency']} <= capacity {cap}: {s['refused']} "
                         "refused")
        if s["within_capacity"] and s["underruns"]:
            notes.append(f"concurrency {s['concurrency']} <= capacity {cap}: {s['underruns']} "
                         f"underruns in {s['streams_with_underruns']} admitted streams")
    if not_idle:
        notes.append(f"the server still ran streams 10 s after a round (levels {sorted(set(not_idle))})")
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
               wall_s=round(wall, 1),
               command="python benchmarks/tts/capacity_bench.py " + shlex.join(
                   argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({doc['wall_s']} s)")
    return 1 if loud else 0


if __name__ == "__main__":
    sys.exit(main())
