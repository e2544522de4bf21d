"""A seeded request gives the same bytes every time on one server (the cluster entry retries a
request on another replica on that basis: cluster/entry.py).

The tiny model's real server decodes in fp32. Its codec stage sizes each stream's chunks from
the timing (the listener's slack, the talker's pace, a backlog decoded at once, other streams
in the same call), so the same request meets another chunk plan each time; unpacked, fp32
rounded by the call's length and 1 LSB of s16 moved in a few hundred of 48,000 samples from
one request to the next. The packed decode (``Code2Wav.pack``) gives a stream the same bits at
any chunk plan and batch, so the bytes repeat whatever the timing: checked here with the same
request alone, with another chunk plan asked for, and beside a copy of itself.
"""

from __future__ import annotations

import asyncio

import aiohttp

from omni_stream.server.testing import post_speech, run_async

BODY = {"input": "Say it again, exactly.", "voice": "ryan", "language": "english", "seed": 5,
        "response_format": "pcm", "max_new_tokens": 20}


def test_a_seeded_request_gives_the_same_pcm_at_any_chunk_plan_and_beside_itself(agents_server):
    async def main() -> list[bytes]:
        async with aiohttp.ClientSession() as s:
            async def one(**extra) -> bytes:
                status, _, raw = await post_speech(s, agents_server, {**BODY, **extra})
                assert status == 200, raw[:300]
                return raw

            out = [await one(), await one(initial_codec_chunk_frames=3)]
            out += await asyncio.gather(one(), one())  # two streams share the codec's calls
            return out

    first, *rest = run_async(main(), timeout=240)
    assert len(first) == 20 * 1920 * 2
    for i, raw in enumerate(rest):
        assert raw == first, f"request {i + 1}: {_lsb_diff(raw, first)}"


def _lsb_diff(a: bytes, b: bytes) -> str:
    import numpy as np

    if len(a) != len(b):
        return f"{len(a)} bytes against {len(b)}"
    x, y = (np.frombuffer(v, "<i2").astype(np.int32) for v in (a, b))
    d = np.abs(x - y)
    return f"{int((d != 0).sum())} of {d.size} samples differ, by at most {int(d.max())}"
