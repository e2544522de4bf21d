"""What the handlers share, stored on the app under one typed key."""

from __future__ import annotations

import time
from typing import Any
from dataclasses import dataclass, field

from aiohttp import web

from omni_stream.contract import Backend
from omni_stream.server.metrics import ServerMetrics
from omni_stream.server.settings import ServerSettings


@dataclass
class ServerState:
    backend: Backend
    settings: ServerSettings
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False  # backend started and not shutting down
    websockets: set[web.WebSocketResponse] = field(default_factory=set)  # open WS sessions
    voices: Any = None  # server.voices.VoiceService (uploaded voices, cloning)


STATE: web.AppKey[ServerState] = web.AppKey("omni_stream_state", ServerState)
