"""The request lifecycle: validation, admission, dispatch, chunk routing, cancellation.

``PipelineBackend`` implements the server's ``contract.Backend`` over the stage processes that
its :class:`~omni_stream.orchestrator.pipeline.Supervisor` runs,

    talker (+ code predictor) --frames ring--> codec (Code2Wav) --audio ring--> this process

A request is validated, priced in KV and admitted (``scheduling.AdmissionController``), sent to
the talker as an ``AddStream``; the supervisor's reader thread hands each audio-ring message to
its stream's asyncio queue, and the stream's generator turns them into ``AudioChunk`` values.
A stream the client leaves is cancelled in the stages; a stream whose stage died gets a
BackendError, never a hang.

What a frame costs here (``orchestrator.costs``: cached per deployment, else measured at start)
sets how many streams are admitted at once, the chunk schedule, the prefill throttle's starting
costs and, where even one stream is slower than real time, how long a stream's first audio is
held back; the streams' chunk arrivals past their ramp keep it current
(``scheduling.tracker``), and when capacity moves the log names the part of a frame step that
moved it
(``scheduling.attribution``, counters read by ``orchestrator.meter``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from typing import AsyncGenerator

from omni_stream.checkpoints.io import read_config
from omni_stream.config import ModelConfig, SamplingParams
from omni_stream.contract import AudioChunk, BackendError, SpeechJob
from omni_stream.models.prompt import PromptRequest, prompt_length, ref_ids, speech_ids
from omni_stream.models.text_stream import IncrementalTokenizer
from omni_stream.models.text_tokenizer import TextTokenizer
from omni_stream.observability import stepstats
from omni_stream.orchestrator.pipeline import Supervisor
from omni_stream.orchestrator.settings import PipelineSettings
from omni_stream.scheduling import AdmissionController, kv_budget_for, kv_bytes_per_token
from omni_stream.scheduling.attribution import PartCounters, parts_per_step
from omni_stream.scheduling.capacity import (DEFAULT_MARGIN, MachineCosts, advice, chunk_policy,
                                             format_costs, holdback_s)
from omni_stream.scheduling.tracker import CapacityTracker, StreamPace
from omni_stream.scheduling.limits import stream_frame_cap
from omni_stream.transport import (AddStream, AppendText, CancelStream, ChannelClosed,
                                   CloneSpec, CostUpdate, FailReason, Flags, Message, MsgKind,
                                   PromptSpec, StatsReply, StatsRequest, cleanup_stale)

log = logging.getLogger(__name__)

# hold-back length without max_new_tokens: a slow reading (limits.py: speech is ~3-6 frames
# per text token)
HOLD_BASE_FRAMES = 8
PROBE_STREAM_IDS = 1 << 40  # the cost probes' stream ids (orchestrator.costs)
HOLD_FRAMES_PER_TOKEN = 6


class _Stream:
    __slots__ = ("sid", "queue", "loop", "done", "pace", "probe")

    def __init__(self, sid: int, loop: asyncio.AbstractEventLoop, steady: int,
                 probe: list | None = None) -> None:
        self.sid = sid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.done = False
        self.pace = StreamPace(steady)  # its pace samples (the live cost estimate)
        # a cost probe: its samples (streams, seconds per frame, frames) go here, not to the
        # tracker
        self.probe = probe


class PipelineBackend:
    """Backend over the multi-process pipeline. See the module docstring."""

    supports_codec_frames = True

    def __init__(self, settings: PipelineSettings) -> None:
        self.s = settings
        self.cfg: ModelConfig = read_config(settings.model_path)
        self.tokenizer = TextTokenizer.from_dir(settings.model_path)
        self.model_name = settings.model_name
        self.sample_rate = self.cfg.code2wav.sample_rate
        self.supports_instructions = self.cfg.supports_instructions
        self.variant = self.cfg.variant
        # a Base checkpoint clones voices (server/voices.py loads its encoders from here)
        self.clone_model_dir = settings.model_path if self.cfg.variant == "base" else None
        self._ids = itertools.count(1)
        self._probe_ids = itertools.count(PROBE_STREAM_IDS)  # apart from the clients' ids
        self._streams: dict[int, _Stream] = {}
        dtype_bytes = 2 if settings.dtype in ("bfloat16", "float16") else 4
        static_cache = (settings.max_streams * settings.max_seq_len
                        * kv_bytes_per_token(self.cfg, dtype_bytes).flat_per_token)
        self.kv = kv_budget_for(self.cfg, dtype_bytes=dtype_bytes, headroom=1.0,
                                setting_bytes=settings.kv_budget_bytes or static_cache)
        self.adm: AdmissionController | None = None
        self.schedule = settings.schedule
        self._cost_cache = settings.cost_cache()
        self.costs: MachineCosts | None = None
        self.tracker: CapacityTracker | None = None
        self.margin = DEFAULT_MARGIN
        self._request_ids = itertools.count(7_000_000)  # ids of requests to the stages (ask)
        self._replies: dict[int, asyncio.Future] = {}  # requests waiting for a stage's answer
        self._counters: deque[PartCounters] = deque(maxlen=128)  # while serving, ~1 per second
        self._tracking: asyncio.Task | None = None
        self.costs_cached = False  # the costs came from the cache (else measured at start)
        self.sup = Supervisor(settings, self._on_audio, self._on_lost, self._on_reply)
        self._completed = 0
        self._failed = 0
        self._invalid_codes = 0  # streams failed because a code failed its check
        self._text_waits = 0  # continuous streams that ran out of text and waited
        self.codec_info: dict | None = None  # announced to codec-frame clients (set in start)

    def text_tokens(self, job: SpeechJob) -> int:
        """Tokens of the text to speak (what the default frame cap follows)."""
        return len(speech_ids(self.tokenizer, job.text))

    def prompt_tokens(self, job: SpeechJob, text_tokens: int | None = None) -> int:
        """Talker positions the prompt will take, as the talker stage will build it."""
        return prompt_length(self.cfg, self.tokenizer, PromptRequest(
            text=job.text, language=job.language, speaker=job.voice, instructions=job.instructions,
            clone=job.clone, stream_text=job.clone is not None or job.text_feed is not None),
            text_tokens)

    # ------------------------------------------------------------------ Backend API
    def voices(self) -> list[str]:
        return list(self.cfg.talker.speakers)

    def languages(self) -> list[str]:
        return sorted(k for k in self.cfg.talker.languages if "dialect" not in k)

    def validate(self, job: SpeechJob) -> None:
        if job.clone is not None:
            if self.cfg.variant != "base":
                raise BackendError(400, "voice_clone_unsupported", f"this {self.cfg.variant} "
                                   "model cannot clone voices: serve a Base checkpoint",
                                   param="voice")
            if job.clone.x_vector.size != self.cfg.talker.lm.hidden_size:
                raise BackendError(400, "invalid_voice", "the cloned voice was made for another "
                                   f"model ({job.clone.x_vector.size}-value x-vector, this one "
                                   f"takes {self.cfg.talker.lm.hidden_size}): upload it again",
                                   param="voice")
        if job.voice is not None and job.voice.lower() not in self.cfg.talker.speakers:
            raise BackendError(400, "invalid_voice", f"unknown voice '{job.voice}': this model's "
                               f"voices are {', '.join(self.voices()) or '(none)'}", param="voice")
        lang = (job.language or "auto").lower()
        if lang != "auto" and lang not in self.languages():
            raise BackendError(400, "invalid_language", f"unknown language '{job.language}': "
                               f"supported are auto, {', '.join(self.languages())}", param="language")
        if job.instructions and not self.supports_instructions:
            raise BackendError(400, "instructions_unsupported",
                               f"this {self.cfg.variant} model ({self.cfg.model_size}) ignores "
                               "instructions: remove 'instructions'", param="instructions")
        if job.max_frames is not None and not 1 <= job.max_frames <= self.s.max_seq_len // 2:
            raise BackendError(400, "invalid_value", f"max_new_tokens must be in [1, "
                               f"{self.s.max_seq_len // 2}]", param="max_new_tokens")
        if job.initial_chunk_frames is not None and not 1 <= job.initial_chunk_frames <= 32:
            raise BackendError(400, "invalid_value", "initial_codec_chunk_frames must be in [1, 32]",
                               param="initial_codec_chunk_frames")

    def stats(self) -> dict[str, float]:
        snap = self.adm.snapshot() if self.adm else {}
        out = dict(active_streams=len(self._streams), queue_depth=snap.get("queued", 0),
                   slots_total=self.s.max_streams,
                   slots_free=self.s.max_streams - snap.get("admitted", 0),
                   stage_restarts=self.sup.restarts, streams_completed=self._completed,
                   streams_failed=self._failed, streams_failed_invalid_code=self._invalid_codes,
                   text_waits=self._text_waits,
                   chunk_policy_calibrated=int(self.s.schedule_calibrated))
        info = self.capacity_info()
        if info:
            out.update(capacity_streams=info["capacity_streams"],
                       rtf_estimate=info["rtf_estimate"], realtime=int(info["realtime"]),
                       cost_contention=info["contention"],
                       memory_bandwidth_gbs=info["bandwidth_gbs"])
        out.update({f"admission_{k}": v for k, v in snap.items()})
        return out

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

    async def start(self) -> None:
        stepstats.configure("server")
        from omni_stream.export.manifest import codec_identity  # hashes the codec weights once

        ident = await asyncio.get_running_loop().run_in_executor(
            None, codec_identity, self.s.model_path)
        self.codec_info = {**ident.as_dict(), "decode_dtype": self.s.decode_dtype}
        cleanup_stale()
        self.adm = AdmissionController(self.kv.usable_bytes, self.s.max_streams, self.s.max_queue,
                                       max_overtakes=self.s.max_overtakes)
        log.info("KV budget: %s", self.kv.describe())
        await asyncio.get_running_loop().run_in_executor(None, self.sup.start)
        await self._init_costs()
        log.info("chunk schedule %s", self.schedule.to_dict())
        self._tracking = asyncio.create_task(self._track())

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

    def begin_shutdown(self) -> None:
        """The server is going down: stage exits from now on are not crashes to recover from."""
        self.sup.closing = True

    async def close(self) -> None:
        if self._tracking is not None:
            self._tracking.cancel()
        t, c = self.tracker, self.costs
        if (t is not None and c is not None and not c.emulated
                and abs(t.contention - c.contention) > 0.1 * max(c.contention, 1e-9)):
            try:  # keep what serving measured for the next start
                self._cost_cache.store(c.with_contention(t.contention))
            except OSError as e:
                log.warning("could not update the cost cache: %s", e)
        await asyncio.get_running_loop().run_in_executor(None, self.sup.close)
        for st in list(self._streams.values()):
            self._deliver(st, BackendError(503, "shutting_down", "server is shutting down",
                                           retry_after=5))

    # ------------------------------------------------------------------ continuous text
    async def _first_text(self, job: SpeechJob) -> tuple[IncrementalTokenizer, list[int]]:
        """Read ``job.text_feed`` until the prompt can be built: one final text id (an ICL voice:
        enough ids to outrun its reference frames) or the close. BackendError on an idle feed,
        an empty utterance or text past the stream's limit."""
        tok = IncrementalTokenizer(self.tokenizer)
        need = 1
        c = job.clone
        if c is not None and c.icl:  # ref + text (no eos yet) must be longer than bos + frames
            need = max(1, len(c.ref_codes) + 2 - len(ref_ids(self.tokenizer, c.ref_text)))
        ids: list[int] = []
        while len(ids) < need and not tok.closed:
            ids += await self._next_ids(job, tok)
        if not ids:
            raise BackendError(400, "empty_input", "the utterance closed without text: send "
                               "input.text before input.done", param="text")
        return tok, ids

    async def _next_ids(self, job: SpeechJob, tok: IncrementalTokenizer) -> list[int]:
        """The ids the next piece of the feed makes final (all the rest when it closes)."""
        try:
            piece = await job.text_feed.next(self.s.text_idle_timeout_s)
        except asyncio.TimeoutError:
            raise BackendError(408, "text_timeout", f"no text for {self.s.text_idle_timeout_s:g} "
                               "s: send input.done to close the utterance; the stream was "
                               "stopped") from None
        try:
            ids = tok.close() if piece is None else tok.push(piece)
        except ValueError as e:
            raise BackendError(400, "invalid_characters", str(e), param="text") from None
        if len(tok.emitted) > self.s.max_text_tokens:
            raise BackendError(400, "input_too_long", f"the utterance passed "
                               f"{self.s.max_text_tokens} text tokens, the most one stream "
                               "takes: close it (input.done) and go on in the next one",
                               param="text")
        return ids

    async def _forward_text(self, sid: int, st: _Stream, job: SpeechJob,
                            tok: IncrementalTokenizer, pipe) -> None:
        """Send the rest of a continuous utterance to the talker as its ids become final."""
        try:
            while not tok.closed:
                ids = await self._next_ids(job, tok)
                if ids or tok.closed:
                    pipe.send(AppendText(stream_id=sid, ids=ids, close=tok.closed))
        except BackendError as e:
            st.queue.put_nowait(e)
        except (ChannelClosed, OSError):
            st.queue.put_nowait(BackendError(503, "unavailable", "the model pipeline is "
                                             "restarting", retry_after=2))

    # ------------------------------------------------------------------ stream
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

    async def stream(self, job: SpeechJob,
                     probe: list | None = None) -> AsyncGenerator[AudioChunk, None]:
        """``probe``: an internal cost-probe stream (no admission, no hold-back); its pace
        samples, (streams running, seconds per frame, frames), are appended to that list
        instead of feeding the capacity tracker (``orchestrator.costs``)."""
        is_probe = probe is not None
        self.validate(job)
        if self.sup.pipe is None:
            raise BackendError(503, "unavailable", "the model pipeline is not running", retry_after=2)
        assert self.adm is not None
        feed_tok, first_ids = (await self._first_text(job)) if job.text_feed is not None \
            else (None, None)
        text_tokens = len(first_ids) if first_ids is not None else self.text_tokens(job)
        prompt_len = self.prompt_tokens(job, text_tokens)
        room = self.s.max_seq_len - prompt_len - 1
        if feed_tok is not None:  # the text may grow: its cap follows it in the talker stage
            max_frames = job.max_frames or max(1, min(self.s.default_max_frames, room))
        else:
            max_frames = job.max_frames or stream_frame_cap(None, text_tokens, self.s.frame_cap,
                                                            self.s.default_max_frames, room)
        if prompt_len + max_frames + 1 > self.s.max_seq_len:
            raise BackendError(400, "request_too_large", f"prompt ({prompt_len} positions) + "
                               f"max_new_tokens ({max_frames}) exceed the {self.s.max_seq_len} "
                               "positions of a stream: shorten the input or lower max_new_tokens",
                               param="max_new_tokens")
        sid = next(self._probe_ids if is_probe else self._ids)
        t_wait = time.perf_counter()
        if not is_probe:  # the start-up cost probes run before any client: no admission
            await self.adm.acquire(sid, self.kv.need_bytes(prompt_len, max_frames),
                                   self.s.queue_timeout_s)  # raises admission's RequestError
        stepstats.record("server.admission_wait", time.perf_counter() - t_wait)
        hold = 0.0 if is_probe else self.holdback_for(
            self.expected_frames(job, text_tokens, max_frames), self.adm.admitted_count)
        chunk = self.schedule
        if job.initial_chunk_frames:
            chunk = chunk.starting_at(job.initial_chunk_frames)
        if hold > 0:
            chunk = chunk.held(hold)
        st = _Stream(sid, asyncio.get_running_loop(), chunk.steady, probe)
        self._streams[sid] = st
        forwarder = None
        pipe = self.sup.pipe
        try:
            if pipe is None:
                raise BackendError(503, "unavailable", "the model pipeline is restarting", retry_after=2)
            seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(7), "little")
            instructions = job.instructions if self.supports_instructions else None
            msg = AddStream(stream_id=sid, seed=seed, max_frames=max_frames, chunk=chunk,
                            prompt=PromptSpec(text=job.text, language=job.language,
                                              speaker=job.voice, instructions=instructions,
                                              # the official clone path streams the text
                                              stream_text=job.clone is not None,
                                              clone=(CloneSpec.of(job.clone)
                                                     if job.clone is not None else None),
                                              text_ids=first_ids,
                                              continuous=feed_tok is not None),
                            sampling=SamplingParams.greedy() if job.greedy else SamplingParams(),
                            stream_codes=job.stream_codes,
                            text_cap=(self.s.frame_cap if feed_tok is not None
                                      and job.max_frames is None else None))
            try:
                with stepstats.phase("server.dispatch"):
                    pipe.send(msg)
                if feed_tok is not None and feed_tok.closed:
                    pipe.send(AppendText(stream_id=sid, close=True))
            except ChannelClosed:  # a stage died just now; the supervisor restarts it
                raise BackendError(503, "unavailable", "the model pipeline is restarting",
                                   retry_after=2) from None
            if feed_tok is not None and not feed_tok.closed:
                forwarder = asyncio.create_task(self._forward_text(sid, st, job, feed_tok, pipe))
            total = 0
            first_t = None
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                m = item
                if m.kind == MsgKind.EVENT and m.flags & (Flags.WAIT | Flags.RESUME):
                    if m.flags & Flags.WAIT:
                        self._text_waits += 1
                        yield AudioChunk(text_waiting=True)
                    else:
                        yield AudioChunk(text_waited_s=m.aux / 1e3)
                    continue
                if m.flags & Flags.ERROR:
                    text = bytes(m.payload).decode(errors="replace") if m.payload is not None else ""
                    if m.aux == FailReason.INVALID_CODE:
                        self._invalid_codes += 1
                    log.warning("stream %d (%s) failed: %s", sid, job.request_id, text)
                    raise BackendError(500, "synthesis_failed", text or "synthesis failed")
                n = 0
                chunk_pcm = chunk_codes = None
                if m.kind == MsgKind.PCM:
                    chunk_pcm = m.payload
                    n = len(chunk_pcm) // self.cfg.code2wav.samples_per_frame
                elif m.kind == MsgKind.CODES:
                    chunk_codes = m.payload
                    n = len(chunk_codes)
                total += n
                if hold > 0 and n:  # not real time here: the first audio waits (the docstring)
                    if first_t is None:
                        first_t = time.monotonic()
                        log.info("stream %d: first audio held back %.2f s (measured RTF %.2f)",
                                 sid, hold, self.tracker.rtf_estimate() if self.tracker else 0)
                    wait = first_t + hold - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                end = bool(m.flags & Flags.END)
                if end:
                    st.done = True
                    self._completed += not is_probe
                    yield AudioChunk(pcm=chunk_pcm, codes=chunk_codes, frames=n, final=True,
                                     input_tokens=int(m.aux), output_frames=total,
                                     finish_reason="length" if m.flags & Flags.LENGTH else "stop")
                    return
                yield AudioChunk(pcm=chunk_pcm, codes=chunk_codes, frames=n)
        except BackendError:
            self._failed += not is_probe
            raise
        finally:
            if forwarder is not None:
                forwarder.cancel()
            self._streams.pop(sid, None)
            if not st.done and self.sup.pipe is pipe and pipe is not None:
                try:
                    pipe.send(CancelStream(stream_id=sid, reason="client gone"))
                except (ChannelClosed, OSError):
                    pass
            if not is_probe:
                self.adm.release(sid)

    # ------------------------------------------------------------------ from the supervisor
    def _deliver(self, st: _Stream, item) -> None:
        st.loop.call_soon_threadsafe(st.queue.put_nowait, item)

    def _on_audio(self, m: Message) -> None:
        """One audio-ring message (reader thread): to its stream, if it is still here."""
        st = self._streams.get(m.stream_id)
        if st is None:
            return
        n = len(m.payload) if m.kind == MsgKind.CODES and m.payload is not None else \
            (len(m.payload) // self.cfg.code2wav.samples_per_frame if m.kind == MsgKind.PCM else 0)
        if m.kind == MsgKind.EVENT and m.flags & Flags.WAIT:
            st.pace.skip_next()  # the gap over a wait for text is not the pipeline's pace
        if n:  # a pace sample once its ramp is over (scheduling.tracker.StreamPace)
            spf = st.pace.arrived(n, m.get_ns / 1e9, final=bool(m.flags & Flags.END))
            tracker = self.tracker
            if spf is not None and st.probe is not None:
                st.probe.append((len(self._streams), spf, n))
            elif spf is not None and tracker is not None:
                st.loop.call_soon_threadsafe(tracker.observe, len(self._streams), spf,
                                             time.monotonic(), n)
        self._deliver(st, m)

    def _on_reply(self, msg: StatsReply) -> None:
        """A stage's answer to a request (``ask``; reader thread): measured costs
        (``MeasureCosts``) or the talker's stats (``StatsRequest``: the part counters)."""
        fut = self._replies.get(msg.request_id)
        if fut is not None:
            fut.get_loop().call_soon_threadsafe(_resolve, fut, dict(msg.stats))

    def _on_lost(self, err: BackendError) -> None:
        """The stages died (reader thread): every stream in flight ends with ``err``."""
        if self._streams:
            log.warning("failing %d streams in flight: %s", len(self._streams), err.message)
        for st in list(self._streams.values()):
            self._deliver(st, err)



def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
