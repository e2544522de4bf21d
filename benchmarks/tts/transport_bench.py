"""Per-hop latency between two processes: shared-memory ring vs multiprocessing.Queue.

One hop = producer calls put() -> consumer's get() returns the message (both clocks are
CLOCK_MONOTONIC, shared by all processes). Messages are spaced by --interval-us so every one
finds the consumer asleep (as a stage waiting for the next 80 ms frame would be): the figure
includes the wake-up, both copies and, for the Queue, pickling and its feeder thread. Variants:

  ring         get() copies the payload out (default)
  ring-view    get(copy=False): zero-copy view, released right after the timestamp
  ring-spin    consumer busy-polls up to --spin-us (default 2x the interval: it never sleeps,
               burning a core) before blocking: the hop with an awake consumer
  mp.Queue     multiprocessing.Queue (pickle + pipe + feeder thread)
  ring-inproc  reference, not a hop: put() then get() in ONE process, paced like the others
               (no wake-up, no cross-core traffic, but the same idle gaps)
  ring-hot     reference: put() then get() in one process back to back (hot caches): the
               transport's own CPU cost, both copies included

On a VM, code that runs right after the CPU went idle is several times slower than the same code
run hot (a put of 1920 float32 takes ~28 us after a 2 ms sleep vs ~6 us hot on the 2-vCPU dev
box); ring-inproc vs ring-hot shows that share, ring vs ring-inproc the wake-up's.

    python benchmarks/tts/transport_bench.py [--n 3000] [--interval-us 2000]

Prints a table (median / p99 / mean / max in microseconds, plus the median time spent inside
put() on the producer side: the copy-in, or for the Queue the hand-off to its feeder thread)
and writes benchmarks/tts/results/transport_bench.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omni_stream.transport import Ring, SegmentRegistry  # noqa: E402
from omni_stream.scheduling.fingerprint import fingerprint_info  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

PAYLOADS = {
    "codes int64 16x2048": lambda: np.arange(16 * 2048, dtype=np.int64).reshape(16, 2048),
    "pcm float32 1920": lambda: np.linspace(-1, 1, 1920, dtype=np.float32),
}
VARIANTS = ("ring", "ring-view", "ring-spin", "mp.Queue", "ring-inproc", "ring-hot")


def _pace(t_next: float, interval_s: float) -> float:
    delay = t_next - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    return t_next + interval_s


def ring_producer(handle, payload_name: str, n: int, interval_s: float, conn) -> None:
    ring = handle.open()
    arr = PAYLOADS[payload_name]()
    put_us = []
    t_next = time.perf_counter()
    for i in range(n):
        t_next = _pace(t_next, interval_s)
        t = time.monotonic_ns()
        if not ring.put(arr, seq=i, timeout=10):
            raise RuntimeError(f"put {i} timed out")
        put_us.append((time.monotonic_ns() - t) / 1e3)
    conn.send(put_us)
    ring.close()


def queue_producer(q, payload_name: str, n: int, interval_s: float, conn) -> None:
    arr = PAYLOADS[payload_name]()
    put_us = []
    t_next = time.perf_counter()
    for i in range(n):
        t_next = _pace(t_next, interval_s)
        t = time.monotonic_ns()
        q.put((t, i, arr))
        put_us.append((time.monotonic_ns() - t) / 1e3)
    conn.send(put_us)
    q.close()
    q.join_thread()


def run_one(ctx, variant: str, payload_name: str, n: int, warmup: int, interval_s: float,
            spin_us: float, registry: SegmentRegistry) -> tuple[list[float], list[float]]:
    """(put->get latencies, time inside put) in us of n messages after `warmup`."""
    total = n + warmup
    lat, put_us = [], []
    if variant in ("ring-inproc", "ring-hot"):
        arr = PAYLOADS[payload_name]()
        ring = Ring.create("bench", max(1 << 20, 8 * arr.nbytes), registry=registry)
        prod, cons = ring.handle("producer").open(), ring.handle("consumer").open()
        t_next = time.perf_counter()
        for i in range(total):
            if variant == "ring-inproc":
                t_next = _pace(t_next, interval_s)
            prod.put(arr, seq=i)
            t = time.monotonic_ns()
            m = cons.get(timeout=1)
            if i >= warmup:
                lat.append((m.get_ns - m.put_ns) / 1e3)
                put_us.append((t - m.put_ns) / 1e3)
        for r in (prod, cons, ring):
            r.close()
        ring.unlink()
        return lat, put_us
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    if variant == "mp.Queue":
        q = ctx.Queue()
        proc = ctx.Process(target=queue_producer,
                           args=(q, payload_name, total, interval_s, child_conn))
        proc.start()
        for i in range(total):
            t_put, seq, arr = q.get(timeout=30)
            t_get = time.monotonic_ns()
            assert seq == i
            if i >= warmup:
                lat.append((t_get - t_put) / 1e3)
    else:
        nbytes = PAYLOADS[payload_name]().nbytes
        ring = Ring.create("bench", max(1 << 20, 8 * nbytes), role="consumer", registry=registry,
                           spin_us=spin_us if variant == "ring-spin" else 0.0)
        proc = ctx.Process(target=ring_producer, args=(ring.handle("producer"), payload_name,
                                                       total, interval_s, child_conn))
        proc.start()
        copy = variant != "ring-view"
        for i in range(total):
            m = ring.get(timeout=30, copy=copy)
            assert m is not None and m.seq == i, f"lost message {i}"
            m.release()
            if i >= warmup:
                lat.append((m.get_ns - m.put_ns) / 1e3)
        ring.close()
        ring.unlink()
    put_us = parent_conn.recv()[warmup:]
    proc.join(30)
    if proc.exitcode != 0:
        raise RuntimeError(f"{variant} producer exited with {proc.exitcode}")
    return lat, put_us


def summarize(lat: list[float], put_us: list[float]) -> dict[str, float]:
    a = np.asarray(lat)
    return {"n": int(a.size), "median_us": round(float(np.median(a)), 2),
            "p99_us": round(float(np.percentile(a, 99)), 2), "mean_us": round(float(a.mean()), 2),
            "max_us": round(float(a.max()), 2),
            "put_median_us": round(float(np.median(put_us)), 2)}


def _table(rows: list[dict]) -> str:
    head = (f"{'payload':<22}{'transport':<12}{'median us':>11}{'p99 us':>10}{'mean us':>10}"
            f"{'max us':>10}{'in put us':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['payload']:<22}{r['transport']:<12}{r['median_us']:>11.1f}"
                     f"{r['p99_us']:>10.1f}{r['mean_us']:>10.1f}{r['max_us']:>10.1f}"
                     f"{r['put_median_us']:>11.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="measured messages per run")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--interval-us", type=float, default=2000.0,
                    help="spacing of puts (wide enough that mp.Queue keeps up with 256 KiB)")
    ap.add_argument("--spin-us", type=float, default=None,
                    help="busy-poll budget of ring-spin (default: 2x --interval-us)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/tts/results/transport_bench.json")
    args = ap.parse_args()
    ctx = mp.get_context(args.start_method)
    if args.spin_us is None:
        args.spin_us = 2 * args.interval_us
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    machine = machine_info()
    rows = []
    t0 = time.monotonic()
    with SegmentRegistry() as registry:
        for payload_name in PAYLOADS:
            for variant in variants:
                lat, put_us = run_one(ctx, variant, payload_name, args.n, args.warmup,
                                      args.interval_us / 1e6, args.spin_us, registry)
                rows.append({"payload": payload_name, "transport": variant,
                             "payload_bytes": PAYLOADS[payload_name]().nbytes,
                             **summarize(lat, put_us)})
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print_machine(machine)
    print(_table(rows))
    result = {
        "benchmark": "transport_hop_latency",
        "hop": "put() entry -> get() return, two processes, consumer asleep between messages",
        "n": args.n, "warmup": args.warmup, "interval_us": args.interval_us,
        "spin_us": args.spin_us, "start_method": args.start_method,
        "python": platform.python_version(), "numpy": np.__version__,
        "cpu": fingerprint_info()["cpu_model"], "cpu_count": os.cpu_count(),
        "load_avg_at_end": list(os.getloadavg()), "wall_s": round(time.monotonic() - t0, 1),
        "machine": machine, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")




if __name__ == "__main__":
    main()
