"""The deployment's measured costs: loaded from the cache or measured at start-up, then kept
current while serving (``scheduling.capacity`` holds the model and the policies).

Measuring (``measure_bandwidth`` at every start; ``measure_parts`` and ``probe_widths`` at the
first start of a deployment), seconds in all:

1. the talker stage times its frame step alone at each batch size up to the slot count and
   the prefill, then the codec stage times Code2Wav calls per chunk size and batch
   (``MeasureCosts`` asked on each stage's control channel in turn, each idle while the other
   is timed: ``ask``);
2. the memory read bandwidth, measured by the talker on its CPUs at every start (a cached
   measurement whose bandwidth differs by more than ``BANDWIDTH_DRIFT`` is measured again);
3. probe streams run through the real pipeline (1 stream, then 2, ... until a width misses
   the real-time margin or the slots are full): their wall time per frame past the ramp at
   each width is what capacity is decided from.

The probes cost what serving costs: each is a request as a client sends it (a typical
sentence, sampled as by default, ``PROBE_FRAMES`` frames: the KV length of a real stream), on
the serving chunk schedule (the first chunk and the ramp the requests get, then steady
chunks), through the same weight path, codec placement and core lending, after one untimed
stream that warms the path. They are measured exactly as the running server measures its
streams (``scheduling.tracker.StreamPace``: arrival gaps per frame once a stream's chunks have
left the ramp, weighted by frames, at the width they were taken), so the capacity announced at
start is the one the tracker then finds. Where their figures move the chunk schedule the probes
run again with it, and the server serves with the schedule they measured
(``MachineCosts.probe_schedule``). While each width runs, the part counters
(``orchestrator.meter``) record where a frame step's time went, what a later change of
capacity is explained against.

A cache written under ``OMNI_STREAM_EMULATE_COSTS`` would describe another machine: emulated
costs are measured at every start and never cached.

The pipeline is reached through two calls, ``CostPipeline``: ``ask`` (a request on a stage's
control channel, its reply) and ``stream`` with ``probe=`` (a probe stream whose pace samples
are collected); ``orchestrator.backend.PipelineBackend`` is the one that serves them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from typing import AsyncIterator, Callable, Protocol

from omni_stream.contract import AudioChunk, SpeechJob
from omni_stream.scheduling.attribution import parts_per_step
from omni_stream.scheduling.capacity import FRAME_S, MachineCosts
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.scheduling.tracker import RAMP_MAX_FRAMES, StreamPace, weighted_median
from omni_stream.transport import MeasureCosts

log = logging.getLogger(__name__)


class CostPipeline(Protocol):
    """What measuring needs of the serving pipeline."""

    s: object  # its PipelineSettings (slots, sequence length, placement, CPU sets)

    async def ask(self, stage: str, request: Callable[[int], object], timeout_s: float) -> dict:
        """``request(request_id)`` on ``stage``'s control channel -> its reply's stats."""

    def stream(self, job: SpeechJob, probe: list | None = None) -> AsyncIterator[AudioChunk]:
        """A stream as a client gets it; ``probe``: pace samples are appended to it."""

    def prompt_tokens(self, job: SpeechJob) -> int: ...

    def voices(self) -> list[str]: ...

    async def part_counters(self): ...

BANDWIDTH_DRIFT = 0.4  # another machine of the kind differs ~2x; one host drifts ~+-25 %
PROBE_FRAMES = 100  # frames per probe stream: a typical request (8 s of audio)
PROBE_STEADY_CHUNKS = 4  # at least this many steady chunks after the ramp
MAX_PROBE_FRAMES = 320  # ... but no probe longer than this
WARMUP_FRAMES = 24  # the untimed stream before the probes: prefill, the ramp's chunk shapes
MIN_SAMPLES = 2  # pace samples a width needs (else the stream's whole pace, ramp included)
# probing stops once the parts' model, scaled to the widths probed so far, keeps every slot
# within this share of the margin (a fast machine needs no probe of every width)
EARLY_STOP = 0.5
# a typical request's text (27 text tokens; capacity_bench's sentences have 10-18)
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


async def _ask(backend: "CostPipeline", parts: bool,
               timeout_s: float) -> tuple[dict, dict]:
    """The talker's measurement, then (``parts``) the codec stage's: one after the other."""
    t = await backend.ask("talker", lambda rid: MeasureCosts(request_id=rid, parts=parts),
                          timeout_s)
    c = await backend.ask("codec", lambda rid: MeasureCosts(request_id=rid),
                          timeout_s) if parts else {}
    return t, c


async def measure_bandwidth(backend: "CostPipeline", timeout_s: float = 60.0) -> dict:
    """{bandwidth_gbs, bandwidth_1t_gbs} measured by the talker stage on its CPUs."""
    t, _ = await _ask(backend, False, timeout_s)
    return t


async def measure_parts(backend: "CostPipeline", timeout_s: float = 300.0) -> MachineCosts:
    """Steps 1-2 of the module docstring: the costs of the parts, contention 1."""
    t, c = await _ask(backend, True, timeout_s)
    ready = t
    if "busy_streams" in c:
        raise RuntimeError(f"codec stage could not measure: {int(c['busy_streams'])} streams "
                           "were running")
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


def probe_frames(schedule: ChunkPolicy) -> int:
    """Frames per probe stream: a typical request's (``PROBE_FRAMES``), or more where the
    steady chunk is large: twice the unthrottled ramp up to the chunk that ends it (the
    listener's buffer slows it; ``RAMP_MAX_FRAMES`` at most, ``StreamPace``), that chunk,
    ``PROBE_STEADY_CHUNKS`` steady samples and a tail, at most ``MAX_PROBE_FRAMES``."""
    reach = StreamPace(schedule.steady).reach
    ramp, i = 0, 0
    while schedule.ramp(i) < reach:
        ramp += schedule.ramp(i)
        i += 1
    need = min(2 * ramp, RAMP_MAX_FRAMES) + (PROBE_STEADY_CHUNKS + 2) * schedule.steady
    return min(MAX_PROBE_FRAMES, max(PROBE_FRAMES, need))


def width_pace(samples: list[tuple[int, float, int]], width: int,
               whole: list[float]) -> tuple[float | None, str]:
    """A width's figure from its probes: the frame-weighted median of the pace samples
    ``(streams, seconds per frame, frames)`` taken while ``width`` streams ran (what the
    tracker compares with), else the median of the streams' whole pace after their first
    chunk (``whole``, ramp included: pessimistic), else None."""
    at = [(v, f) for n, v, f in samples if n == width]
    if len(at) >= MIN_SAMPLES:
        return weighted_median(at), f"{len(at)} chunks past the ramp"
    if whole:
        return statistics.median(whole), "whole streams, ramp included (too few chunks past it)"
    return None, "no samples"


async def probe_widths(backend: "CostPipeline", parts: MachineCosts, schedule: ChunkPolicy,
                       margin: float) -> tuple[tuple[float, ...], tuple[dict[str, float], ...]]:
    """Step 3: after one untimed warm-up stream, probe streams through the pipeline, 1 at a
    time, then 2, ... up to the slots, until a width misses the margin: the wall time per
    frame past the ramp each width saw, and where its frame steps' time went (seconds per
    step by part, ``scheduling.attribution``; empty where not read). Stops early (fewer
    widths) when a probe ends too soon to measure (a model that stops at once), or when the
    widths probed so far leave the rest far inside the margin (``EARLY_STOP``)."""
    observed: list[float] = []
    where: list[dict[str, float]] = []
    job = SpeechJob(text=PROBE_TEXT, request_id="cost-probe")
    room = backend.s.max_seq_len - backend.prompt_tokens(job) - 1
    frames = max(1, min(probe_frames(schedule), backend.s.max_seq_len // 2, room))
    await _probe(backend, 1, min(frames, WARMUP_FRAMES), "warm-up")
    for width in range(1, backend.s.max_streams + 1):
        before = await backend.part_counters()
        per, how = await _probe(backend, width, frames)
        after = await backend.part_counters()
        if per is None:
            break
        observed.append(max(per, observed[-1] if observed else 0.0))
        p = parts_per_step(before, after) if before is not None and after is not None else None
        where.append({k: v for k, v in (p or {}).items() if k != "steps"})
        log.info("probe, %d stream(s) of %d frames: %.1f ms per frame (%s; the parts alone: "
                 "%.1f ms)", width, frames, 1e3 * per, how,
                 1e3 * parts.parts_s(width, schedule.steady))
        if per > margin * FRAME_S:
            break
        # far within the margin even at full slots by the parts' model: no need to probe on
        scaled = parts.with_observed(tuple(observed)).frame_time_s(backend.s.max_streams,
                                                                   schedule.steady)
        if scaled <= EARLY_STOP * margin * FRAME_S:
            break
    return tuple(observed), tuple(where)


async def _probe(backend: "CostPipeline", width: int, frames: int,
                 tag: str = "cost-probe") -> tuple[float | None, str]:
    """``width`` probe streams at once; their figure (``width_pace``) and how it was made."""
    voice = (backend.voices() or [None])[0]
    samples: list[tuple[int, float, int]] = []

    async def one(i: int) -> float | None:
        job = SpeechJob(text=PROBE_TEXT, request_id=f"{tag}-{width}-{i}", voice=voice,
                        seed=i, max_frames=frames)
        first = last = None
        n = 0
        async for c in backend.stream(job, probe=samples):
            if not c.frames:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                n += c.frames
            last = now
        return (last - first) / n if n and first is not None else None

    got = await asyncio.gather(*[one(i) for i in range(width)], return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            log.warning("cost probe stream failed: %s", g)
    whole = [g for g in got if isinstance(g, float)]
    return width_pace(samples, width, whole)


__all__ = ["bandwidth_drifted", "emulated", "measure_bandwidth", "measure_parts", "probe_frames",
           "probe_widths", "shared_cores", "width_pace"]
