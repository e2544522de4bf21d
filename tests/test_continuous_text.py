"""Continuous text (WebSocket ``text_mode: "continuous"``) against the real server on the tiny
model: any split of a text, at any arrival times, gives exactly the greedy codes of the whole
text in text-streaming mode; a stream waiting for text does not hold up the others; limits,
idle timeout and disconnects free the slot."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time

import aiohttp
import numpy as np
import pytest

from omni_stream.engine.sampling import SamplingParams
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.models.prompt import PromptRequest
from omni_stream.orchestrator import PipelineBackend, PipelineSettings
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import run_async, running_server
from tests.servers import tiny_settings

pytestmark = pytest.mark.timeout(900)

FRAMES = 90  # more than the longest text has tokens: no stream ends at its cap mid-text
TEXTS = [
    "Hello world, this is a continuous stream of words from a language model.",
    "Numbers 3.14159 and 2026; café, naïve — 中文测试，你好！👩🏽‍💻 done.",
]


def _settings(ck, **kw) -> PipelineSettings:
    # queue_timeout_s only bounds a failure: a loaded machine may measure a capacity of one
    # stream, and the streams of a test then take their turns
    return tiny_settings(ck, **{"max_streams": 3, "max_queue": 8, "queue_timeout_s": 300, **kw})


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(3, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _piece_after(pieces: list[str], chars: int) -> int:
    """The index of the first piece that starts at least ``chars`` into the text (the last
    piece is cut in two, in place, if none does)."""
    at = 0
    for i, p in enumerate(pieces):
        if at >= chars and i:
            return i
        at += len(p)
    last = pieces.pop()
    cut = chars - (at - len(last))
    pieces += [last[:cut], last[cut:]]
    return len(pieces) - 1


@dataclasses.dataclass(frozen=True)
class Waits:
    """A writer's pause that lasts until the stream has reported its ``n``-th ``text.waiting``
    (its speech caught up with the text and waits for more), however slow the machine."""
    n: int = 1


async def _continuous(url: str, pieces: list[str], delays: list, *,
                      waiting: asyncio.Event | None = None, **config) -> dict:
    """One continuous utterance over a WebSocket with codec frames: its codes and events.

    Before each piece the writer pauses: ``delays[i]`` seconds, a :class:`Waits`, or until an
    ``asyncio.Event`` is set; any pause also ends when the utterance is over (it cannot wait any
    more: the caller's checks then fail rather than hang). ``waiting`` (if given) is set at the
    stream's first ``text.waiting``. ``arrivals`` (of the codec frames) and ``times`` (of the
    events) are ``time.monotonic()``."""
    codes, events, times, arrivals = [], [], [], []
    waits, changed, over = [0], asyncio.Event(), asyncio.Event()

    async def until(event: asyncio.Event) -> None:
        ends = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(over.wait())]
        try:
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in ends:
                f.cancel()

    async def pause(d) -> None:
        if isinstance(d, Waits):
            while waits[0] < d.n and not over.is_set():
                changed.clear()
                await until(changed)
        elif isinstance(d, asyncio.Event):
            await until(d)
        else:
            await asyncio.sleep(d)

    async with aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/audio/speech/stream") as ws:
        assert (await ws.receive_json())["type"] == "session.created"
        await ws.send_json({"type": "session.config", "text_mode": "continuous",
                            "codec_frames": True, "greedy": True, "language": "english",
                            "voice": "ryan", **config})
        assert (await ws.receive_json())["type"] == "session.updated"

        async def writer():
            for piece, d in zip(pieces, delays):
                await pause(d)
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            await ws.send_json({"type": "session.close"})

        w = asyncio.create_task(writer())
        header = None
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                n = header["frames"]
                codes.append(np.frombuffer(msg.data, dtype="<i8").reshape(n, 16))
                arrivals.append(time.monotonic())
                continue
            ev = json.loads(msg.data)
            events.append(ev)
            times.append(time.monotonic())
            if ev["type"] == "codec.frames":
                header = ev
            elif ev["type"] == "text.waiting":
                waits[0] += 1
                changed.set()
                if waiting is not None:
                    waiting.set()
            elif ev["type"] in ("audio.done", "error"):
                over.set()
            elif ev["type"] == "session.done":
                break
        over.set()
        await w
    return dict(codes=np.concatenate(codes) if codes else np.zeros((0, 16), np.int64),
                events=events, times=times, arrivals=arrivals)


def _time_of(res: dict, kind: str) -> float:
    """When the first event of ``kind`` came (``time.monotonic()``)."""
    return next(t for e, t in zip(res["events"], res["times"]) if e["type"] == kind)


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
    cases = []  # (text, pieces, pauses, whether a pause lasts until the stream waits)
    for t in TEXTS:
        cases.append((t, list(t), [0.0] * len(t), False))  # one character at a time, at once
        for k in range(2):
            pieces = _splits(t, rng)
            # one pause (k == 0) lasts until the speech has caught up with the text and waits,
            # on any machine; it comes after at least half the text, so that some of its ids
            # are final and the stream has started
            i = _piece_after(pieces, len(t) // 2) if k == 0 else None
            delays = [rng.choice([0.0, 0.0, 0.3]) for _ in pieces]
            if i is not None:
                delays[i] = Waits(1)
            cases.append((t, pieces, delays, i is not None))

    async def main():
        async with running_server(PipelineBackend(_settings(tiny_ckpt, engine=engine))) as url:
            return await asyncio.gather(*[
                _continuous(url, pieces, delays, max_new_tokens=FRAMES)
                for _, pieces, delays, _ in cases])

    results = run_async(main(), timeout=600)
    waited = 0
    for (text, pieces, _, caught_up), res in zip(cases, results):
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
        if caught_up:  # the writer paused until the stream waited: it did, then went on
            assert "text.waiting" in kinds, pieces
            assert kinds.index("text.waiting") < kinds.index("audio.done")
            last = [e for e in res["events"] if e["type"] == "text.resumed"][-1]
            assert last["total_waited_ms"] == done["text_waited_ms"]
    assert waited >= sum(c[3] for c in cases) > 0  # the pauses made streams wait for their text


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
    """A stream whose writer has paused (its speech caught up and waits for text) is left out
    of the batch: another stream runs all the way through meanwhile, as fast as alone. The
    slow writer sends its next word only once the fast stream is done (so a server that held
    the batch for it would deadlock until its idle timeout and fail), then waits again for its
    speech to catch up (a ``text.waiting``) before each further word. No wall-clock constant:
    the fast stream is compared with the same request alone on the same server in the same
    run."""
    fast_text, slow_text = TEXTS[0], "One. Two. Three. Four."
    words = slow_text.split(" ")

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url:
            # this is about the talker's batch, not admission: both streams are admitted at
            # once whatever capacity the machine measures (a loaded one may measure 1 stream,
            # and the slow stream would then keep the fast one queued)
            backend.tracker.down_s = backend.tracker.up_s = math.inf
            backend.adm.set_capacity(backend.s.max_streams)
            t0 = time.monotonic()
            alone = await _continuous(url, [fast_text], [0.0], max_new_tokens=FRAMES)
            alone_s = time.monotonic() - t0
            slow_waits, fast_done = asyncio.Event(), asyncio.Event()
            slow = asyncio.create_task(_continuous(
                url, [w + " " for w in words],
                [0.0, fast_done, *(Waits(n) for n in range(2, len(words)))],
                waiting=slow_waits, max_new_tokens=FRAMES))
            # the fast stream starts once the slow one waits for its text (or is over)
            first_wait = asyncio.ensure_future(slow_waits.wait())
            await asyncio.wait([first_wait, slow], return_when=asyncio.FIRST_COMPLETED)
            first_wait.cancel()
            t0 = time.monotonic()
            fast = await _continuous(url, [fast_text], [0.0], max_new_tokens=FRAMES)
            fast_s = time.monotonic() - t0
            fast_done.set()
            slow_res = await slow
            # /metrics counts the waiting apart from compute (the talker pushes every second;
            # the deadline only bounds a failure)
            deadline = time.monotonic() + 30
            async with aiohttp.ClientSession() as s:
                while True:
                    async with s.get(url + "/metrics") as r:
                        metrics = await r.text()
                    if 'phase="talker.text_wait"' in metrics or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.3)
            assert 'omni_stream_step_seconds_count{phase="talker.text_wait"}' in metrics
            assert "omni_stream_backend_text_waits" in metrics
            return alone, alone_s, fast, fast_s, slow_res

    alone, alone_s, fast, fast_s, slow = run_async(main(), timeout=300)
    fast_ref = _offline(tiny_ckpt, fast_text, FRAMES)
    assert np.array_equal(alone["codes"], fast_ref)
    assert np.array_equal(fast["codes"], fast_ref)
    # the slow writer made its stream wait, and its speech is still exactly its text's
    kinds = [e["type"] for e in slow["events"]]
    assert kinds.count("text.waiting") >= len(words) - 1  # before each word after the first
    assert kinds.count("text.waiting") == kinds.count("text.resumed")
    assert kinds.index("text.waiting") < kinds.index("text.resumed") < kinds.index("audio.done")
    slow_ref = _offline(tiny_ckpt, "".join(w + " " for w in words), FRAMES)
    assert np.array_equal(slow["codes"], slow_ref)
    # the fast stream ran from its first frame to its end while the slow one waited for text
    assert len(fast["arrivals"]) > 1
    assert _time_of(slow, "text.waiting") < fast["arrivals"][0]
    assert _time_of(fast, "audio.done") < _time_of(slow, "text.resumed")
    # ... and never stalled on it: about as fast as alone (a generous ratio), and no pause
    # between its frames as long as the whole request took alone
    assert fast_s < 3 * alone_s, (fast_s, alone_s)
    gaps = np.diff(fast["arrivals"])
    assert gaps.max() < alone_s, (gaps.max(), alone_s)


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
