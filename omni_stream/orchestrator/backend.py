"""The request lifecycle: validation, admission, dispatch, chunk routing, cancellation.

``PipelineBackend`` implements the server's ``contract.Backend`` over the stage processes that
its :class:`~omni_stream.orchestrator.pipeline.Supervisor` runs,

    talker (+ code predictor) --frames ring--> codec (Code2Wav) --audio ring--> this process

A request is validated, priced in KV and admitted (``scheduling.AdmissionController``), sent to
the talker as an ``AddStream``; the supervisor's reader thread hands each audio-ring message to
its stream's asyncio queue, and the stream's generator turns them into ``AudioChunk`` values.
A stream the client leaves is cancelled in the stages; a stream whose stage died gets a
BackendError, never a hang. Finished streams also calibrate the chunk policy for the next start.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import AsyncGenerator

from omni_stream.checkpoints.io import read_config
from omni_stream.config import ModelConfig, SamplingParams
from omni_stream.contract import AudioChunk, BackendError, SpeechJob
from omni_stream.models.prompt import assistant_text, instruct_text, ref_ids
from omni_stream.models.text_stream import IncrementalTokenizer
from omni_stream.models.text_tokenizer import TextTokenizer
from omni_stream.observability import stepstats
from omni_stream.orchestrator.pipeline import Supervisor
from omni_stream.orchestrator.settings import PipelineSettings
from omni_stream.scheduling import AdmissionController, Rejected, kv_budget_for, kv_bytes_per_token
from omni_stream.scheduling.chunking import calibrate
from omni_stream.scheduling.limits import stream_frame_cap
from omni_stream.transport import (AddStream, AppendText, CancelStream, ChannelClosed,
                                   CloneSpec, FailReason, Flags, Message, MsgKind, PromptSpec,
                                   cleanup_stale)

log = logging.getLogger(__name__)


class _Stream:
    __slots__ = ("sid", "queue", "loop", "done", "arrivals")

    def __init__(self, sid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.sid = sid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.done = False
        self.arrivals: list[tuple[int, float]] = []  # (frames, time) per chunk, for calibration


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
        self._streams: dict[int, _Stream] = {}
        dtype_bytes = 2 if settings.dtype in ("bfloat16", "float16") else 4
        static_cache = (settings.max_streams * settings.max_seq_len
                        * kv_bytes_per_token(self.cfg, dtype_bytes).flat_per_token)
        self.kv = kv_budget_for(self.cfg, dtype_bytes=dtype_bytes, headroom=1.0,
                                setting_bytes=settings.kv_budget_bytes or static_cache)
        self.adm: AdmissionController | None = None
        self.schedule = settings.schedule
        self._calibration = settings.calibration_cache()
        self._calibrated = settings.schedule_calibrated
        self.sup = Supervisor(settings, self._on_audio, self._on_lost)
        self._completed = 0
        self._failed = 0
        self._invalid_codes = 0  # streams failed because a code failed its check
        self._text_waits = 0  # continuous streams that ran out of text and waited
        self.codec_info: dict | None = None  # announced to codec-frame clients (set in start)

    def text_tokens(self, job: SpeechJob) -> int:
        """Tokens of the text to speak (what the default frame cap follows)."""
        return len(self.tokenizer.encode(assistant_text(job.text))) - 8

    def prompt_tokens(self, job: SpeechJob, text_tokens: int | None = None) -> int:
        """Talker positions the prompt will take (an upper bound; exact for text and instruction)."""
        text = self.text_tokens(job) if text_tokens is None else text_tokens
        n = 3 + 6 + text + 2  # role, codec prefix (think.., language, speaker, pad), eos, bos
        if job.instructions and self.supports_instructions:
            n += len(self.tokenizer.encode(instruct_text(job.instructions)))
        c = job.clone
        if c is not None and c.icl:  # the reference transcript and frames come first
            n += len(ref_ids(self.tokenizer, c.ref_text)) + len(c.ref_codes)
        return n

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
                   chunk_policy_calibrated=int(self._calibrated))
        out.update({f"admission_{k}": v for k, v in snap.items()})
        return out

    async def start(self) -> None:
        stepstats.configure("server")
        from omni_stream.export.manifest import codec_identity  # hashes the codec weights once

        ident = await asyncio.get_running_loop().run_in_executor(
            None, codec_identity, self.s.model_path)
        self.codec_info = {**ident.as_dict(), "decode_dtype": self.s.dtype}
        cleanup_stale()
        self.adm = AdmissionController(self.kv.usable_bytes, self.s.max_streams, self.s.max_queue,
                                       max_overtakes=self.s.max_overtakes)
        log.info("KV budget: %s", self.kv.describe())
        log.info("chunk schedule %s%s", self.schedule.to_dict(),
                 " (from the chunk calibration)" if self._calibrated else "")
        await asyncio.get_running_loop().run_in_executor(None, self.sup.start)

    def begin_shutdown(self) -> None:
        """The server is going down: stage exits from now on are not crashes to recover from."""
        self.sup.closing = True

    async def close(self) -> None:
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
    async def stream(self, job: SpeechJob) -> AsyncGenerator[AudioChunk, None]:
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
        sid = next(self._ids)
        t_wait = time.perf_counter()
        try:
            await self.adm.acquire(sid, self.kv.need_bytes(prompt_len, max_frames),
                                   self.s.queue_timeout_s)
        except Rejected as r:
            raise BackendError.from_rejected(r) from None
        stepstats.record("server.admission_wait", time.perf_counter() - t_wait)
        st = _Stream(sid, asyncio.get_running_loop())
        self._streams[sid] = st
        forwarder = None
        pipe = self.sup.pipe
        try:
            if pipe is None:
                raise BackendError(503, "unavailable", "the model pipeline is restarting", retry_after=2)
            chunk = self.schedule
            if job.initial_chunk_frames:
                chunk = chunk.starting_at(job.initial_chunk_frames)
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
            with stepstats.phase("server.dispatch"):
                pipe.send(msg)
            if feed_tok is not None:
                if feed_tok.closed:
                    pipe.send(AppendText(stream_id=sid, close=True))
                else:
                    forwarder = asyncio.create_task(
                        self._forward_text(sid, st, job, feed_tok, pipe))
            total = 0
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
                end = bool(m.flags & Flags.END)
                if end:
                    st.done = True
                    self._completed += 1
                    yield AudioChunk(pcm=chunk_pcm, codes=chunk_codes, frames=n, final=True,
                                     input_tokens=int(m.aux), output_frames=total,
                                     finish_reason="length" if m.flags & Flags.LENGTH else "stop")
                    return
                yield AudioChunk(pcm=chunk_pcm, codes=chunk_codes, frames=n)
        except BackendError:
            self._failed += 1
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
        if n:
            st.arrivals.append((n, m.get_ns / 1e9))
        if m.flags & Flags.END and not self._calibrated:
            self._try_calibrate(st.arrivals)
        self._deliver(st, m)

    def _on_lost(self, err: BackendError) -> None:
        """The stages died (reader thread): every stream in flight ends with ``err``."""
        if self._streams:
            log.warning("failing %d streams in flight: %s", len(self._streams), err.message)
        for st in list(self._streams.values()):
            self._deliver(st, err)

    def _try_calibrate(self, arrivals: list[tuple[int, float]]) -> None:
        """Fit chunk costs from a finished stream and cache the policy for the next start."""
        try:
            policy = calibrate(arrivals, min_steady=self.schedule.steady)
        except ValueError:
            return  # too few chunks or sizes in this stream: wait for another
        path = self._calibration.store(policy, chunks=len(arrivals))
        self._calibrated = True
        log.info("calibrated chunk policy %s (cached at %s; used from the next start)",
                 policy.to_dict(), path)
