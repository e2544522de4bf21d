"""Run the server on a real socket and talk to it: for tests, examples and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

import aiohttp
from multidict import CIMultiDict

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


@contextlib.contextmanager
def serving_in_thread(start: Callable[[], Awaitable[tuple[Any, str]]],
                      timeout: float = 30.0) -> Iterator[str]:
    """Run the server that ``start()`` brings up (returning its ``web.AppRunner`` and URL) on a
    background event-loop thread, for code under test that runs its own loop (a CLI); yields
    the URL and cleans the runner up at the end. A failure to start is raised here."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def up() -> None:
            try:
                box["runner"], box["url"] = await start()
            except BaseException as e:  # surface start-up failures in the caller
                box["error"] = e
            ready.set()

        loop.run_until_complete(up())
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if not ready.wait(timeout):
        raise RuntimeError(f"the test server did not start within {timeout} s")
    if "error" in box:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        raise box["error"]
    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


def run_async(coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run ``coro`` on a fresh event loop with a deadline (tests must never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def post_speech(session: aiohttp.ClientSession, url: str, body: Any,
                      headers: dict[str, str] | None = None,
                      content_type: str | None = "application/json",
                      ) -> tuple[int, CIMultiDict, bytes]:
    """POST ``body`` (a dict, or raw str/bytes sent as is) to /v1/audio/speech; returns
    (status, headers (case-insensitive, as HTTP's: a proxy may send them lower-cased), whole
    body). ``content_type`` is sent unless ``headers`` name one; None
    sends no Content-Type header at all (the server answers 415)."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = dict(headers or {})
    if content_type is not None:
        headers.setdefault("Content-Type", content_type)
    skip = ("Content-Type",) if content_type is None else ()  # aiohttp would add its own
    async with session.post(url + "/v1/audio/speech", data=data, headers=headers,
                            skip_auto_headers=skip) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


def served_here(backend: Backend) -> bool:
    """Whether ``backend`` is the object serving the requests (a single server in this
    process) rather than a copy deployed elsewhere (the cluster entry's replicas): only then
    can a test look inside it."""
    return not getattr(backend, "served_remotely", False)


async def backend_stats(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The backend's ``stats()`` as /metrics exposes them (``omni_stream_backend_<key>``),
    summed over replicas behind a cluster entry: what a test may read from any server."""
    import re

    async with session.get(url + "/metrics") as r:
        assert r.status == 200, r.status
        text = await r.text()
    out: dict[str, float] = {}
    for m in re.finditer(r"^omni_stream_backend_(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def wait_backend(session: aiohttp.ClientSession, url: str,
                       until: Callable[[dict[str, float]], bool], timeout: float = 10.0,
                       every: float = 0.005) -> dict[str, float]:
    """Poll :func:`backend_stats` until ``until(stats)``; the last stats (TimeoutError past
    ``timeout``)."""
    import time

    deadline = time.perf_counter() + timeout
    while True:
        stats = await backend_stats(session, url)
        if until(stats):
            return stats
        if time.perf_counter() > deadline:
            raise TimeoutError(f"backend stats never satisfied the condition: {stats}")
        await asyncio.sleep(every)
