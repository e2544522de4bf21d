"""POST /v1/audio/speech and the plain routes, over a real socket, against FakeBackend."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import struct

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from aiohttp import web

from omni_stream.server.app import create_app
from omni_stream.server.audio import supported_formats, to_s16le
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.server.fake_backend import FakeBackend, chunk_sizes, expected_frames, fake_audio
from omni_stream.server.metrics import observe_step
from omni_stream.server.testing import post_speech as post
from omni_stream.server.testing import run_async as arun
from omni_stream.server.testing import backend_stats, running_server, served_here, wait_backend

# every test here runs against the single server and against the cluster entry (conftest)
pytestmark = pytest.mark.usefixtures("api_entry")

BYTES_PER_FRAME = 1920 * 2  # s16le
TEXT = "The quick brown fox jumps over the lazy dog."  # 44 chars -> 12 frames
LONG_TEXT = "word " * 200  # 251 frames: ~5 s at 20 ms per frame, in 34 chunks


def sse_events(body: bytes) -> list[dict]:
    records = [r for r in body.decode().split("\n\n") if r.strip()]
    assert all(r.startswith("data: ") for r in records), records[:2]
    return [json.loads(r[len("data: "):]) for r in records]


class HeldAfterFirstChunk(FakeBackend):
    """A FakeBackend that makes nothing past a stream's first chunk until ``go`` is set: what a
    client holds by then was written before the rest of its stream existed. ``chunks_made``
    counts the chunks handed to the server (for one stream at a time)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.go = asyncio.Event()
        self.chunks_made = 0

    async def stream(self, job):
        async for chunk in super().stream(job):
            if chunk.frames:
                self.chunks_made += 1
            yield chunk
            if self.chunks_made == 1:
                await self.go.wait()


# --- streaming formats --------------------------------------------------------------------------
def test_streamed_pcm_is_chunked_byte_exact_and_first_audio_comes_before_the_rest(api_entry):
    async def main():
        # on the single server the backend holds the stream after its first chunk until the
        # client has it; a cluster replica is a copy that no test event reaches, so there the
        # stream is paced (1.2 s) and must still be running when the first audio arrives
        backend = (HeldAfterFirstChunk() if api_entry == "direct"
                   else FakeBackend(frame_delay=0.1))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/audio/speech", json={
                    "model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "pcm",
                    "seed": 7}) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "audio/pcm"
                assert r.headers["Transfer-Encoding"] == "chunked"
                assert r.headers["X-Request-Id"].startswith("speech-")
                first = await asyncio.wait_for(r.content.readany(), 30)
                during = await backend_stats(s, url)
                if served_here(backend):
                    assert backend.chunks_made == 1  # the rest was not made yet
                    backend.go.set()
                body = first + await r.read()
        frames = expected_frames(TEXT)
        assert len(body) == frames * BYTES_PER_FRAME
        # the first chunk (1 frame) is written before the stream ends (ordering, not timing)
        assert 0 < len(first) < len(body) and during["active_streams"] == 1, (len(first), during)
        # streamed == one-pass: the chunking is invisible in the bytes
        assert body == to_s16le(fake_audio(7, 0, frames * 1920))
        if served_here(backend):  # the request as it reached the backend
            job = backend.jobs[0]
            assert job.voice == "vivian" and job.seed == 7 and job.text == TEXT

    arun(main())


def test_streamed_wav_has_one_header_with_placeholder_sizes():
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            status, headers, body = await post(s, url, {"input": TEXT, "response_format": "wav"})
        assert status == 200 and headers["Content-Type"] == "audio/wav"
        assert headers["Transfer-Encoding"] == "chunked"
        assert body.count(b"RIFF") == 1 and body.count(b"WAVE") == 1 and body[:4] == b"RIFF"
        riff_size, = struct.unpack("<I", body[4:8])
        data_tag, data_size = struct.unpack("<4sI", body[36:44])
        assert data_tag == b"data" and riff_size == data_size == 0xFFFFFFFF
        frames = expected_frames(TEXT)
        assert len(body) - 44 == frames * BYTES_PER_FRAME
        audio, sr = sf.read(io.BytesIO(body), dtype="float32")  # players accept the placeholder
        assert sr == 24000 and len(audio) == frames * 1920

    arun(main())


def test_non_streamed_wav_has_exact_sizes():
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            status, headers, body = await post(
                s, url, {"input": TEXT, "response_format": "wav", "stream": False})
        assert status == 200 and "Transfer-Encoding" not in headers
        assert int(headers["Content-Length"]) == len(body)
        frames = expected_frames(TEXT)
        riff_size, = struct.unpack("<I", body[4:8])
        data_size, = struct.unpack("<I", body[40:44])
        assert data_size == frames * BYTES_PER_FRAME == len(body) - 44 and riff_size == 36 + data_size
        assert headers["X-Usage-Output-Tokens"] == str(frames)
        assert headers["X-Finish-Reason"] == "stop"

    arun(main())


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_whole_file_formats_decode(fmt):
    if fmt not in supported_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")

    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": TEXT, "response_format": fmt})

    status, headers, body = arun(main())
    assert status == 200 and headers["Content-Type"] == supported_formats()[fmt].content_type
    audio, sr = sf.read(io.BytesIO(body))
    assert sr == 24000 and abs(len(audio) - expected_frames(TEXT) * 1920) <= 2048  # codec padding


def test_default_format_is_openai_mp3_when_available():
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": TEXT})

    status, headers, _ = arun(main())
    assert status == 200
    assert headers["Content-Type"] == ("audio/mpeg" if "mp3" in supported_formats() else "audio/wav")


def test_sse_deltas_and_done_with_usage():
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": TEXT, "stream_format": "sse", "seed": 3})

    status, headers, body = arun(main())
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 3 and all(e["type"] == "speech.audio.delta" for e in deltas)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    frames = expected_frames(TEXT)
    assert pcm == to_s16le(fake_audio(3, 0, frames * 1920))
    assert done == {"type": "speech.audio.done", "finish_reason": "stop",
                    "usage": {"input_tokens": len(TEXT), "output_tokens": frames,
                              "total_tokens": len(TEXT) + frames}}


@pytest.mark.parametrize("fmt", sorted(supported_formats()))
def test_sse_deltas_carry_the_requested_format_as_a_stream_of_its_bytes(fmt):
    """stream_format sse with any response_format (OpenAI's SDKs ask for mp3 by default): the
    deltas, joined, are one file of that format holding the stream's audio; lossless
    formats hold exactly its samples."""
    import io

    import soundfile as sf

    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": TEXT, "stream_format": "sse", "seed": 3,
                                       "response_format": fmt})

    status, headers, body = arun(main())
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1]["type"] == "speech.audio.done"
    deltas = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert len(deltas) >= 2 and all(deltas)
    data = b"".join(deltas)
    want = fake_audio(3, 0, expected_frames(TEXT) * 1920)
    if fmt == "pcm":
        assert data == to_s16le(want)
        return
    # decoded as a stream (the way a player reads it), not as a seekable file: a streamed
    # file's header cannot know the length
    av = pytest.importorskip("av")
    frames = list(av.open(io.BytesIO(data)).decode(audio=0))
    rate = frames[0].sample_rate
    audio = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    if fmt in ("wav", "flac"):  # lossless s16: the samples themselves
        assert rate == 24000
        assert np.array_equal(audio.astype(np.int16), np.frombuffer(to_s16le(want), "<i2"))
    else:  # lossy: the duration (within the codec's delay and padding) and the energy
        seconds = len(audio) / rate
        assert abs(seconds - len(want) / 24000) <= 0.1, (seconds, len(want) / 24000)
        level = np.std(audio.astype(np.float64) / (32768 if audio.dtype == np.int16 else 1))
        assert 0.5 < level / np.std(want) < 2.0


@pytest.mark.parametrize("cap, reason", [(expected_frames(TEXT), "stop"),
                                         (expected_frames(TEXT) - 1, "length"), (3, "length")])
def test_sse_done_says_length_when_max_new_tokens_cut_the_speech_short(cap, reason):
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": TEXT, "stream_format": "sse", "seed": 3,
                                       "max_new_tokens": cap})

    status, _, body = arun(main())
    done = sse_events(body)[-1]
    assert status == 200 and done["type"] == "speech.audio.done"
    assert done["finish_reason"] == reason and done["usage"]["output_tokens"] == cap


@pytest.mark.parametrize("cap, reason", [(None, "stop"), (2, "length")])
def test_whole_file_carries_finish_reason_header(cap, reason):
    async def main():
        async with running_server(FakeBackend()) as url, aiohttp.ClientSession() as s:
            return await post(s, url, {"input": TEXT, "response_format": "wav", "stream": False,
                                       **({"max_new_tokens": cap} if cap else {})})

    status, headers, body = arun(main())
    assert status == 200 and headers["X-Finish-Reason"] == reason
    assert len(body) - 44 == (cap or expected_frames(TEXT)) * BYTES_PER_FRAME


def test_sse_error_event_when_backend_fails_mid_stream():
    async def main():
        backend = FakeBackend(fail_after_frames=3)
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            result = await post(s, url, {"input": TEXT, "stream_format": "sse"})
            return result, backend.stats()

    (status, _, body), stats = arun(main())
    assert status == 200
    events = sse_events(body)
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "server_error"
    assert not any(e["type"] == "speech.audio.done" for e in events)
    assert stats["active_streams"] == 0


def test_audio_stream_is_aborted_not_ended_when_backend_fails_mid_stream():
    async def main():
        async with running_server(FakeBackend(fail_after_frames=3)) as url, \
                aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/audio/speech",
                              json={"input": TEXT, "response_format": "pcm"}) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()

    arun(main())


def test_extensions_reach_the_job():
    async def main():
        backend = FakeBackend()
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            status, _, body = await post(s, url, {
                "input": TEXT, "response_format": "pcm", "voice": {"id": "Serena"},
                "language": "English", "seed": 11, "max_new_tokens": 5,
                "initial_codec_chunk_frames": 2, "do_sample": False,
                "instructions": "  calm  ", "model": "omni-stream-fake"})
        assert status == 200 and len(body) == 5 * BYTES_PER_FRAME
        if not served_here(backend):
            return
        job = backend.jobs[0]
        assert (job.voice, job.language, job.seed, job.max_frames, job.initial_chunk_frames,
                job.greedy, job.instructions) == ("serena", "english", 11, 5, 2, True, "calm")

    arun(main())


@pytest.mark.direct_only("the fake backend itself, no server")
def test_fake_backend_chunks_follow_the_one_ramp():
    """FakeBackend cuts its chunks with ChunkPolicy.ramp (the real stages' growth rule), the
    request's first chunk via starting_at, the last chunk cut to what is left."""
    assert chunk_sizes(20, ChunkPolicy(first=1, steady=8)) == [1, 2, 4, 8, 5]
    assert chunk_sizes(20, ChunkPolicy(first=1, steady=8).starting_at(3)) == [3, 6, 8, 3]
    assert chunk_sizes(7, ChunkPolicy(first=1, steady=4).starting_at(6)) == [6, 1]
    p = ChunkPolicy(first=2, steady=8, growth=1.5)
    assert chunk_sizes(40, p)[:5] == [p.ramp(i) for i in range(5)] == [2, 3, 4, 6, 8]

    async def main():
        backend = FakeBackend(steady_chunk_frames=4)
        got = [c.frames async for c in backend_stream(backend, TEXT, initial_chunk_frames=2)]
        return got

    async def backend_stream(backend, text, **kw):
        from omni_stream.contract import SpeechJob

        await backend.start()
        async for chunk in backend.stream(SpeechJob(text=text, request_id="r", **kw)):
            yield chunk

    frames = arun(main())
    assert frames[:-1] == chunk_sizes(expected_frames(TEXT), ChunkPolicy(first=2, steady=4))
    assert frames[-1] == 0  # the final (empty) chunk


def test_openai_voice_aliases_map_in_documented_order():
    async def main():
        backend = FakeBackend(voices=("a", "b", "c"))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            for v in ("alloy", "ash", "ballad", "coral", "CEDAR"):
                status, _, _ = await post(s, url, {"input": "hi", "voice": v,
                                                   "response_format": "pcm"})
                assert status == 200
            async with s.get(url + "/v1/audio/voices") as r:
                listing = await r.json()
        if served_here(backend):
            assert [j.voice for j in backend.jobs] == ["a", "b", "c", "a", "a"]  # cedar: 13th
        assert listing["voices"] == ["a", "b", "c"]
        assert listing["openai_aliases"]["coral"] == "a"

    arun(main())


# --- observability ------------------------------------------------------------------------------
def test_health_models_and_metrics():
    backend = FakeBackend(max_streams=4)

    async def main():
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            await post(s, url, {"input": TEXT, "response_format": "pcm"})
            await post(s, url, {"input": ""})
            observe_step("talker_step", 0.004)
            async with s.get(url + "/health") as r:
                health = (r.status, await r.json())
            async with s.get(url + "/v1/models/tts-1") as r:
                model = (r.status, await r.json())
            async with s.get(url + "/v1/models/other") as r:
                missing = r.status
            async with s.get(url + "/metrics") as r:
                return health, model, missing, r.status, r.headers["Content-Type"], await r.text()

    health, model, missing, status, ctype, text = arun(main())
    assert health[0] == 200 and health[1]["status"] == "ok"
    assert health[1]["model"] == "omni-stream-fake"
    # the capacity the backend reports (the fake: its slots, RTF from its per-frame sleep)
    assert health[1]["capacity_streams"] == 4 and health[1]["rtf_estimate"] == 0.0
    assert model[0] == 200 and model[1]["id"] == "omni-stream-fake" and missing == 404
    assert status == 200 and ctype.startswith("text/plain")
    if not served_here(backend):  # the cluster entry: every replica's samples, labelled
        text = re.sub(r'\{replica="[^"]*",?', "{", text).replace("{}", "")
        assert 'phase="talker_step"' not in text  # observed in this process, not a replica's
    for name in ("omni_stream_requests_total", "omni_stream_time_to_first_audio_seconds_bucket",
                 "omni_stream_active_streams", "omni_stream_streams_total",
                 "omni_stream_audio_seconds_total", "omni_stream_ws_sessions",
                 "omni_stream_backend_active_streams", "omni_stream_backend_queue_depth",
                 "omni_stream_backend_slots_total 4.0", 'omni_stream_step_seconds_bucket{le=',
                 "omni_stream_capacity_streams 4.0", "omni_stream_rtf_estimate 0.0",
                 'phase="server.encode_write"'):
        assert name in text, name
    if served_here(backend):
        assert 'phase="talker_step"' in text
    assert 'omni_stream_requests_total{route="/v1/audio/speech",status="200"} 1.0' in text
    assert 'omni_stream_requests_total{route="/v1/audio/speech",status="400"} 1.0' in text
    assert 'omni_stream_streams_total{endpoint="audio",outcome="completed"} 1.0' in text
    assert 'omni_stream_time_to_first_audio_seconds_count{endpoint="audio"} 1.0' in text


def test_fake_backend_satisfies_the_protocol():
    from omni_stream.contract import Backend

    assert isinstance(FakeBackend(), Backend)


@pytest.mark.direct_only("the aiohttp runner's lifecycle")
def test_runner_cleanup_closes_the_backend():
    async def main():
        backend = FakeBackend()
        app = create_app(backend)
        runner = web.AppRunner(app)
        await runner.setup()
        assert backend.running
        await runner.cleanup()
        return backend.running

    assert arun(main()) is False


# --- concurrency and cancellation ---------------------------------------------------------------
def test_eight_concurrent_streams_complete_with_correct_lengths():
    async def main():
        backend = FakeBackend(frame_delay=0.01)
        peak = 0

        async def watch(s, url):
            nonlocal peak
            while True:
                stats = await backend_stats(s, url)
                peak = max(peak, int(stats["active_streams"]))
                await asyncio.sleep(0.002)

        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            w = asyncio.create_task(watch(s, url))
            texts = [TEXT[: 8 + 4 * i] for i in range(8)]
            fmts = ["pcm", "wav"] * 4
            results = await asyncio.gather(*(
                post(s, url, {"input": t, "response_format": f, "seed": i})
                for i, (t, f) in enumerate(zip(texts, fmts))))
            w.cancel()
            stats = await wait_backend(s, url, lambda st: st["active_streams"] == 0)
        for i, (t, f, (status, _, body)) in enumerate(zip(texts, fmts, results)):
            header = 44 if f == "wav" else 0
            assert status == 200
            assert body[header:] == to_s16le(fake_audio(i, 0, expected_frames(t) * 1920))
        return peak, stats

    peak, stats = arun(main())
    assert peak >= 4, peak  # they really ran side by side
    assert stats["active_streams"] == 0


async def _disconnect_mid_stream(runner_factory, release_after_disconnect: bool
                                 ) -> tuple[dict, int]:
    """A long stream (251 frames, 34 chunks) held after its first chunk; the client drops the
    connection. Returns the backend's stats once the stream is freed and the number of chunks
    the backend had made by then. ``release_after_disconnect`` lets the backend go on after
    the disconnect (else it stays held: only a cancellation can free the stream)."""
    backend = HeldAfterFirstChunk(frame_delay=0.02)
    app = create_app(backend)
    runner = runner_factory(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/audio/speech",
                             json={"input": LONG_TEXT, "response_format": "pcm"})
            assert r.status == 200
            assert await r.content.readany()
            assert backend.active == 1
            r.close()  # drop the connection mid-stream
        if release_after_disconnect:
            backend.go.set()
        for _ in range(2000):  # a liveness bound (10 s), not a latency claim
            if not backend.active:
                break
            await asyncio.sleep(0.005)
        assert not backend.active, "the stream was not freed after the client disconnected"
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as m:
            text = await m.text()
        assert 'omni_stream_active_streams{endpoint="audio"} 0.0' in text
        assert 'omni_stream_streams_total{endpoint="audio",outcome="disconnected"} 1.0' in text
        return backend.stats() | {"completed": backend.completed_total}, backend.chunks_made
    finally:
        backend.go.set()  # a stream still held (a failed test) must not hold up the clean-up
        await runner.cleanup()


LONG_CHUNKS = len(chunk_sizes(expected_frames(LONG_TEXT), ChunkPolicy(first=1, steady=8)))


@pytest.mark.direct_only("runs its own aiohttp runner")
def test_disconnect_mid_stream_frees_the_backend_stream_at_once():
    from omni_stream.server.app import make_runner

    stats, made = arun(_disconnect_mid_stream(make_runner, release_after_disconnect=False))
    assert stats["active_streams"] == 0 and stats["streams_cancelled_total"] == 1
    assert stats["completed"] == 0
    # freed while the backend was still held after its first chunk: cancelled on disconnect,
    # without making one more chunk (let alone running to its end)
    assert made == 1, made


@pytest.mark.direct_only("runs its own aiohttp runner")
def test_disconnect_is_noticed_at_next_write_without_handler_cancellation():
    stats, made = arun(_disconnect_mid_stream(web.AppRunner, release_after_disconnect=True))
    assert stats["active_streams"] == 0 and stats["streams_cancelled_total"] == 1
    assert stats["completed"] == 0
    # a plain runner notices at a write after the disconnect (the first, or the one after it
    # when the kernel still took the first): a chunk or two more, not the stream's 34
    assert 2 <= made <= 3 < LONG_CHUNKS, (made, LONG_CHUNKS)
