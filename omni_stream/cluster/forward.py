"""An ASGI application that forwards HTTP requests and WebSockets to an aiohttp server.

Serve's ingress is ASGI; omni-stream's API is the aiohttp app (``server.app``). A replica runs
that app on a free port of its node's address and hands every ASGI request to it through :class:`Forwarder`, so
parsing, validation, admission, errors and stream encoding are the single server's own code.
Bytes pass through unchanged in both directions, as they are produced (a chunked stream stays
chunked, an SSE event is sent when it is written); a response the app aborts mid-stream (its
error contract for a failed raw-audio stream) is aborted here too. A client that goes away
cancels the forwarded request, which frees the stream's slot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import aiohttp

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# connection-level headers that are not forwarded (RFC 9110 7.6.1), in either direction
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "host", "date", "server",
                        "content-length"})
WS_SKIP = HOP_BY_HOP | {"sec-websocket-key", "sec-websocket-version",
                        "sec-websocket-extensions", "sec-websocket-protocol"}


def _headers_in(scope: Scope, skip: frozenset[str]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())
            if k.decode("latin-1").lower() not in skip]


def _target(scope: Scope, base: str) -> str:
    path = scope.get("raw_path") or scope["path"].encode()
    url = base + path.decode("latin-1")
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    return url


class Forwarder:
    """ASGI app forwarding to the aiohttp server at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, extra_headers: dict[str, str] | None = None) -> None:
        """``extra_headers``: added to every response and WebSocket handshake (the replica
        names itself in ``x-omni-stream-replica``)."""
        self.extra = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                      for k, v in (extra_headers or {}).items()]
        self.base = base_url.rstrip("/")
        self.ws_base = "ws" + self.base[len("http"):]
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=10),
                connector=aiohttp.TCPConnector(limit=0, force_close=False))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
        elif scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    # ------------------------------------------------------------------ HTTP
    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        async with self.session().request(
                scope["method"], _target(scope, self.base), data=bytes(body) if body else None,
                headers=_headers_in(scope, HOP_BY_HOP),
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
                allow_redirects=False) as resp:
            headers = [(k.lower(), v) for k, v in resp.raw_headers
                       if k.decode("latin-1").lower() not in HOP_BY_HOP]
            headers += self.extra
            if resp.headers.get("Content-Length") is not None:
                headers.append((b"content-length", resp.headers["Content-Length"].encode()))
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": headers})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ------------------------------------------------------------------ WebSocket
    async def websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        try:
            up = await self.session().ws_connect(
                _target(scope, self.ws_base), protocols=tuple(scope.get("subprotocols") or ()),
                headers=_headers_in(scope, WS_SKIP), autoping=True, max_msg_size=0,
                compress=0)
        except aiohttp.WSServerHandshakeError as e:
            await self._deny(scope, send, e.status, e.message)
            return
        try:
            accept: dict[str, Any] = {"type": "websocket.accept", "headers": list(self.extra)}
            if up.protocol:
                accept["subprotocol"] = up.protocol
            await send(accept)
            to_up = asyncio.ensure_future(self._client_to_upstream(receive, up))
            to_client = asyncio.ensure_future(self._upstream_to_client(up, send))
            done, pending = await asyncio.wait({to_up, to_client},
                                               return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            for t in pending:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
            for t in done:
                t.result()
        finally:
            if not up.closed:
                await up.close()

    async def _deny(self, scope: Scope, send: Send, status: int, message: str) -> None:
        """The app refused the handshake (401, 503...): the client gets that status where the
        server supports the denial extension, else a policy-violation close."""
        if "websocket.http.response" in (scope.get("extensions") or {}):
            body = message.encode()
            await send({"type": "websocket.http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008 if status < 500 else 1011,
                        "reason": f"{status} {message}"[:120]})

    @staticmethod
    async def _client_to_upstream(receive: Receive, up: aiohttp.ClientWebSocketResponse) -> None:
        while True:
            msg = await receive()
            kind = msg["type"]
            if kind == "websocket.receive":
                if msg.get("text") is not None:
                    await up.send_str(msg["text"])
                elif msg.get("bytes") is not None:
                    await up.send_bytes(msg["bytes"])
            elif kind == "websocket.disconnect":
                await up.close(code=msg.get("code", 1000) or 1000)
                return

    @staticmethod
    async def _upstream_to_client(up: aiohttp.ClientWebSocketResponse, send: Send) -> None:
        reason = ""
        while True:
            m = await up.receive()
            if m.type == aiohttp.WSMsgType.TEXT:
                await send({"type": "websocket.send", "text": m.data})
            elif m.type == aiohttp.WSMsgType.BINARY:
                await send({"type": "websocket.send", "bytes": m.data})
            elif m.type == aiohttp.WSMsgType.CLOSE:
                reason = str(m.extra or "")
                break
            elif m.type in (aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.ERROR):
                break
        code = up.close_code if up.close_code is not None else 1011
        await send({"type": "websocket.close", "code": code, "reason": reason[:120]})
