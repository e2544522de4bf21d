"""One backend stream as a handler sees it: typed errors, metrics, and a guaranteed close.

``async with StreamRun(...) as run`` opens ``backend.stream(job)``; ``await run.next()`` returns
the next chunk (None after the final one) and turns every other backend failure into a 500 RequestError;
leaving the block closes the generator (``aclose``) whatever happened, which is how a client
disconnect or handler cancellation reaches the backend and frees its slot.

With ``speed`` != 1.0 each chunk's PCM goes through the stream's own :class:`Stretcher` (in a
worker thread: Rubber Band takes ms per chunk) and the final chunk carries its flushed tail;
``chunk.frames`` still counts the codec frames generated (usage), not the stretched duration.
A stretcher failure fails this stream (500 ``speed_failed``) and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import AsyncGenerator

import numpy as np

from omni_stream.config import FRAME_S
from omni_stream.contract import AudioChunk, Backend, SpeechJob
from omni_stream.errors import RequestError
from omni_stream.server.errors import internal_error
from omni_stream.server.metrics import ServerMetrics
from omni_stream.server.speed import Stretcher, StretchError

log = logging.getLogger(__name__)


class StreamRun:
    def __init__(self, backend: Backend, job: SpeechJob, metrics: ServerMetrics, endpoint: str,
                 t0: float | None = None, speed: float = 1.0) -> None:
        self.backend = backend
        self.job = job
        self.speed = speed  # 1.0: chunks pass untouched (bit-identical to no speed at all)
        self._stretch: Stretcher | None = None
        self.metrics = metrics
        self.endpoint = endpoint
        self.t0 = time.perf_counter() if t0 is None else t0  # TTFA is measured from here
        self.final: AudioChunk | None = None
        self.frames_sent = 0
        self._gen: AsyncGenerator[AudioChunk, None] | None = None
        self._first_sent = False
        self.cancelled = False  # set by the caller that stops it on purpose (WS input.cancel)

    async def __aenter__(self) -> "StreamRun":
        self._gen = self.backend.stream(self.job)
        self.metrics.active_streams.labels(self.endpoint).inc()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        assert self._gen is not None
        try:
            await self._gen.aclose()
        finally:
            self.metrics.active_streams.labels(self.endpoint).dec()
            if exc_type is None:
                outcome = "completed" if self.final is not None else "error"
            elif issubclass(exc_type, (asyncio.CancelledError, ConnectionError)):
                outcome = "cancelled" if self.cancelled else "disconnected"
            elif (issubclass(exc_type, RequestError) and self.frames_sent == 0
                  and (exc.status < 500 or exc.status == 503)):
                outcome = "rejected"  # refused at admission (queue full, shutting down)
            else:
                outcome = "error"
            self.metrics.stream_outcomes.labels(self.endpoint, outcome).inc()
            self.metrics.audio_seconds.labels(self.endpoint).inc(self.frames_sent * FRAME_S)
            log.debug("%s %s: %d frames, %s", self.endpoint, self.job.request_id,
                      self.frames_sent, outcome)

    async def next(self) -> AudioChunk | None:
        """The next chunk, or None once the final chunk has been returned."""
        assert self._gen is not None
        if self.final is not None:
            return None
        try:
            chunk = await self._gen.__anext__()
        except StopAsyncIteration:
            log.error("%s: backend stream ended without a final chunk", self.job.request_id)
            raise internal_error(self.job.request_id) from None
        except RequestError as e:
            if e.status >= 500:
                log.error("%s: backend failed: %r", self.job.request_id, e)
            raise
        except Exception:
            log.exception("%s: backend raised", self.job.request_id)
            raise internal_error(self.job.request_id) from None
        if self.speed != 1.0 and not chunk.is_event:
            chunk = await self._stretched(chunk)
        if chunk.final:
            self.final = chunk
        return chunk

    async def _stretched(self, chunk: AudioChunk) -> AudioChunk:
        """``chunk`` with its PCM time-stretched (the final one with the stretcher's tail)."""
        assert chunk.codes is None, "speed != 1.0 with codec frames is refused at validation"
        sr = self.backend.sample_rate

        def work() -> np.ndarray:
            if self._stretch is None:
                self._stretch = Stretcher(self.speed, sr)
            pcm = chunk.pcm if chunk.pcm is not None else np.zeros(0, np.float32)
            out = self._stretch.push(pcm)
            return np.concatenate([out, self._stretch.finish()]) if chunk.final else out

        try:
            pcm = await asyncio.get_running_loop().run_in_executor(None, work)
        except Exception as e:  # noqa: BLE001 - any stretcher fault fails this stream only
            if isinstance(e, StretchError):
                log.error("%s: %s", self.job.request_id, e)
            else:
                log.exception("%s: the time-stretch raised", self.job.request_id)
            raise RequestError(500, "speed_failed", f"time-stretch to speed {self.speed} failed "
                               f"({self.job.request_id}); see the server log", param="speed") from None
        return replace(chunk, pcm=pcm)

    def sent(self, chunk: AudioChunk) -> None:
        """Call after a chunk's bytes were written: feeds time to first audio."""
        self.frames_sent += chunk.frames
        if not self._first_sent and chunk.frames and (chunk.pcm is None or chunk.pcm.size):
            self._first_sent = True
            self.metrics.ttfa.labels(self.endpoint).observe(time.perf_counter() - self.t0)

    def finish_reason(self) -> str | None:
        """Why the stream ended: "stop" (the model finished the utterance) or "length" (it hit
        the frame cap, so the audio may stop mid-word); None before the final chunk."""
        return self.final.finish_reason if self.final is not None else None

    def usage(self) -> dict[str, int]:
        """OpenAI usage: input tokens, output tokens (= codec frames)."""
        inp = self.final.input_tokens if self.final else 0
        out = self.final.output_frames if self.final else self.frames_sent
        return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}
