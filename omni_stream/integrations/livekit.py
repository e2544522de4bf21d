"""A LiveKit Agents TTS that speaks the LLM's words as they are written, through omni-stream.

LiveKit's OpenAI TTS (or any non-streaming TTS behind ``tts.StreamAdapter``) waits for each
sentence to end and pays a whole time-to-first-audio per sentence. This TTS has
``streaming=True``: :meth:`TTS.stream` opens one WebSocket session to ``omni-stream serve``
in continuous mode and sends every text piece the agent pushes as it arrives (no sentence
aggregation) into one utterance per LiveKit segment, labelled by a context id; audio comes
back as 24 kHz mono pcm while the text is still being written. Closing the stream (the agent
does on barge-in) cancels the turn on the server (``input.cancel``) and closes the socket:
its slot is free at once. :meth:`TTS.synthesize` speaks a whole text with one streamed
``POST /v1/audio/speech`` (pcm): the server's speech for that text, as its HTTP API gives it.

    from omni_stream.integrations.livekit import TTS
    session = AgentSession(stt=..., llm=..., tts=TTS(base_url="http://127.0.0.1:8000",
                                                     voice="ryan", language="en", seed=7))

``voice`` is a built-in speaker, an OpenAI voice name or an uploaded (cloned) voice name;
``language`` the server's name ("english", "auto") or a language code ("en", "en-US");
``seed`` makes sampled speech repeatable; ``session_options`` adds further request fields
(``greedy``, ``max_new_tokens``, ...). :meth:`TTS.update_options` changes them for later
streams. Server refusals raise ``APIStatusError`` with the server's message, an unreachable
server ``APIConnectionError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from livekit.agents import (APIConnectionError, APIConnectOptions, APIStatusError,
                            APITimeoutError, LanguageCode, tts, utils)
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, NOT_GIVEN, NotGivenOr
from livekit.agents.utils import is_given

from omni_stream.integrations.session import (SAMPLE_RATE, Audio, ContextDone, SessionError,
                                              SpeechSession, TurnCancelled, TurnError,
                                              TurnStarted)

__all__ = ["TTS", "ChunkedStream", "SynthesizeStream"]

NUM_CHANNELS = 1
# what the server refuses in a text piece (omni_stream/server/schema.py check_characters):
# control characters but tab/newline/CR, and lone surrogates
_FORBIDDEN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
# OpenAI error "type" -> HTTP status (the WebSocket's error events carry the type only)
_STATUS = {"invalid_request_error": 400, "rate_limit_error": 429}


@dataclass
class _Options:
    voice: str | None
    language: str | None
    seed: int | None
    instructions: str | None
    model: str | None
    session_options: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The request fields: ``session.config`` of a stream, the body of a speech request."""
        out = dict(self.session_options)
        for name in ("model", "voice", "language", "seed", "instructions"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        return out


def _language(language: str | None) -> str | None:
    """A language code ("en", "en-US") -> the server's name ("english"); names pass."""
    if language is None:
        return None
    if language.strip().lower() in ("auto", "multi"):
        return "auto"
    try:
        name = LanguageCode(language).to_language_name()
    except Exception:
        name = None
    return name or language


def _http_base(base_url: str) -> str:
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must be the server's http(s):// URL, got {base_url!r}")
    return url


def _status_error(message: str, status: int, body: Any = None,
                  request_id: str | None = None) -> APIStatusError:
    return APIStatusError(message, status_code=status, request_id=request_id, body=body)


def _turn_error(ev: TurnError) -> APIStatusError:
    return _status_error(ev.message, _STATUS.get(ev.status_type or "", 500),
                         body={"code": ev.code, "type": ev.status_type,
                               "context_id": ev.context_id}, request_id=ev.request_id)


class TTS(tts.TTS):
    """LiveKit Agents TTS over omni-stream: ``stream()`` feeds the LLM's text into one
    continuous utterance per segment over a WebSocket; ``synthesize()`` speaks a whole text
    over HTTP. ``base_url`` is the server's http URL ("http://host:8000", "/v1" optional)."""

    def __init__(self, *, base_url: str, voice: str | None = None,
                 language: str | None = None, api_key: str | None = None,
                 seed: int | None = None, instructions: str | None = None,
                 model: str | None = None, session_options: dict[str, Any] | None = None,
                 http_session: aiohttp.ClientSession | None = None) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True),
                         sample_rate=SAMPLE_RATE, num_channels=NUM_CHANNELS)
        self._base_url = _http_base(base_url)
        self._api_key = api_key
        self._opts = _Options(voice=voice, language=_language(language), seed=seed,
                              instructions=instructions, model=model,
                              session_options=dict(session_options or {}))
        self._http = http_session
        self._own_http = http_session is None

    @property
    def model(self) -> str:
        return self._opts.model or "omni-stream"

    @property
    def provider(self) -> str:
        return "omni-stream"

    def update_options(self, *, voice: NotGivenOr[str | None] = NOT_GIVEN,
                       language: NotGivenOr[str | None] = NOT_GIVEN,
                       seed: NotGivenOr[int | None] = NOT_GIVEN,
                       instructions: NotGivenOr[str | None] = NOT_GIVEN,
                       model: NotGivenOr[str | None] = NOT_GIVEN,
                       session_options: NotGivenOr[dict[str, Any]] = NOT_GIVEN) -> None:
        """Change options for the streams and syntheses started from now on (None: the
        server's default); one already running keeps its own."""
        if is_given(voice):
            self._opts.voice = voice
        if is_given(language):
            self._opts.language = _language(language)
        if is_given(seed):
            self._opts.seed = seed
        if is_given(instructions):
            self._opts.instructions = instructions
        if is_given(model):
            self._opts.model = model
        if is_given(session_options):
            self._opts.session_options = dict(session_options)

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
                   ) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
               ) -> SynthesizeStream:
        return SynthesizeStream(tts=self, conn_options=conn_options)

    async def aclose(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.close()
            self._http = None

    # --- transport -----------------------------------------------------------------------------
    def _http_session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
            self._own_http = True
        return self._http

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    async def _connect(self, opts: _Options, conn_options: APIConnectOptions) -> SpeechSession:
        """A configured continuous session; the server's refusal as APIStatusError."""
        session = SpeechSession(self._base_url, api_key=self._api_key, config=opts.fields(),
                                http_session=self._http_session(),
                                connect_timeout=conn_options.timeout)
        try:
            await asyncio.wait_for(session.connect(), conn_options.timeout)
        except BaseException as e:
            await session.close()
            if isinstance(e, SessionError):
                if e.status is not None:  # the handshake was refused (auth, not ready, ...)
                    raise _status_error(str(e), e.status) from None
                if e.code is not None:  # session.config refused: bad voice, language, ...
                    raise _status_error(str(e), 400, body={"code": e.code}) from None
                raise APIConnectionError(str(e)) from e
            if isinstance(e, asyncio.TimeoutError):
                raise APITimeoutError(f"omni-stream at {self._base_url} did not open a session "
                                      f"within {conn_options.timeout} s") from None
            if isinstance(e, (aiohttp.ClientError, OSError)):
                raise APIConnectionError(f"cannot reach omni-stream at {self._base_url}: "
                                         f"{e}") from e
            raise
        return session


class ChunkedStream(tts.ChunkedStream):
    """A whole text: one streamed ``POST /v1/audio/speech`` (pcm), audio pushed as it comes."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts, session_options=dict(tts._opts.session_options))

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        body = {**self._opts.fields(), "input": self.input_text, "response_format": "pcm",
                "stream": True}
        # the server may take a while before the first byte (a full queue): only the connect
        # is bounded by conn_options, reads by a generous gap between chunks
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._conn_options.timeout,
                                        sock_read=max(30.0, self._conn_options.timeout))
        url = self._tts._base_url + "/v1/audio/speech"
        try:
            async with self._tts._http_session().post(url, json=body, timeout=timeout,
                                                      headers=self._tts._headers()) as r:
                request_id = r.headers.get("X-Request-Id")
                if r.status >= 400:
                    raw = await r.read()
                    try:
                        err = json.loads(raw)["error"]
                    except Exception:
                        err = {"message": raw.decode(errors="replace") or r.reason}
                    raise _status_error(err.get("message") or str(err), r.status, body=err,
                                        request_id=request_id)
                output_emitter.initialize(request_id=request_id or utils.shortuuid(),
                                          sample_rate=SAMPLE_RATE, num_channels=NUM_CHANNELS,
                                          mime_type="audio/pcm")
                # no flush() at the end: it would release the held-back tail early and the
                # end of input would then add 10 ms of silence as the final frame
                async for chunk in r.content.iter_any():
                    output_emitter.push(chunk)
        except asyncio.TimeoutError:
            raise APITimeoutError() from None
        except aiohttp.ClientError as e:
            raise APIConnectionError(f"omni-stream at {self._tts._base_url}: {e}") from e


@dataclass
class _Turns:
    """The turns (segments) a stream opened and how far they are."""

    opened: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    input_ended: bool = False
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def check(self) -> None:
        if self.input_ended and self.done.issuperset(self.opened):
            self.finished.set()


async def _cancel_all(session: SpeechSession) -> None:
    """``input.cancel`` for every turn of the session, and its answer."""
    await session.cancel()
    async for ev in session.events():
        if isinstance(ev, TurnCancelled):
            return


class SynthesizeStream(tts.SynthesizeStream):
    """Text pieces in as they are pushed, audio out as it comes: one WebSocket session; each
    segment (text up to a flush) is one server turn labelled by a context id, and one LiveKit
    segment of audio."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts, session_options=dict(tts._opts.session_options))

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=SAMPLE_RATE,
                                  num_channels=NUM_CHANNELS, mime_type="audio/pcm", stream=True)
        session = await self._tts._connect(self._opts, self._conn_options)
        turns = _Turns()
        sender = asyncio.create_task(self._send_input(session, turns))
        receiver = asyncio.create_task(self._receive(session, output_emitter, turns))
        finished = asyncio.create_task(turns.finished.wait())
        complete = False
        try:
            pending = {sender, receiver, finished}
            while not turns.finished.is_set():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {finished}:
                    task.result()  # raises the task's failure
                if receiver in done and not turns.finished.is_set():
                    raise APIConnectionError("omni-stream closed the session before the "
                                             "speech ended")
            complete = True
        except (ConnectionError, aiohttp.ClientError) as e:
            raise APIConnectionError(f"omni-stream session at {self._tts._base_url} failed: "
                                     f"{e}") from e
        finally:
            await utils.aio.cancel_and_wait(sender, receiver, finished)
            if not complete and session.connected:
                # cancelled (barge-in, aclose) or failed: stop the server's turn now and wait
                # (briefly) for its answer, sent once the slot is free; closing the socket
                # alone frees it too, but the server may not have finished stopping by then
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_cancel_all(session), 1.0)
            await session.close()

    async def _send_input(self, session: SpeechSession, turns: _Turns) -> None:
        context_id: str | None = None  # the open turn
        held = ""  # leading whitespace: a turn opens with text to speak, not with blanks
        async for data in self._input_ch:
            if isinstance(data, self._FlushSentinel):
                if context_id is not None:
                    await session.end(context_id)
                context_id, held = None, ""
                continue
            # one stray control character would get the whole piece refused: drop it alone
            text = held + _FORBIDDEN.sub("", data)
            if context_id is None:
                if not text.strip():
                    held = text
                    continue
                context_id = utils.shortuuid("turn_")
                turns.opened.append(context_id)
                self._mark_started()
            held = ""
            await session.send_text(text, context_id)
        turns.input_ended = True
        if context_id is not None:
            await session.end(context_id)
        turns.check()

    async def _receive(self, session: SpeechSession, output_emitter: tts.AudioEmitter,
                       turns: _Turns) -> None:
        segment: str | None = None  # the turn whose audio is being emitted

        def begin(context_id: str | None) -> None:
            nonlocal segment
            if context_id is None or context_id == segment or context_id in turns.done:
                return
            if segment is not None:  # the server speaks turns in order: defensive only
                output_emitter.end_segment()
            segment = context_id
            output_emitter.start_segment(segment_id=context_id)

        async for ev in session.events():
            if isinstance(ev, Audio):
                begin(ev.context_id)
                if ev.context_id == segment:
                    output_emitter.push(ev.pcm)
            elif isinstance(ev, TurnStarted):
                begin(ev.context_id)
            elif isinstance(ev, ContextDone) and ev.context_id in turns.opened:
                begin(ev.context_id)  # a turn without audio still is a segment
                output_emitter.end_segment()
                segment = None
                turns.done.add(ev.context_id)
                turns.check()
            elif isinstance(ev, TurnError):
                raise _turn_error(ev)
