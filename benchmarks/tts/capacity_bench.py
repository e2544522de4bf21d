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
import contextlib
import contextvars
import json
import os
import re
import shlex
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import (SAMPLES_PER_FRAME, TEXTS, first_voice,  # noqa: E402
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


# ------------------------------------------------------------ the steady-load check
def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (this client, the server and its stage processes)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def cpu_snapshot() -> dict:
    """Busy CPU seconds of the machine (steal included) and of this benchmark's process tree."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    return dict(t=time.monotonic(), busy_s=busy,
                ours_s=sum(_proc_cpu_s(p) for p in _tree(os.getpid())), load=os.getloadavg())


def others_cores(a: dict, b: dict) -> float:
    """Cores that processes other than this benchmark and its server used between a and b."""
    return round(max(0.0, (b["busy_s"] - a["busy_s"]) - (b["ours_s"] - a["ours_s"]))
                 / max(b["t"] - a["t"], 1e-9), 3)


async def steady_load(url: str, clients: int, seconds: float, voice: str | None, args,
                      first: int) -> tuple[list[dict], list[dict]]:
    """``clients`` clients, each sending its next request when the previous ends, until
    ``seconds`` have passed (a request started before then runs to its end); /health every
    second. Returns (requests, health timeline)."""
    t0 = time.monotonic()
    rows: list[dict] = []
    timeline: list[dict] = []
    ids = iter(range(first, first + 1_000_000))

    async def client(k: int) -> None:
        while time.monotonic() - t0 < seconds:
            r = await offer(url, next(ids), voice, args)
            r.update(client=k, started_s=round(time.monotonic() - t0, 2))
            rows.append(r)
            if r["outcome"] != "admitted":
                await asyncio.sleep(0.5)  # refused: the Retry-After a client would honour

    async def health() -> None:
        while True:
            h = await asyncio.to_thread(get_json, url + "/health")
            timeline.append(dict(t_s=round(time.monotonic() - t0, 2),
                                 **{k: h.get(k) for k in HEALTH_KEYS}))
            await asyncio.sleep(1.0)

    poll = asyncio.create_task(health())
    try:
        await asyncio.gather(*[client(k) for k in range(clients)])
    finally:
        poll.cancel()
    return rows, timeline


def steady_checks(cap_start: int, cap_after: int | None, timeline: list[dict],
                  single: list[dict], steady: list[dict], clients: int) -> dict:
    """The three checks of the module docstring, with their figures."""
    ok_single = [r for r in single if r["outcome"] == "admitted"]
    ok = [r for r in steady if r["outcome"] == "admitted"]
    ttfa1 = pct([r["ttfa_ms"] for r in ok_single], 0.5) if ok_single else None
    ttfas = [r["ttfa_ms"] for r in ok]
    seen = [h["capacity_streams"] for h in timeline if isinstance(h.get("capacity_streams"), int)]
    under = sum(r["underruns"] for r in ok)
    limit = 2 * ttfa1 if ttfa1 is not None else None
    return dict(
        clients=clients, capacity_at_start=cap_start, capacity_after=cap_after,
        capacity_min=min(seen) if seen else None, capacity_max=max(seen) if seen else None,
        capacity_held=cap_after == cap_start,
        streams=len(ok), refused=sum(r["outcome"] == "refused" for r in steady),
        errors=sum(r["outcome"] in ("error", "other_status") for r in steady),
        underruns=under, underruns_single=sum(r["underruns"] for r in ok_single),
        streams_with_underruns=sum(1 for r in ok if r["underruns"]),
        gap_free=bool(ok) and under == 0 and all(r["outcome"] == "admitted" for r in steady),
        ttfa_single_ms_p50=ttfa1, ttfa_ms_max=max(ttfas) if ttfas else None,
        ttfa_ms_p50=pct(ttfas, 0.5) if ttfas else None,
        ttfa_ms_p95=pct(ttfas, 0.95) if ttfas else None, ttfa_limit_ms=limit,
        ttfa_within=bool(ttfas) and limit is not None and max(ttfas) <= limit,
        rtf_max=max(r["rtf"] for r in ok) if ok else None)


def print_checks(c: dict, seconds: float, others: float) -> list[str]:
    """Print the checks; returns the failed ones."""
    lines = [
        (c["capacity_held"], f"capacity at start {c['capacity_at_start']} == capacity after "
         f"{seconds:g} s of steady load at {c['clients']} client(s): {c['capacity_after']} "
         f"(lowest seen {c['capacity_min']}, highest {c['capacity_max']})"),
        (c["gap_free"], f"every admitted stream gap-free: {c['underruns']} underruns in "
         f"{c['streams']} streams ({c['refused']} refused, {c['errors']} errors; single-stream "
         f"runs: {c['underruns_single']} underruns)"),
        (c["ttfa_within"], f"TTFA of each of {c['clients']} client(s)' {c['streams']} requests "
         f"<= 2 x single-stream TTFA: max {fmt(c['ttfa_ms_max'], '.0f')} ms (p50 "
         f"{fmt(c['ttfa_ms_p50'], '.0f')}, p95 {fmt(c['ttfa_ms_p95'], '.0f')}), limit 2 x "
         f"{fmt(c['ttfa_single_ms_p50'], '.0f')} = {fmt(c['ttfa_limit_ms'], '.0f')} ms"),
    ]
    print(f"steady load, {c['clients']} client(s) for {seconds:g} s:")
    for good, text in lines:
        print(f"  [{'PASS' if good else 'FAIL'}] {text}")
    print(f"  other processes on this machine used {others:.2f} cores on average meanwhile")
    return [text for good, text in lines if not good]


def write_md(path: Path, doc: dict) -> None:
    """A Markdown summary of the run beside its JSON."""
    m, h = doc["machine"], doc["health"]
    out = [f"# capacity_bench: {doc.get('label') or Path(doc['model']).name}", "",
           f"Machine: {m.get('label')} (1 thread {m.get('bandwidth_gbs_1_thread')} GB/s; load "
           f"average at start {m.get('load_avg_at_start')}; measured {m.get('measured_at')}).",
           f"Server: `omni-stream serve --model {doc['model']} {doc['server_args']}`; /health at "
           f"start: capacity {h.get('capacity_streams')}, RTF estimate {h.get('rtf_estimate')}, "
           f"bandwidth {h.get('bandwidth_gbs')} GB/s, slots {h.get('slots')}.",
           f"Command: `{doc['command']}`", ""]
    st = doc.get("steady")
    if st:
        c = st["checks"]
        out += ["## Steady load at capacity", "",
                f"{c['clients']} client(s), each sending its next {doc['frames']}-frame request "
                f"as soon as the previous ended, for {st['seconds']:g} s; other processes used "
                f"{st['others_cores']:.2f} cores on average meanwhile.", "",
                "| check | result | figures |", "|---|---|---|",
                f"| capacity at start == after {st['seconds']:g} s | "
                f"{'PASS' if c['capacity_held'] else 'FAIL'} | {c['capacity_at_start']} -> "
                f"{c['capacity_after']} (lowest {c['capacity_min']}) |",
                f"| every admitted stream gap-free | {'PASS' if c['gap_free'] else 'FAIL'} | "
                f"{c['underruns']} underruns in {c['streams']} streams, {c['refused']} refused |",
                f"| TTFA <= 2 x single-stream | {'PASS' if c['ttfa_within'] else 'FAIL'} | max "
                f"{fmt(c['ttfa_ms_max'], '.0f')} ms, p95 {fmt(c['ttfa_ms_p95'], '.0f')}; single "
                f"p50 {fmt(c['ttfa_single_ms_p50'], '.0f')} ms |", ""]
    if doc["summaries"]:
        out += ["## Load levels", "", "| clients | offered | admitted | refused | underruns "
                "| TTFA p50 ms | p95 | RTF p50 | capacity after |", "|---" * 9 + "|"]
        for s in doc["summaries"]:
            out.append(f"| {s['concurrency']} | {s['offered']} | {s['admitted']} | "
                       f"{s['refused']} | {s['underruns']} | {fmt(s['ttfa_ms_p50'], '.0f')} | "
                       f"{fmt(s['ttfa_ms_p95'], '.0f')} | {fmt(s['rtf_p50'], '.2f')} | "
                       f"{s['capacity_after']} |")
        out.append("")
    if doc["failures"] or doc["notes"]:
        out += ["## Notes", ""] + [f"- {x}" for x in doc["failures"] + doc["notes"]] + [""]
    path.write_text("\n".join(out))


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
            single = []
            for k in range(args.single_runs):
                idle(url)
                single += asyncio.run(round_of(url, 1, 20_000 + k, voice, args))
            print(f"  single stream: TTFA p50 "
                  f"{pct([r['ttfa_ms'] for r in single if 'ttfa_ms' in r] or [0], 0.5):.0f} ms "
                  f"over {len(single)} requests", flush=True)
            idle(url)
            before = cpu_snapshot()
            rows, timeline = asyncio.run(steady_load(url, cap, args.steady_s, voice, args,
                                                     30_000))
            after_cpu = cpu_snapshot()
            after = get_json(url + "/health")
            checks = steady_checks(cap, after.get("capacity_streams"), timeline, single, rows,
                                   cap)
            others = others_cores(before, after_cpu)
            check_failures = print_checks(checks, args.steady_s, others)
            steady = dict(seconds=args.steady_s, checks=checks, health_after=after,
                          timeline=timeline, single=single, requests=rows,
                          others_cores=others, load_before=before["load"],
                          load_after=after_cpu["load"])
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
               steady=steady, checks_failed=check_failures, wall_s=round(wall, 1),
               command="python benchmarks/tts/capacity_bench.py " + shlex.join(
                   argv if argv is not None else sys.argv[1:]))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    write_md(out.with_suffix(".md"), doc)
    print(f"wrote {out} and {out.with_suffix('.md').name} ({doc['wall_s']} s)")
    return 1 if loud or check_failures else 0


if __name__ == "__main__":
    sys.exit(main())
