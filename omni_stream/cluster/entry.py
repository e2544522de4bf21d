"""The cluster entry's ASGI middleware, run inside Ray Serve's HTTP proxy on the head.

Serve's proxy answers some requests itself, in its own words: backpressure (a plain-text 429),
no replica (503), and, when the replica holding a request dies before answering, nothing at
all (uvicorn then sends a bare 500). A client of the single server gets OpenAI's
``{"error": {...}}`` shape with a code and ``Retry-After``; this middleware keeps that contract
at the entry:

- a response the proxy made (it lacks the ``x-omni-stream-replica`` header every replica
  response carries) becomes the single server's error: 429 ``server_busy``, 503
  ``no_replica_available``, 408 ``timeout``, with ``Retry-After``;
- a request whose replica died before the response started is sent again, once, to another
  replica when sending it again cannot do anything twice (``POST /v1/audio/speech`` and GET:
  no audio reached the client, a seeded request gives the same audio anywhere); otherwise, or
  when the second try fails too, it is a 503 ``replica_unavailable`` with ``Retry-After``.
  A stream whose response had started is not retried: it fails as on one server (the chunked
  response is aborted, SSE and WebSocket clients see the connection end).

Installed through Serve's proxy hook: the proxy's environment names :func:`proxy_middlewares`
in ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (``omni-stream serve --ray local`` sets it;
on a cluster started with ``ray start --head`` the head's environment must carry it, see
docs/scaling.md). Every response through it carries ``x-omni-stream-entry: 1``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from omni_stream.errors import RequestError
from omni_stream.server.errors import error_body, retry_headers

log = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "omni_stream.cluster.entry:proxy_middlewares"
REPLICA_HEADER = b"x-omni-stream-replica"
ENTRY_HEADER = (b"x-omni-stream-entry", b"1")
ATTEMPTS = 2
MAX_REPLAY_BYTES = 4 << 20  # a speech request larger than this is not buffered for a retry

# the proxy's own statuses -> (status, code, message, Retry-After s)
_PROXY_ERRORS = {
    429: (429, "server_busy", "every replica is busy and the entry's queue is full: retry "
                              "after the delay in Retry-After", 2),
    503: (503, "no_replica_available", "no replica can take requests right now (starting, "
                                       "restarting or scaled to zero): retry shortly", 2),
    404: (503, "no_replica_available", "the omni-stream application is not running on this "
                                       "cluster yet: retry shortly", 5),
    408: (408, "timeout", "the request timed out at the cluster entry", None),
}


def error_response(status: int, code: str, message: str,
                   retry_after: float | None) -> tuple[dict[str, Any], bytes]:
    """The entry's own refusal as the single server answers one (``server.errors``): ASGI start
    + body."""
    err = RequestError(status, code, message, retry_after=retry_after)
    body = json.dumps(error_body(err)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), ENTRY_HEADER]
    headers += [(k.lower().encode(), v.encode()) for k, v in retry_headers(err).items()]
    return {"type": "http.response.start", "status": status, "headers": headers}, body


def _retry_after(headers) -> float | None:
    for k, v in headers:
        if k.lower() == b"retry-after":
            try:
                return float(v)
            except ValueError:
                return None
    return None


class _Attempt:
    """One pass of a request through the proxy: forwards a replica's response, holds back
    and rewrites one the proxy made."""

    def __init__(self, send) -> None:
        self.downstream = send
        self.started = False  # a replica's response started: the client has it
        self.answered = False  # the proxy's error was rewritten and sent
        self._held: tuple[int, list] | None = None
        self._held_body = bytearray()

    async def send(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "http.response.start":
            headers = list(msg.get("headers") or [])
            if msg["status"] >= 400 and not any(k.lower() == REPLICA_HEADER
                                                for k, _ in headers):
                self._held = (msg["status"], headers)
                return
            self.started = True
            await self.downstream({**msg, "headers": headers + [ENTRY_HEADER]})
            return
        if self._held is not None and kind == "http.response.body":
            self._held_body += msg.get("body", b"")
            if not msg.get("more_body"):
                await self._rewrite()
            return
        await self.downstream(msg)

    async def _rewrite(self) -> None:
        status, headers = self._held
        text = self._held_body.decode("utf-8", "replace").strip()
        status, code, message, retry = _PROXY_ERRORS.get(
            status, (status, "entry_error" if status < 500 else "replica_unavailable",
                     text or f"the cluster entry answered {status}", 2 if status >= 500
                     else None))
        retry = _retry_after(headers) or retry
        start, body = error_response(status, code, message, retry)
        await self.downstream(start)
        await self.downstream({"type": "http.response.body", "body": body, "more_body": False})
        self.answered = True
        log.info("entry: the proxy answered %s (%s); sent as %s %s", self._held[0], text[:120],
                 status, code)


def _replayable(scope: dict[str, Any]) -> bool:
    return scope["method"] in ("GET", "HEAD") or (
        scope["method"] == "POST" and scope["path"] == "/v1/audio/speech")


class EntryMiddleware:
    """Pure ASGI middleware (Starlette's ``Middleware(EntryMiddleware)``)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replay = _replayable(scope)
        rx = receive
        if replay and scope["method"] == "POST":
            buffered: list[dict[str, Any]] = []
            size = 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                buffered.append(msg)
                size += len(msg.get("body", b""))
                if not msg.get("more_body"):
                    break
            replay = size <= MAX_REPLAY_BYTES

            def replayer():
                queue = list(buffered)

                async def rx_() -> dict[str, Any]:
                    if queue:
                        return queue.pop(0)
                    return await receive()  # after the body: the client's disconnect
                return rx_
        for attempt in range(ATTEMPTS):
            if replay and scope["method"] == "POST":
                rx = replayer()
            at = _Attempt(send)
            failure: BaseException | None = None
            try:
                await self.app(scope, rx, at.send)
            except Exception as e:  # the proxy failed the request before a response
                failure = e
            if at.started or at.answered:
                if failure is not None:
                    raise failure
                return
            last = attempt == ATTEMPTS - 1 or not replay
            log.warning("entry: %s %s got no response (%s)%s", scope["method"], scope["path"],
                        failure or "the replica stopped before answering",
                        "" if last else ": sending it to another replica")
            if last:
                break
        start, body = error_response(
            503, "replica_unavailable", "the replica serving this request stopped before "
            "answering (it is being restarted): retry shortly", 1)
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list:
    """Serve's proxy hook (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    return [Middleware(EntryMiddleware)]
