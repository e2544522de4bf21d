"""Run the server on a real socket and talk to it: for tests, examples and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, TypeVar

import aiohttp

from omni_stream.contract import Backend
from omni_stream.server.settings import ServerSettings

T = TypeVar("T")


@contextlib.asynccontextmanager
async def running_server(backend: Backend, settings: ServerSettings | None = None,
                         host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve ``backend`` on a free port of ``host`` for the block; yields the base URL.
    Leaving the block shuts down gracefully (which closes the backend)."""
    from omni_stream.server.app import start_server

    runner, url = await start_server(backend, host, 0, settings)
    try:
        yield url
    finally:
        await runner.cleanup()


def run_async(coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run ``coro`` on a fresh event loop with a deadline (tests must never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def post_speech(session: aiohttp.ClientSession, url: str, body: Any,
                      headers: dict[str, str] | None = None,
                      content_type: str | None = "application/json",
                      ) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` (a dict, or raw str/bytes sent as is) to /v1/audio/speech; returns
    (status, headers, whole body). ``content_type`` is sent unless ``headers`` name one; None
    sends no Content-Type header at all (the server answers 415)."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = dict(headers or {})
    if content_type is not None:
        headers.setdefault("Content-Type", content_type)
    skip = ("Content-Type",) if content_type is None else ()  # aiohttp would add its own
    async with session.post(url + "/v1/audio/speech", data=data, headers=headers,
                            skip_auto_headers=skip) as r:
        return r.status, dict(r.headers), await r.read()
