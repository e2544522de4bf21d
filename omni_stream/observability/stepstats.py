"""Per-step attribution: a process-local registry of phase timings, dumped as JSON and merged.

Every process of the pipeline (server, talker, code predictor, codec) times its phases here;
``omni-stream stats DIR`` (:mod:`.report`) merges the dumps into one table of shares of the
80 ms frame. Recording is cheap enough for the per-frame path (0.5-1 us on a slow 2-core VM,
~1.5 us for ``with phase()``: one dict lookup, a ``log10`` and a few float ops, nothing
allocated beyond the float itself)::

    from omni_stream.observability import stepstats

    stepstats.configure("talker")                 # once, at process start
    with stepstats.phase("talker.step"):          # perf_counter_ns around the block
        ...
    stepstats.record("server.admission_wait", seconds)
    stepstats.record_ns("hop.frames.put_get", msg.put_ns, msg.get_ns)   # same clock for both
    stepstats.dump()                              # on shutdown (SIGTERM may skip atexit)

Phase names: ``<stage>.<phase>``, lower case, dots only between levels.

* ``server.admission_wait`` (queued until a slot is free), ``server.dispatch`` (request ->
  AddStream sent), ``server.encode_write`` (encode one audio chunk and write it to the socket);
* ``talker.prefill`` (one stream's prompt), ``talker.step`` (one whole batched frame step),
  nested inside it ``talker.talker_lm`` and ``talker.code_predictor``; other talker-loop work
  (e.g. ``talker.emit``, ``talker.control``) also under ``talker.``;
* ``cp.*`` in the code-predictor process (split placement);
* hops, measured by the consumer from the record's stamps: ``hop.<ring>.enqueue_put``
  (produced -> written into the ring), ``hop.<ring>.put_get`` (in the ring, incl. wake-up),
  ``hop.<ring>.get`` (read + copy), for ``<ring>`` = ``frames``, ``audio``, ``cp``...;
* ``codec.decode`` (one Code2Wav step);
* ``frame.total``: the measured wall time of one talker-loop iteration that ran a frame step
  (from the top of the iteration: control, admission/prefill, step, putting the frames), the
  denominator the report compares the critical-path phases against.

A name's children are named ``<name>.<sub>`` (``talker.step.sample`` is inside ``talker.step``);
the report uses that to avoid double counting (see :mod:`.report`).

Each phase keeps count, sum, min, max and a fixed log-spaced histogram: bin 0 is [0, 1 us),
bins 1..160 cover 1 us .. 100 s at 20 bins per decade (each bin spans a factor 10^(1/20) =
1.122), the last bin is [100 s, inf). Percentiles interpolate (in log space) inside the bin that
holds the rank and are clamped to [min, max], so p50/p99 are within one bin (< 12.2 %) of the
exact order statistic, typically ~1 % for smooth distributions (tests/test_stepstats.py).

Environment (read by :func:`configure`, never at import time):

* ``OMNI_STREAM_STEP_STATS_DIR``: when set, the process writes ``<dir>/<process>-<pid>.json``
  (a :func:`snapshot`) at exit, on :func:`dump`, and every few seconds while it records;
* ``OMNI_STREAM_STEP_STATS_INTERVAL``: seconds between those periodic dumps (default 5; 0 turns
  periodic dumps off, leaving atexit and explicit :func:`dump`).

Listeners (:func:`add_listener`) see every recorded ``(name, seconds)``: the server registers
``observe_step`` so its own phases also feed Prometheus. Other processes ship :func:`snapshot`
(or :func:`flatten_snapshot` for a flat ``StatsReply.stats``) to the server.

Not locked: a phase timed concurrently from several threads may rarely lose an increment; async
tasks are fine (each ``phase()`` call has its own start time). After ``fork`` a configured
registry starts empty and unconfigured in the child.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

ENV_DIR = "OMNI_STREAM_STEP_STATS_DIR"
ENV_INTERVAL = "OMNI_STREAM_STEP_STATS_INTERVAL"
FORMAT_VERSION = 1

LO_S = 1e-6                  # lower edge of bin 1
DECADES = 8                  # 1 us .. 100 s
BINS_PER_DECADE = 20
NBINS = DECADES * BINS_PER_DECADE + 2   # + underflow [0, LO_S) + overflow [HI_S, inf)
HI_S = LO_S * 10.0 ** DECADES
_LOG_LO = math.log10(LO_S)
_TICK_EVERY = 16             # records between two looks at the clock for the periodic dump
_clock = time.perf_counter_ns  # module attribute so tests can inject a fake clock

Listener = Callable[[str, float], None]


class PhaseStats:
    """Accumulated timings of one phase; ``bins[i]`` counts durations in bin ``i``."""

    __slots__ = ("count", "total", "min", "max", "bins")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = 0.0
        self.bins = [0] * NBINS


_phases: dict[str, PhaseStats] = {}
_listeners: list[Listener] = []
_countdown = _TICK_EVERY
_state: dict[str, Any] = {"process": "", "pid": 0, "dir": None, "interval_ns": 0,
                          "next_dump_ns": 0, "started": 0.0, "atexit": False, "fork_hook": False}


def bin_index(seconds: float) -> int:
    """Histogram bin of a duration (>= 0)."""
    if seconds < LO_S:
        return 0
    i = int((math.log10(seconds) - _LOG_LO) * BINS_PER_DECADE) + 1
    return i if i < NBINS - 1 else NBINS - 1


def bin_edges(i: int) -> tuple[float, float]:
    """[lower, upper) of bin ``i`` in seconds (bin 0 starts at 0, the last ends at inf)."""
    if i <= 0:
        return 0.0, LO_S
    if i >= NBINS - 1:
        return HI_S, math.inf
    return (LO_S * 10.0 ** ((i - 1) / BINS_PER_DECADE), LO_S * 10.0 ** (i / BINS_PER_DECADE))


# ---------------------------------------------------------------------------------- recording
def record(name: str, seconds: float) -> None:
    """Add one duration (seconds; negative or NaN counts as 0) to phase ``name``."""
    global _countdown
    if not seconds >= 0.0:
        seconds = 0.0
    p = _phases.get(name)
    if p is None:
        p = _phases[name] = PhaseStats()
    p.count += 1
    p.total += seconds
    if seconds < p.min:
        p.min = seconds
    if seconds > p.max:
        p.max = seconds
    if seconds < LO_S:
        p.bins[0] += 1
    else:
        i = int((math.log10(seconds) - _LOG_LO) * BINS_PER_DECADE) + 1
        p.bins[i if i < NBINS - 1 else NBINS - 1] += 1
    if _listeners:
        for fn in _listeners:
            fn(name, seconds)
    _countdown -= 1
    if _countdown <= 0:
        _tick()


def record_ns(name: str, start_ns: int, end_ns: int) -> None:
    """Add ``end_ns - start_ns`` (both from one clock: perf_counter_ns within a process,
    monotonic_ns for stamps that crossed processes)."""
    record(name, (end_ns - start_ns) * 1e-9)


class phase:
    """``with phase("talker.step"):`` times the block with ``perf_counter_ns``; the duration is
    recorded even if the block raises, and is left in ``.seconds``."""

    __slots__ = ("name", "start_ns", "seconds")

    def __init__(self, name: str) -> None:
        self.name = name
        self.start_ns = 0
        self.seconds = 0.0

    def __enter__(self) -> "phase":
        self.start_ns = _clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = (_clock() - self.start_ns) * 1e-9
        record(self.name, self.seconds)


def add_listener(fn: Listener) -> None:
    """Call ``fn(name, seconds)`` for every record in this process (e.g. ``observe_step``)."""
    if fn not in _listeners:
        _listeners.append(fn)


def notify(name: str, seconds: float) -> None:
    """Hand a duration recorded elsewhere (a stage process's pushed timings) to this process's
    listeners only: this process's own registry and dumps keep what it timed itself."""
    for fn in _listeners:
        fn(name, seconds)


def remove_listener(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def reset() -> None:
    """Forget every recorded phase (configuration and listeners stay)."""
    _phases.clear()


# ------------------------------------------------------------------------- identity and dumps
def configure(process_name: str, *, dump_dir: str | os.PathLike | None = None,
              dump_interval_s: float | None = None) -> None:
    """Name this process (``server``, ``talker``, ``cp``, ``codec``) and set up dumping.

    ``dump_dir`` None reads ``OMNI_STREAM_STEP_STATS_DIR`` ("" = no dumps); ``dump_interval_s``
    None reads ``OMNI_STREAM_STEP_STATS_INTERVAL`` (default 5 s, 0 = only at exit / dump()).
    Calling it again re-configures (tests; a forked child naming itself).
    """
    global _countdown
    if not process_name or "/" in process_name or os.sep in process_name:
        raise ValueError(f"process name {process_name!r} must be a non-empty file-name part, "
                         "e.g. 'talker'")
    if dump_dir is None:
        dump_dir = os.environ.get(ENV_DIR, "")
    if dump_interval_s is None:
        raw = os.environ.get(ENV_INTERVAL, "5")
        try:
            dump_interval_s = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_INTERVAL}={raw!r} is not a number of seconds") from None
    if dump_interval_s < 0:
        raise ValueError(f"dump interval must be >= 0 s, got {dump_interval_s}")
    s = _state
    s.update(process=process_name, pid=os.getpid(), started=time.time(),
             dir=Path(dump_dir) if str(dump_dir) else None,
             interval_ns=int(dump_interval_s * 1e9) if str(dump_dir) else 0)
    s["next_dump_ns"] = _clock() + s["interval_ns"]
    _countdown = _TICK_EVERY
    if s["dir"] is not None and not s["atexit"]:
        atexit.register(_dump_at_exit)
        s["atexit"] = True
    if not s["fork_hook"] and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
        s["fork_hook"] = True


def process_name() -> str:
    return _state["process"]


def dump_path() -> Path | None:
    """Where :func:`dump` writes, or None when dumps are off."""
    s = _state
    if s["dir"] is None:
        return None
    return s["dir"] / f"{s['process']}-{os.getpid()}.json"


def dump() -> Path | None:
    """Write :func:`snapshot` to :func:`dump_path` atomically (tmp + rename); None if off."""
    path = dump_path()
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(snapshot(), separators=(",", ":")))
    os.replace(tmp, path)
    return path


def _tick() -> None:
    """Every few records: dump if the interval is up (cheap no-op when dumps are off)."""
    global _countdown
    s = _state
    if not s["interval_ns"]:
        _countdown = 1 << 62
        return
    _countdown = _TICK_EVERY
    now = _clock()
    if now >= s["next_dump_ns"]:
        s["next_dump_ns"] = now + s["interval_ns"]
        try:
            dump()
        except OSError as e:  # a full disk must not take a stage down
            log.warning("step stats dump to %s failed: %s", dump_path(), e)


def _dump_at_exit() -> None:
    if _state["pid"] != os.getpid():
        return
    try:
        dump()
    except OSError as e:
        log.warning("step stats dump at exit to %s failed: %s", dump_path(), e)


def _after_fork() -> None:
    global _countdown
    _phases.clear()
    _listeners.clear()
    _state.update(process="", pid=0, dir=None, interval_ns=0)
    _countdown = _TICK_EVERY


# ---------------------------------------------------------------------------------- snapshots
def snapshot() -> dict[str, Any]:
    """This process's counters as a JSON-able dict (bins sparse: ``[[index, count], ...]``)."""
    phases = {}
    for name, p in list(_phases.items()):
        bins = list(p.bins)
        phases[name] = {"count": p.count, "sum_s": p.total,
                        "min_s": p.min if p.count else 0.0, "max_s": p.max,
                        "bins": [[i, c] for i, c in enumerate(bins) if c]}
    return {"version": FORMAT_VERSION, "process": _state["process"] or "unconfigured",
            "pid": os.getpid(), "started": _state["started"], "time": time.time(),
            "hist": _layout(), "phases": phases}


def _layout() -> dict[str, float]:
    return {"lo_s": LO_S, "decades": DECADES, "bins_per_decade": BINS_PER_DECADE}


def merge_snapshots(snaps: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum several snapshots (processes, or one process over time) into one snapshot."""
    phases: dict[str, dict[str, Any]] = {}
    procs = []
    for s in snaps:
        if s.get("version") != FORMAT_VERSION or s.get("hist") != _layout():
            raise ValueError(f"snapshot of {s.get('process')!r} (pid {s.get('pid')}) has format "
                             f"{s.get('version')} / histogram {s.get('hist')}; this build reads "
                             f"{FORMAT_VERSION} / {_layout()}: re-run with matching versions")
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
            "started": 0.0, "time": time.time(), "hist": _layout(), "phases": phases}


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
            "time": time.time(), "hist": _layout(), "phases": phases}


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    """Read one dump file written by :func:`dump`."""
    snap = json.loads(Path(path).read_text())
    if not isinstance(snap, dict) or "phases" not in snap:
        raise ValueError(f"{path} is not a step-stats dump (no 'phases')")
    return snap
