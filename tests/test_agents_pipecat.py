"""Pipecat against the real server on the tiny model, headless (pipecat.tests.utils.run_test):
the unmodified OpenAITTSService, and OmniStreamTTSService with an LLM's text frames dripped in:
the same speech as the whole text, first audio before the text ends, barge-in (no audio of the
turn after it, the slot back, the session goes on), a dropped socket that reconnects, and a
cloned voice by name."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (ErrorFrame, Frame, InterruptionFrame,  # noqa: E402
                                   LLMFullResponseEndFrame, LLMFullResponseStartFrame,
                                   LLMTextFrame, TTSAudioRawFrame, TTSSpeakFrame,
                                   TTSStartedFrame, TTSStoppedFrame)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.tts import OpenAITTSService  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from omni_stream.integrations.pipecat import OmniStreamTTSService  # noqa: E402
from omni_stream.integrations.session import Audio, ContextDone, SpeechSession  # noqa: E402
from omni_stream.server.testing import run_async, wait_backend  # noqa: E402
from speech_checks import llm_pieces, same_speech, uploaded_voice  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TEXT = "Hello world, this is a reply from a language model. It goes on a little more."
OPTS = dict(greedy=True, max_new_tokens=48)  # with voice ryan, language english


class Recorder(FrameProcessor):
    """Passes every frame on and notes (monotonic time, frame) of those going downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list[tuple[float, Frame]]:
        return [(t, f) for t, f in self.frames if isinstance(f, kind)]

    def pcm(self) -> np.ndarray:
        return np.frombuffer(b"".join(f.audio for _, f in self.of(TTSAudioRawFrame)),
                             dtype="<i2")


class Stamp(FrameProcessor):
    """Notes when each LLMTextFrame entered the pipeline (before the TTS)."""

    def __init__(self) -> None:
        super().__init__()
        self.text_at: list[float] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMTextFrame):
            self.text_at.append(time.monotonic())
        await self.push_frame(frame, direction)


def _tts(url: str, **kw) -> OmniStreamTTSService:
    return OmniStreamTTSService(base_url=url, voice="ryan", language="english",
                                session_options=OPTS, **kw)


def _llm_frames(text: str, pause: float) -> list[Frame]:
    frames: list[Frame] = [LLMFullResponseStartFrame()]
    for p in llm_pieces(text):
        frames += [LLMTextFrame(p), SleepFrame(pause)]
    return frames + [LLMFullResponseEndFrame()]


async def _whole(url: str, text: str, voice: str = "ryan") -> np.ndarray:
    """The reference: the whole text as one piece of one continuous turn."""
    async with SpeechSession(url, config=dict(voice=voice, language="english", **OPTS)) as s:
        await s.send_text(text, "ref")
        await s.end("ref")
        parts = []
        async for ev in s.events():
            if isinstance(ev, Audio):
                parts.append(ev.pcm)
            elif isinstance(ev, ContextDone):
                break
    return np.frombuffer(b"".join(parts), dtype="<i2")


@pytest.fixture(scope="module")
def url(agents_server):
    return agents_server


@pytest.mark.parametrize("model", ["gpt-4o-mini-tts", "served"])
def test_unmodified_openai_tts_service_speaks(url, model):
    """Pipecat's own OpenAITTSService, only base_url and api key changed: its default model
    name, or the served one, and an OpenAI voice name."""
    async def main():
        if model == "served":
            import aiohttp
            async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
                name = (await r.json())["data"][0]["id"]
            settings = OpenAITTSService.Settings(model=name, voice="alloy")
        else:
            settings = OpenAITTSService.Settings(voice="alloy")
        tts = OpenAITTSService(api_key="not-needed", base_url=url + "/v1", settings=settings)
        rec = Recorder()
        down, up = await run_test(Pipeline([tts, rec]),
                                  frames_to_send=[TTSSpeakFrame("Hello there. Second line.")])
        return rec, up

    rec, up = run_async(main(), timeout=120)
    audio = rec.of(TTSAudioRawFrame)
    assert audio and all(f.sample_rate == 24000 and f.num_channels == 1 for _, f in audio)
    assert len(rec.pcm()) > 24000 * 0.08  # at least one frame of speech
    assert rec.of(TTSStartedFrame) and rec.of(TTSStoppedFrame)
    assert not [f for f in up if isinstance(f, ErrorFrame)], up


def test_llm_tokens_stream_into_one_turn_with_the_whole_texts_speech(url):
    """Tokens dripped at LLM speed: one turn, started/stopped once, first audio before the
    last token, and the speech of the whole text sent at once (greedy)."""
    async def main():
        ref = await _whole(url, TEXT)
        stamp, rec = Stamp(), Recorder()
        await run_test(Pipeline([stamp, _tts(url), rec]),
                       frames_to_send=_llm_frames(TEXT, 0.04))
        return ref, stamp, rec

    ref, stamp, rec = run_async(main(), timeout=120)
    same_speech(rec.pcm(), ref)
    assert len(rec.of(TTSStartedFrame)) == 1 and len(rec.of(TTSStoppedFrame)) == 1
    (t_start, started), = rec.of(TTSStartedFrame)
    ctx = started.context_id
    assert all(f.context_id == ctx for _, f in rec.of(TTSAudioRawFrame))
    assert all(f.sample_rate == 24000 for _, f in rec.of(TTSAudioRawFrame))
    first_audio = rec.of(TTSAudioRawFrame)[0][0]
    assert first_audio < stamp.text_at[-1], "audio only began after the whole text was written"
    assert rec.of(TTSStoppedFrame)[0][0] > rec.of(TTSAudioRawFrame)[-1][0]


def test_barge_in_cancels_the_turn_on_the_server_and_the_session_goes_on(url):
    """An InterruptionFrame mid-turn: no audio of the turn reaches the pipeline after it, the
    server stops the stream as cancelled (its slot is free while the pipeline runs on), and
    the next turn on the same service is spoken."""
    async def main():
        import aiohttp
        long_text = " ".join(["This reply is long enough to still be speaking."] * 6)
        tts = OmniStreamTTSService(base_url=url, voice="ryan", language="english",
                                   session_options=dict(greedy=True, max_new_tokens=500))
        rec = Recorder()
        slots: dict = {}
        heard = asyncio.Event()

        class Heard(Recorder):
            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if isinstance(frame, TTSAudioRawFrame):
                    heard.set()

        class Gate(FrameProcessor):
            """Holds the interruption until the turn's audio is flowing (mid-utterance)."""

            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if isinstance(frame, InterruptionFrame):
                    await asyncio.wait_for(heard.wait(), 60)
                await self.push_frame(frame, direction)

        rec = Heard()

        class Probe(FrameProcessor):
            """After the interruption: the server's streams once it has freed the slot."""

            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if isinstance(frame, TTSSpeakFrame) and "slots" not in slots:
                    async with aiohttp.ClientSession() as s:
                        slots["after"] = await wait_backend(
                            s, url, lambda st: st["active_streams"] == 0, timeout=10)
                await self.push_frame(frame, direction)

        before = await _cancelled(url)
        frames = [LLMFullResponseStartFrame(), LLMTextFrame(long_text), SleepFrame(0.05),
                  InterruptionFrame(), SleepFrame(0.3), TTSSpeakFrame("Next turn.")]
        await run_test(Pipeline([Gate(), Probe(), tts, rec]), frames_to_send=frames)
        return rec, before, slots, await _cancelled(url)

    rec, before, slots, after = run_async(main(), timeout=120)
    started = rec.of(TTSStartedFrame)
    assert len(started) == 2, [type(f).__name__ for _, f in rec.frames]
    first_ctx, second_ctx = started[0][1].context_id, started[1][1].context_id
    (t_int, _), = rec.of(InterruptionFrame)
    first_audio = [t for t, f in rec.of(TTSAudioRawFrame) if f.context_id == first_ctx]
    assert first_audio and max(first_audio) < t_int, "audio of the cancelled turn came after it"
    assert [f for _, f in rec.of(TTSAudioRawFrame) if f.context_id == second_ctx]
    assert slots["after"]["active_streams"] == 0 and slots["after"]["slots_free"] == 2
    assert after == before + 1  # stopped by input.cancel, not by a disconnect


async def _cancelled(url: str) -> int:
    """The server's count of WebSocket streams stopped by input.cancel."""
    import re

    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(r'^omni_stream_streams_total\{endpoint="ws",outcome="cancelled"\} (\S+)$',
                  text, re.M)
    return int(float(m.group(1))) if m else 0


class _Proxy:
    """A TCP forwarder to the server whose connections can be cut (a dropped socket)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.writers: list[asyncio.StreamWriter] = []
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_w]

        async def pipe(r, w):
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def cut(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut()
        self.server.close()


def test_a_dropped_socket_reconnects_and_the_next_turn_is_spoken(url):
    async def main():
        proxy = _Proxy(int(url.rsplit(":", 1)[1]))
        purl = await proxy.start()
        tts = _tts(purl)
        rec = Recorder()
        errors: list = []

        class Cut(FrameProcessor):
            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if isinstance(frame, ErrorFrame):
                    errors.append(frame)
                if isinstance(frame, LLMTextFrame) and frame.text == "CUT":
                    proxy.cut()
                    return
                await self.push_frame(frame, direction)

        frames = [TTSSpeakFrame("Before the drop."), SleepFrame(1.0), LLMTextFrame("CUT"),
                  SleepFrame(1.0), TTSSpeakFrame("After the drop.")]
        await run_test(Pipeline([Cut(), tts, rec]), frames_to_send=frames)
        await proxy.close()
        return rec, proxy.connections

    rec, connections = run_async(main(), timeout=120)
    assert connections == 2  # the first session, and the one it reconnected with
    stopped = rec.of(TTSStoppedFrame)
    spoken = {f.context_id for _, f in rec.of(TTSAudioRawFrame)}
    assert len(rec.of(TTSStartedFrame)) == 2 and len(stopped) == 2
    assert {f.context_id for _, f in stopped} == spoken  # both turns spoke


def test_refused_voice_is_an_error_frame_not_a_hang(url):
    async def main():
        tts = OmniStreamTTSService(base_url=url, voice="nobody-has-this-voice",
                                   reconnect_attempts=1)
        return await run_test(tts, frames_to_send=[TTSSpeakFrame("Hello.")])

    down, up = run_async(main(), timeout=60)
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and "nobody-has-this-voice" in errors[0].error
    assert not [f for f in down if isinstance(f, TTSAudioRawFrame)]


def test_sample_rate_other_than_24k_is_refused():
    with pytest.raises(ValueError, match="24000 Hz"):
        OmniStreamTTSService(base_url="http://127.0.0.1:1", sample_rate=16000)


def test_a_cloned_voice_by_name(agents_base_server):
    """A voice uploaded to a Base model's server (POST /v1/audio/voices), named in the
    service's voice: tokens dripped in speak what the same voice speaks for the whole text."""
    url, name = agents_base_server, "pc-narrator"

    async def main():
        async with uploaded_voice(url, name):
            ref = await _whole(url, TEXT, voice=name)
            rec = Recorder()
            tts = OmniStreamTTSService(base_url=url, voice=name, language="english",
                                       session_options=OPTS)
            await run_test(Pipeline([tts, rec]), frames_to_send=_llm_frames(TEXT, 0.02))
        return ref, rec

    ref, rec = run_async(main(), timeout=180)
    same_speech(rec.pcm(), ref)
    assert len(rec.of(TTSStartedFrame)) == 1 and len(rec.of(TTSStoppedFrame)) == 1
