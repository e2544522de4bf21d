"""Prometheus metrics for /metrics.

Each app owns a registry (so several apps in one process, as in tests, do not collide) holding
its request counters, time-to-first-audio histogram, stream gauges and a collector that turns
``backend.stats()`` into ``omni_stream_backend_<key>`` gauges at scrape time. Per-phase step
timings are process-wide: any code (stages, orchestrator, the server itself) calls
``observe_step(phase, seconds)`` and every app's /metrics shows ``omni_stream_step_seconds``.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds, tuned to the 80 ms frame: sub-ms hops up to multi-frame stalls
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16,
                0.32, 0.64, 1.28)
TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)

_step_lock = threading.Lock()
_step_hist: Histogram | None = None


def _step_histogram() -> Histogram:
    global _step_hist
    if _step_hist is not None:
        return _step_hist
    with _step_lock:
        if _step_hist is None:
            _step_hist = Histogram("omni_stream_step_seconds",
                                   "Duration of one pipeline phase (admission, prefill, talker "
                                   "step, hops, Code2Wav step, encode_write...)",
                                   ["phase"], registry=None, buckets=STEP_BUCKETS)
        return _step_hist


def observe_step(phase: str, seconds: float) -> None:
    """Record one timed phase; cheap enough for the per-frame path (one lock, one bisect)."""
    _step_histogram().labels(phase).observe(seconds)


class _StepCollector:
    """Exposes the process-wide step histogram inside an app's registry."""

    def collect(self) -> Iterator[Metric]:
        return _step_histogram().collect()


class _BackendStatsCollector:
    """``backend.stats()`` -> one gauge per numeric key, read at scrape time."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # names depend on the backend; skip the registry's duplicate check

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the backend is mid-shutdown
            log.exception("backend.stats() failed")
            return
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "omni_stream_backend_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            yield GaugeMetricFamily(name, f"backend.stats()['{key}']", value=float(value))


class _CapacityCollector:
    """The measured real-time capacity and one stream's RTF estimate, read at scrape time."""

    def __init__(self, info: Callable[[], dict | None]) -> None:
        self._info = info

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            info = self._info()
        except Exception:
            log.exception("capacity_info() failed")
            return
        if not info:
            return
        yield GaugeMetricFamily("omni_stream_capacity_streams", "Streams admitted at once: "
                                "what the measured frame costs keep real time",
                                value=float(info["capacity_streams"]))
        yield GaugeMetricFamily("omni_stream_rtf_estimate", "Measured real-time factor of one "
                                "stream at the served settings (< 1: faster than real time)",
                                value=float(info["rtf_estimate"]))


class ServerMetrics:
    """One app's metrics."""

    def __init__(self, backend_stats: Callable[[], dict],
                 capacity_info: Callable[[], dict | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("omni_stream_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttfa = Histogram("omni_stream_time_to_first_audio_seconds",
                              "Request arrival (or WebSocket utterance start) to first audio "
                              "bytes written", ["endpoint"], registry=r, buckets=TTFA_BUCKETS)
        self.active_streams = Gauge("omni_stream_active_streams",
                                    "Streams the server is currently writing", ["endpoint"],
                                    registry=r)
        self.stream_outcomes = Counter("omni_stream_streams",
                                       "Finished streams by outcome (completed, disconnected, "
                                       "cancelled, rejected, error)", ["endpoint", "outcome"], registry=r)
        self.audio_seconds = Counter("omni_stream_audio_seconds",
                                     "Seconds of audio (or codec frames) sent", ["endpoint"],
                                     registry=r)
        self.ws_sessions = Gauge("omni_stream_ws_sessions", "Open WebSocket sessions",
                                 registry=r)
        self.ws_cancels = Counter("omni_stream_ws_cancels", "WebSocket input.cancel events "
                                  "answered", registry=r)
        r.register(_BackendStatsCollector(backend_stats))
        if capacity_info is not None:
            r.register(_CapacityCollector(capacity_info))
        r.register(_StepCollector())

    def render(self) -> bytes:
        return generate_latest(self.registry)
