"""Errors as typed values, mapped onto OpenAI's error shape.

Every failure a client can see is an :class:`ApiError`: the HTTP status, and the body
``{"error": {"message", "type", "param", "code"}}``. The same value becomes an SSE ``error``
event or a WebSocket ``error`` event when the response has already started.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
from aiohttp import web

from omni_stream.contract import BackendError

# status -> OpenAI "type" (OpenAI uses invalid_request_error for every 4xx but 429)
_TYPES = {429: "rate_limit_error"}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


class ApiError(Exception):
    """A client-visible failure: status, OpenAI error fields, optional Retry-After seconds."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    @classmethod
    def from_backend(cls, e: BackendError) -> "ApiError":
        return cls(e.status, e.message, code=e.code, param=e.param, retry_after=e.retry_after)

    @classmethod
    def from_validation(cls, e: msgspec.ValidationError | msgspec.DecodeError) -> "ApiError":
        """msgspec's message already names the field ("... - at `$.speed`"); lift it to param."""
        msg = str(e)
        m = re.search(r"at `\$\.([A-Za-z_][\w]*)", msg) or re.search(r"field `(\w+)`", msg)
        if isinstance(e, msgspec.ValidationError):
            return cls(400, msg, code="invalid_type", param=m.group(1) if m else None)
        return cls(400, f"could not parse the JSON body: {msg}", code="invalid_json")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers())


def internal_error(ref: str) -> ApiError:
    """A 500 that names what failed (request id or route) so the log line can be found."""
    return ApiError(500, f"internal error ({ref}); see the server log",
                    code="internal_error")


# aiohttp's own HTTP exceptions (routing, body size) -> our codes
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def from_http_exception(e: web.HTTPException) -> ApiError:
    """aiohttp's routing / protocol errors (404, 405, 413, a GET without WebSocket upgrade...)
    in OpenAI's shape, keeping aiohttp's explanation where it gave one."""
    status, text = e.status, (e.text or "").strip()
    if status == 404:
        msg = "no such route; see GET /v1/models, POST /v1/audio/speech"
    elif isinstance(e, web.HTTPMethodNotAllowed):
        msg = f"method {e.method} is not allowed here: use {', '.join(sorted(e.allowed_methods))}"
    elif text and text != f"{status}: {e.reason}":
        msg = text
    else:
        msg = e.reason
    return ApiError(status, msg, code=_HTTP_CODES.get(status, e.reason.lower().replace(" ", "_")))
