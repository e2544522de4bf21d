"""A deterministic stand-in for the model pipeline, for server tests and client development.

Audio is a seeded linear chirp computed from the absolute sample index, so any chunking of a
stream concatenates to exactly the one-pass waveform. It honours the same contract as the real
backend: slots with a bounded wait, BackendError 429 when full, per-frame pacing, a
1-frame-first chunk ramp, and prompt release of its slot when the consumer closes the stream.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from typing import Any, AsyncGenerator

import numpy as np

from omni_stream.server.backend import NUM_CODE_GROUPS, AudioChunk, BackendError, SpeechJob

SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
CHARS_PER_FRAME = 4  # fake "speaking rate": one 80 ms frame per 4 characters of text

DEFAULT_VOICES = ("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna",
                  "sohee")
DEFAULT_LANGUAGES = ("chinese", "english", "german", "spanish", "japanese", "french", "korean",
                     "russian", "italian", "portuguese")


def expected_frames(text: str, max_frames: int | None = None) -> int:
    """Frames FakeBackend generates for ``text`` (tests compute expected byte counts from it)."""
    n = 1 + len(text) // CHARS_PER_FRAME
    return min(n, max_frames) if max_frames else n


def chunk_schedule(total: int, first: int, steady: int) -> list[int]:
    """Chunk sizes in frames: ``first``, then doubling up to ``steady``; sums to ``total``."""
    sizes, size, left = [], max(1, first), total
    while left > 0:
        take = min(size, left)
        sizes.append(take)
        left -= take
        size = min(max(size * 2, 2), max(steady, first))
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
    full waits up to ``queue_timeout`` seconds, then gets 429 with ``retry_after``.
    ``frame_delay`` seconds are slept per frame; ``fail_after_frames`` raises a 500 mid-stream;
    ``reject`` (a BackendError) refuses every stream at admission."""

    def __init__(self, *, model_name: str = "omni-stream-fake", sample_rate: int = 24000,
                 voices: tuple[str, ...] = DEFAULT_VOICES,
                 languages: tuple[str, ...] = DEFAULT_LANGUAGES,
                 supports_instructions: bool = True, supports_codec_frames: bool = True,
                 frame_delay: float = 0.0, max_streams: int | None = None,
                 queue_timeout: float = 0.0, retry_after: float = 1.0,
                 steady_chunk_frames: int = 8, fail_after_frames: int | None = None,
                 reject: BackendError | None = None, max_frames_cap: int = 4096) -> None:
        self.model_name = model_name
        self.sample_rate = sample_rate
        self.supports_instructions = supports_instructions
        self.supports_codec_frames = supports_codec_frames
        self._voices = list(voices)
        self._languages = list(languages)
        self.frame_delay = frame_delay
        self.max_streams = max_streams
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.steady_chunk_frames = steady_chunk_frames
        self.fail_after_frames = fail_after_frames
        self.reject = reject
        self.max_frames_cap = max_frames_cap
        self.active = 0
        self.waiting = 0
        self.started_total = 0
        self.completed_total = 0
        self.cancelled_total = 0
        self.jobs: list[SpeechJob] = []  # every admitted job, for tests
        self.running = False
        self._slot_freed: asyncio.Condition | None = None

    # --- Backend interface -------------------------------------------------------------------
    def voices(self) -> list[str]:
        return list(self._voices)

    def languages(self) -> list[str]:
        return list(self._languages)

    def validate(self, job: SpeechJob) -> None:
        if job.voice is not None and job.voice not in self._voices:
            raise BackendError(400, "invalid_voice", f"unknown voice '{job.voice}'", param="voice")
        if job.language != "auto" and job.language.lower() not in self._languages:
            raise BackendError(400, "invalid_language",
                               f"unknown language '{job.language}': use 'auto' or one of "
                               f"{', '.join(self._languages)}", param="language")
        if job.instructions and not self.supports_instructions:
            raise BackendError(400, "instructions_unsupported",
                               f"model '{self.model_name}' does not take instructions",
                               param="instructions")
        if job.stream_codes and not self.supports_codec_frames:
            raise BackendError(400, "codec_frames_unsupported",
                               f"model '{self.model_name}' cannot stream codec frames",
                               param="codec_frames")
        if job.max_frames is not None and not 1 <= job.max_frames <= self.max_frames_cap:
            raise BackendError(400, "invalid_max_new_tokens",
                               f"max_new_tokens must be in [1, {self.max_frames_cap}]",
                               param="max_new_tokens")

    def stats(self) -> dict[str, Any]:
        slots = self.max_streams or 0
        return {"active_streams": self.active, "queue_depth": self.waiting, "slots_total": slots,
                "slots_free": max(0, slots - self.active) if slots else 0,
                "streams_cancelled_total": self.cancelled_total}

    async def start(self) -> None:
        self._slot_freed = asyncio.Condition()
        self.running = True

    async def close(self) -> None:
        self.running = False

    async def stream(self, job: SpeechJob) -> AsyncGenerator[AudioChunk, None]:
        if self.reject is not None:
            raise self.reject
        if not self.running:
            raise BackendError(503, "unavailable", "backend is not running", retry_after=1.0)
        await self._admit()
        self.jobs.append(job)
        self.started_total += 1
        finished = False
        try:
            seed = job.seed if job.seed is not None else zlib.crc32(f"{job.voice}|{job.text}".encode())
            total = expected_frames(job.text, job.max_frames)
            first = job.initial_chunk_frames or 1
            done = 0
            for size in chunk_schedule(total, first, self.steady_chunk_frames):
                for _ in range(size):  # one "decode step" per frame
                    await asyncio.sleep(self.frame_delay)
                    if self.fail_after_frames is not None and done >= self.fail_after_frames:
                        raise BackendError(500, "internal_error", "fake backend failure")
                if job.stream_codes:
                    yield AudioChunk(codes=fake_codes(seed, done, size), frames=size)
                else:
                    yield AudioChunk(pcm=fake_audio(seed, done * SAMPLES_PER_FRAME,
                                                    size * SAMPLES_PER_FRAME, self.sample_rate),
                                     frames=size)
                done += size
            finished = True
            yield AudioChunk(final=True, input_tokens=len(job.text.encode()), output_frames=done)
        finally:
            self.active -= 1
            if finished:
                self.completed_total += 1
            else:
                self.cancelled_total += 1
            assert self._slot_freed is not None
            async with self._slot_freed:
                self._slot_freed.notify()

    # --- admission ---------------------------------------------------------------------------
    async def _admit(self) -> None:
        """Take a slot, waiting at most ``queue_timeout``; 429 with Retry-After past it."""
        assert self._slot_freed is not None, "start() was not called"
        if self.max_streams is None or self.active < self.max_streams:
            self.active += 1
            return
        self.waiting += 1
        try:
            async with self._slot_freed:
                await asyncio.wait_for(
                    self._slot_freed.wait_for(lambda: self.active < self.max_streams),
                    self.queue_timeout)
                self.active += 1
        except asyncio.TimeoutError:
            raise BackendError(429, "server_busy",
                               f"all {self.max_streams} streams are busy; retry later",
                               retry_after=self.retry_after) from None
        finally:
            self.waiting -= 1
