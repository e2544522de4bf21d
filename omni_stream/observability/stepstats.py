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

Each phase keeps count, sum, min, max and a fixed log-spaced histogram (layout and the
arithmetic on snapshots: :mod:`.snapshots`, re-exported here).

Environment (read by :func:`configure`, never at import time):

* ``OMNI_STREAM_STEP_STATS_DIR``: when set, the process writes ``<dir>/<process>-<pid>.json``
  (a :func:`snapshot`) at exit, on :func:`dump`, and every few seconds while it records;
* ``OMNI_STREAM_STEP_STATS_INTERVAL``: seconds between those periodic dumps (default 5; 0 turns
  periodic dumps off, leaving atexit and explicit :func:`dump`).

Listeners (:func:`add_listener`) see every recorded ``(name, seconds)``: the server registers
``observe_step`` so its own phases also feed Prometheus. Other processes ship :func:`snapshot`
(or :func:`flatten_snapshot` for a flat ``StatsReply.stats``) to the server, which hands their
samples to its listeners with :func:`notify` (not recorded in its own registry).

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
from typing import Any, Callable

# the histogram layout and the snapshot arithmetic, re-exported (stepstats.merge_snapshots...)
from omni_stream.observability.snapshots import (  # noqa: F401
    BINS_PER_DECADE, DECADES, FORMAT_VERSION, HI_S, LO_S, LOG_LO, NBINS, bin_edges, bin_index,
    cumulative_buckets, diff_snapshots, flatten_snapshot, layout, load_snapshot, merge_snapshots,
    quantile, summarize, unflatten_snapshot)

log = logging.getLogger(__name__)

ENV_DIR = "OMNI_STREAM_STEP_STATS_DIR"
ENV_INTERVAL = "OMNI_STREAM_STEP_STATS_INTERVAL"
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
        i = int((math.log10(seconds) - LOG_LO) * BINS_PER_DECADE) + 1
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
            "hist": layout(), "phases": phases}


