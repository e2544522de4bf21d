"""Continuous text (WebSocket ``text_mode: "continuous"``) against the real server on the tiny
model: any split of a text, at any arrival times, gives exactly the greedy codes of the whole
text in text-streaming mode; a stream waiting for text does not hold up the others; limits,
idle timeout and disconnects free the slot."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import numpy as np
import pytest

from omni_stream.engine.sampling import SamplingParams
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.models.prompt import PromptRequest
from omni_stream.orchestrator import PipelineBackend, PipelineSettings
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import run_async, running_server

pytestmark = pytest.mark.timeout(900)

FRAMES = 90  # more than the longest text has tokens: no stream ends at its cap mid-text
TEXTS = [
    "Hello world, this is a continuous stream of words from a language model.",
    "Numbers 3.14159 and 2026; café, naïve — 中文测试，你好！👩🏽‍💻 done.",
]


def _settings(ck, **kw) -> PipelineSettings:
    base = dict(model_path=str(ck), max_streams=3, max_seq_len=512, max_queue=8,
                queue_timeout_s=60, schedule=ChunkPolicy(first=1, steady=4))
    base.update(kw)
    return PipelineSettings(**base)


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(3, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


async def _continuous(url: str, pieces: list[str], delays: list[float], **config) -> dict:
    """One continuous utterance over a WebSocket with codec frames: its codes and events."""
    codes, events, arrivals = [], [], []
    async with aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/audio/speech/stream") as ws:
        assert (await ws.receive_json())["type"] == "session.created"
        await ws.send_json({"type": "session.config", "text_mode": "continuous",
                            "codec_frames": True, "greedy": True, "language": "english",
                            "voice": "ryan", **config})
        assert (await ws.receive_json())["type"] == "session.updated"
        t0 = time.monotonic()

        async def writer():
            for piece, d in zip(pieces, delays):
                await asyncio.sleep(d)
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            await ws.send_json({"type": "session.close"})

        w = asyncio.create_task(writer())
        header = None
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                n = header["frames"]
                codes.append(np.frombuffer(msg.data, dtype="<i8").reshape(n, 16))
                arrivals.append(time.monotonic() - t0)
                continue
            ev = json.loads(msg.data)
            events.append(ev)
            if ev["type"] == "codec.frames":
                header = ev
            elif ev["type"] == "session.done":
                break
        await w
    return dict(codes=np.concatenate(codes) if codes else np.zeros((0, 16), np.int64),
                events=events, arrivals=arrivals)


def _offline(ck, text: str, frames: int) -> np.ndarray:
    synth = Synthesizer.from_path(ck)
    codes, _, _ = synth.generate_codes(
        PromptRequest(text=text, language="english", speaker="ryan", stream_text=True),
        SamplingParams.greedy(), 0, frames)
    return codes


@pytest.mark.parametrize("engine", ["torch", "native"])
def test_any_split_gives_the_codes_of_the_whole_text(tiny_ckpt, engine):
    rng = random.Random(7)
    refs = {t: _offline(tiny_ckpt, t, FRAMES) for t in TEXTS}
    cases = []
    for t in TEXTS:
        cases.append((t, list(t), [0.0] * len(t)))  # one character at a time, at once
        for _ in range(2):
            pieces = _splits(t, rng)
            # pauses long enough that the speech catches up with the text and waits
            cases.append((t, pieces, [rng.choice([0.0, 0.0, 0.3]) for _ in pieces]))

    async def main():
        async with running_server(PipelineBackend(_settings(tiny_ckpt, engine=engine))) as url:
            return await asyncio.gather(*[
                _continuous(url, pieces, delays, max_new_tokens=FRAMES)
                for _, pieces, delays in cases])

    results = run_async(main(), timeout=600)
    waited = 0
    for (text, pieces, _), res in zip(cases, results):
        ref = refs[text]
        got = res["codes"]
        mism = np.argwhere(got[:len(ref)] != ref[:len(got)])
        assert got.shape == ref.shape and mism.size == 0, (pieces, got.shape, ref.shape,
                                                           mism[:1].tolist())
        kinds = [e["type"] for e in res["events"]]
        assert kinds.index("audio.start") < kinds.index("audio.done")
        done = next(e for e in res["events"] if e["type"] == "audio.done")
        waited += kinds.count("text.waiting")
        assert kinds.count("text.waiting") == kinds.count("text.resumed")
        assert done["text_waited_ms"] >= 0
    assert waited > 0  # the pauses made some streams wait for their text


@pytest.mark.slow
def test_any_split_at_0_6b_shape(ckpt_factory):
    """The same property on the released 0.6B widths (depth cut for test time; the checkpoint
    is the one the official-parity tests use)."""
    ck = ckpt_factory("0.6b", "custom_voice", 1, talker_layers=2, cp_layers=2)
    text = TEXTS[1]
    ref = _offline(ck, text, FRAMES)
    rng = random.Random(3)
    cases = [_splits(text, rng) for _ in range(2)]

    async def main():
        async with running_server(PipelineBackend(_settings(ck, max_streams=2))) as url:
            return await asyncio.gather(*[
                _continuous(url, pieces, [rng.choice([0.0, 0.4]) for _ in pieces],
                            max_new_tokens=FRAMES) for pieces in cases])

    for pieces, res in zip(cases, run_async(main(), timeout=600)):
        assert np.array_equal(res["codes"], ref), pieces


def test_a_slow_writer_does_not_stall_a_fast_one(tiny_ckpt):
    fast_text, slow_text = TEXTS[0], "One. Two. Three. Four."
    words = slow_text.split(" ")

    async def main():
        async with running_server(PipelineBackend(_settings(tiny_ckpt))) as url:
            slow = asyncio.create_task(_continuous(
                url, [w + " " for w in words], [0.0] + [1.0] * (len(words) - 1),
                max_new_tokens=FRAMES))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            fast = await _continuous(url, [fast_text], [0.0], max_new_tokens=FRAMES)
            fast_s = time.monotonic() - t0
            slow_res = await slow
            # /metrics counts the waiting apart from compute (the talker pushes every second)
            deadline = time.monotonic() + 5
            async with aiohttp.ClientSession() as s:
                while True:
                    async with s.get(url + "/metrics") as r:
                        metrics = await r.text()
                    if 'phase="talker.text_wait"' in metrics or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.3)
            assert 'omni_stream_step_seconds_count{phase="talker.text_wait"}' in metrics
            assert "omni_stream_backend_text_waits" in metrics
            return fast, fast_s, slow_res

    fast, fast_s, slow = run_async(main(), timeout=300)
    assert np.array_equal(fast["codes"], _offline(tiny_ckpt, fast_text, FRAMES))
    # the slow writer made its stream wait, and its speech is still exactly its text's
    assert "text.waiting" in [e["type"] for e in slow["events"]]
    slow_ref = _offline(tiny_ckpt, "".join(w + " " for w in words), FRAMES)
    assert np.array_equal(slow["codes"], slow_ref)
    # the fast stream finished while the slow one was still being written (its last word
    # comes 3 s in), and never stalled on it
    assert fast_s < 2.5, fast_s
    gaps = np.diff(fast["arrivals"])
    assert len(gaps) == 0 or gaps.max() < 1.0, gaps.max()


def test_limits_timeouts_and_disconnects_free_the_slot(tiny_ckpt):
    settings = ServerSettings(max_input_chars=40)

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt, max_streams=1, text_idle_timeout_s=1.0))
        async with running_server(backend, settings) as url, aiohttp.ClientSession() as s:
            async with s.ws_connect(url + "/v1/audio/speech/stream") as ws:
                await ws.receive_json()
                await ws.send_json({"type": "session.config", "text_mode": "paragraphs"})
                ev = await ws.receive_json()
                assert ev["type"] == "error" and ev["error"]["param"] == "text_mode"
                await ws.send_json({"type": "session.config", "text_mode": "continuous",
                                    "greedy": True, "voice": "ryan", "max_new_tokens": 8})
                await ws.receive_json()
                await ws.send_json({"type": "input.text", "text": "Hello there, "})
                await ws.send_json({"type": "input.text", "text": "x" * 40})  # past the cap
                events = []
                while True:  # the piece is refused; then nothing more comes: idle timeout
                    ev = await _next_event(ws, 20)
                    events.append(ev)
                    if ev["type"] == "error" and ev["error"]["code"] == "text_timeout":
                        break
                assert any(e["type"] == "error" and e["error"]["code"] == "input_too_long"
                           for e in events)
                assert await _slot_freed(backend)
                # the session goes on: a new utterance starts and completes
                await ws.send_json({"type": "input.text", "text": "Again. "})
                await ws.send_json({"type": "input.done"})
                while (ev := await _next_event(ws, 60))["type"] != "audio.done":
                    assert ev["type"] != "error", ev
            # a client that disconnects mid-utterance frees everything
            async with s.ws_connect(url + "/v1/audio/speech/stream") as ws:
                await ws.receive_json()
                await ws.send_json({"type": "session.config", "text_mode": "continuous",
                                    "voice": "ryan"})
                await ws.receive_json()
                await ws.send_json({"type": "input.text", "text": "Half a sentence and "})
                await asyncio.sleep(0.5)
            assert await _slot_freed(backend)

    run_async(main(), timeout=120)


async def _next_event(ws, timeout: float) -> dict:
    """The next JSON event (audio frames skipped)."""
    while True:
        msg = await ws.receive(timeout)
        if msg.type == aiohttp.WSMsgType.TEXT:
            return json.loads(msg.data)
        assert msg.type == aiohttp.WSMsgType.BINARY, msg


async def _slot_freed(backend, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if backend.stats()["slots_free"] == backend.s.max_streams:
            return True
        await asyncio.sleep(0.05)
    return False
