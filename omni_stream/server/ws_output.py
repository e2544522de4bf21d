"""The WebSocket session's way out: events, PCM and codec frames of one utterance as it is
spoken (the protocol: ``server/ws.py``).

:class:`WsSender` owns the socket's sending side: JSON events, binary frames, and a
``codec.frames`` / ``codec.prime`` header kept next to the binary frame it describes (one lock).
:func:`speak` runs one utterance's backend stream and sends it: ``audio.start`` with its first
audio, the audio (binary pcm s16le, ``speech.audio.delta`` events with stream_format "sse", or
codec frames), ``text.waiting`` / ``text.resumed`` for continuous text, ``audio.done``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import msgspec
import numpy as np
from aiohttp import web

from omni_stream.config import FRAME_S
from omni_stream.contract import NUM_CODE_GROUPS, Backend
from omni_stream.errors import RequestError
from omni_stream.server.audio import to_s16le
from omni_stream.server.errors import ws_error_event
from omni_stream.server.sse import delta_event
from omni_stream.server.state import ServerState
from omni_stream.server.stream import StreamRun
from omni_stream.server.ws_utterances import Utterance


def codec_info(backend: Backend) -> dict[str, Any]:
    """What a client-side decoder must match: geometry, plus the codec weights' identity
    (``codec_sha256``, from ``omni_stream.export.manifest.codec_identity``) where the
    backend knows it."""
    return {"num_codebooks": NUM_CODE_GROUPS, "sample_rate": backend.sample_rate,
            "frame_rate": 1 / FRAME_S, **(getattr(backend, "codec_info", None) or {})}


class WsSender:
    """The sending side of one WebSocket."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.lock = asyncio.Lock()  # keeps a codec.frames header next to its binary frame

    async def json(self, event: dict[str, Any]) -> None:
        async with self.lock:
            await self.ws.send_str(msgspec.json.encode(event).decode())

    async def binary(self, data: bytes) -> None:
        async with self.lock:
            await self.ws.send_bytes(data)

    async def codes(self, header: dict[str, Any], codes: np.ndarray) -> None:
        """A JSON header, then ``codes`` [n, 16] as little-endian int64, nothing in between."""
        async with self.lock:
            await self.ws.send_str(msgspec.json.encode(header).decode())
            await self.ws.send_bytes(codes.astype("<i8", copy=False).tobytes())

    async def error(self, err: RequestError, utt: Utterance | None = None,
                    context_id: str | None = None) -> None:
        if utt is not None:
            await self.json(ws_error_event(err, utt.job.request_id, utt.context_id))
        else:
            await self.json(ws_error_event(err, context_id=context_id))


async def speak(st: ServerState, out: WsSender, utt: Utterance, sse: bool,
                on_run: Callable[[StreamRun], None]) -> None:
    """Speak ``utt`` on ``out`` (``sse``: delta events instead of binary pcm); ``on_run`` gets the
    StreamRun as it opens (input.cancel marks it cancelled)."""
    job = utt.job
    async with StreamRun(st.backend, job, st.metrics, "ws", time.perf_counter(),
                         speed=utt.speed) as run:
        on_run(run)
        started = False
        offset = 0
        waited_s = 0.0
        while (chunk := await run.next()) is not None:
            if chunk.is_event:  # continuous text: the stream waits for (or got) its text
                event = utt.tag({"type": "text.waiting" if chunk.text_waiting
                                 else "text.resumed", "frames": offset})
                if chunk.text_waited_s is not None:
                    waited_s += chunk.text_waited_s
                    event.update(waited_ms=round(chunk.text_waited_s * 1e3),
                                 total_waited_ms=round(waited_s * 1e3))
                await out.json(event)
                continue
            if not started:  # with the first audio (or the empty end of a silent one)
                started = True
                await _audio_start(st, out, utt)
            if chunk.codes is not None and len(chunk.codes):
                codes = chunk.codes  # [n, 16]
                await out.codes(utt.tag({"type": "codec.frames", "offset": offset,
                                         "frames": len(codes), "shape": list(codes.shape),
                                         "dtype": "int64"}), codes)
                offset += len(codes)
            elif chunk.pcm is not None and chunk.pcm.size:
                data = to_s16le(chunk.pcm)
                if sse:
                    await out.json(delta_event(data))
                else:
                    await out.binary(data)
                offset += chunk.frames
            run.sent(chunk)
        done = utt.tag({"type": "audio.done", "usage": run.usage(),
                        "finish_reason": run.finish_reason()})
        if job.text_feed is not None:
            done["text_waited_ms"] = round(waited_s * 1e3)
        await out.json(done)


async def _audio_start(st: ServerState, out: WsSender, utt: Utterance) -> None:
    job = utt.job
    start = utt.tag({"type": "audio.start", "text": job.text,
                     "sample_rate": st.backend.sample_rate})
    if job.text_feed is not None:
        start.update(text=None, text_mode="continuous")
    if job.stream_codes:
        start.update(codec_info(st.backend))
        start.update(format="codec_frames", dtype="int64")  # dtype of the codes
    else:
        start.update(format="pcm_s16le", channels=1)
    if utt.speed != 1.0:
        start["speed"] = utt.speed
    await out.json(start)
    prime = job.clone.prime_codes() if job.stream_codes and job.clone else None
    if prime is not None:
        # an ICL voice: the client's decoder decodes these reference frames first and drops
        # their audio, as the server's Code2Wav does (same left context)
        await out.codes(utt.tag({"type": "codec.prime", "frames": len(prime),
                                 "shape": list(prime.shape), "dtype": "int64"}), prime)
