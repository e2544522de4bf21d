"""Reading the pipeline's part counters (``scheduling.attribution.PartCounters``) at one moment.

The talker's counters are its own step timings (``stepstats`` sums of ``talker.step``,
``talker.code_predictor`` and ``frame.total``, with the step count), returned by the talker
stage for a ``StatsRequest`` (``attribution.talker_phase_sums``). The CPU times come from
Linux's ``/proc``: the codec stage's process, this (the server's) process, and the busy time of
the pipeline's cores less what the pipeline's processes used (other processes, and the
hypervisor's steal on a VM; approximate where the server runs on other cores too). On a system
without ``/proc`` those fields are NaN and their parts are left out.
"""

from __future__ import annotations

import logging
import math
import os

from omni_stream.scheduling.attribution import PartCounters

log = logging.getLogger(__name__)


def _tick() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far; NaN if unreadable."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _tick()  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return math.nan


def cores_busy_s(cpus: set[int] | None) -> float:
    """Busy CPU seconds (all but idle and iowait; steal included) of ``cpus`` (None: all)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return math.nan
    total = 0
    seen = False
    for line in lines:
        name, *vals = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpus is not None and cpu not in cpus:
            continue
        v = [int(x) for x in vals[:8]] + [0] * max(0, 8 - len(vals))
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        seen = True
    return total / _tick() if seen else math.nan


def counters(t: float, talker: dict, codec_pid: int | None, stage_pids: list[int | None],
             cpus: set[int] | None) -> PartCounters:
    """One ``PartCounters`` from the talker's reply (``talker_phase_sums`` fields) and /proc.
    ``stage_pids``: every pipeline process (talker, code predictor, codec), whose CPU is not
    "others"; ``cpus``: the pipeline's cores (None: the whole machine)."""
    server = process_cpu_s(os.getpid())
    stages = [process_cpu_s(p) for p in stage_pids]
    busy = cores_busy_s(cpus)
    ours = server + sum(stages)
    return PartCounters(
        t=t, steps=int(talker.get("talker.step|count", 0)),
        step_s=float(talker.get("talker.step|sum_s", 0.0)),
        cp_s=float(talker.get("talker.code_predictor|sum_s", 0.0)),
        loop_s=float(talker.get("frame.total|sum_s", 0.0)),
        codec_cpu_s=process_cpu_s(codec_pid), server_cpu_s=server,
        other_cpu_s=busy - ours if not math.isnan(busy + ours) else math.nan)


__all__ = ["cores_busy_s", "counters", "process_cpu_s"]
