"""The machine a benchmark ran on, measured when it starts: CPU model, CPU counts and memory read
bandwidth now (one thread and all usable cores), for the ``machine`` key of every result JSON
and a one-line header printed beside its table.

    from benchmarks.tts.machine import machine_info, print_machine

    machine = machine_info()       # first thing in main(), before any server or worker starts
    ...
    print_machine(machine)         # next to the table
    doc["machine"] = machine       # in the JSON

Bandwidth is ``omni_stream.edge.measure.memory_bandwidth_gbs`` (what the server measures at
start-up), the median of a few calls: about a second in all. A loaded machine reads lower, so
the figure says what the benchmark's own numbers had to work with; ``load_avg`` is kept beside
it.

    python benchmarks/tts/machine.py        # print the header and the JSON
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omni_stream.scheduling.fingerprint import fingerprint_info, hardware_fingerprint  # noqa: E402

__all__ = ["machine_info", "machine_label", "print_machine"]


def _bandwidth(threads: int, calls: int, mib: int) -> float:
    from omni_stream.edge.measure import memory_bandwidth_gbs

    return round(statistics.median(memory_bandwidth_gbs(threads, mib=mib, repeats=5)
                                   for _ in range(calls)), 1)


def _short_cpu(model: str) -> str:
    """'AMD EPYC 7B13 64-Core Processor' -> 'AMD EPYC 7B13'; '(R)', '(TM)', 'CPU @ x GHz' go."""
    s = re.sub(r"\((R|TM|tm|r)\)", "", model)
    s = re.sub(r"\s+CPU\s*@.*$|\s+@\s*[\d.]+\s*GHz.*$", "", s)
    s = re.sub(r"\s+\d+-Core Processor$|\s+Processor$", "", s)
    return " ".join(s.split()) or model


def machine_label(info: dict[str, Any]) -> str:
    """'AMD EPYC, 2 cores, 38.1 GB/s (2 threads)' (+ ', GPU <name>' where one is visible)."""
    n, total = info.get("usable_cpus"), info.get("logical_cpus")
    cores = f"{n} cores" if n == total else f"{n} of {total} cpus"
    label = (f"{_short_cpu(str(info.get('cpu_model')))}, {cores}, "
             f"{info.get('bandwidth_gbs')} GB/s ({info.get('bandwidth_threads')} threads)")
    if info.get("gpus"):
        label += ", GPU " + " + ".join(info["gpus"])
    return label


def machine_info(calls: int = 3, mib: int = 256) -> dict[str, Any]:
    """This machine now: CPU model (/proc/cpuinfo), logical and usable CPUs, memory read
    bandwidth on 1 thread and on every usable core (median of ``calls`` calls of
    ``memory_bandwidth_gbs``, each itself a median of 5 passes over ``mib`` MiB), the load
    average, when and how long it took, and a ``label``."""
    t0 = time.perf_counter()
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    fp = fingerprint_info()
    usable = int(fp["cpu_usable"])
    load = [round(x, 2) for x in os.getloadavg()]
    bw1 = _bandwidth(1, calls, mib)
    bwn = _bandwidth(usable, calls, mib) if usable > 1 else bw1
    info: dict[str, Any] = dict(
        cpu_model=fp["cpu_model"], logical_cpus=int(fp["cpu_count"]), usable_cpus=usable,
        bandwidth_gbs_1_thread=bw1, bandwidth_gbs=bwn, bandwidth_threads=usable,
        bandwidth_method=f"omni_stream.edge.measure.memory_bandwidth_gbs(threads, mib={mib}, "
                         f"repeats=5), median of {calls} calls",
        ram_gib=fp.get("ram_gib"), isa=fp.get("isa"), gpus=fp.get("gpus") or [],
        torch=fp.get("torch"), fingerprint=hardware_fingerprint(fp), load_avg_at_start=load,
        measured_at=when, measure_s=round(time.perf_counter() - t0, 2))
    info["label"] = machine_label(info)
    return info


def print_machine(info: dict[str, Any] | None, file=None) -> None:
    """One header line: label, one-thread bandwidth, load at start."""
    if not info:
        print("machine: not recorded", file=file)
        return
    print(f"machine: {info.get('label')}; 1 thread {info.get('bandwidth_gbs_1_thread')} GB/s; "
          f"load {', '.join(str(x) for x in info.get('load_avg_at_start', []))} "
          f"(measured {info.get('measured_at')})", file=file or sys.stdout, flush=True)


if __name__ == "__main__":
    m = machine_info()
    print_machine(m)
    print(json.dumps(m, indent=1))
