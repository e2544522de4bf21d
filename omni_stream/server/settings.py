"""Server settings: a frozen dataclass, validated on construction."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from typing import Any

API_KEY_ENV = "OMNI_STREAM_API_KEY"
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


@dataclass(frozen=True)
class ServerSettings:
    """Knobs of the HTTP/WebSocket layer (the model's own knobs live in the backend).

    ``api_key``: when set, ``Authorization: Bearer <key>`` is required on every route but
    /health. ``model_aliases``: ``model`` values accepted besides the backend's own name.
    ``default_response_format``: used when a request names none (None: OpenAI's mp3 where
    libsndfile can write it, else wav).
    """

    api_key: str | None = None
    max_input_chars: int = 4096
    max_body_bytes: int = 1 << 20
    model_aliases: tuple[str, ...] = OPENAI_MODEL_ALIASES
    default_response_format: str | None = None
    ws_heartbeat_s: float = 20.0
    ws_max_pending_utterances: int = 64
    shutdown_timeout_s: float = 10.0
    ui: bool = True  # the playground at / and the dashboard at /dashboard (ui.py)
    voice_dir: str | None = None  # uploaded voices (None: under the cache dir, per model)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be non-empty (or None to disable auth)")
        for name in ("max_input_chars", "max_body_bytes", "ws_max_pending_utterances"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"ServerSettings.{name} must be a positive int")
        if self.max_body_bytes < 4 * self.max_input_chars + 4096:
            raise ValueError("max_body_bytes must hold max_input_chars of UTF-8 text plus the "
                             "other fields: raise it or lower max_input_chars")
        for name in ("ws_heartbeat_s", "shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ServerSettings.{name} must be > 0")

    def max_request_bytes(self, clone: bool) -> int:
        """The largest body or WebSocket message. Where the model clones voices, a voice upload
        or a ref_audio request (base64 of the upload cap plus the other fields) may exceed
        ``max_body_bytes``."""
        if not clone:
            return self.max_body_bytes
        from omni_stream.voices.audio import MAX_UPLOAD_BYTES

        return max(self.max_body_bytes, MAX_UPLOAD_BYTES * 4 // 3 + (64 << 10))

    @classmethod
    def from_env(cls, **overrides: Any) -> "ServerSettings":
        """Settings with the API key taken from $OMNI_STREAM_API_KEY unless given explicitly."""
        key = overrides.pop("api_key", None) or os.environ.get(API_KEY_ENV) or None
        return replace(cls(**overrides), api_key=key)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's command-line flags (for ``omni-stream serve`` and ``python -m``)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--max-input-chars", type=int, default=ServerSettings.max_input_chars)
    p.add_argument("--max-body-bytes", type=int, default=ServerSettings.max_body_bytes)
    p.add_argument("--default-response-format", default=None,
                   help="format when a request names none (default: mp3 where available)")
    p.add_argument("--voice-dir", default=None,
                   help="where uploaded voices are kept (default: under the cache dir, one "
                   "folder per model); they survive restarts")
    p.add_argument("--no-ui", action="store_true",
                   help="serve the API only: no playground at / and no /dashboard")


def from_args(a: argparse.Namespace) -> ServerSettings:
    return ServerSettings.from_env(api_key=a.api_key, max_input_chars=a.max_input_chars,
                                   max_body_bytes=a.max_body_bytes,
                                   default_response_format=a.default_response_format,
                                   voice_dir=a.voice_dir, ui=not a.no_ui)
