"""The deployment's measured costs: loaded from the cache or measured at start-up, then kept
current while serving (``scheduling.capacity`` holds the model and the policies).

Measuring (``measure_bandwidth`` at every start; ``measure_parts`` and ``probe_widths`` at the
first start of a deployment), seconds in all:

1. the talker stage times its frame step alone at each batch size up to the slot count and
   the prefill, then has the codec stage time Code2Wav calls per chunk size and batch
   (``MeasureCosts``: the stages take turns, each idle while the other is timed);
2. the memory read bandwidth, measured by the talker on its CPUs at every start (a cached
   measurement whose bandwidth differs by more than ``BANDWIDTH_DRIFT`` is measured again);
3. probe streams run through the real pipeline (1 stream, then 2, ... until a width misses
   the real-time margin or the slots are full): their wall time per frame at each width is
   what capacity is decided from.

A cache written under ``OMNI_STREAM_EMULATE_COSTS`` would describe another machine: emulated
costs are measured at every start and never cached.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from typing import TYPE_CHECKING

from omni_stream.contract import BackendError, SpeechJob
from omni_stream.scheduling.capacity import FRAME_S, MachineCosts
from omni_stream.transport import MeasureCosts

if TYPE_CHECKING:
    from omni_stream.orchestrator.backend import PipelineBackend

log = logging.getLogger(__name__)

BANDWIDTH_DRIFT = 0.4  # another machine of the kind differs ~2x; one host drifts ~+-25 %
PROBE_CHUNK = 8  # frames per chunk of a probe stream (at most the steady size)
PROBE_CHUNKS = 5  # chunks per probe stream (4 arrival gaps)
# probing stops once the parts' model, scaled to the widths probed so far, keeps every slot
# within this share of the margin (a fast machine needs no probe of every width)
EARLY_STOP = 0.5
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs all the way back "
              "home again before the sun goes down over the quiet hills.")
EMULATE_ENV = "OMNI_STREAM_EMULATE_COSTS"


def emulated() -> bool:
    return bool(os.environ.get(EMULATE_ENV))


def bandwidth_drifted(cached: MachineCosts, ready: dict) -> bool:
    """The bandwidth measured at this start differs from the cached one by more than
    ``BANDWIDTH_DRIFT`` (another machine of the same kind, or a busier host)."""
    now, then = float(ready.get("bandwidth_gbs", 0.0)), cached.bandwidth_gbs
    return now > 0 and then > 0 and abs(now - then) / then > BANDWIDTH_DRIFT


async def _ask(backend: "PipelineBackend", parts: bool,
               timeout_s: float) -> tuple[dict, dict]:
    loop = asyncio.get_running_loop()
    talker, codec = loop.create_future(), loop.create_future()
    backend._measuring = (talker, codec)
    backend._measure_request += 1
    try:
        pipe = backend.sup.pipe
        if pipe is None:
            raise BackendError(503, "unavailable", "the model pipeline is not running")
        pipe.send(MeasureCosts(request_id=backend._measure_request, parts=parts))
        t = await asyncio.wait_for(talker, timeout_s)
        c = await asyncio.wait_for(codec, timeout_s) if parts else {}
    finally:
        backend._measuring = None
    return t, c


async def measure_bandwidth(backend: "PipelineBackend", timeout_s: float = 60.0) -> dict:
    """{bandwidth_gbs, bandwidth_1t_gbs} measured by the talker stage on its CPUs."""
    t, _ = await _ask(backend, False, timeout_s)
    return t


async def measure_parts(backend: "PipelineBackend", timeout_s: float = 300.0) -> MachineCosts:
    """Steps 1-2 of the module docstring: the costs of the parts, contention 1."""
    t, c = await _ask(backend, True, timeout_s)
    ready = t
    if "error" in c:
        raise RuntimeError(f"codec stage could not measure: {c['error']}")
    n = sum(1 for k in t if k.startswith("frame_s_"))
    s = backend.s
    return MachineCosts(
        frame_s=tuple(float(t[f"frame_s_{i}"]) for i in range(1, n + 1)),
        codec_call_s=float(c["codec_call_s"]), codec_frame_s=float(c["codec_frame_s"]),
        prefill_fixed_s=float(t["prefill_fixed_s"]), prefill_token_s=float(t["prefill_token_s"]),
        shared_cores=shared_cores(s), contention=1.0,
        bandwidth_gbs=float(ready.get("bandwidth_gbs", 0.0)),
        bandwidth_1t_gbs=float(ready.get("bandwidth_1t_gbs", 0.0)),
        measured_unix=time.time(), emulated=bool(t.get("emulated")) or emulated())


def shared_cores(s) -> bool:
    """Does the codec take time from the talker's cores (their costs add), or decode on cores of
    its own (the slower of the two sets the pace)? Its own when the stages are pinned apart; a
    lent core runs the talker only while the codec is idle, so lending keeps them apart too."""
    if s.device != "cpu":
        return False
    return not (s.cpu_sets.get("codec") and s.cpu_sets.get("talker"))


async def probe_widths(backend: "PipelineBackend", parts: MachineCosts, steady: int,
                       margin: float) -> tuple[float, ...]:
    """Step 3: probe streams through the pipeline, 1 at a time, then 2, ... up to the slots,
    until a width misses the margin: the wall time per frame each width saw (median arrival
    gap per frame after the first chunk). Stops early (fewer widths) when a probe ends too
    soon to measure (a model that stops at once), or when the widths probed so far leave the
    rest far inside the margin (``EARLY_STOP``)."""
    observed: list[float] = []
    chunk = max(1, min(PROBE_CHUNK, steady))
    for width in range(1, backend.s.max_streams + 1):
        per = await _probe(backend, width, chunk)
        if per is None:
            break
        observed.append(max(per, observed[-1] if observed else 0.0))
        log.info("probe, %d stream(s): %.1f ms per frame (the parts alone: %.1f ms)",
                 width, 1e3 * per, 1e3 * parts.parts_s(width, chunk))
        if per > margin * FRAME_S:
            break
        # far within the margin even at full slots by the parts' model: no need to probe on
        scaled = parts.with_observed(tuple(observed)).frame_time_s(backend.s.max_streams, chunk)
        if scaled <= EARLY_STOP * margin * FRAME_S:
            break
    return tuple(observed)


async def _probe(backend: "PipelineBackend", width: int, chunk: int) -> float | None:
    voice = (backend.voices() or [None])[0]

    async def one(i: int) -> list[float]:
        job = SpeechJob(text=PROBE_TEXT, request_id=f"cost-probe-{width}-{i}", voice=voice,
                        seed=i, max_frames=PROBE_CHUNKS * chunk, greedy=True,
                        initial_chunk_frames=chunk)
        per = []
        last = None
        async for c in backend.stream(job, probe=True):
            now = time.perf_counter()
            if last is not None and c.frames:
                per.append((now - last) / c.frames)
            if c.frames:
                last = now
        return per

    got = await asyncio.gather(*[one(i) for i in range(width)], return_exceptions=True)
    samples = [v for g in got if isinstance(g, list) for v in g]
    for g in got:
        if isinstance(g, BaseException):
            log.warning("cost probe stream failed: %s", g)
    return statistics.median(samples) if len(samples) >= 2 else None


__all__ = ["bandwidth_drifted", "emulated", "measure_bandwidth", "measure_parts", "probe_widths", "shared_cores"]
