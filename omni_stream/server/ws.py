"""WebSocket ``/v1/audio/speech/stream``: text in as it is written, speech out per sentence.

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
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from omni_stream.server import ui
from omni_stream.server.audio import to_s16le
from omni_stream.config import FRAME_S
from omni_stream.contract import NUM_CODE_GROUPS, SpeechJob, TextFeed
from omni_stream.errors import RequestError
from omni_stream.server.errors import ws_error_event
from omni_stream.server.schema import (ClientEvent, InputCancel, InputDone, InputText,
                                       SessionClose, SessionConfig, check_characters,
                                       check_stream_speed, check_text, decode_json,
                                       new_request_id, resolve_options)
from omni_stream.server.speech import check_ready
from omni_stream.server.speed import check_speed
from omni_stream.server.sse import delta_event
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


MAX_CONTEXT_ID_CHARS = 128


@dataclass
class Utterance:
    """A queued utterance: the backend job and the client's label for it."""

    job: SpeechJob
    context_id: str | None = None
    speed: float = 1.0  # OpenAI speed: its audio is time-stretched by the server

    def tag(self, event: dict[str, Any]) -> dict[str, Any]:
        """``event`` with this utterance's request_id and (if any) context_id."""
        event["request_id"] = self.job.request_id
        if self.context_id is not None:
            event["context_id"] = self.context_id
        return event


@dataclass
class ContextEnd:
    """Queued by ``input.done`` {context_id}: answered with ``context.done`` when reached."""

    context_id: str


def check_context_id(context_id: str | None) -> None:
    if context_id is None:
        return
    check_characters(context_id, "context_id")
    if not context_id or len(context_id) > MAX_CONTEXT_ID_CHARS:
        raise RequestError(400, "invalid_value",
                           f"context_id must be 1 to {MAX_CONTEXT_ID_CHARS} characters",
                           param="context_id")


class WsSession:
    """One WebSocket connection: a reader (this handler's task) and a worker that speaks the
    queued utterances in order, one at a time."""

    def __init__(self, ws: web.WebSocketResponse, st: ServerState) -> None:
        self.ws = ws
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
        self.queue: asyncio.Queue[Utterance | ContextEnd | None] = asyncio.Queue()
        self.current: Utterance | None = None  # the utterance being spoken
        self.current_task: asyncio.Task | None = None  # the task speaking it
        self.current_run: StreamRun | None = None
        self.cancel_lock = asyncio.Lock()  # held by cancel() until audio.cancelled is sent
        self.send_lock = asyncio.Lock()  # keeps a codec.frames header next to its binary frame
        self.closing = False  # session.close received
        self.finishing = False  # the worker is closing the socket gracefully

    # --- sending -------------------------------------------------------------------------------
    async def send_json(self, event: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.ws.send_str(msgspec.json.encode(event).decode())

    async def send_error(self, err: RequestError, utt: Utterance | None = None,
                         context_id: str | None = None) -> None:
        if utt is not None:
            event = ws_error_event(err, utt.job.request_id, utt.context_id)
        else:
            event = ws_error_event(err, context_id=context_id)
        await self.send_json(event)

    def describe(self) -> dict[str, Any]:
        t, c = self.template, self.config
        return {"model": self.st.backend.model_name, "voice": t.voice_label or t.voice,
                "language": t.language,
                "instructions": t.instructions, "seed": t.seed, "response_format": "pcm",
                "stream_format": c.stream_format or "audio", "codec_frames": c.codec_frames,
                "split_sentences": c.split_sentences, "text_mode": c.text_mode or "sentences",
                "speed": self.speed,
                "sample_rate": self.st.backend.sample_rate,
                **({"codec": self.codec()} if self.st.backend.supports_codec_frames else {})}

    def codec(self) -> dict[str, Any]:
        """What a client-side decoder must match: geometry, plus the codec weights' identity
        (``codec_sha256``, from ``omni_stream.export.manifest.codec_identity``) where the
        backend knows it."""
        b = self.st.backend
        return {"num_codebooks": NUM_CODE_GROUPS, "sample_rate": b.sample_rate,
                "frame_rate": 1 / FRAME_S, **(getattr(b, "codec_info", None) or {})}

    # --- reader --------------------------------------------------------------------------------
    async def run(self) -> None:
        worker = asyncio.create_task(self.work())
        try:
            await self.send_json({"type": "session.created", "session": self.describe()})
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.send_error(RequestError(400, "invalid_event",
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
            await self.send_error(err)
            return
        if isinstance(event, InputCancel):
            try:
                check_context_id(event.context_id)
            except RequestError as e:
                await self.send_error(e)
                return
            await self.cancel(event.context_id)
            return
        if self.closing:
            await self.send_error(RequestError(400, "session_closing",
                                               "session.close was received; open a new "
                                               "session"))
            return
        try:
            if isinstance(event, SessionConfig):
                await self.configure(event)
                await self.send_json({"type": "session.updated", "session": self.describe()})
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
                self.queue.put_nowait(None)
        except RequestError as e:
            await self.send_error(e, context_id=getattr(event, "context_id", None))

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
        items = self._take_queue()
        last = max((i for i, u in enumerate(items)
                    if isinstance(u, Utterance) and u.context_id == context_id), default=None)
        running = self.current is not None and self.current.context_id == context_id
        if last is None and not running:
            self._refill(items)
            await self.send_json({"type": "context.done", "context_id": context_id})
            return
        if len(items) >= self.st.settings.ws_max_pending_utterances:
            self._refill(items)
            self.check_pending()  # raises: too many pending
        items.insert(0 if last is None else last + 1, ContextEnd(context_id))
        self._refill(items)

    def _take_queue(self) -> list[Utterance | ContextEnd | None]:
        items = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def _refill(self, items: list[Utterance | ContextEnd | None]) -> None:
        for item in items:
            self.queue.put_nowait(item)

    async def cancel(self, context_id: str | None) -> None:
        """``input.cancel``: stop the running utterance and drop the queued ones (those labelled
        ``context_id``, or all), then ``audio.cancelled``. Returns once the running one's
        stream is closed, so nothing of it is sent after the answer."""
        def match(label: str | None) -> bool:
            return context_id is None or label == context_id

        self.st.metrics.ws_cancels.inc()
        async with self.cancel_lock:  # the worker waits for the answer before going on
            stopped = await self._drop(match)
            await self.send_json({"type": "audio.cancelled", "context_id": context_id,
                                  "request_ids": stopped})

    async def _drop(self, match) -> list[str]:
        stopped: list[str] = []
        if match(self.feed_context):
            self.close_feed()
        if match(self.buffer_context):
            self.buffer = ""
        kept: list[Utterance | ContextEnd | None] = []
        for utt in self._take_queue():
            if isinstance(utt, ContextEnd) and match(utt.context_id):
                continue  # a cancelled turn gets no context.done
            if isinstance(utt, Utterance) and match(utt.context_id):
                stopped.append(utt.job.request_id)
                if utt.job.text_feed is not None:
                    utt.job.text_feed.close()
            else:
                kept.append(utt)
        self._refill(kept)
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
            self.check_pending()
            self.feed = TextFeed()
            self.feed_context, self.feed_speed = context_id, speed
            self.queue.put_nowait(Utterance(
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
        self.check_pending()
        self.queue.put_nowait(Utterance(replace(self.template, text=text,
                                                request_id=new_request_id("ws")), context_id,
                                        speed))

    def check_pending(self) -> None:
        cap = self.st.settings.ws_max_pending_utterances
        if self.queue.qsize() >= cap:
            raise RequestError(429, "too_many_pending",
                               f"more than {cap} utterances pending: wait for audio.done before "
                               "sending more text", param="text")

    # --- worker --------------------------------------------------------------------------------
    async def work(self) -> None:
        try:
            while (utt := await self.queue.get()) is not None:
                if isinstance(utt, ContextEnd):
                    await self.send_json({"type": "context.done", "context_id": utt.context_id})
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
                    await self.send_error(err, utt)
                elif err is not None:
                    raise err
            self.finishing = True
            await self.send_json({"type": "session.done"})
            await self.ws.close(code=WSCloseCode.OK)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("websocket session failed")
            self.finishing = True
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")

    async def speak(self, utt: Utterance) -> None:
        st, sse, job = self.st, self.config.stream_format == "sse", utt.job
        async with StreamRun(st.backend, job, st.metrics, "ws", time.perf_counter(),
                             speed=utt.speed) as run:
            self.current_run = run
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
                    await self.send_json(event)
                    continue
                if not started:  # with the first audio (or the empty end of a silent one)
                    started = True
                    await self._audio_start(utt)
                if chunk.codes is not None and len(chunk.codes):
                    codes = chunk.codes  # [n, 16]
                    async with self.send_lock:
                        await self.ws.send_str(msgspec.json.encode(utt.tag(
                            {"type": "codec.frames", "offset": offset, "frames": len(codes),
                             "shape": list(codes.shape), "dtype": "int64"})).decode())
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
            done = utt.tag({"type": "audio.done", "usage": run.usage(),
                            "finish_reason": run.finish_reason()})
            if job.text_feed is not None:
                done["text_waited_ms"] = round(waited_s * 1e3)
            await self.send_json(done)

    async def _audio_start(self, utt: Utterance) -> None:
        st, job = self.st, utt.job
        start = utt.tag({"type": "audio.start", "text": job.text,
                         "sample_rate": st.backend.sample_rate})
        if job.text_feed is not None:
            start.update(text=None, text_mode="continuous")
        if job.stream_codes:
            start.update(self.codec())
            start.update(format="codec_frames", dtype="int64")  # dtype of the codes
        else:
            start.update(format="pcm_s16le", channels=1)
        if utt.speed != 1.0:
            start["speed"] = utt.speed
        await self.send_json(start)
        prime = job.clone.prime_codes() if job.stream_codes and job.clone else None
        if prime is not None:
            # an ICL voice: the client's decoder decodes these reference frames first and drops
            # their audio, as the server's Code2Wav does (same left context)
            async with self.send_lock:
                await self.ws.send_str(msgspec.json.encode(utt.tag(
                    {"type": "codec.prime", "frames": len(prime), "shape": list(prime.shape),
                     "dtype": "int64"})).decode())
                await self.ws.send_bytes(prime.astype("<i8", copy=False).tobytes())


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
