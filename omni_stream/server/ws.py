"""WebSocket ``/v1/audio/speech/stream``: text in as it is written, speech out per sentence.

Client -> server (JSON text messages, field ``type``):
  ``session.config`` {voice, language, instructions, seed, response_format ("pcm"),
      stream_format ("audio": binary frames, default | "sse": JSON delta events),
      codec_frames (bool), split_sentences (bool, default true), text_mode ("sentences",
      default | "continuous"), max_new_tokens, initial_codec_chunk_frames, greedy, model,
      ref_audio / ref_text / x_vector_only (cloning)}: applies to the utterances that follow.
  ``input.text`` {text}: appended to the text buffer; with split_sentences every complete
      sentence (terminal punctuation + whitespace, or CJK terminal punctuation) is queued as an
      utterance at once, and a buffer past the input cap is cut at its last space.
      text_mode "continuous": every piece (any split: mid-word, mid-character sequence) is
      appended to ONE running utterance, spoken while it is written (an LLM's tokens); its text
      is tokenized as far as more text cannot change the tokens, so the speech is exactly that
      of the whole text sent at once in text-streaming mode.
  ``input.done``: the rest of the buffer becomes an utterance (continuous: closes it; the next
      ``input.text`` starts the next one).
  ``session.close``: flush the buffer, finish every queued utterance, then ``session.done``.

Server -> client:
  ``session.created`` {session} on connect; ``session.updated`` {session} per accepted config;
  With a backend that can stream codec frames, ``session`` also holds ``codec`` {num_codebooks,
  sample_rate, frame_rate, and where known codebook_size, samples_per_frame, codec_sha256,
  model_size, variant, decode_dtype}: what a client-side decoder must match (``omni-stream
  export-decoder``); ``decode_dtype`` is what the server itself decodes in.
  Per utterance ``audio.start`` {request_id, text, format, sample_rate, ...} with its first
  audio, then the audio, then ``audio.done`` {request_id, usage, finish_reason}; ``session.done``
  then close 1000. Continuous utterances: ``text.waiting`` {request_id, frames} when the speech
  caught up with the text and waits for more (the writer, not the TTS, is the bottleneck),
  ``text.resumed`` {request_id, frames, waited_ms, total_waited_ms} when it goes on, and
  ``audio.done`` adds ``text_waited_ms``. An utterance left open with no text for the
  server's idle time (30 s) fails with ``error`` code ``text_timeout``, freeing its slot. One
  that ends before its ``input.done`` (the model finished, or it reached max_new_tokens) is
  over: the next ``input.text`` starts a new utterance.
  ``finish_reason`` is "stop" (the model ended the utterance) or "length" (it reached the frame
  cap, max_new_tokens or the default that follows the text: the audio may end mid-word).
  Audio is binary frames of pcm s16le mono at ``sample_rate``; with stream_format "sse",
  ``speech.audio.delta`` JSON events (base64 pcm) instead. With codec_frames, each binary frame
  of ``n`` codec frames is preceded by a JSON ``codec.frames`` {request_id, offset, frames,
  shape: [n, 16], dtype: "int64"} message; the binary frame is those codes as little-endian
  int64, row-major [n, 16] (n * 128 bytes).
  Errors are ``error`` {error: {message, type, param, code}, request_id?} events; the session
  stays open. An ``input.text`` piece or ``instructions`` with a control character (other than
  tab, newline, carriage return) or a lone surrogate is refused whole with code
  ``invalid_characters``. Close codes: 1000 after session.close, 1001 server shutdown, 1009
  message over the size cap, 1011 internal error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from omni_stream.server.audio import to_s16le
from omni_stream.contract import FRAME_SECONDS, NUM_CODE_GROUPS, SpeechJob, TextFeed
from omni_stream.server.errors import ApiError
from omni_stream.server.schema import (ClientEvent, InputDone, InputText, SessionClose,
                                       SessionConfig, check_characters, check_text, decode_json,
                                       new_request_id, resolve_options)
from omni_stream.server.speech import check_ready
from omni_stream.server.sse import delta_event, error_event
from omni_stream.server.state import STATE, ServerState
from omni_stream.server.stream import StreamRun

log = logging.getLogger(__name__)

# a sentence ends at terminal punctuation (plus closing quotes/brackets) followed by whitespace,
# or right after CJK terminal punctuation
_SENTENCE_END = re.compile(r"[.!?;…]+[\"'”’)\]]*\s+|[。！？；]+[”’」』）]*\s*")


def split_sentences(buffer: str, max_chars: int, sentences: bool = True) -> tuple[list[str], str]:
    """Cut the complete sentences (if ``sentences``) off ``buffer``: (pieces, rest). A rest
    longer than ``max_chars`` is cut at its last whitespace (or hard at the cap), so no
    utterance exceeds the cap and the buffer stays bounded."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(buffer) if sentences else ():
        out.append(buffer[start:m.end()].strip())
        start = m.end()
    rest = buffer[start:]
    while len(rest) > max_chars:
        cut = rest.rfind(" ", 0, max_chars + 1)
        cut = cut if cut > 0 else max_chars
        out.append(rest[:cut].strip())
        rest = rest[cut:].lstrip()
    return [s for s in out if s], rest


class WsSession:
    """One WebSocket connection: a reader (this handler's task) and a worker that speaks the
    queued utterances in order, one at a time."""

    def __init__(self, ws: web.WebSocketResponse, st: ServerState) -> None:
        self.ws = ws
        self.st = st
        self.config = SessionConfig()
        self.template = resolve_options(self.config, st.backend, st.settings, voices=st.voices)
        self.buffer = ""
        self.feed: TextFeed | None = None  # the open continuous utterance
        self.queue: asyncio.Queue[SpeechJob | None] = asyncio.Queue()
        self.send_lock = asyncio.Lock()  # keeps a codec.frames header next to its binary frame
        self.closing = False  # session.close received
        self.finishing = False  # the worker is closing the socket gracefully

    # --- sending -------------------------------------------------------------------------------
    async def send_json(self, event: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.ws.send_str(msgspec.json.encode(event).decode())

    async def send_error(self, err: ApiError, request_id: str | None = None) -> None:
        event = error_event(err)
        if request_id:
            event["request_id"] = request_id
        await self.send_json(event)

    def describe(self) -> dict[str, Any]:
        t, c = self.template, self.config
        return {"model": self.st.backend.model_name, "voice": t.voice_label or t.voice,
                "language": t.language,
                "instructions": t.instructions, "seed": t.seed, "response_format": "pcm",
                "stream_format": c.stream_format or "audio", "codec_frames": c.codec_frames,
                "split_sentences": c.split_sentences, "text_mode": c.text_mode or "sentences",
                "sample_rate": self.st.backend.sample_rate,
                **({"codec": self.codec()} if self.st.backend.supports_codec_frames else {})}

    def codec(self) -> dict[str, Any]:
        """What a client-side decoder must match: geometry, plus the codec weights' identity
        (``codec_sha256``, from ``omni_stream.export.manifest.codec_identity``) where the
        backend knows it."""
        b = self.st.backend
        return {"num_codebooks": NUM_CODE_GROUPS, "sample_rate": b.sample_rate,
                "frame_rate": 1 / FRAME_SECONDS, **(getattr(b, "codec_info", None) or {})}

    # --- reader --------------------------------------------------------------------------------
    async def run(self) -> None:
        worker = asyncio.create_task(self.work())
        try:
            await self.send_json({"type": "session.created", "session": self.describe()})
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.send_error(ApiError(400, "binary messages are not accepted: send "
                                                   "JSON text events", code="invalid_event"))
        except ConnectionError:
            log.info("websocket client went away")
        finally:
            if not self.finishing:
                worker.cancel()  # client gone or server shutting down: closes the backend stream
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await worker

    async def on_text(self, data: str) -> None:
        try:
            event = decode_json(data, ClientEvent)
        except ApiError as err:
            if err.param == "type":
                err.message += " (use session.config, input.text, input.done, session.close)"
            await self.send_error(err)
            return
        if self.closing:
            await self.send_error(ApiError(400, "session.close was received; open a new "
                                           "session", code="session_closing"))
            return
        try:
            if isinstance(event, SessionConfig):
                await self.configure(event)
                await self.send_json({"type": "session.updated", "session": self.describe()})
            elif isinstance(event, InputText):
                check_characters(event.text, "text")  # refused whole: the buffer stays clean
                if self.continuous:
                    self.append(event.text)
                    return
                pieces, self.buffer = split_sentences(self.buffer + event.text,
                                                      self.st.settings.max_input_chars,
                                                      self.config.split_sentences)
                for piece in pieces:
                    self.enqueue(piece)
            elif isinstance(event, (InputDone, SessionClose)):
                if self.feed is not None:
                    self.feed.close()
                    self.feed = None
                text, self.buffer = self.buffer, ""
                if text.strip():
                    self.enqueue(text.strip())
                if isinstance(event, SessionClose):
                    self.closing = True
                    self.queue.put_nowait(None)
        except ApiError as e:
            await self.send_error(e)

    @property
    def continuous(self) -> bool:
        return self.config.text_mode == "continuous"

    def append(self, text: str) -> None:
        """Continuous mode: ``text`` joins the open utterance (opening one if none is)."""
        cap = self.st.settings.max_input_chars
        if self.feed is None:
            if not text:
                return
            if self.queue.qsize() >= self.st.settings.ws_max_pending_utterances:
                raise ApiError(429, f"more than {self.st.settings.ws_max_pending_utterances} "
                               "utterances pending: wait for audio.done before sending more",
                               code="too_many_pending", param="text")
            self.feed = TextFeed()
            self.queue.put_nowait(replace(self.template, text="", request_id=new_request_id("ws"),
                                          text_feed=self.feed))
        if self.feed.chars + len(text) > cap:
            raise ApiError(400, f"the utterance would pass {cap} characters: this piece was "
                           "refused; close it with input.done and go on in a new one",
                           code="input_too_long", param="text")
        self.feed.push(text)

    async def configure(self, cfg: SessionConfig) -> None:
        backend = self.st.backend
        if (cfg.text_mode or "sentences") not in ("sentences", "continuous"):
            raise ApiError(400, f"unknown text_mode '{cfg.text_mode}': use 'sentences' (each "
                           "sentence is its own utterance) or 'continuous' (one utterance fed "
                           "as it is written, closed by input.done)", code="invalid_value",
                           param="text_mode")
        if self.feed is not None:
            raise ApiError(400, "a continuous utterance is open: close it with input.done "
                           "before changing the session", code="utterance_open")
        if (cfg.stream_format or "audio") not in ("audio", "sse"):
            raise ApiError(400, f"unknown stream_format '{cfg.stream_format}': use 'audio' "
                           "(binary frames) or 'sse' (JSON delta events)", code="invalid_value",
                           param="stream_format")
        if (cfg.response_format or "pcm").lower() != "pcm":
            raise ApiError(400, "the WebSocket streams pcm (or codec frames): response_format "
                           "must be 'pcm'", code="invalid_response_format",
                           param="response_format")
        if cfg.codec_frames:
            if not backend.supports_codec_frames:
                raise ApiError(400, f"codec_frames: model '{backend.model_name}' cannot stream "
                               "codec frames (this server decodes on its side); ask for pcm",
                               code="codec_frames_unsupported", param="codec_frames")
            if cfg.stream_format == "sse":
                raise ApiError(400, "codec_frames are sent as binary frames: use stream_format "
                               "'audio'", code="invalid_value", param="stream_format")
        template = resolve_options(cfg, backend, self.st.settings,
                                   stream_codes=cfg.codec_frames, voices=self.st.voices)
        # a ref_audio clip is cloned once here and serves every utterance of the session
        self.template = await self.st.voices.attach_ref_audio(template, cfg)
        self.config = cfg

    def enqueue(self, text: str) -> None:
        check_text(text, self.st.settings, "text")
        if self.queue.qsize() >= self.st.settings.ws_max_pending_utterances:
            raise ApiError(429, f"more than {self.st.settings.ws_max_pending_utterances} "
                           "utterances pending: wait for audio.done before sending more text",
                           code="too_many_pending", param="text")
        self.queue.put_nowait(replace(self.template, text=text, request_id=new_request_id("ws")))

    # --- worker --------------------------------------------------------------------------------
    async def work(self) -> None:
        try:
            while (job := await self.queue.get()) is not None:
                try:
                    await self.speak(job)
                except ApiError as e:
                    await self.send_error(e, job.request_id)
                finally:
                    if job.text_feed is not None and job.text_feed is self.feed:
                        # over before its close (failed, or the model ended it): the next
                        # input.text starts a new utterance
                        self.feed.close()
                        self.feed = None
            self.finishing = True
            await self.send_json({"type": "session.done"})
            await self.ws.close(code=WSCloseCode.OK)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("websocket session failed")
            self.finishing = True
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")

    async def speak(self, job: SpeechJob) -> None:
        st, sse = self.st, self.config.stream_format == "sse"
        async with StreamRun(st.backend, job, st.metrics, "ws", time.perf_counter()) as run:
            started = False
            offset = 0
            waited_s = 0.0
            while (chunk := await run.next()) is not None:
                if chunk.is_event:  # continuous text: the stream waits for (or got) its text
                    event = {"type": "text.waiting" if chunk.text_waiting else "text.resumed",
                             "request_id": job.request_id, "frames": offset}
                    if chunk.text_waited_s is not None:
                        waited_s += chunk.text_waited_s
                        event.update(waited_ms=round(chunk.text_waited_s * 1e3),
                                     total_waited_ms=round(waited_s * 1e3))
                    await self.send_json(event)
                    continue
                if not started:  # with the first audio (or the empty end of a silent one)
                    started = True
                    await self._audio_start(job)
                if chunk.codes is not None and len(chunk.codes):
                    codes = chunk.codes  # [n, 16]
                    async with self.send_lock:
                        await self.ws.send_str(msgspec.json.encode(
                            {"type": "codec.frames", "request_id": job.request_id,
                             "offset": offset, "frames": len(codes), "shape": list(codes.shape),
                             "dtype": "int64"}).decode())
                        await self.ws.send_bytes(codes.astype("<i8", copy=False).tobytes())
                    offset += len(codes)
                elif chunk.pcm is not None and chunk.pcm.size:
                    data = to_s16le(chunk.pcm)
                    if sse:
                        await self.send_json(delta_event(data))
                    else:
                        async with self.send_lock:
                            await self.ws.send_bytes(data)
                    offset += chunk.frames
                run.sent(chunk)
            done = {"type": "audio.done", "request_id": job.request_id, "usage": run.usage(),
                    "finish_reason": run.finish_reason()}
            if job.text_feed is not None:
                done["text_waited_ms"] = round(waited_s * 1e3)
            await self.send_json(done)

    async def _audio_start(self, job: SpeechJob) -> None:
        st = self.st
        start = {"type": "audio.start", "request_id": job.request_id, "text": job.text,
                 "sample_rate": st.backend.sample_rate}
        if job.text_feed is not None:
            start.update(text=None, text_mode="continuous")
        if job.stream_codes:
            start.update(self.codec())
            start.update(format="codec_frames", dtype="int64")  # dtype of the codes
        else:
            start.update(format="pcm_s16le", channels=1)
        await self.send_json(start)
        prime = job.clone.prime_codes() if job.stream_codes and job.clone else None
        if prime is not None:
            # an ICL voice: the client's decoder decodes these reference frames first and drops
            # their audio, as the server's Code2Wav does (same left context)
            async with self.send_lock:
                await self.ws.send_str(msgspec.json.encode(
                    {"type": "codec.prime", "request_id": job.request_id,
                     "frames": len(prime), "shape": list(prime.shape),
                     "dtype": "int64"}).decode())
                await self.ws.send_bytes(prime.astype("<i8", copy=False).tobytes())


async def speech_stream(request: web.Request) -> web.WebSocketResponse:
    st = request.app[STATE]
    check_ready(st)
    ws = web.WebSocketResponse(heartbeat=st.settings.ws_heartbeat_s,
                               max_msg_size=st.settings.max_request_bytes(st.voices.supported),
                               compress=False)
    await ws.prepare(request)
    st.websockets.add(ws)
    st.metrics.ws_sessions.inc()
    try:
        await WsSession(ws, st).run()
    finally:
        st.metrics.ws_sessions.dec()
        st.websockets.discard(ws)
    return ws
