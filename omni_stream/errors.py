"""The one failure a client can see: :class:`RequestError` (status, code, message, param).

It is raised wherever a request is refused or fails (the server's checks, voice input,
admission control, the backends) and travels unchanged to the server, which maps it once per
transport (``server/errors.py``: OpenAI's JSON error body, an SSE ``error`` event, a WebSocket
``error`` message). It sits in the lowest layer and imports nothing, so every layer that refuses
a request (``scheduling``'s admission included) raises the same type.
"""

from __future__ import annotations


def _request_error(status, code, message, param, retry_after, reason) -> "RequestError":
    return RequestError(status, code, message, param=param, retry_after=retry_after,
                        reason=reason)


class RequestError(ValueError):
    """A client-visible failure of one request.

    ``status``: the HTTP status (400 bad input, 413 too large, 429 busy, 503 unavailable or
    shutting down, 500 internal); ``code``: a short snake_case machine string
    ("invalid_voice", "server_busy"...); ``message``: what went wrong and how to fix it;
    ``param``: the request field at fault; ``retry_after``: seconds a client should wait before
    retrying (the Retry-After header on 429/503; None: retrying will not help); ``reason``: a
    finer cause than ``code`` for logs and counters (admission's queue_full, deadline,
    too_large, cancelled), ``code`` when not given.

    A ValueError: almost every instance is bad input, and code that refuses input with
    ValueError (voice decoding, the voice store) refuses it with this.
    """

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 retry_after: float | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.reason = reason if reason is not None else code

    @property
    def retry_after_s(self) -> float | None:
        """``retry_after`` (seconds), as scheduling spells its durations."""
        return self.retry_after

    def __reduce__(self):
        """Picklable with its keyword fields (it crosses process boundaries: stage processes,
        Ray replicas)."""
        return (_request_error, (self.status, self.code, self.message, self.param,
                                 self.retry_after, self.reason))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("param", self.param),
                                                     ("retry_after", self.retry_after))
                        if v is not None)
        return f"RequestError({self.status}, {self.code!r}, {self.message!r}{extra})"


__all__ = ["RequestError"]
