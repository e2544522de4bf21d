"""``GET /v1/stats``: what the live dashboard (``/dashboard``) shows, as one JSON object.

API data, so it keeps the API key (the page itself is public and holds none). One poll gives:

- ``model``, ``capacity`` (``backend.capacity_info()``, as /health: streams admitted at once,
  one stream's RTF estimate, real time or not, slots) and ``bandwidth_gbs``, the memory read
  bandwidth the talker measured at start-up (null where the backend measured none);
- ``streams``: ``running`` and ``queued`` now (``backend.stats()``), ``refused`` since start
  (streams the server answered with an admission refusal: ServerMetrics' ``rejected`` outcome);
- ``step_ms``: where a frame step's time went over about the last ``window_s`` seconds, in ms
  per talker frame step (one 80 ms frame of every running stream), part by part as
  ``scheduling.attribution`` names them (talker LM, code predictor, scheduling, codec,
  transport, others, wall); null while fewer than ``attribution.MIN_STEPS`` steps ran in the
  window (idle). ``frame_ms`` is the 80 ms budget the parts are drawn against.

Where the parts come from: a pipeline backend's own part counters (``part_counters()``: the
talker's step-timing sums and the stages' CPU time from /proc, the counters the capacity
tracker explains itself with), else the process-wide step histogram that /metrics carries
(``omni_stream_step_seconds``: sums and counts of ``talker.step``, ``talker.code_predictor``,
``frame.total``, ``codec.decode`` and the server's own phases). One sampler per app takes at
most one reading every ``SAMPLE_EVERY_S`` however many pages poll, and keeps a short history.

Behind a cluster entry each replica answers for itself and ``cluster.aggregate`` merges the
replicas' answers with :func:`merge_stats`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Any, Callable

import msgspec
from aiohttp import web

from omni_stream.config import FRAME_S
from omni_stream.scheduling.attribution import (LABELS, MIN_STEPS, PARTS, PartCounters,
                                                parts_per_step)
from omni_stream.server.metrics import _step_histogram
from omni_stream.server.state import STATE

STATS_PATH = "/v1/stats"
WINDOW_S = 3.0        # the parts are averaged over about this much recent serving
SAMPLE_EVERY_S = 0.5  # one reading per app at most this often
HISTORY = 64          # readings kept (a window needs a few)
READ_TIMEOUT_S = 1.0  # a talker busy past this: the poll answers with the readings it has
SERVER_PHASES = ("server.encode_write", "server.dispatch")  # the fallback's transport part


def histogram_counters(t: float) -> PartCounters:
    """The part counters read from the process-wide step histogram (/metrics' sums)."""
    sums: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, float] = collections.defaultdict(float)
    for family in _step_histogram().collect():
        for s in family.samples:
            phase = s.labels.get("phase", "")
            if s.name.endswith("_sum"):
                sums[phase] += s.value
            elif s.name.endswith("_count"):
                counts[phase] += s.value
    # a phase not timed yet counts 0 s; other processes' CPU time is not in it (NaN: no part)
    return PartCounters(t=t, steps=int(counts["talker.step"]), step_s=sums["talker.step"],
                        cp_s=sums["talker.code_predictor"], loop_s=sums["frame.total"],
                        codec_cpu_s=sums["codec.decode"],
                        server_cpu_s=sum(sums[p] for p in SERVER_PHASES))


class StatsSampler:
    """Part-counter readings of one app's backend, at most one every ``every_s``; the parts
    per frame step over the last ``window_s`` from them."""

    def __init__(self, backend: Any, clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S, every_s: float = SAMPLE_EVERY_S) -> None:
        self.backend = backend
        self.clock = clock  # the fallback's time axis (a pipeline stamps its own: monotonic)
        self.window_s = window_s
        self.every_s = every_s
        self.readings: collections.deque[PartCounters] = collections.deque(maxlen=HISTORY)
        self._taken_at = -math.inf
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._lock:  # pages polling together share one reading
            now = self.clock()
            if now - self._taken_at < self.every_s:
                return
            self._taken_at = now
            read = getattr(self.backend, "part_counters", None)
            c = await read(timeout_s=READ_TIMEOUT_S) if read is not None \
                else histogram_counters(now)
            if c is not None:
                self.readings.append(c)

    def parts(self) -> tuple[dict[str, float] | None, float]:
        """(seconds per frame step by part, with ``steps``; or None) and the window's span."""
        if len(self.readings) < 2:
            return None, 0.0
        last = self.readings[-1]
        first = next(c for c in self.readings if c.t >= last.t - self.window_s or c is last)
        if first is last:
            first = self.readings[-2]
        return parts_per_step(first, last, MIN_STEPS), last.t - first.t


SAMPLER = web.AppKey("dashboard_sampler", StatsSampler)


def _refused(metrics: Any) -> int:
    n = 0.0
    for family in metrics.stream_outcomes.collect():
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("outcome") == "rejected":
                n += s.value
    return int(n)


def stats_body(st: Any, sampler: StatsSampler) -> dict[str, Any]:
    """The /v1/stats body from the app's state and its sampler's readings."""
    backend = st.backend
    stats = backend.stats()
    info = getattr(backend, "capacity_info", None)
    cap = (info() if info is not None else None) or None
    bandwidth = float(cap["bandwidth_gbs"]) if cap and cap.get("bandwidth_gbs") else None
    parts, span = sampler.parts()
    step_ms = None if parts is None else {
        k: round(1e3 * v, 3) for k, v in parts.items() if k in PARTS or k == "wall"}
    capacity = None if cap is None else {
        k: cap[k] for k in ("capacity_streams", "rtf_estimate", "realtime", "slots", "margin",
                            "contention") if k in cap}
    return {"object": "stats", "model": backend.model_name, "ready": st.ready,
            "frame_ms": 1e3 * FRAME_S, "capacity": capacity, "bandwidth_gbs": bandwidth,
            "streams": {"running": int(stats.get("active_streams", 0)),
                        "queued": int(stats.get("queue_depth", 0)),
                        "refused": _refused(st.metrics)},
            "step_ms": step_ms, "steps": int(parts["steps"]) if parts else 0,
            "window_s": round(span, 3), "labels": LABELS}


async def stats(request: web.Request) -> web.Response:
    sampler = request.app[SAMPLER]
    await sampler.refresh()
    body = stats_body(request.app[STATE], sampler)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def add_routes(app: web.Application) -> None:
    """``GET /v1/stats`` (the app's state must be set: the sampler reads its backend)."""
    app[SAMPLER] = StatsSampler(app[STATE].backend)
    app.router.add_get(STATS_PATH, stats)


def merge_stats(rows: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any]:
    """A cluster's /v1/stats from its replicas' (id, body or None when unreachable): capacity,
    slots and streams add up; the RTF is the slowest replica's; the bandwidth the lowest
    measured; the parts are the replicas' averaged weighted by their frame steps. Each
    replica's own body is kept under ``replicas``."""
    ok = [b for _, b in rows if b is not None]
    caps = [b["capacity"] for b in ok if b.get("capacity")]
    capacity = None if not caps else {
        "capacity_streams": sum(int(c.get("capacity_streams") or 0) for c in caps),
        "slots": sum(int(c.get("slots") or 0) for c in caps),
        "rtf_estimate": max(float(c.get("rtf_estimate") or 0.0) for c in caps),
        "realtime": all(bool(c.get("realtime")) for c in caps)}
    bws = [float(b["bandwidth_gbs"]) for b in ok if b.get("bandwidth_gbs")]
    steps = sum(int(b.get("steps") or 0) for b in ok if b.get("step_ms"))
    step_ms = None
    if steps:
        keys = {k for b in ok if b.get("step_ms") for k in b["step_ms"]}
        step_ms = {k: round(sum(b["step_ms"].get(k, 0.0) * int(b.get("steps") or 0)
                                for b in ok if b.get("step_ms")) / steps, 3) for k in keys}
    return {"object": "stats", "model": next((b.get("model") for b in ok), None),
            "ready": any(b.get("ready") for b in ok), "frame_ms": 1e3 * FRAME_S,
            "capacity": capacity, "bandwidth_gbs": min(bws) if bws else None,
            "streams": {k: sum(int(b.get("streams", {}).get(k, 0)) for b in ok)
                        for k in ("running", "queued", "refused")},
            "step_ms": step_ms, "steps": steps,
            "window_s": max((float(b.get("window_s") or 0.0) for b in ok), default=0.0),
            "labels": LABELS,
            "replicas": [{"replica": r, "status": "ok" if b is not None else "unreachable",
                          **{k: v for k, v in (b or {}).items() if k != "labels"}}
                         for r, b in rows]}


__all__ = ["STATS_PATH", "SAMPLER", "StatsSampler", "add_routes", "histogram_counters",
           "merge_stats", "snapshot", "stats"]
