"""The cost lifecycle of ``PipelineBackend`` (a mixin it inherits): at start the deployment's costs
come from the cache or are measured (``orchestrator.costs``: the stages asked in turn over their
control channels, then probe streams); admission, the chunk schedule and the talker's prefill
throttle follow them; while serving the streams' own pace keeps capacity current
(``scheduling.tracker``) and the part counters (``orchestrator.meter``) say which part of a frame
step moved it; a stream's first audio is held back where one stream is slower than real time.

It reads the backend's settings (``s``), supervisor (``sup``), admission (``adm``), running
streams and cost cache; it owns ``costs``, ``tracker``, ``schedule``'s updates and the part
counter history."""

from __future__ import annotations

import asyncio
import logging
import time

from omni_stream.contract import BackendError, SpeechJob
from omni_stream.scheduling.attribution import PartCounters, parts_per_step
from omni_stream.scheduling.capacity import (MachineCosts, advice, chunk_policy, format_costs,
                                             holdback_s)
from omni_stream.scheduling.tracker import CapacityTracker
from omni_stream.transport import ChannelClosed, CostUpdate, StatsRequest

log = logging.getLogger("omni_stream.orchestrator.backend")

# hold-back length without max_new_tokens: a slow reading (limits.py: speech is ~3-6 frames
# per text token)
HOLD_BASE_FRAMES = 8
HOLD_FRAMES_PER_TOKEN = 6


class CostLifecycle:
    """See the module docstring."""

    def capacity_info(self) -> dict | None:
        """What /health shows: the streams admitted at once, one stream's RTF estimate, whether
        that is real time, and the measured bandwidth (None until the costs are known)."""
        t = self.tracker
        if t is None or self.costs is None:
            return None
        return dict(capacity_streams=t.current.streams, rtf_estimate=round(t.rtf_estimate(), 4),
                    realtime=t.current.realtime, contention=round(t.contention, 4),
                    bandwidth_gbs=round(self.costs.bandwidth_gbs, 2), margin=self.margin,
                    slots=self.s.max_streams)

    async def _init_costs(self) -> None:
        """The cached costs of this deployment, or measure them (``orchestrator.costs``);
        then admission, the chunk schedule and the throttle follow them."""
        from omni_stream.orchestrator import costs as oc

        ready = await oc.measure_bandwidth(self)
        cached = None if oc.emulated() else self._cost_cache.load()
        if cached is not None and oc.bandwidth_drifted(cached, ready):
            log.warning("memory bandwidth %.1f GB/s against %.1f GB/s when the costs were "
                        "measured: measuring again", ready.get("bandwidth_gbs", 0.0),
                        cached.bandwidth_gbs)
            cached = None
        self.costs_cached = cached is not None
        if cached is not None:
            costs = cached
            log.info("machine costs from %s", self._cost_cache.path)
        else:
            t0 = time.perf_counter()
            parts = await oc.measure_parts(self)
            self._apply_costs(parts)  # the probe streams run with the parts' chunk schedule
            for attempt in range(2):  # ... and again if what they saw moves the schedule
                ran = self.schedule
                observed, where = await oc.probe_widths(self, parts, ran, self.margin)
                self._apply_costs(parts.with_observed(observed, where))
                if self.schedule == ran:
                    break
                log.info("the probes moved the chunk schedule (%s -> %s): %s", ran.to_dict(),
                         self.schedule.to_dict(), "probing again with it" if attempt == 0 else
                         "serving with the one they measured (a machine at the margin's edge)")
            costs = parts.with_observed(observed, where, schedule=ran)
            log.info("machine costs measured in %.1f s%s", time.perf_counter() - t0,
                     " (emulated, not cached)" if costs.emulated else
                     f" (cached at {self._cost_cache.path})")
            if not costs.emulated:
                self._cost_cache.store(costs)
        self._apply_costs(costs)
        cap = self.tracker.current
        log.info("measured costs:\n%s", format_costs(costs, cap, steady=self.schedule.steady,
                                                       margin=self.margin))
        log.info("capacity: %d stream(s) at once, RTF estimate %.2f for one stream, memory "
                 "bandwidth %.1f GB/s", cap.streams, cap.rtf, costs.bandwidth_gbs)
        if not cap.realtime:
            log.warning(advice(costs, steady=self.schedule.steady,
                               weight_path=self.s.weight_path, engine=self.s.engine,
                               model_size=str(self.cfg.model_size)))

    def _apply_costs(self, costs: MachineCosts) -> None:
        self.costs = costs
        if not (self.s.schedule_fixed or self.s.schedule_calibrated):  # what the probes ran
            self.schedule = costs.probe_schedule or chunk_policy(costs, self.s.schedule,
                                                                 margin=self.margin)
        self.tracker = CapacityTracker(costs, slots=self.s.max_streams,
                                       steady=self.schedule.steady, margin=self.margin)
        assert self.adm is not None
        self.adm.set_capacity(self.tracker.current.streams)
        pipe = self.sup.pipe
        if pipe is not None:
            try:
                pipe.send(CostUpdate(prefill_fixed_s=costs.prefill_fixed_s,
                                     prefill_token_s=costs.prefill_token_s,
                                     frame_s=costs.talker_s(1)))
            except (ChannelClosed, OSError):
                pass

    async def _track(self, period_s: float = 0.5, meter_s: float = 1.0) -> None:
        """Capacity follows the streams' own frame costs (``CapacityTracker``); the part
        counters are read every ``meter_s`` while streams run, so that a change of capacity
        can say which part of the frame step moved it."""
        last_meter = -meter_s
        while True:
            await asyncio.sleep(period_s)
            t = self.tracker
            if t is None or self.adm is None:
                continue
            now = time.monotonic()
            if now - last_meter >= meter_s and (self._streams or not self._counters):
                last_meter = now
                c = await self.part_counters(timeout_s=meter_s)
                if c is not None:
                    self._counters.append(c)
            before = t.current
            if t.update(time.monotonic()):
                self.adm.set_capacity(t.current.streams)
                log.warning("%s", t.explain(before, self.live_parts(t.window_s)))
            elif t.current.realtime != before.realtime:  # one stream, now held back or not
                log.log(logging.INFO if t.current.realtime else logging.WARNING, "%s",
                        t.explain(before, self.live_parts(t.window_s)))

    async def ask(self, stage: str, request, timeout_s: float) -> dict:
        """Send ``request(request_id)`` (a StatsRequest, a MeasureCosts) on ``stage``'s control
        channel and wait for its StatsReply: the reply's stats. asyncio.TimeoutError when it
        does not answer in time; BackendError 503 while the pipeline is not running."""
        pipe = self.sup.pipe
        if pipe is None:
            raise BackendError(503, "unavailable", "the model pipeline is not running")
        rid = next(self._request_ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        try:
            pipe.send(request(rid), stage=stage)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(rid, None)

    async def part_counters(self, timeout_s: float = 2.0) -> PartCounters | None:
        """The pipeline's part counters now (``orchestrator.meter``): the talker's step-timing
        sums (a StatsRequest) and the CPU times; None when the talker does not answer."""
        from omni_stream.orchestrator import meter

        pipe = self.sup.pipe
        if pipe is None:
            return None
        try:
            talker = await self.ask("talker", lambda rid: StatsRequest(request_id=rid), timeout_s)
        except (asyncio.TimeoutError, BackendError, ChannelClosed, OSError):
            return None
        cpus = {c for v in self.s.cpu_sets.values() for c in v} or None
        return meter.counters(time.monotonic(), talker, pipe.codec.pid,
                              [p.pid for p in pipe.procs], cpus)

    def live_parts(self, window_s: float) -> dict[str, float] | None:
        """Seconds per frame step by part over about the last ``window_s`` of serving."""
        if len(self._counters) < 2:
            return None
        last = self._counters[-1]
        first = next((c for c in self._counters if c.t >= last.t - window_s - 0.5),
                     self._counters[0])
        if first is last:
            first = self._counters[-2]
        return parts_per_step(first, last)

    def holdback_for(self, frames: int, streams: int) -> float:
        """Seconds a stream of ``frames`` frames holds its first audio back when it runs with
        ``streams`` streams (0 while that keeps real time): ``scheduling.holdback_s``."""
        t = self.tracker
        if t is None or self.costs is None:
            return 0.0
        ft = self.costs.frame_time_s(max(1, streams), self.schedule.steady, t.contention)
        return holdback_s(ft, frames, steady=self.schedule.steady, margin=self.margin)

    def expected_frames(self, job: SpeechJob, text_tokens: int, max_frames: int) -> int:
        """The frames a stream is expected to run, for its hold-back: its ``max_new_tokens``
        when given, else a slow reading of its text (``HOLD_FRAMES_PER_TOKEN`` per token, the
        slow end of speech), within its frame cap."""
        if job.max_frames is not None:
            return max_frames
        return min(max_frames, HOLD_BASE_FRAMES + HOLD_FRAMES_PER_TOKEN * max(0, text_tokens))
