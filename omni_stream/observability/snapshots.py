"""Step-timing snapshots: the histogram layout and the arithmetic on snapshot dicts.

A snapshot (``stepstats.snapshot()``, a dump file, or a merge of several) is plain JSON-able
data; everything here is a pure function of it: merging processes, percentiles, differences
over time, Prometheus buckets, the flat ``StatsReply.stats`` form and reading dumps back.
:mod:`.stepstats` re-exports all of it, so ``stepstats.merge_snapshots`` etc. keep working.

Each phase keeps count, sum, min, max and a fixed log-spaced histogram: bin 0 is [0, 1 us),
bins 1..160 cover 1 us .. 100 s at 20 bins per decade (each bin spans a factor 10^(1/20) =
1.122), the last bin is [100 s, inf). Percentiles interpolate (in log space) inside the bin that
holds the rank and are clamped to [min, max], so p50/p99 are within one bin (< 12.2 %) of the
exact order statistic, typically ~1 % for smooth distributions (tests/test_stepstats.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable

FORMAT_VERSION = 1

LO_S = 1e-6                  # lower edge of bin 1
DECADES = 8                  # 1 us .. 100 s
BINS_PER_DECADE = 20
NBINS = DECADES * BINS_PER_DECADE + 2   # + underflow [0, LO_S) + overflow [HI_S, inf)
HI_S = LO_S * 10.0 ** DECADES
LOG_LO = math.log10(LO_S)


def bin_index(seconds: float) -> int:
    """Histogram bin of a duration (>= 0)."""
    if seconds < LO_S:
        return 0
    i = int((math.log10(seconds) - LOG_LO) * BINS_PER_DECADE) + 1
    return i if i < NBINS - 1 else NBINS - 1


def bin_edges(i: int) -> tuple[float, float]:
    """[lower, upper) of bin ``i`` in seconds (bin 0 starts at 0, the last ends at inf)."""
    if i <= 0:
        return 0.0, LO_S
    if i >= NBINS - 1:
        return HI_S, math.inf
    return (LO_S * 10.0 ** ((i - 1) / BINS_PER_DECADE), LO_S * 10.0 ** (i / BINS_PER_DECADE))


def layout() -> dict[str, float]:
    """The histogram layout a snapshot records (merging checks it matches)."""
    return {"lo_s": LO_S, "decades": DECADES, "bins_per_decade": BINS_PER_DECADE}


def merge_snapshots(snaps: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum several snapshots (processes, or one process over time) into one snapshot."""
    phases: dict[str, dict[str, Any]] = {}
    procs = []
    for s in snaps:
        if s.get("version") != FORMAT_VERSION or s.get("hist") != layout():
            raise ValueError(f"snapshot of {s.get('process')!r} (pid {s.get('pid')}) has format "
                             f"{s.get('version')} / histogram {s.get('hist')}; this build reads "
                             f"{FORMAT_VERSION} / {layout()}: re-run with matching versions")
        procs.extend(s.get("processes") or [{"process": s["process"], "pid": s["pid"]}])
        for name, p in s["phases"].items():
            m = phases.get(name)
            if m is None:
                m = phases[name] = {"count": 0, "sum_s": 0.0, "min_s": math.inf, "max_s": 0.0,
                                    "bins": {}}
            if not p["count"]:
                continue
            m["count"] += p["count"]
            m["sum_s"] += p["sum_s"]
            m["min_s"] = min(m["min_s"], p["min_s"])
            m["max_s"] = max(m["max_s"], p["max_s"])
            for i, c in p["bins"]:
                m["bins"][i] = m["bins"].get(i, 0) + c
    for m in phases.values():
        m["bins"] = sorted([i, c] for i, c in m["bins"].items())
        if not m["count"]:
            m["min_s"] = 0.0
    return {"version": FORMAT_VERSION, "process": "merged", "pid": 0, "processes": procs,
            "started": 0.0, "time": time.time(), "hist": layout(), "phases": phases}


def quantile(p: dict[str, Any], q: float) -> float:
    """Estimated ``q``-quantile (0..1, numpy's linear definition) of one snapshot phase."""
    n = p["count"]
    if not n:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} must be within [0, 1]")
    if q == 0.0 or q == 1.0:
        return p["min_s"] if q == 0.0 else p["max_s"]
    target = q * (n - 1)  # 0-based rank
    seen = 0
    for i, c in p["bins"]:
        if target < seen + c:
            lo, hi = bin_edges(i)
            lo, hi = max(lo, p["min_s"]), min(hi, p["max_s"])
            f = min(1.0, (target - seen + 0.5) / c)
            if lo <= 0.0 or hi <= lo:  # underflow bin or a one-value bin: linear
                v = lo + (hi - lo) * f
            else:
                v = lo * (hi / lo) ** f
            return min(max(v, p["min_s"]), p["max_s"])
        seen += c
    return p["max_s"]


def summarize(p: dict[str, Any]) -> dict[str, float]:
    """count, sum, mean, min, max, p50, p99 (seconds) of one snapshot phase."""
    n = p["count"]
    return {"count": n, "sum_s": p["sum_s"], "mean_s": p["sum_s"] / n if n else math.nan,
            "min_s": p["min_s"], "max_s": p["max_s"], "p50_s": quantile(p, 0.5),
            "p99_s": quantile(p, 0.99)}


def diff_snapshots(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """What ``new`` recorded since ``old`` (same process): counts, sums and bins subtract;
    min/max are ``new``'s (not recoverable for the interval)."""
    phases = {}
    for name, p in new["phases"].items():
        o = old["phases"].get(name)
        if o is None:
            phases[name] = p
            continue
        ob = dict((i, c) for i, c in o["bins"])
        bins = [[i, c - ob.get(i, 0)] for i, c in p["bins"] if c - ob.get(i, 0)]
        phases[name] = {"count": p["count"] - o["count"], "sum_s": p["sum_s"] - o["sum_s"],
                        "min_s": p["min_s"], "max_s": p["max_s"], "bins": bins}
    return dict(new, phases=phases)


def cumulative_buckets(p: dict[str, Any], upper_bounds: Iterable[float]) -> list[float]:
    """Cumulative counts at each upper bound (plus +Inf last), Prometheus-style, from one
    snapshot phase; a bin goes to the first bound >= its geometric centre (exact to a bin)."""
    bounds = sorted(upper_bounds)
    out = [0.0] * (len(bounds) + 1)
    for i, c in p["bins"]:
        lo, hi = bin_edges(i)
        centre = hi / 2 if lo == 0.0 else (lo if math.isinf(hi) else math.sqrt(lo * hi))
        k = next((j for j, b in enumerate(bounds) if centre <= b), len(bounds))
        out[k] += c
    for j in range(1, len(out)):
        out[j] += out[j - 1]
    return out


_SEP = "|"


def flatten_snapshot(snap: dict[str, Any], prefix: str = "step") -> dict[str, float]:
    """A snapshot as flat ``{str: number}`` (fits ``StatsReply.stats``): keys
    ``<prefix>|<phase>|count|sum_s|min_s|max_s`` and ``<prefix>|<phase>|b<index>``."""
    out: dict[str, float] = {}
    for name, p in snap["phases"].items():
        k = f"{prefix}{_SEP}{name}{_SEP}"
        out[k + "count"] = p["count"]
        out[k + "sum_s"] = p["sum_s"]
        out[k + "min_s"] = p["min_s"]
        out[k + "max_s"] = p["max_s"]
        for i, c in p["bins"]:
            out[f"{k}b{i}"] = c
    return out


def unflatten_snapshot(flat: dict[str, float], process: str, pid: int,
                       prefix: str = "step") -> dict[str, Any]:
    """Inverse of :func:`flatten_snapshot` (other keys in ``flat`` are ignored)."""
    phases: dict[str, dict[str, Any]] = {}
    head = prefix + _SEP
    for key, v in flat.items():
        if not key.startswith(head):
            continue
        name, _, field = key[len(head):].rpartition(_SEP)
        p = phases.setdefault(name, {"count": 0, "sum_s": 0.0, "min_s": 0.0, "max_s": 0.0,
                                     "bins": []})
        if field.startswith("b"):
            p["bins"].append([int(field[1:]), int(v)])
        else:
            p[field] = int(v) if field == "count" else float(v)
    for p in phases.values():
        p["bins"].sort()
    return {"version": FORMAT_VERSION, "process": process, "pid": pid, "started": 0.0,
            "time": time.time(), "hist": layout(), "phases": phases}


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    """Read one dump file written by :func:`dump`."""
    snap = json.loads(Path(path).read_text())
    if not isinstance(snap, dict) or "phases" not in snap:
        raise ValueError(f"{path} is not a step-stats dump (no 'phases')")
    return snap
