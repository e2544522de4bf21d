"""The steady-load check (issue 37): as many clients as /health's capacity, each sending its
next request when the previous ends, for S seconds, /health read every second; then the three
checks of capacity_bench.py's docstring (capacity held, every admitted stream gap-free, TTFA at
most 2x the single-stream TTFA), with the CPU other processes used meanwhile."""

from __future__ import annotations

import asyncio
import os
import time

from benchmarks.tts.capacity.offers import HEALTH_KEYS, get_json, idle, offer, round_of
from benchmarks.tts.capacity.report import fmt
from benchmarks.tts.harness import pct


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


def run_steady(url: str, cap: int, voice: str | None, args) -> tuple[dict, list[str]]:
    """``args.single_runs`` single-stream requests, then ``args.steady_s`` seconds of steady load
    at ``cap`` clients; prints the checks. Returns (the JSON's ``steady``, the failed checks)."""
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
    return steady, check_failures
