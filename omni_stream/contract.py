"""The contract between the server and the model pipeline (the real one or ``FakeBackend``).

It sits below both (``server`` and ``orchestrator`` import it; it imports nothing above
``errors``), so neither side depends on the other. The server never touches the model: a
handler builds a :class:`SpeechJob`, asks the backend to ``validate`` it, then iterates
``backend.stream(job)`` and writes each :class:`AudioChunk` as it arrives. Everything the
server needs to know about failures travels as an ``errors.RequestError`` (``BackendError`` here)
carrying its HTTP status, so admission control (429/503 with Retry-After) lives in the backend
and the server only maps it onto the wire.

Cancellation contract: when the client goes away the server stops iterating and closes the
generator, either with ``aclose()`` (GeneratorExit at the backend's current ``yield``) or by
cancelling the task that is awaiting the next chunk (CancelledError at the backend's current
``await``). Both must free the stream's slot and KV within one frame step; a ``try/finally``
around the generator body does it. There is no separate cancel call.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Protocol, runtime_checkable

import numpy as np

from omni_stream.errors import RequestError

NUM_CODE_GROUPS = 16  # codes per frame (code0 from the talker + 15 from the code predictor)


class TextFeed:
    """The text of one continuous utterance as it arrives: the server pushes pieces and closes
    it, the backend reads them in order (``None``: closed). One event loop only."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.closed = False
        self.chars = 0  # characters pushed so far (the input cap counts them)
        self.first_t: float | None = None  # when the first piece came (monotonic)

    def push(self, text: str) -> None:
        if self.closed:
            raise ValueError("the utterance is closed")
        if self.first_t is None:
            self.first_t = time.monotonic()
        self.chars += len(text)
        self._queue.put_nowait(text)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)

    async def next(self, timeout: float | None = None) -> str | None:
        """The next piece, or None once closed; TimeoutError after ``timeout`` s of nothing."""
        return await asyncio.wait_for(self._queue.get(), timeout)


@dataclass(frozen=True)
class SpeechJob:
    """One utterance to synthesize, already validated and resolved by the server.

    ``voice`` is a model speaker name (the server has mapped OpenAI aliases onto
    ``Backend.voices()``) or None for the model default. ``text`` is non-blank and within the
    server's length cap.
    """

    text: str
    request_id: str
    voice: str | None = None
    language: str = "auto"
    instructions: str | None = None
    seed: int | None = None
    max_frames: int | None = None
    greedy: bool = False
    stream_codes: bool = False  # yield codec frames (chunk.codes) instead of PCM, for client-side decoding
    initial_chunk_frames: int | None = None  # size of the first chunk; None: the backend's schedule
    # a cloned voice (Base models: an uploaded voice or the request's ref_audio); ``voice`` is
    # then None and ``voice_label`` names it for logs and session descriptions
    clone: Any = None  # models.voice_clone.VoiceClone
    voice_label: str | None = None
    # continuous text (WebSocket text_mode "continuous"): the text arrives while the utterance
    # is spoken; ``text`` is then empty and the backend reads the feed until it closes
    text_feed: "TextFeed | None" = None
    # ``Backend.validate`` accepted this job's options (the server's ``resolve_options`` sets
    # it, and every job it derives by replacing the text keeps it): ``stream`` checks only jobs
    # without it, so a request is validated once. A job built any other way is checked there.
    validated: bool = False


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """A piece of one stream, in order. The last chunk of a stream has ``final=True``.

    Exactly one of ``pcm`` / ``codes`` is set on a non-empty chunk (``codes`` when the job asked
    for ``stream_codes``); the final chunk may carry the audio tail or be empty (both None,
    ``frames == 0``). ``input_tokens`` / ``output_frames`` are set on the final chunk.
    """

    pcm: np.ndarray | None = None  # [samples] float32 mono in [-1, 1] at Backend.sample_rate
    codes: np.ndarray | None = None  # [frames, 16] int64
    frames: int = 0  # codec frames (80 ms each) this chunk covers
    final: bool = False
    input_tokens: int = 0  # final chunk only: prompt tokens billed to the request
    output_frames: int = 0  # final chunk only: codec frames generated in total
    # final chunk only: "stop" (the model ended the utterance) or "length" (it reached the
    # stream's frame cap: max_new_tokens, or the default cap that follows the text)
    finish_reason: str = "stop"
    # continuous text: an event chunk (no audio) saying the stream ran out of text and waits
    # (``text_waiting``) or got it and goes on after ``text_waited_s``
    text_waiting: bool = False
    text_waited_s: float | None = None

    @property
    def is_event(self) -> bool:
        return self.text_waiting or self.text_waited_s is not None


# the backends' name for the one error type (``errors.RequestError``): the stages and the
# orchestrator raise it as BackendError, the server and the rest of the tree as RequestError
BackendError = RequestError


@runtime_checkable
class Backend(Protocol):
    """What the server needs from a model pipeline (the real one or ``FakeBackend``)."""

    model_name: str  # the served model id (``model`` in requests, ``/v1/models``)
    sample_rate: int  # PCM rate of AudioChunk.pcm (24000 for the 12 Hz codec)
    supports_instructions: bool  # False: a request with ``instructions`` is a 400
    supports_codec_frames: bool  # False: ``stream_codes`` jobs are refused (validate raises 400)

    def voices(self) -> list[str]:
        """Speaker names, in a fixed order (OpenAI aliases map onto it); [] if the model has none."""
        ...

    def languages(self) -> list[str]:
        """Language names accepted in ``SpeechJob.language`` besides "auto"."""
        ...

    def validate(self, job: SpeechJob) -> None:
        """Raise BackendError (4xx) for a job this backend cannot run: unknown voice or language,
        instructions or codec frames unsupported, max_frames out of range. Called before any
        audio is produced; cheap and synchronous. Text content is the server's to check (this
        may be called with an empty-text template at WebSocket ``session.config`` time)."""
        ...

    def stream(self, job: SpeechJob) -> AsyncGenerator[AudioChunk, None]:
        """Synthesize ``job``: implement as ``async def stream(self, job): ... yield chunk``.

        Admission failures (queue full past its deadline, shutting down) raise BackendError
        before the first chunk; failures after it raise BackendError (or anything else, which
        the server reports as 500) mid-stream. See the module docstring for cancellation."""
        ...

    def stats(self) -> dict[str, Any]:
        """Numeric gauges for /metrics, read at scrape time: at least ``active_streams`` and
        ``queue_depth``; ``slots_total`` / ``slots_free`` etc. as the backend has them."""
        ...

    async def start(self) -> None:
        """Load / spawn stages; called once before the server accepts requests."""
        ...

    async def close(self) -> None:
        """Cancel running streams and release every resource; called once at shutdown."""
        ...
