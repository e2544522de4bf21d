"""Server-sent events for ``stream_format: "sse"`` (the events are reused by the WebSocket).

Each event is one ``data: <json>\\n\\n`` record, as OpenAI sends them:
``{"type": "speech.audio.delta", "audio": <base64 audio>}`` per chunk (pcm s16le, or the bytes
of the requested response_format as its encoder produces them), then
``{"type": "speech.audio.done", "usage": {...}, "finish_reason": "stop" | "length"}``
("length": the stream reached its frame cap, max_new_tokens or the default that follows the
text, so the audio may end mid-word); a failure after the first event becomes
``{"type": "error", "error": {message, type, param, code}}`` and ends the stream.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from omni_stream.server.audio import AudioFormat, StreamEncoder, supported_formats
from omni_stream.contract import AudioChunk
from omni_stream.errors import RequestError
from omni_stream.server.errors import sse_error_event
from omni_stream.observability import stepstats
from omni_stream.server.stream import StreamRun

log = logging.getLogger(__name__)


def delta_event(audio: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()}


def done_event(usage: dict[str, int], finish_reason: str | None) -> dict[str, Any]:
    return {"type": "speech.audio.done", "usage": usage, "finish_reason": finish_reason}


def sse_record(event: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


async def write_sse(request: web.Request, resp: web.StreamResponse, run: StreamRun,
                    first: AudioChunk, fmt: AudioFormat | None = None,
                    sample_rate: int = 24000) -> None:
    """Send ``first`` and the rest of ``run`` as SSE events on ``resp`` (not yet prepared):
    ``speech.audio.delta`` events carry base64 audio in ``fmt`` (pcm s16le by default; wav,
    mp3, opus, flac as a stream of that file's bytes, as OpenAI sends them)."""
    resp.headers.update({"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                         "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    enc = StreamEncoder(fmt or supported_formats()["pcm"], sample_rate)
    loop = asyncio.get_running_loop()

    async def encode(call, *args) -> bytes:
        return await loop.run_in_executor(None, call, *args) if enc.slow else call(*args)

    chunk: AudioChunk | None = first
    try:
        while chunk is not None:
            t = time.perf_counter()
            if chunk.pcm is not None and chunk.pcm.size:
                data = await encode(enc.encode, chunk.pcm)
                if data:
                    await resp.write(sse_record(delta_event(data)))
            stepstats.record("server.encode_write", time.perf_counter() - t)
            run.sent(chunk)
            chunk = await run.next()
        if tail := await encode(enc.finish):
            await resp.write(sse_record(delta_event(tail)))
        await resp.write(sse_record(done_event(run.usage(), run.finish_reason())))
    except RequestError as e:
        log.warning("%s: failed mid-stream: %s", run.job.request_id, e.message)
        await resp.write(sse_record(sse_error_event(e)))
    await resp.write_eof()
