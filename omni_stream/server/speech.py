"""``POST /v1/audio/speech``: chunked audio, SSE, or a whole file.

The handler parses and validates, opens the backend stream and awaits the FIRST chunk before
sending any header, so admission failures (429/503) still get their real status and JSON body.
After that each chunk is encoded and written as it arrives. A failure mid-stream cannot change
the status any more: a chunked audio response is aborted (the client sees a truncated transfer,
never a clean end of a partial file), an SSE response gets an ``error`` event. A client that goes
away surfaces as ConnectionError on write or as cancellation of this handler (the server runs
with handler cancellation): both leave the StreamRun block, which closes the backend stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import numpy as np
from aiohttp import web

from omni_stream.server.audio import encode_whole, to_s16le, wav_header
from omni_stream.contract import AudioChunk
from omni_stream.errors import RequestError
from omni_stream.observability import stepstats
from omni_stream.server.schema import (SpeechPlan, check_content_type, decode_speech_request,
                                       plan_speech)
from omni_stream.server.sse import write_sse
from omni_stream.server.state import STATE, ServerState
from omni_stream.server.stream import StreamRun

log = logging.getLogger(__name__)


def check_ready(st: ServerState) -> None:
    if not st.ready:
        raise RequestError(503, "unavailable",
                           "the server is starting or shutting down; retry shortly",
                           retry_after=1.0)


async def speech(request: web.Request) -> web.StreamResponse:
    t0 = time.perf_counter()
    st = request.app[STATE]
    check_ready(st)
    check_content_type(request.headers.get("Content-Type"))  # 415 before reading the body
    body = await request.read()  # raises 413 past client_max_size
    req = decode_speech_request(body)
    if len(body) > st.settings.max_body_bytes and req.ref_audio is None:
        raise RequestError(413, "request_too_large",
                           f"the request body is over {st.settings.max_body_bytes} bytes (only "
                           "a request carrying ref_audio may be larger): shorten the input")
    plan = plan_speech(req, st.backend, st.settings, st.voices)
    if req.ref_audio is not None:  # a one-off clone: computed before the stream is admitted
        plan = replace(plan, job=await st.voices.attach_ref_audio(plan.job, req))
    resp = web.StreamResponse(headers={"X-Request-Id": plan.job.request_id})
    try:
        async with StreamRun(st.backend, plan.job, st.metrics, plan.mode, t0,
                             speed=plan.speed) as run:
            first = await run.next()  # RequestError here still becomes a JSON error response
            assert first is not None
            if plan.mode == "file":
                return await whole_file(run, first, plan, st.backend.sample_rate, resp.headers)
            if plan.mode == "sse":
                await write_sse(request, resp, run, first, plan.fmt, st.backend.sample_rate)
            else:
                await write_audio(request, resp, run, first, plan, st.backend.sample_rate)
    except ConnectionError:
        log.info("%s: client went away mid-stream", plan.job.request_id)
    return resp


async def write_audio(request: web.Request, resp: web.StreamResponse, run: StreamRun,
                      first: AudioChunk, plan: SpeechPlan, sample_rate: int) -> None:
    """Chunked pcm / wav: every chunk written as it arrives; one wav header up front."""
    resp.content_type = plan.fmt.content_type
    resp.headers["Cache-Control"] = "no-cache"
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    header = wav_header(sample_rate, None) if plan.fmt.name == "wav" else b""
    chunk: AudioChunk | None = first
    try:
        while chunk is not None:
            t = time.perf_counter()
            data = header + (to_s16le(chunk.pcm) if chunk.pcm is not None else b"")
            header = b""
            if data:
                await resp.write(data)
            stepstats.record("server.encode_write", time.perf_counter() - t)
            run.sent(chunk)
            chunk = await run.next()
    except RequestError as e:
        log.warning("%s: failed mid-stream, aborting the response: %s", run.job.request_id,
                    e.message)
        if request.transport is not None:
            request.transport.close()  # no terminating chunk: the client sees the failure
        return
    await resp.write_eof()


async def whole_file(run: StreamRun, first: AudioChunk, plan: SpeechPlan, sample_rate: int,
                     headers) -> web.Response:
    """Collect the stream, encode it once (libsndfile formats off the event loop). Usage and
    finish_reason ("stop" / "length") have no body to travel in: they are headers
    (X-Usage-Input-Tokens, X-Usage-Output-Tokens, X-Finish-Reason)."""
    parts: list[np.ndarray] = []
    chunk: AudioChunk | None = first
    while chunk is not None:
        if chunk.pcm is not None:
            parts.append(chunk.pcm)
        run.sent(chunk)
        chunk = await run.next()
    pcm = np.concatenate(parts) if parts else np.zeros(0, np.float32)  # [samples]
    t = time.perf_counter()
    if plan.fmt.sf_format is None:
        data = encode_whole(pcm, sample_rate, plan.fmt.name)
    else:
        data = await asyncio.get_running_loop().run_in_executor(
            None, encode_whole, pcm, sample_rate, plan.fmt.name)
    stepstats.record("server.encode_write", time.perf_counter() - t)
    usage, reason = run.usage(), run.finish_reason()
    assert reason is not None  # the loop above ends only after the final chunk
    return web.Response(body=data, content_type=plan.fmt.content_type,
                        headers={**headers, "X-Usage-Input-Tokens": str(usage["input_tokens"]),
                                 "X-Usage-Output-Tokens": str(usage["output_tokens"]),
                                 "X-Finish-Reason": reason})
