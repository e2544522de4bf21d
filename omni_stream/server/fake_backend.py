"""A deterministic stand-in for the model pipeline, for server tests and client development.

Audio is a seeded linear chirp computed from the absolute sample index, so any chunking of a
stream concatenates to exactly the one-pass waveform. It honours the same contract as the real
backend, and admits streams with the real backend's own :class:`AdmissionController` (whose
refusals are the RequestErrors ``PipelineBackend.stream`` raises) so that server tests see the
statuses production sends: queue full -> 429 ``server_busy`` at once, queued past the deadline
-> 503 ``queue_timeout``, both with the controller's Retry-After. Only the KV budget is left out
(effectively unlimited, one byte per stream): there is no model whose cache could run out.
Besides: per-frame pacing, chunks sized by the real ramp (``ChunkPolicy.ramp``: 1 frame first,
x2 per chunk up to ``steady_chunk_frames``, no slack feedback), and prompt release of its slot
when the consumer closes the stream.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import zlib
from dataclasses import replace
from typing import Any, AsyncGenerator

import numpy as np

from omni_stream.config import FRAME_S
from omni_stream.scheduling import AdmissionController, ChunkPolicy
from omni_stream.contract import NUM_CODE_GROUPS, AudioChunk, SpeechJob
from omni_stream.errors import RequestError

SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
CHARS_PER_FRAME = 4  # fake "speaking rate": one 80 ms frame per 4 characters of text
UNLIMITED_KV_BYTES = 1 << 62  # the fake has no KV cache: admission is by slots and queue only

DEFAULT_VOICES = ("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna",
                  "sohee")
DEFAULT_LANGUAGES = ("chinese", "english", "german", "spanish", "japanese", "french", "korean",
                     "russian", "italian", "portuguese")


def expected_frames(text: str, max_frames: int | None = None) -> int:
    """Frames FakeBackend generates for ``text`` (tests compute expected byte counts from it)."""
    n = 1 + len(text) // CHARS_PER_FRAME
    return min(n, max_frames) if max_frames else n


def chunk_sizes(total: int, policy: ChunkPolicy) -> list[int]:
    """Chunk sizes in frames: ``policy.ramp(0), policy.ramp(1), ...``, the last one cut so
    they sum to ``total``."""
    sizes: list[int] = []
    left = total
    while left > 0:
        sizes.append(min(policy.ramp(len(sizes)), left))
        left -= sizes[-1]
    return sizes


def fake_audio(seed: int, start: int, n: int, sample_rate: int = 24000) -> np.ndarray:
    """Samples [start, start + n) of the seeded chirp: float32, amplitude 0.3."""
    t = (np.arange(start, start + n, dtype=np.float64)) / sample_rate
    f0 = 180.0 + (seed % 97) * 3.0  # Hz
    sweep = 120.0  # Hz per second
    return (0.3 * np.sin(2 * math.pi * (f0 * t + 0.5 * sweep * t * t))).astype(np.float32)


def fake_codes(seed: int, start: int, n: int) -> np.ndarray:
    """Codec frames [start, start + n): int64 [n, 16] in [0, 2048)."""
    f = np.arange(start, start + n, dtype=np.int64)[:, None]
    g = np.arange(NUM_CODE_GROUPS, dtype=np.int64)[None, :]
    return (f * 16 + g * 7 + seed) % 2048


class FakeBackend:
    """Deterministic Backend. ``max_streams`` slots (None: unlimited); a stream that finds them
    full waits in a queue of ``max_queue`` for up to ``queue_timeout`` seconds (defaults as
    ``PipelineSettings``). ``frame_delay`` seconds are slept per frame; ``fail_after_frames``
    raises a 500 mid-stream; ``reject`` (a RequestError) refuses every stream at admission."""

    def __init__(self, *, model_name: str = "omni-stream-fake", sample_rate: int = 24000,
                 voices: tuple[str, ...] = DEFAULT_VOICES,
                 languages: tuple[str, ...] = DEFAULT_LANGUAGES,
                 supports_instructions: bool = True, supports_codec_frames: bool = True,
                 frame_delay: float = 0.0, max_streams: int | None = None, max_queue: int = 16,
                 queue_timeout: float = 10.0, steady_chunk_frames: int = 8,
                 fail_after_frames: int | None = None, reject: RequestError | None = None,
                 max_frames_cap: int = 4096) -> None:
        if max_streams is not None and max_streams < 1:
            raise ValueError(f"max_streams must be >= 1 or None (unlimited), got {max_streams}")
        if max_queue < 0 or queue_timeout <= 0:
            raise ValueError(f"need max_queue >= 0 and queue_timeout > 0 (as PipelineSettings), "
                             f"got {max_queue} and {queue_timeout}")
        self.model_name = model_name
        self.variant = "custom_voice"  # named voices; cannot clone (no Base encoders)
        self.text_idle_timeout_s = 30.0  # continuous text, as PipelineSettings
        self.sample_rate = sample_rate
        self.supports_instructions = supports_instructions
        self.supports_codec_frames = supports_codec_frames
        self._voices = list(voices)
        self._languages = list(languages)
        self.frame_delay = frame_delay
        self.max_streams = max_streams
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.chunk_policy = ChunkPolicy(first=1, steady=steady_chunk_frames)
        self.fail_after_frames = fail_after_frames
        self.reject = reject
        self.max_frames_cap = max_frames_cap
        self.active = 0  # admitted streams not yet finished
        self.started_total = 0
        self.completed_total = 0
        self.cancelled_total = 0
        self.jobs: list[SpeechJob] = []  # every admitted job, for tests
        self.running = False
        self.adm: AdmissionController | None = None  # made in start(), on the serving loop
        self._ids = itertools.count(1)

    # --- Backend interface -------------------------------------------------------------------
    def capacity_info(self) -> dict:
        """As the pipeline's: its slot count, and the RTF its per-frame sleep gives."""
        cap = self.max_streams if self.max_streams is not None else 0
        rtf = self.frame_delay / FRAME_S
        return dict(capacity_streams=cap, rtf_estimate=round(rtf, 4), realtime=rtf <= 1,
                    contention=1.0, bandwidth_gbs=0.0, margin=1.0, slots=cap)

    def voices(self) -> list[str]:
        return list(self._voices)

    def languages(self) -> list[str]:
        return list(self._languages)

    def validate(self, job: SpeechJob) -> None:
        if job.clone is not None:
            raise RequestError(400, "voice_clone_unsupported",
                               f"model '{self.model_name}' cannot clone voices: serve a Base "
                               "checkpoint", param="voice")
        if job.voice is not None and job.voice not in self._voices:
            raise RequestError(400, "invalid_voice", f"unknown voice '{job.voice}'", param="voice")
        if job.language != "auto" and job.language.lower() not in self._languages:
            raise RequestError(400, "invalid_language",
                               f"unknown language '{job.language}': use 'auto' or one of "
                               f"{', '.join(self._languages)}", param="language")
        if job.instructions and not self.supports_instructions:
            raise RequestError(400, "instructions_unsupported",
                               f"model '{self.model_name}' does not take instructions",
                               param="instructions")
        if job.stream_codes and not self.supports_codec_frames:
            raise RequestError(400, "codec_frames_unsupported",
                               f"model '{self.model_name}' cannot stream codec frames",
                               param="codec_frames")
        if job.max_frames is not None and not 1 <= job.max_frames <= self.max_frames_cap:
            raise RequestError(400, "invalid_max_new_tokens",
                               f"max_new_tokens must be in [1, {self.max_frames_cap}]",
                               param="max_new_tokens")

    def stats(self) -> dict[str, Any]:
        """The real backend's gauges: slots_free counts admission slots, queue_depth the queue."""
        snap = self.adm.snapshot() if self.adm is not None else {}
        slots = self.max_streams or 0
        out = {"active_streams": self.active, "queue_depth": snap.get("queued", 0),
               "slots_total": slots,
               "slots_free": slots - snap.get("admitted", 0) if slots else 0,
               "streams_cancelled_total": self.cancelled_total}
        out.update({f"admission_{k}": v for k, v in snap.items()})
        return out

    async def start(self) -> None:
        # None means unlimited: the controller still runs (same code path), with a cap that is
        # never reached
        self.adm = AdmissionController(UNLIMITED_KV_BYTES, self.max_streams or sys.maxsize,
                                       self.max_queue)
        self.running = True

    async def close(self) -> None:
        self.running = False

    async def _read_feed(self, job: SpeechJob) -> SpeechJob | None:
        """The job with its whole continuous text, or None after an idle timeout."""
        parts = []
        while True:
            try:
                piece = await job.text_feed.next(self.text_idle_timeout_s)
            except asyncio.TimeoutError:
                return None
            if piece is None:
                break
            parts.append(piece)
        text = "".join(parts)
        if not text.strip():
            raise RequestError(400, "empty_input", "the utterance closed without text: send "
                               "input.text before input.done", param="text")
        return replace(job, text=text, text_feed=None)

    async def stream(self, job: SpeechJob) -> AsyncGenerator[AudioChunk, None]:
        if not job.validated:  # the server's jobs were (schema.resolve_options)
            self.validate(job)
        if self.reject is not None:
            raise self.reject
        if not self.running or self.adm is None:
            raise RequestError(503, "unavailable", "backend is not running", retry_after=1.0)
        if job.text_feed is not None:  # continuous text: the fake speaks it once it is closed
            job = await self._read_feed(job)
            if job is None:
                raise RequestError(408, "text_timeout", f"no text for {self.text_idle_timeout_s:g}"
                                   " s: send input.done to close the utterance")
        sid = next(self._ids)
        # as PipelineBackend.stream: 429 queue full, 503 deadline, Retry-After from adm
        await self.adm.acquire(sid, 1, self.queue_timeout)
        self.active += 1
        self.jobs.append(job)
        self.started_total += 1
        finished = False
        try:
            seed = job.seed if job.seed is not None else zlib.crc32(f"{job.voice}|{job.text}".encode())
            total = expected_frames(job.text, job.max_frames)
            policy = self.chunk_policy
            if job.initial_chunk_frames:
                policy = policy.starting_at(job.initial_chunk_frames)
            done = 0
            for size in chunk_sizes(total, policy):
                for _ in range(size):  # one "decode step" per frame
                    await asyncio.sleep(self.frame_delay)
                    if self.fail_after_frames is not None and done >= self.fail_after_frames:
                        raise RequestError(500, "internal_error", "fake backend failure")
                if job.stream_codes:
                    yield AudioChunk(codes=fake_codes(seed, done, size), frames=size)
                else:
                    yield AudioChunk(pcm=fake_audio(seed, done * SAMPLES_PER_FRAME,
                                                    size * SAMPLES_PER_FRAME, self.sample_rate),
                                     frames=size)
                done += size
            finished = True
            # "length" when max_new_tokens cut the text's frames short, as the real cap does
            capped = expected_frames(job.text, job.max_frames) < expected_frames(job.text)
            yield AudioChunk(final=True, input_tokens=len(job.text.encode()), output_frames=done,
                             finish_reason="length" if capped else "stop")
        finally:
            self.active -= 1
            if finished:
                self.completed_total += 1
            else:
                self.cancelled_total += 1
            self.adm.release(sid)
