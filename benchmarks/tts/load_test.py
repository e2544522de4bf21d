"""Burst load test: new requests arrive while streams are playing; throttling on vs off.

In each mode a fresh server is started on the same checkpoint; ``--running`` streams start at
t=0 and play long utterances; at ``--burst-at`` seconds ``--burst`` newcomers with long prompts
(expensive prefills) arrive at once. For the running streams we report the p99 gap between
chunks after the burst and the underruns of a real-time player (``--prebuffer``); for the
newcomers their time to first audio. With playback-slack throttling the prefills are fitted
into the running streams' slack (split or deferred) instead of stalling them.

    python benchmarks/tts/load_test.py --model /tmp/ck-small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import TEXTS, pct, server  # noqa: E402
from clients.playback import simulate_playback  # noqa: E402
from clients.stream_client import stream_speech  # noqa: E402

LONG = " ".join(TEXTS * 2)  # two paragraphs: a prefill of ~700 positions (several frames of work)


async def scenario(url: str, a) -> dict:
    t0 = time.monotonic()

    async def runner(i: int):
        return await stream_speech(url, TEXTS[i % len(TEXTS)], None, "english", seed=i,
                                   extra={"max_new_tokens": a.running_frames}, timeout=600)

    async def newcomer(i: int):
        await asyncio.sleep(a.burst_at)
        return await stream_speech(url, LONG + f" Request {i}.", None, "english", seed=100 + i,
                                   extra={"max_new_tokens": a.burst_frames}, timeout=600)

    res = await asyncio.gather(*[runner(i) for i in range(a.running)],
                               *[newcomer(i) for i in range(a.burst)])
    running, new = res[:a.running], res[a.running:]
    burst_t = t0 + a.burst_at
    gaps, underruns, under_s = [], 0, 0.0
    for r in running:
        arr = r.arrivals
        gaps += [b - x for x, b in zip(arr, arr[1:]) if b >= burst_t]
        pb = simulate_playback(arr, r.durations, a.prebuffer)
        underruns += pb.underruns
        under_s += pb.underrun_s
    return dict(gap_ms_p50=pct(gaps, 0.5) * 1e3, gap_ms_p99=pct(gaps, 0.99) * 1e3,
                gap_ms_max=max(gaps) * 1e3 if gaps else float("nan"),
                underruns=underruns, underrun_s=under_s,
                newcomer_ttfa_ms=[r.ttfa_s * 1e3 for r in new],
                newcomer_ttfa_ms_p50=pct([r.ttfa_s * 1e3 for r in new], 0.5),
                running_rtf=[r.rtf for r in running])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--running", type=int, default=3)
    ap.add_argument("--running-frames", type=int, default=150)
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--burst-frames", type=int, default=30)
    ap.add_argument("--burst-at", type=float, default=3.0)
    ap.add_argument("--prebuffer", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--server-args", default="--max-streams 8 --max-seq-len 1024")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/load_test.json"))
    a = ap.parse_args()
    machine = machine_info()
    rows = {}
    log = Path(a.out).with_suffix(".server.log")
    for rep in range(a.repeats):
        for mode in ("on", "off"):
            extra = a.server_args.split() + ([] if mode == "on" else ["--no-throttle"])
            with server(a.model, extra, log) as url:
                r = asyncio.run(scenario(url, a))
            rows.setdefault(mode, []).append(r)
            print(f"[{rep}] throttling {mode}: gap p99 {r['gap_ms_p99']:.0f} ms, underruns "
                  f"{r['underruns']} ({r['underrun_s']:.2f} s), newcomer TTFA p50 "
                  f"{r['newcomer_ttfa_ms_p50']:.0f} ms", flush=True)
    med = {m: {k: float(sorted(x[k] for x in v)[len(v) // 2]) for k in
               ("gap_ms_p50", "gap_ms_p99", "gap_ms_max", "underruns", "underrun_s",
                "newcomer_ttfa_ms_p50")} for m, v in rows.items()}
    print()
    print_machine(machine)
    print(f"{'throttling':10} | {'gap p50':>8} {'gap p99':>8} {'gap max':>8} ms | {'underruns':>9} "
          f"{'(s)':>6} | newcomer TTFA p50 ms")
    for m, r in med.items():
        print(f"{m:10} | {r['gap_ms_p50']:8.0f} {r['gap_ms_p99']:8.0f} {r['gap_ms_max']:8.0f}    | "
              f"{r['underruns']:>9.0f} {r['underrun_s']:6.2f} | {r['newcomer_ttfa_ms_p50']:.0f}")
    better = med["on"]["gap_ms_p99"] < med["off"]["gap_ms_p99"] and \
        med["on"]["underruns"] <= med["off"]["underruns"]
    print("throttling lowers the p99 gap and underruns:", better)
    Path(a.out).write_text(json.dumps(dict(
        model=a.model, settings=vars(a), median=med, runs=rows, throttling_better=better,
        machine=machine,
        command="python benchmarks/tts/load_test.py " + " ".join(sys.argv[1:])), indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
