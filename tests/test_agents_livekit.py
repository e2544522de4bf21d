"""LiveKit Agents against the real server on the tiny model, headless (plain asyncio, no room):
the unmodified OpenAI plugin (SSE and raw pcm paths, and behind a StreamAdapter), and
``omni_stream.integrations.livekit.TTS``: synthesize() speaks what HTTP speech does, stream()
with an LLM's tokens dripped in speaks the whole text's speech with audio before the text ends,
segments are turns, closing a stream frees its slot, refusals are APIErrors, and a cloned
voice by name."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import numpy as np
import pytest

pytest.importorskip("livekit.agents")

from livekit.agents import (APIConnectionError, APIConnectOptions, APIError,  # noqa: E402
                            APIStatusError, tokenize)
from livekit.agents import tts as lk_tts  # noqa: E402

from omni_stream.integrations.livekit import TTS  # noqa: E402
from omni_stream.server.testing import (backend_stats, run_async,  # noqa: E402
                                        wait_backend)
from speech_checks import llm_pieces, same_speech, uploaded_voice  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TEXT = "Hello world, this is a reply from a language model."
OTHER = "And here is a second turn."
OPTS = dict(greedy=True, max_new_tokens=48)  # with voice ryan, language english
NO_RETRY = APIConnectOptions(max_retry=0, timeout=10.0)


@pytest.fixture(scope="module")
def url(agents_server):
    return agents_server


def _tts(url: str, **kw) -> TTS:
    kw.setdefault("voice", "ryan")
    return TTS(base_url=url, language="english", session_options=OPTS, **kw)


def _pcm(frames) -> np.ndarray:
    return np.frombuffer(b"".join(bytes(f.data) for f in frames), dtype="<i2")


def _speech(events: list[lk_tts.SynthesizedAudio]) -> np.ndarray:
    """The audio of one segment's events, less the 10 ms of zeros LiveKit's AudioEmitter sends
    as the final frame when its flush timer already released the held-back tail (audio
    arriving slower than it plays, e.g. on a loaded machine): framework padding, not speech."""
    frames = [ev.frame for ev in events]
    if events and events[-1].is_final and frames[-1].samples_per_channel == 240 \
            and not _pcm(frames[-1:]).any():
        frames = frames[:-1]
    return _pcm(frames)


async def _http_speech(url: str, text: str, voice: str = "ryan") -> np.ndarray:
    body = dict(input=text, voice=voice, language="english", response_format="pcm", **OPTS)
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        return np.frombuffer(await r.read(), dtype="<i2")


async def _streamed(tts: TTS, text: str) -> list[lk_tts.SynthesizedAudio]:
    """The whole text pushed at once into one stream: the reference for dripped text."""
    async with tts.stream() as s:
        s.push_text(text)
        s.end_input()
        return [ev async for ev in s]


# ---------------------------------------------------------------- the official OpenAI plugin
@pytest.mark.parametrize("model,response_format", [
    ("tts-1", None), ("tts-1", "pcm"), ("gpt-4o-mini-tts", "pcm"),
    ("gpt-4o-mini-tts", None),  # the plugin's defaults: SSE deltas of an mp3 stream
])
def test_unmodified_openai_plugin_speaks(url, model, response_format):
    """livekit-plugins-openai's TTS, only base_url and api key changed: stream_format "sse"
    (gpt-4o-mini-tts) and raw audio (tts-1), an OpenAI voice name."""
    from livekit.plugins import openai as lk_openai

    async def main():
        kw = {} if response_format is None else dict(response_format=response_format)
        tts = lk_openai.TTS(base_url=url + "/v1", api_key="x", model=model, voice="alloy", **kw)
        try:
            return await tts.synthesize("Hello there.", conn_options=NO_RETRY).collect()
        finally:
            await tts.aclose()

    frame = run_async(main(), timeout=120)
    assert frame.sample_rate == 24000 and frame.num_channels == 1
    assert frame.samples_per_channel > 1920  # more than one 80 ms codec frame


def test_openai_plugin_behind_a_stream_adapter_speaks_each_sentence(url):
    from livekit.plugins import openai as lk_openai

    sentences = ["Hello there, this is the first sentence.", "And this one is the second."]

    async def main():
        oai = lk_openai.TTS(base_url=url + "/v1", api_key="x", model="tts-1", voice="alloy",
                            response_format="pcm")
        asked: list[str] = []
        synthesize = oai.synthesize

        def spy(text: str, **kw):
            asked.append(text)
            return synthesize(text, **kw)

        oai.synthesize = spy  # type: ignore[method-assign]
        adapter = lk_tts.StreamAdapter(tts=oai,
                                       sentence_tokenizer=tokenize.basic.SentenceTokenizer())
        try:
            async with adapter.stream() as s:
                for p in llm_pieces(" ".join(sentences)):
                    s.push_text(p)
                s.end_input()
                events = [ev async for ev in s]
        finally:
            await adapter.aclose()
            await oai.aclose()
        return asked, events

    asked, events = run_async(main(), timeout=120)
    assert [a.strip() for a in asked] == sentences
    assert len(_pcm(ev.frame for ev in events)) > 2 * 1920
    assert all(ev.frame.sample_rate == 24000 for ev in events)


# ---------------------------------------------------------------- omni-stream's LiveKit TTS
def test_synthesize_is_the_http_speech_of_the_text(url):
    async def main():
        ref = await _http_speech(url, TEXT)
        tts = _tts(url)
        try:
            events = [ev async for ev in tts.synthesize(TEXT)]
        finally:
            await tts.aclose()
        return ref, events

    ref, events = run_async(main(), timeout=120)
    assert all(ev.frame.sample_rate == 24000 and ev.frame.num_channels == 1 for ev in events)
    same_speech(_speech(events), ref)
    assert isinstance(_tts(url), lk_tts.TTS) and _tts(url).capabilities.streaming


def test_stream_speaks_dripped_tokens_as_the_whole_text_and_starts_before_it_ends(url):
    """Tokens pushed at LLM speed: one segment, its first audio before the last token, and
    the speech of the whole text sent at once (greedy)."""
    pieces = llm_pieces(TEXT)
    assert "".join(pieces) == TEXT

    async def main():
        tts = _tts(url)
        try:
            ref = await _streamed(tts, TEXT)
            pushed: list[float] = []
            got: list[tuple[float, lk_tts.SynthesizedAudio]] = []
            async with tts.stream() as s:
                async def llm():
                    for p in pieces:
                        s.push_text(p)
                        pushed.append(time.monotonic())
                        await asyncio.sleep(0.04)
                    s.end_input()

                feeder = asyncio.create_task(llm())
                async for ev in s:
                    got.append((time.monotonic(), ev))
                await feeder
        finally:
            await tts.aclose()
        return ref, pushed, got

    ref, pushed, got = run_async(main(), timeout=120)
    events = [ev for _, ev in got]
    same_speech(_speech(events), _speech(ref))
    assert len({ev.segment_id for ev in events}) == 1
    assert [ev.is_final for ev in events].count(True) == 1 and events[-1].is_final
    assert got[0][0] < pushed[-1], "audio only began after the whole text was written"


def _push_segments(stream: lk_tts.SynthesizeStream, texts: list[str]) -> None:
    """Several segments into one stream, as push_text/flush gave them before livekit-agents
    deprecated it (1.8 drops text pushed after a flush): straight into the input channel
    that the stream's _run reads."""
    for text in texts:
        for p in llm_pieces(text):
            stream._input_ch.send_nowait(p)
        stream._input_ch.send_nowait(stream._FlushSentinel())
    stream._input_ch.close()


def test_each_segment_is_one_turn_spoken_as_its_text_alone(url):
    async def main():
        tts = _tts(url)
        try:
            alone = [_speech(await _streamed(tts, t)) for t in (TEXT, OTHER)]
            async with tts.stream() as s:
                _push_segments(s, [TEXT, OTHER])
                events = [ev async for ev in s]
            # the public API of livekit-agents 1.8: a second segment is dropped (with a
            # warning); the stream speaks the first and ends
            async with tts.stream() as s:
                s.push_text(TEXT)
                s.flush()
                s.push_text(OTHER)
                s.end_input()
                public = [ev async for ev in s]
        finally:
            await tts.aclose()
        return alone, events, public

    alone, events, public = run_async(main(), timeout=120)
    segments = list(dict.fromkeys(ev.segment_id for ev in events))
    assert len(segments) == 2
    for seg, ref in zip(segments, alone):
        seg_events = [ev for ev in events if ev.segment_id == seg]
        assert [ev.is_final for ev in seg_events].count(True) == 1 and seg_events[-1].is_final
        same_speech(_speech(seg_events), ref)
    assert len({ev.segment_id for ev in public}) == 1
    same_speech(_speech(public), alone[0])


def test_a_turn_the_model_ends_before_its_text_stays_one_segment(url):
    """max_new_tokens reached while the text is still coming: the server speaks the rest of
    the turn as further utterances with the same context id; LiveKit sees one segment that
    ends once the whole turn is over (context.done)."""
    async def main():
        tts = TTS(base_url=url, voice="ryan", language="english",
                  session_options=dict(greedy=True, max_new_tokens=3))
        try:
            async with tts.stream() as s:
                async def llm():
                    for p in llm_pieces(TEXT):
                        s.push_text(p)
                        await asyncio.sleep(0.04)
                    s.end_input()

                feeder = asyncio.create_task(llm())
                events = [ev async for ev in s]
                await feeder
        finally:
            await tts.aclose()
        return events

    events = run_async(main(), timeout=120)
    assert len({ev.segment_id for ev in events}) == 1
    assert [ev.is_final for ev in events].count(True) == 1 and events[-1].is_final
    assert len(_speech(events)) > 3 * 1920  # more than one utterance's cap of speech


async def _ws_counts(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(input.cancel events answered, WebSocket streams ended as cancelled) from /metrics."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()

    def value(pattern: str) -> float:
        m = re.search(pattern, text, re.M)
        return float(m.group(1)) if m else 0.0

    return (value(r"^omni_stream_ws_cancels_total (\S+)$"),
            value(r'^omni_stream_streams_total\{(?=[^}]*endpoint="ws")(?=[^}]*outcome="cancelled")'
                  r"[^}]*\} (\S+)$"))


def test_closing_a_stream_mid_utterance_frees_its_slot(url):
    """aclose() (what the agent does on barge-in) while the turn is spoken: the server gets
    input.cancel and stops the stream, its slot is free, and it speaks the next request."""
    async def main():
        async with aiohttp.ClientSession() as http:
            await wait_backend(http, url, lambda st: st["active_streams"] == 0, timeout=60)
            counts = await _ws_counts(http, url)
            tts = TTS(base_url=url, voice="ryan", language="english",
                      session_options=dict(greedy=True, max_new_tokens=500))
            try:
                s = tts.stream()
                s.push_text(TEXT)
                s.end_input()
                first = await asyncio.wait_for(s.__anext__(), 60)
                busy = await backend_stats(http, url)
                await s.aclose()
                idle = await wait_backend(http, url, lambda st: st["active_streams"] == 0,
                                          timeout=60)
                counts_after = await _ws_counts(http, url)
                for _ in range(600):  # the counters move just after the slot is freed
                    if counts_after[0] > counts[0] and counts_after[1] > counts[1]:
                        break
                    await asyncio.sleep(0.05)
                    counts_after = await _ws_counts(http, url)
                after = await _tts(url).synthesize(OTHER).collect()
            finally:
                await tts.aclose()
        return first, busy, idle, counts, counts_after, after

    first, busy, idle, counts, counts_after, after = run_async(main(), timeout=180)
    assert len(first.frame.data) > 0
    assert busy["active_streams"] >= 1 and idle["active_streams"] == 0
    # input.cancel reached the server and stopped the running stream (500 frames allowed)
    assert counts_after[0] - counts[0] >= 1, (counts, counts_after)
    assert counts_after[1] - counts[1] == 1
    assert after.samples_per_channel > 0


def test_refusals_are_api_errors_not_hangs(url):
    async def main():
        bad = _tts(url, voice="nobody")
        errors = []
        try:
            with pytest.raises(APIStatusError) as e:
                await bad.synthesize(TEXT, conn_options=NO_RETRY).collect()
            errors.append(e.value)
            with pytest.raises(APIStatusError) as e:
                async with bad.stream(conn_options=NO_RETRY) as s:
                    s.push_text(TEXT)
                    s.end_input()
                    async for _ in s:
                        pass
            errors.append(e.value)
        finally:
            await bad.aclose()
        gone = TTS(base_url="http://127.0.0.1:9/v1", voice="ryan")
        try:
            with pytest.raises(APIConnectionError):
                await gone.synthesize(TEXT, conn_options=NO_RETRY).collect()
            with pytest.raises(APIConnectionError):
                async with gone.stream(conn_options=NO_RETRY) as s:
                    s.push_text(TEXT)
                    s.end_input()
                    async for _ in s:
                        pass
        finally:
            await gone.aclose()
        return errors

    for err in run_async(main(), timeout=60):
        assert isinstance(err, APIError) and not err.retryable
        assert err.status_code == 400 and "unknown voice 'nobody'" in err.message


def test_update_options_applies_to_later_streams(url):
    async def main():
        tts = _tts(url, voice="nobody")
        try:
            tts.update_options(voice="ryan", language="en-US")
            assert tts._opts.language == "english"
            return [ev async for ev in tts.synthesize(OTHER)], await _streamed(tts, OTHER)
        finally:
            await tts.aclose()

    said, streamed = run_async(main(), timeout=120)
    assert len(_pcm(ev.frame for ev in said)) > 0 and len(_pcm(ev.frame for ev in streamed)) > 0


# ---------------------------------------------------------------- a cloned voice by name
def test_cloned_voice_by_name(agents_base_server):
    """A voice uploaded to a Base model's server, named in TTS(voice=...): synthesize() and
    stream() speak what HTTP speech with that voice does (a cloned voice streams its text on
    every path, so all three agree)."""
    url, name = agents_base_server, "lk-narrator"

    async def main():
        async with uploaded_voice(url, name):
            ref = await _http_speech(url, TEXT, voice=name)
            tts = _tts(url, voice=name)
            try:
                said = [ev async for ev in tts.synthesize(TEXT)]
                streamed = await _streamed(tts, TEXT)
            finally:
                await tts.aclose()
        return ref, said, streamed

    ref, said, streamed = run_async(main(), timeout=180)
    same_speech(_speech(said), ref)
    same_speech(_speech(streamed), ref)
