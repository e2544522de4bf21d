"""One WebSocket session to ``omni-stream serve`` in continuous text mode, for voice agents.

An agent framework turns an LLM's tokens into speech turn by turn and stops a turn when the
user barges in. :class:`SpeechSession` speaks the server's WebSocket protocol
(``/v1/audio/speech/stream``, ``omni_stream/server/ws.py``) for that: every turn is one
continuous utterance labelled with the caller's ``context_id``; text goes out as it is written
(:meth:`send_text`), :meth:`end` closes a turn, :meth:`cancel` stops one (or all) and
:meth:`events` yields what comes back as typed events, each with its turn's label. Audio the
server sent before it saw a cancel (in flight) is dropped here: after :meth:`cancel`, no
:class:`Audio` of the cancelled turns is yielded.

Only aiohttp (a base dependency): the framework adapters (``integrations.pipecat``,
``integrations.livekit``) build on it, and it is usable on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp

__all__ = ["SpeechSession", "SessionError", "Audio", "TurnStarted", "TurnDone", "ContextDone",
           "TurnCancelled", "Configured", "TurnError", "ws_url", "SAMPLE_RATE", "WS_PATH"]

WS_PATH = "/v1/audio/speech/stream"
SAMPLE_RATE = 24000
_ALL = object()  # a cancel of every turn


class SessionError(RuntimeError):
    """The session could not be opened or configured; ``code`` is the server's error code."""

    def __init__(self, message: str, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass
class TurnStarted:
    context_id: str | None
    request_id: str
    sample_rate: int


@dataclass
class Audio:
    context_id: str | None
    pcm: bytes  # s16le mono at the session's sample rate


@dataclass
class TurnDone:
    context_id: str | None
    request_id: str
    finish_reason: str | None
    usage: dict = field(default_factory=dict)


@dataclass
class Configured:
    """The answer to :meth:`SpeechSession.reconfigure`: the session as the server now has it
    (a refused config comes as a :class:`TurnError` instead)."""

    session: dict


@dataclass
class ContextDone:
    """The answer to :meth:`SpeechSession.end` with a context_id: every utterance of the turn
    is over (a turn can be spoken as several utterances, e.g. when the model ended one before
    its text did)."""

    context_id: str


@dataclass
class TurnCancelled:
    """The answer to :meth:`SpeechSession.cancel`: the utterances it stopped or dropped."""

    context_id: str | None
    request_ids: list[str]


@dataclass
class TurnError:
    """An error event: of a turn (``request_id`` set: the turn is over), or of an input event
    the server refused (the turn, if any, goes on)."""

    context_id: str | None
    request_id: str | None
    code: str | None
    message: str
    status_type: str | None = None


Event = TurnStarted | Audio | TurnDone | ContextDone | TurnCancelled | TurnError | Configured


def ws_url(base_url: str) -> str:
    """``http(s)://host:port[/v1]`` -> the WebSocket URL of the speech stream."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if url.startswith("http://"):
        url = "ws://" + url[len("http://"):]
    elif url.startswith("https://"):
        url = "wss://" + url[len("https://"):]
    elif not url.startswith(("ws://", "wss://")):
        raise ValueError(f"base_url must be the server's http(s):// URL, got {base_url!r}")
    return url + WS_PATH


class SpeechSession:
    """One connected session. ``config`` is the ``session.config`` (voice, language, seed,
    ...); ``text_mode`` is always "continuous". Use as ``async with SpeechSession(...) as s``
    or :meth:`connect` / :meth:`close`."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 config: dict[str, Any] | None = None,
                 http_session: aiohttp.ClientSession | None = None,
                 connect_timeout: float = 10.0) -> None:
        self.url = ws_url(base_url)
        self.api_key = api_key
        self.config = dict(config or {})
        self.connect_timeout = connect_timeout
        self._http = http_session
        self._own_http = http_session is None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._current: str | None = None  # the context of the last audio.start
        self._pending_cancels: list[Any] = []  # cancels sent, not yet answered (in order)
        self.session: dict[str, Any] = {}  # the server's description (session.updated)
        self.sample_rate = SAMPLE_RATE

    async def __aenter__(self) -> "SpeechSession":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def connect(self) -> dict[str, Any]:
        """Open the socket and apply the config; the server's session description.
        SessionError when the server refuses the config (bad voice, language, ...)."""
        await self.close()
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
            self._own_http = True
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self._ws = await self._http.ws_connect(self.url, headers=headers,
                                                   timeout=aiohttp.ClientWSTimeout(
                                                       ws_close=self.connect_timeout),
                                                   heartbeat=20.0)
        except aiohttp.WSServerHandshakeError as e:
            raise SessionError(f"{self.url}: handshake refused ({e.status} {e.message})",
                               status=e.status) from e
        self._current, self._pending_cancels = None, []
        created = await self._receive_json()
        if created.get("type") != "session.created":
            raise SessionError(f"expected session.created, got {created}")
        self.session = created.get("session", {})
        return await self.configure(**self.config)

    async def configure(self, **fields: Any) -> dict[str, Any]:
        """Send ``session.config`` (continuous text) and wait for its answer. Only between
        turns: the server refuses a change while a turn is open."""
        self.config = {k: v for k, v in fields.items() if v is not None}
        await self._send({"type": "session.config", **self.config, "text_mode": "continuous"})
        answer = await self._receive_json()
        if answer.get("type") == "error":
            err = answer.get("error", {})
            raise SessionError(err.get("message", str(answer)), code=err.get("code"))
        if answer.get("type") != "session.updated":
            raise SessionError(f"expected session.updated, got {answer}")
        self.session = answer.get("session", {})
        self.sample_rate = int(self.session.get("sample_rate", SAMPLE_RATE))
        return self.session

    async def reconfigure(self, **fields: Any) -> None:
        """Send a new ``session.config`` while :meth:`events` is being read: the answer comes
        there (:class:`Configured`, or a :class:`TurnError` naming the refused field). Close
        the open turn first (:meth:`end`): the server refuses a change in the middle of one."""
        self.config = {k: v for k, v in fields.items() if v is not None}
        await self._send({"type": "session.config", **self.config, "text_mode": "continuous"})

    async def send_text(self, text: str, context_id: str | None = None) -> None:
        """Append ``text`` to the turn ``context_id`` (opening it if it is not open)."""
        if text:
            await self._send({"type": "input.text", "text": text,
                              **({"context_id": context_id} if context_id is not None else {})})

    async def end(self, context_id: str | None = None) -> None:
        """The turn's text is complete: it is spoken to its end, then (with a context_id)
        :class:`ContextDone` says the whole turn is over."""
        await self._send({"type": "input.done",
                          **({"context_id": context_id} if context_id is not None else {})})

    async def cancel(self, context_id: str | None = None) -> None:
        """Stop the turn ``context_id`` (None: every turn) at once: from now on no audio of it
        is yielded, and the server frees its slot; a :class:`TurnCancelled` answers."""
        self._pending_cancels.append(_ALL if context_id is None else context_id)
        await self._send({"type": "input.cancel",
                          **({"context_id": context_id} if context_id is not None else {})})

    async def close(self) -> None:
        """Close the socket: the server stops every turn of this session and frees its slot."""
        ws, self._ws = self._ws, None
        if ws is not None and not ws.closed:
            await ws.close()
        if self._own_http and self._http is not None:
            await self._http.close()
            self._http = None

    def dropping(self, context_id: str | None) -> bool:
        """Whether audio of ``context_id`` is dropped: a cancel of it is not yet answered."""
        return any(c is _ALL or c == context_id for c in self._pending_cancels)

    async def events(self) -> AsyncIterator[Event]:
        """The server's events until the socket closes: it ends after a normal close (1000,
        after ``session.close`` or :meth:`close`) and raises ConnectionError when the socket
        drops any other way."""
        assert self._ws is not None, "connect() first"
        ws = self._ws
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                if not self.dropping(self._current):
                    yield Audio(self._current, msg.data)
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            ev = json.loads(msg.data)
            kind, ctx = ev.get("type"), ev.get("context_id")
            if kind == "audio.start":
                self._current = ctx
                if not self.dropping(ctx):
                    yield TurnStarted(ctx, ev["request_id"], int(ev.get("sample_rate",
                                                                        self.sample_rate)))
            elif kind == "audio.done":
                if not self.dropping(ctx):
                    yield TurnDone(ctx, ev["request_id"], ev.get("finish_reason"),
                                   ev.get("usage", {}))
            elif kind == "session.updated":
                self.session = ev.get("session", {})
                yield Configured(self.session)
            elif kind == "context.done":
                if not self.dropping(ctx):
                    yield ContextDone(ctx)
            elif kind == "audio.cancelled":
                if self._pending_cancels:
                    self._pending_cancels.pop(0)
                yield TurnCancelled(ctx, list(ev.get("request_ids", [])))
            elif kind == "error":
                err = ev.get("error", {})
                if not (ev.get("request_id") and self.dropping(ctx)):
                    yield TurnError(ctx, ev.get("request_id"), err.get("code"),
                                    err.get("message", ""), err.get("type"))
        if ws is not self._ws or ws.close_code == aiohttp.WSCloseCode.OK:
            return  # closed here, or by the server after session.close
        raise ConnectionError(f"omni-stream session dropped (close code {ws.close_code})")

    async def _send(self, event: dict[str, Any]) -> None:
        if not self.connected:
            raise ConnectionError("omni-stream session is not connected")
        await self._ws.send_str(json.dumps(event))

    async def _receive_json(self) -> dict[str, Any]:
        assert self._ws is not None
        msg = await self._ws.receive(timeout=self.connect_timeout)
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise SessionError(f"session ended during setup: {msg.type} {self._ws.close_code}")
        return json.loads(msg.data)
