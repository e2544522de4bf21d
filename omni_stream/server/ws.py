"""WebSocket ``/v1/audio/speech/stream``: text in as it is written, speech out per sentence.

This docstring is the protocol. Here: the session (reader, config, worker); the text side (the
sentence splitter, the utterance queue, context labels) is ws_utterances.py, the sending side
(events, PCM, codec frames of one utterance) ws_output.py.

Client -> server (JSON text messages, field ``type``):
  ``session.config`` {voice, language, instructions, seed, response_format ("pcm"),
      stream_format ("audio": binary frames, default | "sse": JSON delta events),
      codec_frames (bool), split_sentences (bool, default true), text_mode ("sentences",
      default | "continuous"), speed (0.25-4.0, default 1.0), max_new_tokens,
      initial_codec_chunk_frames, greedy, model, ref_audio / ref_text / x_vector_only
      (cloning)}: applies to the utterances that follow.
  ``input.text`` {text}: appended to the text buffer; with split_sentences every complete
      sentence (terminal punctuation + whitespace, or CJK terminal punctuation) is queued as an
      utterance at once, and a buffer past the input cap is cut at its last space.
      ``speed`` (optional, 0.25-4.0) sets the speed of the utterance this text goes to (default:
      the session's): a piece whose speed differs from the buffered text's (or the open
      continuous utterance's) first closes that one, as another context_id does. The audio is
      time-stretched, pitch kept (server/speed.py); speed != 1.0 with codec_frames is refused
      (``speed_with_codec_frames``: the client decodes, so it stretches).
      text_mode "continuous": every piece (any split: mid-word, mid-character sequence) is
      appended to ONE running utterance, spoken while it is written (an LLM's tokens); its text
      is tokenized as far as more text cannot change the tokens, so the speech is exactly that
      of the whole text sent at once in text-streaming mode.
  ``input.done``: the rest of the buffer becomes an utterance (continuous: closes it; the next
      ``input.text`` starts the next one).
  ``input.cancel`` {context_id?}: stop speaking (barge-in) and keep the session: the running
      utterance stops (its backend stream closes, freeing its slot), queued utterances, the
      open continuous one and the unsent buffer are dropped. With ``context_id``, only the
      utterances (and buffered text) with that label. Answered by ``audio.cancelled``.
  ``session.close``: flush the buffer, finish every queued utterance, then ``session.done``.
  ``context_id`` (optional, on ``input.text`` / ``input.done`` / ``input.cancel``, at most 128
      characters): the client's label for an utterance, echoed on every event of that utterance
      (audio.start, audio.done, text.waiting/resumed, codec.frames, codec.prime, its errors), so
      a client can run several conversational turns over one session. A piece with another
      context_id than the open continuous utterance's (or than the buffered text's, in
      sentences mode) first closes that one, as ``input.done`` would; an ``input.done`` with a
      context_id closes only that utterance (one already closed: nothing to do) and is
      answered by ``context.done`` once everything sent under that label before it is spoken.

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
  ``context.done`` {context_id} answers ``input.done`` {context_id}: every utterance of that
  label sent before it has ended (done, failed or cancelled); one turn may have been spoken as
  several utterances (closed early by another label's text, or ended by the model before its
  text did). Not sent for a label cancelled before it.
  ``audio.cancelled`` {context_id, request_ids} answers ``input.cancel``: ``request_ids`` are
  the utterances it stopped or dropped (running first; empty when nothing matched). Every
  message of those utterances comes before it and none after it, so a client drops the audio
  it receives between sending ``input.cancel`` and this event (audio in flight); the binary
  frames in between belong to the utterance of the last ``audio.start``.
  Errors are ``error`` {error: {message, type, param, code}, request_id?, context_id?} events;
  the session
  stays open. An ``input.text`` piece or ``instructions`` with a control character (other than
  tab, newline, carriage return) or a lone surrogate is refused whole with code
  ``invalid_characters``. Close codes: 1000 after session.close, 1001 server shutdown, 1009
  message over the size cap, 1011 internal error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from omni_stream.contract import TextFeed
from omni_stream.errors import RequestError
from omni_stream.server import ui
from omni_stream.server.schema import (ClientEvent, InputCancel, InputDone, InputText,
                                       SessionClose, SessionConfig, check_characters,
                                       check_stream_speed, check_text, decode_json,
                                       new_request_id, resolve_options)
from omni_stream.server.speech import check_ready
from omni_stream.server.speed import check_speed
from omni_stream.server.state import STATE, ServerState
from omni_stream.server.stream import StreamRun
from omni_stream.server.ws_output import WsSender, codec_info, speak
from omni_stream.server.ws_utterances import (ContextEnd, Utterance, UtteranceQueue,
                                              check_context_id, split_sentences)

log = logging.getLogger(__name__)

__all__ = ["WsSession", "speech_stream", "split_sentences"]


class WsSession:
    """One WebSocket connection: a reader (this handler's task: :meth:`on_text` applies each
    client event) and a worker (:meth:`work`) that speaks the queued utterances in order, one at
    a time (``ws_output.speak``); the text becomes utterances in ``ws_utterances``."""

    def __init__(self, ws: web.WebSocketResponse, st: ServerState) -> None:
        self.ws = ws
        self.out = WsSender(ws)
        self.st = st
        self.config = SessionConfig()
        self.template = resolve_options(self.config, st.backend, st.settings, voices=st.voices)
        self.buffer = ""
        self.buffer_context: str | None = None  # the label of the buffered text
        self.buffer_speed = 1.0  # the speed of the buffered text
        self.speed = 1.0  # the session's speed (session.config); input.text may override it
        self.feed: TextFeed | None = None  # the open continuous utterance
        self.feed_context: str | None = None  # its label
        self.feed_speed = 1.0  # its speed
        self.queue = UtteranceQueue(st.settings.ws_max_pending_utterances)
        self.current: Utterance | None = None  # the utterance being spoken
        self.current_task: asyncio.Task | None = None  # the task speaking it
        self.current_run: StreamRun | None = None
        self.cancel_lock = asyncio.Lock()  # held by cancel() until audio.cancelled is sent
        self.closing = False  # session.close received
        self.finishing = False  # the worker is closing the socket gracefully

    def describe(self) -> dict[str, Any]:
        t, c = self.template, self.config
        return {"model": self.st.backend.model_name, "voice": t.voice_label or t.voice,
                "language": t.language,
                "instructions": t.instructions, "seed": t.seed, "response_format": "pcm",
                "stream_format": c.stream_format or "audio", "codec_frames": c.codec_frames,
                "split_sentences": c.split_sentences, "text_mode": c.text_mode or "sentences",
                "speed": self.speed,
                "sample_rate": self.st.backend.sample_rate,
                **({"codec": codec_info(self.st.backend)}
                   if self.st.backend.supports_codec_frames else {})}

    async def run(self) -> None:
        worker = asyncio.create_task(self.work())
        try:
            await self.out.json({"type": "session.created", "session": self.describe()})
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.out.error(RequestError(400, "invalid_event",
                                                       "binary messages are not accepted: send "
                                                       "JSON text events"))
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
        except RequestError as err:
            if err.param == "type":
                err.message += (" (use session.config, input.text, input.done, input.cancel, "
                                "session.close)")
            await self.out.error(err)
            return
        if isinstance(event, InputCancel):
            try:
                check_context_id(event.context_id)
            except RequestError as e:
                await self.out.error(e)
                return
            await self.cancel(event.context_id)
            return
        if self.closing:
            await self.out.error(RequestError(400, "session_closing",
                                               "session.close was received; open a new "
                                               "session"))
            return
        try:
            if isinstance(event, SessionConfig):
                await self.configure(event)
                await self.out.json({"type": "session.updated", "session": self.describe()})
            elif isinstance(event, InputText):
                check_characters(event.text, "text")  # refused whole: the buffer stays clean
                check_context_id(event.context_id)
                speed = self.speed if event.speed is None else check_speed(event.speed)
                check_stream_speed(speed, self.config.codec_frames)
                if self.continuous:
                    if self.feed is not None and (event.context_id != self.feed_context
                                                  or speed != self.feed_speed):
                        self.close_feed()  # another turn's (or speed's) text: this one is done
                    self.append(event.text, event.context_id, speed)
                    return
                if event.context_id != self.buffer_context or speed != self.buffer_speed:
                    self.flush_buffer()
                    self.buffer_context, self.buffer_speed = event.context_id, speed
                pieces, self.buffer = split_sentences(self.buffer + event.text,
                                                      self.st.settings.max_input_chars,
                                                      self.config.split_sentences)
                for piece in pieces:
                    self.enqueue(piece, event.context_id, speed)
            elif isinstance(event, InputDone):
                check_context_id(event.context_id)
                if event.context_id is None or event.context_id == self.feed_context:
                    self.close_feed()
                if event.context_id is None or event.context_id == self.buffer_context:
                    self.flush_buffer()
                if event.context_id is not None:
                    await self.end_context(event.context_id)
            elif isinstance(event, SessionClose):
                self.close_feed()
                self.flush_buffer()
                self.closing = True
                self.queue.put(None)
        except RequestError as e:
            await self.out.error(e, context_id=getattr(event, "context_id", None))

    @property
    def continuous(self) -> bool:
        return self.config.text_mode == "continuous"

    def close_feed(self) -> None:
        """Close the open continuous utterance (it goes on to its end)."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None
            self.feed_context = None

    def flush_buffer(self) -> None:
        """The buffered text (sentences mode) becomes an utterance."""
        text, self.buffer = self.buffer, ""
        if text.strip():
            self.enqueue(text.strip(), self.buffer_context, self.buffer_speed)

    async def end_context(self, context_id: str) -> None:
        """``context.done`` for ``context_id`` right after its last utterance: at once when
        none is running or queued, else queued just behind the last one."""
        running = self.current is not None and self.current.context_id == context_id
        if not self.queue.end_context(context_id, running):
            await self.out.json({"type": "context.done", "context_id": context_id})

    async def cancel(self, context_id: str | None) -> None:
        """``input.cancel``: stop the running utterance and drop the queued ones (those labelled
        ``context_id``, or all), then ``audio.cancelled``. Returns once the running one's
        stream is closed, so nothing of it is sent after the answer."""
        def match(label: str | None) -> bool:
            return context_id is None or label == context_id

        self.st.metrics.ws_cancels.inc()
        async with self.cancel_lock:  # the worker waits for the answer before going on
            stopped = await self._drop(match)
            await self.out.json({"type": "audio.cancelled", "context_id": context_id,
                                 "request_ids": stopped})

    async def _drop(self, match) -> list[str]:
        if match(self.feed_context):
            self.close_feed()
        if match(self.buffer_context):
            self.buffer = ""
        stopped = self.queue.drop(match)
        utt, task = self.current, self.current_task
        if utt is not None and task is not None and not task.done() and match(utt.context_id):
            stopped.insert(0, utt.job.request_id)
            if self.current_run is not None:
                self.current_run.cancelled = True
            task.cancel()
            await asyncio.wait([task])
        return stopped

    def append(self, text: str, context_id: str | None = None, speed: float = 1.0) -> None:
        """Continuous mode: ``text`` joins the open utterance (opening one if none is)."""
        cap = self.st.settings.max_input_chars
        if self.feed is None:
            if not text:
                return
            self.queue.check_pending()
            self.feed = TextFeed()
            self.feed_context, self.feed_speed = context_id, speed
            self.queue.put(Utterance(
                replace(self.template, text="", request_id=new_request_id("ws"),
                        text_feed=self.feed), context_id, speed))
        if self.feed.chars + len(text) > cap:
            raise RequestError(400, "input_too_long",
                               f"the utterance would pass {cap} characters: this piece was "
                               "refused; close it with input.done and go on in a new one",
                               param="text")
        self.feed.push(text)

    async def configure(self, cfg: SessionConfig) -> None:
        backend = self.st.backend
        if (cfg.text_mode or "sentences") not in ("sentences", "continuous"):
            raise RequestError(400, "invalid_value",
                               f"unknown text_mode '{cfg.text_mode}': use 'sentences' (each "
                               "sentence is its own utterance) or 'continuous' (one utterance fed "
                               "as it is written, closed by input.done)", param="text_mode")
        if self.feed is not None:
            raise RequestError(400, "utterance_open",
                               "a continuous utterance is open: close it with input.done "
                               "before changing the session")
        if (cfg.stream_format or "audio") not in ("audio", "sse"):
            raise RequestError(400, "invalid_value",
                               f"unknown stream_format '{cfg.stream_format}': use 'audio' "
                               "(binary frames) or 'sse' (JSON delta events)",
                               param="stream_format")
        if (cfg.response_format or "pcm").lower() != "pcm":
            raise RequestError(400, "invalid_response_format",
                               "the WebSocket streams pcm (or codec frames): response_format "
                               "must be 'pcm'", param="response_format")
        if cfg.codec_frames:
            if not backend.supports_codec_frames:
                raise RequestError(400, "codec_frames_unsupported",
                                   f"codec_frames: model '{backend.model_name}' cannot stream "
                                   "codec frames (this server decodes on its side); ask for pcm",
                                   param="codec_frames")
            if cfg.stream_format == "sse":
                raise RequestError(400, "invalid_value",
                                   "codec_frames are sent as binary frames: use stream_format "
                                   "'audio'", param="stream_format")
        template = resolve_options(cfg, backend, self.st.settings,
                                   stream_codes=cfg.codec_frames, voices=self.st.voices)
        # a ref_audio clip is cloned once here and serves every utterance of the session
        self.template = await self.st.voices.attach_ref_audio(template, cfg)
        self.config = cfg
        self.speed = check_speed(cfg.speed)  # checked with the rest by resolve_options

    def enqueue(self, text: str, context_id: str | None = None, speed: float = 1.0) -> None:
        check_text(text, self.st.settings, "text")
        self.queue.check_pending()
        job = replace(self.template, text=text, request_id=new_request_id("ws"))
        self.queue.put(Utterance(job, context_id, speed))

    # --- worker --------------------------------------------------------------------------------
    async def work(self) -> None:
        try:
            while (utt := await self.queue.get()) is not None:
                if isinstance(utt, ContextEnd):
                    await self.out.json({"type": "context.done", "context_id": utt.context_id})
                    continue
                # the utterance runs as a task of its own: input.cancel stops it, not the worker
                task = asyncio.create_task(self.speak(utt))
                self.current, self.current_task = utt, task
                try:
                    await asyncio.wait([task])
                finally:
                    if not task.done():  # the worker itself was cancelled
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                            await task
                    self.current = self.current_task = self.current_run = None
                    if utt.job.text_feed is not None and utt.job.text_feed is self.feed:
                        # over before its close (failed, or the model ended it): the next
                        # input.text starts a new utterance
                        self.close_feed()
                if task.cancelled():
                    async with self.cancel_lock:  # input.cancel answers before anything else
                        continue
                if isinstance(err := task.exception(), RequestError):
                    await self.out.error(err, utt)
                elif err is not None:
                    raise err
            self.finishing = True
            await self.out.json({"type": "session.done"})
            await self.ws.close(code=WSCloseCode.OK)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("websocket session failed")
            self.finishing = True
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")

    async def speak(self, utt: Utterance) -> None:
        def opened(run: StreamRun) -> None:
            self.current_run = run

        await speak(self.st, self.out, utt, self.config.stream_format == "sse", opened)


async def speech_stream(request: web.Request) -> web.WebSocketResponse:
    st = request.app[STATE]
    check_ready(st)
    ws = web.WebSocketResponse(heartbeat=st.settings.ws_heartbeat_s,
                               max_msg_size=st.settings.max_request_bytes(st.voices.supported),
                               compress=False, protocols=(ui.WS_PROTOCOL,))
    await ws.prepare(request)
    st.websockets.add(ws)
    st.metrics.ws_sessions.inc()
    try:
        await WsSession(ws, st).run()
    finally:
        st.metrics.ws_sessions.dec()
        st.websockets.discard(ws)
    return ws
