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
from omni_stream.models.prompt import (PromptRequest, prompt_length, ref_ids, speech_ids,
                                       tokenize_prompt)
from omni_stream.models.text_tokenizer import TextTokenizer
from omni_stream.observability import stepstats
from omni_stream.orchestrator.cost_lifecycle import CostLifecycle
from omni_stream.orchestrator.pipeline import Supervisor
from omni_stream.orchestrator.text_feed import ContinuousText
from omni_stream.orchestrator.settings import PipelineSettings
from omni_stream.scheduling import AdmissionController, kv_budget_for, kv_bytes_per_token
from omni_stream.scheduling.attribution import PartCounters
from omni_stream.scheduling.capacity import (DEFAULT_MARGIN, MachineCosts)
from omni_stream.scheduling.tracker import CapacityTracker, StreamPace
from omni_stream.scheduling.limits import stream_frame_cap
from omni_stream.transport import (AddStream, AppendText, CancelStream, ChannelClosed,
                                   CloneSpec, FailReason, Flags, Message, MsgKind,
                                   PromptSpec, StatsReply, cleanup_stale)

log = logging.getLogger(__name__)

PROBE_STREAM_IDS = 1 << 40  # the cost probes' stream ids (orchestrator.costs)


def prompt_spec(job: SpeechJob, req: PromptRequest, instructions: str | None, *,
                continuous: bool) -> PromptSpec:
    """What the talker stage builds ``job``'s prompt from: its options and the token ids of
    ``req`` (``tokenize_prompt``), so the stage tokenizes nothing."""
    def listed(ids: tuple[int, ...] | None) -> list[int] | None:
        return None if ids is None else list(ids)

    return PromptSpec(text=job.text, language=job.language, speaker=job.voice,
                      instructions=instructions,
                      stream_text=job.clone is not None,  # the official clone path streams text
                      clone=CloneSpec.of(job.clone) if job.clone is not None else None,
                      text_ids=listed(req.text_ids), continuous=continuous,
                      role_ids=listed(req.role_ids), instruct_ids=listed(req.instruct_ids),
                      ref_ids=listed(req.ref_ids))


class _Route:
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


class PipelineBackend(CostLifecycle):
    """Backend over the multi-process pipeline. See the module docstring (the cost lifecycle:
    ``orchestrator.cost_lifecycle``; continuous text: ``orchestrator.text_feed``)."""

    supports_codec_frames = True

    def __init__(self, settings: PipelineSettings) -> None:
        self.s = settings
        self.cfg: ModelConfig = read_config(settings.model_path)
        self.tokenizer = TextTokenizer.from_dir(settings.model_path)
        self.text_feed = ContinuousText(self.tokenizer, settings)
        self.model_name = settings.model_name
        self.sample_rate = self.cfg.code2wav.sample_rate
        self.supports_instructions = self.cfg.supports_instructions
        self.variant = self.cfg.variant
        # a Base checkpoint clones voices (server/voices.py loads its encoders from here)
        self.clone_model_dir = settings.model_path if self.cfg.variant == "base" else None
        self._ids = itertools.count(1)
        self._probe_ids = itertools.count(PROBE_STREAM_IDS)  # apart from the clients' ids
        self._streams: dict[int, _Route] = {}
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

    def prompt_request(self, job: SpeechJob, text_ids: list[int] | None = None,
                       ref: tuple[int, ...] | None = None) -> PromptRequest:
        """``job``'s prompt with all its token ids (``models.prompt.tokenize_prompt``): the one
        tokenization of a request; the talker stage builds from these ids. ``text_ids``: a
        continuous utterance's text so far; ``ref``: the ICL transcript's ids if made already."""
        return tokenize_prompt(self.cfg, self.tokenizer, PromptRequest(
            text=job.text, language=job.language, speaker=job.voice, instructions=job.instructions,
            clone=job.clone, stream_text=job.clone is not None or job.text_feed is not None,
            text_ids=None if text_ids is None else tuple(text_ids), ref_ids=ref))

    def prompt_tokens(self, job: SpeechJob) -> int:
        """Talker positions the prompt will take, as the talker stage will build it."""
        return prompt_length(self.cfg, self.tokenizer, self.prompt_request(job))

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

    # ------------------------------------------------------------------ stream

    async def stream(self, job: SpeechJob,
                     probe: list | None = None) -> AsyncGenerator[AudioChunk, None]:
        """``probe``: an internal cost-probe stream (no admission, no hold-back); its pace
        samples, (streams running, seconds per frame, frames), are appended to that list
        instead of feeding the capacity tracker (``orchestrator.costs``)."""
        is_probe = probe is not None
        if not job.validated:  # the server's jobs were (schema.resolve_options); others here
            self.validate(job)
        if self.sup.pipe is None:
            raise BackendError(503, "unavailable", "the model pipeline is not running", retry_after=2)
        assert self.adm is not None
        c = job.clone
        ref = tuple(ref_ids(self.tokenizer, c.ref_text)) if c is not None and c.icl else None
        feed_tok, first_ids = (await self.text_feed.first(job, len(ref or ()))) \
            if job.text_feed is not None else (None, None)
        req = self.prompt_request(job, first_ids, ref)  # tokenized here, once
        if not req.text_ids:
            raise BackendError(400, "empty_input", "the input text tokenizes to nothing: send "
                               "at least one word", param="input")
        text_tokens = len(req.text_ids)
        prompt_len = prompt_length(self.cfg, self.tokenizer, req)
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
        st = _Route(sid, asyncio.get_running_loop(), chunk.steady, probe)
        self._streams[sid] = st
        forwarder = None
        pipe = self.sup.pipe
        try:
            if pipe is None:
                raise BackendError(503, "unavailable", "the model pipeline is restarting", retry_after=2)
            seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(7), "little")
            instructions = job.instructions if self.supports_instructions else None
            msg = AddStream(stream_id=sid, seed=seed, max_frames=max_frames, chunk=chunk,
                            prompt=prompt_spec(job, req, instructions,
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
                forwarder = asyncio.create_task(self.text_feed.forward(sid, st.queue, job,
                                                                       feed_tok, pipe))
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
    def _deliver(self, st: _Route, item) -> None:
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
