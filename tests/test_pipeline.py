"""End to end over a real socket: server + talker and codec stage processes on the tiny model."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time

import aiohttp
import numpy as np
import pytest

from omni_stream.orchestrator import PipelineBackend, PipelineSettings
from omni_stream.server.testing import running_server, run_async
from omni_stream.scheduling.chunking import ChunkPolicy
from tests.servers import tiny_settings

pytestmark = pytest.mark.timeout(600)

TEXT = "Hello world, this is a streaming test of the whole pipeline."


def _shm_segments(prefix: str = "omni-stream-") -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


def _settings(ck, **kw) -> PipelineSettings:
    return tiny_settings(ck, **{"max_streams": 4, "max_queue": 16, **kw})


def _synth_reference(ck, text, voice, seed, max_frames):
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    s = Synthesizer.from_path(ck)
    return s.synthesize(PromptRequest(text=text, language="english", speaker=voice),
                        SamplingParams(), seed=seed, max_frames=max_frames)


def _close_pcm(a: bytes, b: bytes) -> bool:
    """Same length and within 1 LSB: identical codes decoded with different (adaptive) chunkings
    differ only by float rounding."""
    x, y = np.frombuffer(a, dtype="<i2"), np.frombuffer(b, dtype="<i2")
    return len(x) == len(y) and (len(x) == 0 or int(np.abs(x.astype(int) - y.astype(int)).max()) <= 1)


async def _seeded_pcm(session, url, n: int, seed: int, frames: int) -> list[bytes]:
    """n different texts at once, request i seeded seed + i: their pcm bodies (all must be 200)."""
    results = await asyncio.gather(*[
        _speech(session, url, input=f"{TEXT} {i}", response_format="pcm", seed=seed + i,
                max_new_tokens=frames) for i in range(n)])
    assert all(r[0] == 200 for r in results), [r[0] for r in results]
    return [r[2] for r in results]


async def _speech(session, url, **body):
    body.setdefault("model", "qwen3-tts")
    body.setdefault("voice", "ryan")
    body.setdefault("language", "english")
    async with session.post(url + "/v1/audio/speech", json=body) as r:
        data = await r.read()
        return r.status, r.headers, data


def test_streamed_audio_equals_offline_synthesis(tiny_ckpt):
    frames = 24
    ref = _synth_reference(tiny_ckpt, TEXT, "ryan", 1234, frames)
    nframes = len(ref.codes)

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            st, _, pcm = await _speech(s, url, input=TEXT, response_format="pcm", seed=1234,
                                       max_new_tokens=frames)
            assert st == 200
            st2, _, pcm2 = await _speech(s, url, input=TEXT, response_format="pcm", seed=1234,
                                         max_new_tokens=frames)
            # SSE
            body = dict(model="qwen3-tts", input=TEXT, voice="ryan", language="english", seed=1234,
                        max_new_tokens=frames, response_format="pcm", stream_format="sse")
            async with s.post(url + "/v1/audio/speech", json=body) as r:
                assert r.status == 200
                raw = (await r.read()).decode()
            # codes over the WebSocket (client-side decoding mode)
            return pcm, pcm2, raw

    pcm, pcm2, raw = run_async(main(), timeout=300)
    audio = np.frombuffer(pcm, dtype="<i2")
    assert len(audio) == nframes * 1920
    expected = np.clip(ref.audio, -1, 1) * 32767.0
    assert np.abs(audio.astype(np.float64) - expected).max() <= 1.0 + 1e-6
    assert _close_pcm(pcm, pcm2)  # same seeded request on an idle server: same codes every time
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    done = [e for e in events if e["type"] == "speech.audio.done"]
    sse_pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert _close_pcm(sse_pcm, pcm) and len(done) == 1 and done[0]["usage"]["output_tokens"] > 0


def test_concurrency_cancellation_and_cleanup(tiny_ckpt):
    before = _shm_segments()

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt, max_streams=4))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            lengths = [6 + i for i in range(8)]
            results = await asyncio.gather(*[
                _speech(s, url, input=f"{TEXT} Number {i}.", response_format="pcm", seed=i,
                        max_new_tokens=n) for i, n in enumerate(lengths)])
            for (st, _, data), n in zip(results, lengths):
                assert st == 200
                # a stream may end early on eos, never late, and always on a frame boundary
                assert len(data) % (1920 * 2) == 0 and 0 < len(data) <= n * 1920 * 2
            segs_running = _shm_segments() - before
            assert len(segs_running) >= 2  # the server's rings exist while it runs
            # disconnect mid-stream: the slot comes back
            async with s.post(url + "/v1/audio/speech", json=dict(
                    model="qwen3-tts", input=TEXT * 3, voice="ryan", response_format="pcm",
                    max_new_tokens=250)) as r:
                assert r.status == 200
                await r.content.readexactly(1920 * 2)
                assert backend.stats()["active_streams"] == 1
            for _ in range(100):
                if backend.stats()["active_streams"] == 0 and backend.stats()["slots_free"] == 4:
                    break
                await asyncio.sleep(0.05)
            assert backend.stats()["active_streams"] == 0 and backend.stats()["slots_free"] == 4
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            assert "omni_stream_backend_slots_free 4.0" in text
            for _ in range(40):  # the talker pushes its timings every second
                if 'phase="talker.step"' in text:
                    break
                await asyncio.sleep(0.1)
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
            assert 'phase="talker.step"' in text  # stage timings reach the server's /metrics
            return segs_running

    segs = run_async(main(), timeout=400)
    time.sleep(0.5)
    assert not (segs & _shm_segments()), "a shared-memory segment outlived the server"


def test_stage_crash_fails_streams_fast_and_recovers(tiny_ckpt):
    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/audio/speech", json=dict(
                    model="qwen3-tts", input=TEXT * 3, voice="ryan", response_format="pcm",
                    max_new_tokens=250)) as r:
                assert r.status == 200
                await r.content.readexactly(1920 * 2)
                os.kill(backend.sup.pipe.talker.pid, signal.SIGKILL)
                got = 1920 * 2
                with pytest.raises(aiohttp.ClientPayloadError):
                    while data := await r.content.read(65536):
                        got += len(data)
                restarted = backend.sup.pipe is not None
            # failed fast: before the supervisor had the new stages up (ordering: it fails the
            # streams in flight first, then restarts, which takes seconds), and short of the
            # stream's 250 frames (it did not run on or hang until some timeout)
            assert not restarted, "the stream failed only after the stages were restarted"
            assert got < 250 * 1920 * 2, got
            # the server stays up and the next request succeeds (after the restart)
            for _ in range(200):
                if backend.sup.pipe is not None:
                    break
                await asyncio.sleep(0.1)
            st, _, data = await _speech(s, url, input="After the crash.", response_format="pcm",
                                        max_new_tokens=5)
            assert st == 200 and len(data) > 0
            assert backend.stats()["stage_restarts"] == 1

    run_async(main(), timeout=300)


def test_bad_input_does_not_disturb_running_stream(tiny_ckpt):
    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            long_req = asyncio.create_task(_speech(s, url, input=TEXT, response_format="pcm",
                                                   seed=5, max_new_tokens=30))
            await asyncio.sleep(0.2)
            bad = [
                dict(input=""), dict(input="hi", voice="nobody"), dict(input="hi", language="klingon"),
                dict(input="hi", response_format="ogg-vorbis"), dict(input="hi", model="other"),
                dict(input=123), dict(input="x" * 5000),
            ]
            for b in bad:
                st, _, body = await _speech(s, url, **b)
                assert 400 <= st < 500, (b, st)
                assert "error" in json.loads(body)
            async with s.post(url + "/v1/audio/speech", data=b"{not json",
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
            async with s.post(url + "/v1/audio/speech", data=b'{"input": "hi"}',
                              headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 415
            st, _, body = await _speech(s, url, input="bad\x00byte")
            assert st == 400 and json.loads(body)["error"]["code"] == "invalid_characters"
            st, _, data = await long_req
            assert st == 200
            ref = await _speech(s, url, input=TEXT, response_format="pcm", seed=5, max_new_tokens=30)
            assert _close_pcm(data, ref[2])

    run_async(main(), timeout=300)


def test_split_placement_gives_identical_audio(tiny_ckpt):
    """Talker and code predictor in separate processes: same seeded request, same samples."""
    async def main():
        out = {}
        for placement in ("split", "together"):
            backend = PipelineBackend(_settings(tiny_ckpt, placement=placement))
            async with running_server(backend) as url, aiohttp.ClientSession() as s:
                out[placement] = await _seeded_pcm(s, url, 2, seed=40, frames=12)
                if placement == "split":
                    assert backend.sup.pipe.cp is not None and backend.sup.pipe.cp.is_alive()
        assert all(_close_pcm(a, b) for a, b in zip(out["split"], out["together"]))

    run_async(main(), timeout=300)


def test_websocket_codec_frames_match_offline_codes(tiny_ckpt):
    """WS session with codec_frames: the frames equal what offline synthesis produces."""
    frames = 10
    text = "Codec frames for client side decoding."
    ref = _synth_reference(tiny_ckpt, text, "ryan", 77, frames)

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            async with s.ws_connect(url + "/v1/audio/speech/stream") as ws:
                await ws.send_json(dict(type="session.config", voice="ryan", language="english",
                                        seed=77, codec_frames=True, max_new_tokens=frames,
                                        split_sentences=False))
                await ws.send_json(dict(type="input.text", text=text))
                await ws.send_json(dict(type="input.done"))
                got = []
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        got.append(np.frombuffer(msg.data, dtype="<i8").reshape(-1, 16))
                    elif msg.type == aiohttp.WSMsgType.TEXT:
                        ev = json.loads(msg.data)
                        assert ev["type"] != "error", ev
                        if ev["type"] == "audio.done":
                            break
                return np.concatenate(got)

    codes = run_async(main(), timeout=300)
    np.testing.assert_array_equal(codes, ref.codes)


def test_seeded_codes_under_batching(tiny_ckpt):
    """Per-stream RNG: a seeded request gives the same audio alone or with 3 others batched.
    (Reports the fraction of identical streams; on this CPU every one matched.)"""
    texts = [f"{TEXT} Variant {i}." for i in range(4)]

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            alone = [(await _speech(s, url, input=t, response_format="pcm", seed=100 + i,
                                    max_new_tokens=16))[2] for i, t in enumerate(texts)]
            batched = await asyncio.gather(*[_speech(s, url, input=t, response_format="pcm",
                                                     seed=100 + i, max_new_tokens=16)
                                             for i, t in enumerate(texts)])
            return alone, [b[2] for b in batched]

    alone, batched = run_async(main(), timeout=300)
    same = sum(_close_pcm(a, b) for a, b in zip(alone, batched))
    print(f"seeded streams identical under batching: {same}/{len(texts)}")
    assert same == len(texts)


def test_measured_costs_cached_and_reused(tiny_ckpt, tmp_path, monkeypatch):
    """The first start of a deployment measures what a frame costs (bandwidth, frame steps per
    batch, Code2Wav calls, probe streams), caches it per hardware fingerprint and deployment;
    the next ``serve`` puts the chunk policy of those costs in the profile's calibration layer
    and the backend runs with them without measuring again."""
    import dataclasses

    from omni_stream.cli import build_parser, pipeline_settings
    from omni_stream.scheduling.capacity import MachineCosts, chunk_policy

    from omni_stream.orchestrator import costs as oc

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OMNI_STREAM_EMULATE_COSTS", raising=False)
    # the subject is the cache per deployment: a busy host's bandwidth swinging past the drift
    # threshold between the two starts (seen under a parallel benchmark: 24.8 -> 12.0 GB/s)
    # would rightly measure again (test_bandwidth_drift_measures_again_past_the_threshold)
    monkeypatch.setattr(oc, "BANDWIDTH_DRIFT", float("inf"))

    async def serve_once(settings):
        backend = PipelineBackend(settings)
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            st, _, data = await _speech(s, url, input=TEXT, response_format="pcm", seed=3,
                                        max_new_tokens=40)
            assert st == 200 and len(data) > 0
            async with s.get(url + "/health") as r:
                health = await r.json()
            return backend.costs_cached, backend.costs, backend.schedule, health

    cached0, costs0, sched0, h0 = run_async(serve_once(_settings(tiny_ckpt,
                                                                 schedule=ChunkPolicy())),
                                            timeout=300)
    files = list((tmp_path / "calibration").glob("costs-*.json"))
    assert not cached0 and len(files) == 1
    assert len(costs0.frame_s) == 4 and all(v > 0 for v in costs0.frame_s)
    assert costs0.bandwidth_gbs > 0 and costs0.codec_frame_s + costs0.codec_call_s > 0
    assert h0["capacity_streams"] >= 1 and h0["rtf_estimate"] > 0
    stored = MachineCosts(**{**json.loads(files[0].read_text())["costs"]})
    assert stored.measured_unix == costs0.measured_unix
    assert sched0 == chunk_policy(costs0, ChunkPolicy())
    # ``serve --profile none`` with the same deployment (model, dtype, slots, placement, threads)
    args = build_parser().parse_args(["serve", "--model", str(tiny_ckpt), "--profile", "none",
                                      "--max-streams", "4"])
    settings, prof, sources = pipeline_settings(args)
    policy = chunk_policy(stored, ChunkPolicy())
    assert sources["first_chunk"] == sources["steady_chunk"] == "calibration"
    assert (prof.first_chunk, prof.steady_chunk) == (policy.first, policy.steady)
    cached1, costs1, sched1, _ = run_async(serve_once(dataclasses.replace(
        settings, model_name="qwen3-tts", max_seq_len=512, queue_timeout_s=60)), timeout=300)
    assert cached1 and costs1.measured_unix == costs0.measured_unix  # not measured again
    assert (sched1.first, sched1.steady) == (policy.first, policy.steady)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "group-term"])
def test_group_signal_shuts_down_cleanly(tiny_ckpt, tmp_path, sig):
    """Ctrl-C (or a service manager's SIGTERM) reaches the server AND its stage processes: the
    server must exit without restarting the pipeline and leave no shared-memory segment."""
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "omni_stream.cli", "serve", "--model", str(tiny_ckpt),
                          "--port", str(port), "--max-seq-len", "512"],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        mine = {n for n in _shm_segments() if n.startswith(f"omni-stream-{p.pid}-")}
        assert len(mine) >= 2
        os.killpg(p.pid, sig)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "restarting" not in text and text.count("pipeline ready") == 1
    assert not {n for n in _shm_segments() if n.startswith(f"omni-stream-{p.pid}-")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_stages_pinned_to_disjoint_cpu_sets(tiny_ckpt):
    cpus = sorted(os.sched_getaffinity(0))

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt, cpu_sets={"talker": (cpus[0],),
                                                                 "codec": (cpus[1],)}))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            st, _, data = await _speech(s, url, input="Pinned.", response_format="pcm",
                                        max_new_tokens=4)
            assert st == 200 and len(data) > 0
            pipe = backend.sup.pipe
            return os.sched_getaffinity(pipe.talker.pid), os.sched_getaffinity(pipe.codec.pid)

    talker, codec = run_async(main(), timeout=300)
    assert talker == {cpus[0]} and codec == {cpus[1]}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_lent_codec_cores_serve_the_same_audio(tiny_ckpt):
    """The codec lends its core to the talker's native runtime while it does not decode: the
    same seeded requests give the same samples as without lending, and the talker's runtime
    has a thread pinned to the codec's CPU (that it runs jobs there: test_cpu_engine)."""
    cpus = sorted(os.sched_getaffinity(0))
    sets = {"talker": (cpus[0],), "codec": (cpus[1],)}

    async def main():
        out = {}
        for lend in (False, True):
            backend = PipelineBackend(_settings(tiny_ckpt, engine="native", cpu_sets=sets,
                                                lend_cores=lend))
            async with running_server(backend) as url, aiohttp.ClientSession() as s:
                out[lend] = await _seeded_pcm(s, url, 3, seed=60, frames=16)
                if lend:
                    threads = os.listdir(f"/proc/{backend.sup.pipe.talker.pid}/task")
                    affinities = {frozenset(os.sched_getaffinity(int(t))) for t in threads}
                    assert frozenset({cpus[1]}) in affinities and frozenset({cpus[0]}) in affinities
        assert all(_close_pcm(a, b) for a, b in zip(out[False], out[True]))
        with pytest.raises(ValueError, match="lend_cores needs engine 'native'"):
            _settings(tiny_ckpt, cpu_sets=sets, lend_cores=True)

    run_async(main(), timeout=300)


def test_pin_cpus_outside_the_allowed_set_is_a_warning(caplog):
    from omni_stream.stages.proc import pin_cpus

    before = os.sched_getaffinity(0)
    pin_cpus((10_000,))
    assert os.sched_getaffinity(0) == before
    assert "not pinning" in caplog.text


def test_int8_weight_path_serves_the_same_audio_as_offline_int8(tiny_ckpt):
    """The low-bit weight path reaches every stage that runs the decoder (talker, split code
    predictor): a seeded stream equals offline int8 synthesis of the same request."""
    import torch

    from omni_stream.engine.loading import load_on_weight_path
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    s = Synthesizer(load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16, weight_path="int8"), max_seq_len=512)
    ref = s.synthesize(PromptRequest(text=TEXT, language="english", speaker="ryan"),
                       SamplingParams(), seed=7, max_frames=10)
    expected = (np.clip(ref.audio, -1, 1) * 32767.0).astype(np.float64)

    async def main():
        out = {}
        for placement in ("together", "split"):
            backend = PipelineBackend(_settings(tiny_ckpt, dtype="bfloat16", weight_path="int8",
                                                placement=placement))
            async with running_server(backend) as url, aiohttp.ClientSession() as sess:
                st, _, pcm = await _speech(sess, url, input=TEXT, response_format="pcm", seed=7,
                                           max_new_tokens=10)
                assert st == 200
                out[placement] = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
        return out

    out = run_async(main(), timeout=300)
    from omni_stream.evaluation.metrics import snr_db

    for placement, audio in out.items():
        assert len(audio) == len(expected), placement
        # a bf16 codec streamed in chunks vs in one pass rounds differently (bf16 steps are 64
        # LSB near full scale), so compare SNR: same codes give ~30 dB, other codes ~0 dB
        assert snr_db(expected, audio) > 20, (placement, snr_db(expected, audio))


def test_default_frame_cap_follows_the_text(tiny_ckpt):
    """'Hi.' on the tiny random model (which rarely says eos) stops at 40 + 12 x its text tokens
    with finish_reason 'length', not after minutes; max_new_tokens still overrides the formula."""
    from omni_stream.scheduling.limits import FrameCap

    async def main():
        backend = PipelineBackend(_settings(tiny_ckpt))
        async with running_server(backend) as url, aiohttp.ClientSession() as s:
            dones = []
            for extra in ({}, {"max_new_tokens": 7}):
                st, _, body = await _speech(s, url, input="Hi.", response_format="pcm",
                                            stream_format="sse", seed=3, **extra)
                assert st == 200
                events = [json.loads(line[6:]) for line in body.decode().split("\n\n")
                          if line.startswith("data: ")]
                pcm = b"".join(base64.b64decode(e["audio"]) for e in events
                               if e["type"] == "speech.audio.delta")
                done = events[-1]
                assert done["type"] == "speech.audio.done"
                assert len(pcm) == done["usage"]["output_tokens"] * 1920 * 2  # complete
                dones.append(done)
            return dones, backend.text_tokens(_job("Hi."))

    (default, capped), tokens = run_async(main(), timeout=300)
    cap = FrameCap().frames(tokens)
    assert cap == 40 + 12 * tokens and cap <= 100  # a few seconds of audio, not minutes
    out = default["usage"]["output_tokens"]
    assert 0 < out <= cap and (default["finish_reason"] == "length") == (out == cap)
    assert capped["usage"]["output_tokens"] <= 7 and capped["finish_reason"] in ("length", "stop")
    assert (capped["finish_reason"] == "length") == (capped["usage"]["output_tokens"] == 7)


def _job(text: str):
    from omni_stream.contract import SpeechJob

    return SpeechJob(text=text, request_id="t")
