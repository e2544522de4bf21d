"""The one error type (``errors.RequestError``) mapped onto the wire, once per transport.

- HTTP: :func:`http_response`, OpenAI's shape ``{"error": {"message", "type", "param",
  "code"}}`` (:func:`error_body`) with the status and, on 429/503, Retry-After;
- SSE: :func:`sse_error_event`, ``{"type": "error", "error": {...}}``, when a response has
  already started (the stream then ends);
- WebSocket: :func:`ws_error_event`, the same event tagged with the utterance's request_id and
  the client's context_id (the session stays open).

Failures that are not a RequestError yet (msgspec's decode errors, aiohttp's HTTP exceptions, an
unexpected exception) become one here: :func:`from_validation`, :func:`from_http_exception`,
:func:`internal_error`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
from aiohttp import web

from omni_stream.errors import RequestError

# status -> OpenAI "type" (OpenAI uses invalid_request_error for every 4xx but 429)
_TYPES = {429: "rate_limit_error"}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(err: RequestError) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": err.message, "type": error_type(err.status),
                      "param": err.param, "code": err.code}}


def retry_headers(err: RequestError) -> dict[str, str]:
    """Retry-After in whole seconds (at least 1) where the error carries a retry delay."""
    if err.retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after)))}


def http_response(err: RequestError) -> web.Response:
    """The HTTP answer: the status, OpenAI's error JSON, Retry-After."""
    return web.Response(status=err.status, body=msgspec.json.encode(error_body(err)),
                        content_type="application/json", headers=retry_headers(err))


def sse_error_event(err: RequestError) -> dict[str, Any]:
    """The SSE ``error`` event that ends a stream whose response has started."""
    return {"type": "error", **error_body(err)}


def ws_error_event(err: RequestError, request_id: str | None = None,
                   context_id: str | None = None) -> dict[str, Any]:
    """The WebSocket ``error`` message: the SSE event, tagged with the utterance it belongs to
    (``request_id``) and the client's label (``context_id``) where there is one."""
    event = sse_error_event(err)
    if request_id is not None:
        event["request_id"] = request_id
    if context_id is not None:
        event["context_id"] = context_id
    return event


def from_validation(e: msgspec.ValidationError | msgspec.DecodeError) -> RequestError:
    """msgspec's message already names the field ("... - at `$.speed`"); lift it to param."""
    msg = str(e)
    m = re.search(r"at `\$\.([A-Za-z_][\w]*)", msg) or re.search(r"field `(\w+)`", msg)
    if isinstance(e, msgspec.ValidationError):
        return RequestError(400, "invalid_type", msg, param=m.group(1) if m else None)
    return RequestError(400, "invalid_json", f"could not parse the JSON body: {msg}")


def internal_error(ref: str) -> RequestError:
    """A 500 that names what failed (request id or route) so the log line can be found."""
    return RequestError(500, "internal_error", f"internal error ({ref}); see the server log")


# aiohttp's own HTTP exceptions (routing, body size) -> our codes
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def from_http_exception(e: web.HTTPException) -> RequestError:
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
    return RequestError(status, _HTTP_CODES.get(status, e.reason.lower().replace(" ", "_")), msg)
