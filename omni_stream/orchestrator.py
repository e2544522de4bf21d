"""The request lifecycle: admission, stage processes, chunk routing, cancellation, recovery.

``PipelineBackend`` implements the server's ``Backend``. It owns two stage processes,

    talker (+ code predictor) --frames ring--> codec (Code2Wav) --audio ring--> this process

plus a control pipe to the talker. A reader thread drains the audio ring and hands each chunk
to its stream's asyncio queue; a supervisor notices a dead stage within ~0.1 s, fails the
streams in flight (they get a BackendError, never a hang), and restarts the pipeline.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncGenerator


from omni_stream.config import ModelConfig, SamplingParams
from omni_stream.checkpoints.io import read_config
from omni_stream.models.text_tokenizer import TextTokenizer
from omni_stream.models.prompt import assistant_text, instruct_text
from omni_stream.observability import stepstats
from omni_stream.checkpoints.default import cache_dir
from omni_stream.scheduling import AdmissionController, Rejected, kv_budget_for, kv_bytes_per_token
from omni_stream.scheduling.chunking import CalibrationCache, ChunkPolicy, calibrate
from omni_stream.scheduling.fingerprint import hardware_fingerprint
from omni_stream.scheduling.limits import FrameCap, stream_frame_cap
from omni_stream.contract import AudioChunk, BackendError, SpeechJob
from omni_stream.stages.codec_stage import READY_STREAM_ID, run_codec_stage
from omni_stream.stages.cp_stage import run_cp_stage
from omni_stream.stages.talker_stage import StageSpec, run_talker_stage
from omni_stream.transport import (AddStream, CancelStream, ChannelClosed, ControlChannel,
                                   FailReason, Flags, MsgKind, PromptSpec, Ring, Shutdown,
                                   StatsReply, cleanup_stale)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSettings:
    model_path: str
    model_name: str = "qwen3-tts"
    dtype: str = "float32"
    weight_path: str | None = None  # talker/code-predictor weights: None = dtype, int8, int4
    compile: bool = False  # torch.compile the decoder steps (cached across restarts)
    max_streams: int = 4  # talker slots
    max_seq_len: int = 2048
    max_queue: int = 16
    queue_timeout_s: float = 10.0
    default_max_frames: int = 1500  # 120 s of audio: the ceiling of the default frame cap
    frame_cap: FrameCap = field(default_factory=FrameCap)  # default cap that follows the text
    schedule: ChunkPolicy = field(default_factory=ChunkPolicy)  # audio chunk sizes per stream
    talker_threads: int = 1
    codec_threads: int = 1
    device: str = "cpu"
    placement: str = "together"  # talker and code predictor: "together" (one process) or "split"
    kv_budget_bytes: int | None = None  # None: exactly the static cache (slots x max_seq_len)
    max_overtakes: int = 4  # head-of-line: how often a queued request may be passed
    throttle: bool = True  # playback-slack prefill throttling in the talker stage
    cpu_sets: dict = field(default_factory=dict)  # stage ('talker'|'cp'|'codec') -> CPU ids
    cp_threads: int = 1
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.placement not in ("together", "split"):
            raise ValueError(f"placement must be 'together' or 'split', not {self.placement!r}")
        if self.max_streams < 1 or self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise ValueError("max_streams >= 1, max_queue >= 0 and queue_timeout_s > 0 required")


class _Stream:
    __slots__ = ("sid", "queue", "loop", "done", "arrivals")

    def __init__(self, sid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.sid = sid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.done = False
        self.arrivals: list[tuple[int, float]] = []  # (frames, time) per chunk, for calibration


class _Pipeline:
    """One incarnation of the stage processes and rings (replaced whole on a crash)."""

    def __init__(self, s: PipelineSettings) -> None:
        ctx = mp.get_context("spawn")
        self.frames = Ring.create("frames", 8 << 20)
        self.audio = Ring.create("audio", 32 << 20, role="consumer")
        self.ctrl, child_ctrl = ControlChannel.pair(ctx)
        spec = StageSpec(model_path=s.model_path, dtype=s.dtype, max_slots=s.max_streams,
                         max_seq_len=s.max_seq_len, threads=s.talker_threads, device=s.device,
                         weight_path=s.weight_path, compile=s.compile,
                         throttle=s.throttle, cpus=tuple(s.cpu_sets.get("talker", ())))
        cspec = StageSpec(model_path=s.model_path, dtype=s.dtype, max_slots=s.max_streams,
                          threads=s.codec_threads, device=s.device,
                          cpus=tuple(s.cpu_sets.get("codec", ())))
        self.rings = [self.frames, self.audio]
        cp_handles = None
        self.cp = None
        if s.placement == "split":
            to_cp, from_cp = Ring.create("cp_in", 4 << 20), Ring.create("cp_out", 1 << 20)
            self.rings += [to_cp, from_cp]
            cp_handles = (to_cp.handle("producer"), from_cp.handle("consumer"))
            pspec = StageSpec(model_path=s.model_path, dtype=s.dtype, max_slots=s.max_streams,
                              threads=s.cp_threads, device=s.device,
                              weight_path=s.weight_path, compile=s.compile,
                              cpus=tuple(s.cpu_sets.get("cp", ())))
            self.cp = ctx.Process(target=run_cp_stage, name="omni-code-predictor", daemon=True,
                                  args=(pspec, to_cp.handle("consumer"), from_cp.handle("producer")))
        self.talker = ctx.Process(target=run_talker_stage, name="omni-talker", daemon=True,
                                  args=(spec, child_ctrl, self.frames.handle("producer"), cp_handles))
        self.codec = ctx.Process(target=run_codec_stage, name="omni-codec", daemon=True,
                                 args=(cspec, self.frames.handle("consumer"), self.audio.handle("producer")))
        self.procs = [p for p in (self.talker, self.cp, self.codec) if p is not None]
        for p in self.procs:
            p.start()
        child_ctrl.close()
        self.lock = threading.Lock()  # control sends come from the loop thread and the reader

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        msg = self.ctrl.recv(timeout=timeout)
        if not isinstance(msg, StatsReply):
            raise RuntimeError(f"talker stage did not start (got {msg!r}); see its log")
        while time.monotonic() < deadline:
            m = self.audio.get(timeout=0.5)
            if m is not None and m.stream_id == READY_STREAM_ID:
                return
            if not self.codec.is_alive():
                break
        raise RuntimeError("codec stage did not start; see its log")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def send(self, msg) -> None:
        with self.lock:
            self.ctrl.send(msg)

    def close(self) -> None:
        try:
            self.send(Shutdown(reason="server closing"))
        except (ChannelClosed, OSError):
            pass
        for p in self.procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
        self.ctrl.close()
        for r in self.rings:
            r.close()
            r.unlink()


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
        self._ids = itertools.count(1)
        self._streams: dict[int, _Stream] = {}
        dtype_bytes = 2 if settings.dtype in ("bfloat16", "float16") else 4
        static_cache = (settings.max_streams * settings.max_seq_len
                        * kv_bytes_per_token(self.cfg, dtype_bytes).flat_per_token)
        self.kv = kv_budget_for(self.cfg, dtype_bytes=dtype_bytes, headroom=1.0,
                                setting_bytes=settings.kv_budget_bytes or static_cache)
        self.adm: AdmissionController | None = None
        self.schedule = settings.schedule
        self._calibration = CalibrationCache(
            cache_dir() / "calibration", fingerprint=self._fingerprint())
        self._calibrated = False
        self._pipe: _Pipeline | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._restarts = 0
        self._restart_times: list[float] = []
        self._closing = False
        self._completed = 0
        self._failed = 0
        self._invalid_codes = 0  # streams failed because a code failed its check
        self.codec_info: dict | None = None  # announced to codec-frame clients (set in start)

    def _fingerprint(self) -> str:
        """Chunk-cost calibration holds for this hardware AND this model/deployment."""
        key = [hardware_fingerprint(), str(self.s.model_path), self.s.dtype, self.s.weight_path,
               self.s.compile, self.s.max_streams,
               self.s.placement, self.s.talker_threads, self.s.codec_threads]
        return hashlib.sha256(repr(key).encode()).hexdigest()[:16]

    def text_tokens(self, job: SpeechJob) -> int:
        """Tokens of the text to speak (what the default frame cap follows)."""
        return len(self.tokenizer.encode(assistant_text(job.text))) - 8

    def prompt_tokens(self, job: SpeechJob, text_tokens: int | None = None) -> int:
        """Talker positions the prompt will take (an upper bound; exact for text and instruction)."""
        text = self.text_tokens(job) if text_tokens is None else text_tokens
        n = 3 + 6 + text + 2  # role, codec prefix (think.., language, speaker, pad), eos, bos
        if job.instructions and self.supports_instructions:
            n += len(self.tokenizer.encode(instruct_text(job.instructions)))
        return n

    # ------------------------------------------------------------------ Backend API
    def voices(self) -> list[str]:
        return list(self.cfg.talker.speakers)

    def languages(self) -> list[str]:
        return sorted(k for k in self.cfg.talker.languages if "dialect" not in k)

    def validate(self, job: SpeechJob) -> None:
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
                   stage_restarts=self._restarts, streams_completed=self._completed,
                   streams_failed=self._failed, streams_failed_invalid_code=self._invalid_codes,
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
        cached = self._calibration.load()
        if cached is not None and self.s.schedule == ChunkPolicy():
            self.schedule = ChunkPolicy(first=cached.first, steady=cached.steady,
                                        growth=cached.growth)
            self._calibrated = True
            log.info("chunk schedule from calibration cache %s: %s", self._calibration.path,
                     cached.to_dict())
        await asyncio.get_running_loop().run_in_executor(None, self._start_pipeline)

    def _start_pipeline(self) -> None:
        pipe = _Pipeline(self.s)
        try:
            pipe.wait_ready(self.s.start_timeout_s)
        except Exception:
            pipe.close()
            raise
        self._pipe = pipe
        self._stop.clear()
        self._reader = threading.Thread(target=self._read_loop, args=(pipe,), name="omni-audio-reader",
                                        daemon=True)
        self._reader.start()
        log.info("pipeline ready (talker pid %d, codec pid %d)", pipe.talker.pid, pipe.codec.pid)

    def begin_shutdown(self) -> None:
        """The server is going down: stage exits from now on are not crashes to recover from."""
        self._closing = True

    async def close(self) -> None:
        self._closing = True
        self._stop.set()
        if self._reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._reader.join, 5)
        if self._pipe is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._pipe.close)
            self._pipe = None
        for st in list(self._streams.values()):
            self._deliver(st, BackendError(503, "shutting_down", "server is shutting down",
                                           retry_after=5))

    # ------------------------------------------------------------------ stream
    async def stream(self, job: SpeechJob) -> AsyncGenerator[AudioChunk, None]:
        self.validate(job)
        if self._pipe is None:
            raise BackendError(503, "unavailable", "the model pipeline is not running", retry_after=2)
        assert self.adm is not None
        text_tokens = self.text_tokens(job)
        prompt_len = self.prompt_tokens(job, text_tokens)
        room = self.s.max_seq_len - prompt_len - 1
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
        pipe = self._pipe
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
                                              speaker=job.voice, instructions=instructions),
                            sampling=SamplingParams.greedy() if job.greedy else SamplingParams(),
                            stream_codes=job.stream_codes)
            with stepstats.phase("server.dispatch"):
                pipe.send(msg)
            total = 0
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                m = item
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
            self._streams.pop(sid, None)
            if not st.done and self._pipe is pipe and pipe is not None:
                try:
                    pipe.send(CancelStream(stream_id=sid, reason="client gone"))
                except (ChannelClosed, OSError):
                    pass
            self.adm.release(sid)

    # ------------------------------------------------------------------ reader / supervisor
    def _deliver(self, st: _Stream, item) -> None:
        st.loop.call_soon_threadsafe(st.queue.put_nowait, item)

    def _read_loop(self, pipe: _Pipeline) -> None:
        last_check = time.monotonic()
        while not self._stop.is_set():
            m = pipe.audio.get(timeout=0.05)
            if m is not None:
                stepstats.record_ns("hop.audio.enqueue_put", m.enqueue_ns, m.put_ns)
                stepstats.record_ns("hop.audio.put_get", m.put_ns, m.get_ns)
                st = self._streams.get(m.stream_id)
                if st is not None:
                    n = len(m.payload) if m.kind == MsgKind.CODES and m.payload is not None else \
                        (len(m.payload) // self.cfg.code2wav.samples_per_frame if m.kind == MsgKind.PCM else 0)
                    if n:
                        st.arrivals.append((n, m.get_ns / 1e9))
                    if m.flags & Flags.END and not self._calibrated:
                        self._try_calibrate(st.arrivals)
                    self._deliver(st, m)
            now = time.monotonic()
            if now - last_check >= 0.1:
                last_check = now
                self._drain_control(pipe)
                if not pipe.alive():
                    self._recover(pipe)
                    return

    def _try_calibrate(self, arrivals: list[tuple[int, float]]) -> None:
        """Fit chunk costs from a finished stream and cache the policy for the next start."""
        try:
            policy = calibrate(arrivals)
        except ValueError:
            return  # too few chunks or sizes in this stream: wait for another
        path = self._calibration.store(policy, chunks=len(arrivals))
        self._calibrated = True
        log.info("calibrated chunk policy %s (cached at %s; used from the next start)",
                 policy.to_dict(), path)

    def _drain_control(self, pipe: _Pipeline) -> None:
        """Stage timing pushes (StatsReply with request_id -1) -> this process's /metrics."""
        try:
            while (msg := pipe.ctrl.recv(timeout=0)) is not None:
                if isinstance(msg, StatsReply) and msg.request_id == -1:
                    _replay_into_metrics(msg.stats, msg.stage, msg.pid)
        except (ChannelClosed, OSError):
            pass

    def _recover(self, pipe: _Pipeline) -> None:
        time.sleep(0.2)  # a shutdown signal that also hit the stages is noticed here first
        dead = [p.name for p in pipe.procs if not p.is_alive()]
        self._pipe = None
        closing = self._closing or self._stop.is_set()
        if closing:
            log.info("stage processes exited during shutdown (%s)", ", ".join(dead))
        else:
            log.error("stage process died (%s): failing %d streams and restarting",
                      ", ".join(dead), len(self._streams))
        err = BackendError(503 if closing else 500, "stage_failed",
                           f"a pipeline stage ({', '.join(dead)}) stopped; the stream was aborted, "
                           "retry the request", retry_after=2 if closing else None)
        for st in list(self._streams.values()):
            self._deliver(st, err)
        pipe.close()
        if closing:
            return
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < 60] + [now]
        if len(self._restart_times) > 5:
            log.error("stages died 6 times within a minute: not restarting again; the server "
                      "answers 503 until it is restarted (see the stage logs)")
            return
        self._restarts += 1
        try:
            self._start_pipeline()
        except Exception as e:  # keep serving errors rather than dying
            log.error("pipeline restart failed: %s", e)


def _replay_into_metrics(flat: dict, stage: str, pid: int) -> None:
    """Feed a stage's timing delta to the server's step histograms (one sample per recorded
    phase event, at its histogram bin's geometric centre)."""
    from omni_stream.server.metrics import observe_step

    snap = stepstats.unflatten_snapshot(flat, stage, pid)
    for name, p in snap["phases"].items():
        for b, n in p["bins"]:
            lo, hi = stepstats.bin_edges(b)
            centre = (lo * hi) ** 0.5 if lo > 0 and hi != float("inf") else (hi if lo == 0 else lo)
            for _ in range(min(int(n), 1000)):
                observe_step(name, centre)
