"""Overload against the real backend: the tiny model in its real stage processes, one slot, a
queue of one. Refusals must be fast and typed (429 queue full at once, 503 past the queue
deadline, both with Retry-After and OpenAI's error shape), and must not touch the stream that
holds the slot: its audio equals the same request served alone."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
from multidict import CIMultiDict
import numpy as np
import pytest

from omni_stream.orchestrator import PipelineBackend
from omni_stream.server.testing import run_async, running_server
from tests.servers import tiny_settings

pytestmark = pytest.mark.timeout(600)

QUEUE_TIMEOUT_S = 0.4
FRAME_BYTES = 1920 * 2  # one 80 ms frame of s16le at 24 kHz
# greedy and seeded: the same codes every time. 80 frames take ~2 s on an idle 2-core machine
# (longer under load), several times the queue deadline, so the stream holding the slot is still
# running when the queued request's deadline passes
LONG = dict(model="qwen3-tts", voice="ryan", language="english", response_format="pcm",
            input="Hello world, this is a streaming test of the whole pipeline.", seed=7,
            greedy=True, max_new_tokens=80)


def _our_segments() -> set[str]:
    """Shared-memory segments owned by this process (the server runs in it)."""
    prefix = f"omni-stream-{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _close_pcm(a: bytes, b: bytes) -> bool:
    """Same length and within 1 LSB: identical codes decoded with different (adaptive) chunkings
    differ only by float rounding."""
    x, y = np.frombuffer(a, dtype="<i2"), np.frombuffer(b, dtype="<i2")
    return len(x) == len(y) and (len(x) == 0 or int(np.abs(x.astype(int) - y.astype(int)).max()) <= 1)


async def _post(s: aiohttp.ClientSession, url: str, body: dict, answered: list[int] | None = None
                ) -> tuple[int, dict, bytes, float]:
    """(status, headers, body, seconds to the whole answer); the status is appended to
    ``answered`` when the answer is complete (the order in which the requests were answered)."""
    t = time.perf_counter()
    async with s.post(url + "/v1/audio/speech", json=body) as r:
        data = await r.read()
        if answered is not None:
            answered.append(r.status)
        return r.status, CIMultiDict(r.headers), data, time.perf_counter() - t


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
def test_overload_refuses_fast_and_typed_and_the_running_stream_is_unharmed(tiny_ckpt):
    before = _our_segments()

    async def main():
        backend = PipelineBackend(tiny_settings(tiny_ckpt, max_streams=1, max_queue=1,
                                                queue_timeout_s=QUEUE_TIMEOUT_S))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/audio/speech", json=LONG) as r:
                assert r.status == 200
                head = await r.content.readexactly(FRAME_BYTES)  # admitted and speaking
                segments = _our_segments() - before
                # one of these takes the queue's only place and waits out its deadline; the
                # other two find the queue full
                answered: list[int] = []
                others = await asyncio.gather(*(_post(s, url, dict(LONG, seed=i), answered)
                                                for i in (1, 2, 3)))
                still_running = backend.stats()["active_streams"] == 1
                running = await r.read()
            for _ in range(100):  # the slot is released when the handler leaves the stream
                stats = backend.stats()
                if stats["active_streams"] == 0 and stats["slots_free"] == 1:
                    break
                await asyncio.sleep(0.02)
            alone = await _post(s, url, LONG)
            return (segments, head + running, others, stats, alone, backend.stats(), answered,
                    still_running)

    (segments, running, others, idle, alone, final, answered,
     still_running) = run_async(main(), timeout=300)

    assert sorted(o[0] for o in others) == [429, 429, 503], [(o[0], o[2][:200]) for o in others]
    # ordering, not timing: both 429s were answered while the third request still waited in
    # the queue (refused at once), and the 503 came while the stream holding the slot still
    # ran (it waited out its own deadline, not the slot)
    assert answered == [429, 429, 503], answered
    assert still_running
    for status, headers, body, elapsed in others:
        doc = json.loads(body)
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
        err = doc["error"]
        assert int(headers["Retry-After"]) >= 1  # whole seconds, as HTTP wants
        if status == 429:
            assert (err["type"], err["code"]) == ("rate_limit_error", "server_busy")
        else:
            assert (err["type"], err["code"]) == ("server_error", "queue_timeout")
            # a lower bound, which no load can break: it did wait out its deadline
            assert elapsed >= QUEUE_TIMEOUT_S, elapsed
    assert len(running) == LONG["max_new_tokens"] * FRAME_BYTES
    assert alone[0] == 200 and _close_pcm(running, alone[2])  # the overload changed nothing
    assert (idle["active_streams"], idle["slots_free"], idle["queue_depth"]) == (0, 1, 0)
    assert (final["active_streams"], final["slots_free"], final["queue_depth"]) == (0, 1, 0)
    assert (final["admission_rejected_queue_full"], final["admission_rejected_deadline"],
            final["admission_admitted_total"]) == (2, 1, 2)
    assert len(segments) >= 2  # the server's rings existed while it ran...
    assert _our_segments() - before == set()  # ...and none outlived it
