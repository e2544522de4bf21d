"""Server-sent events for ``stream_format: "sse"`` (the events are reused by the WebSocket).

Each event is one ``data: <json>\\n\\n`` record, as OpenAI sends them:
``{"type": "speech.audio.delta", "audio": <base64 pcm s16le>}`` per chunk, then
``{"type": "speech.audio.done", "usage": {...}, "finish_reason": "stop" | "length"}``
("length": the stream reached its frame cap, max_new_tokens or the default that follows the
text, so the audio may end mid-word); a failure after the first event becomes
``{"type": "error", "error": {message, type, param, code}}`` and ends the stream.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from omni_stream.server.audio import to_s16le
from omni_stream.contract import AudioChunk
from omni_stream.server.errors import ApiError
from omni_stream.observability import stepstats
from omni_stream.server.stream import StreamRun

log = logging.getLogger(__name__)


def delta_event(pcm_s16le: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(pcm_s16le).decode()}


def done_event(usage: dict[str, int], finish_reason: str | None) -> dict[str, Any]:
    return {"type": "speech.audio.done", "usage": usage, "finish_reason": finish_reason}


def error_event(err: ApiError) -> dict[str, Any]:
    return {"type": "error", **err.body()}


def sse_record(event: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


async def write_sse(request: web.Request, resp: web.StreamResponse, run: StreamRun,
                    first: AudioChunk) -> None:
    """Send ``first`` and the rest of ``run`` as SSE events on ``resp`` (not yet prepared)."""
    resp.headers.update({"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                         "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    chunk: AudioChunk | None = first
    try:
        while chunk is not None:
            t = time.perf_counter()
            if chunk.pcm is not None and chunk.pcm.size:
                await resp.write(sse_record(delta_event(to_s16le(chunk.pcm))))
            stepstats.record("server.encode_write", time.perf_counter() - t)
            run.sent(chunk)
            chunk = await run.next()
        await resp.write(sse_record(done_event(run.usage(), run.finish_reason())))
    except ApiError as e:
        log.warning("%s: failed mid-stream: %s", run.job.request_id, e.message)
        await resp.write(sse_record(error_event(e)))
    await resp.write_eof()
