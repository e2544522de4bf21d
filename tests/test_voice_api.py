"""Voice cloning through the HTTP/WebSocket API: upload -> list -> speak -> restart -> speak ->
delete against the real server on a tiny Base checkpoint, one-off ``ref_audio`` requests,
client-side decoding of a cloned voice, and every refusal (with the store left unchanged)."""

from __future__ import annotations

import base64
import io

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from omni_stream.orchestrator import PipelineBackend, PipelineSettings
from omni_stream.server.fake_backend import FakeBackend
from omni_stream.server.settings import ServerSettings
from omni_stream.server.testing import run_async, running_server
from tests.servers import tiny_settings

pytestmark = pytest.mark.timeout(900)

TEXT = "Hello, this is my own voice speaking."
REF_TEXT = "A short reference sentence for the cloned voice."
FRAMES = 10


def _wav(seconds: float = 2.5, sr: int = 24000, seed: int = 0, amp: float = 0.3) -> bytes:
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = amp * np.sin(2 * np.pi * 140 * t) * np.clip(np.sin(2 * np.pi * 3 * t), 0, None)
    x = x + amp * 0.05 * g.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _settings(ck) -> PipelineSettings:
    return tiny_settings(ck, max_queue=8)


async def _upload(s, url, name, audio: bytes | None, **fields):
    form = aiohttp.FormData()
    if audio is not None:
        form.add_field("audio", audio, filename="ref.wav", content_type="audio/wav")
    if name is not None:
        form.add_field("name", name)
    for k, v in fields.items():
        form.add_field(k, v)
    async with s.post(url + "/v1/audio/voices", data=form) as r:
        return r.status, await r.json()


async def _voices(s, url) -> list[str]:
    async with s.get(url + "/v1/audio/voices") as r:
        assert r.status == 200
        body = await r.json()
    return [v["name"] for v in body["uploaded_voices"]]


async def _speak(s, url, **body):
    body = dict(input=TEXT, response_format="pcm", language="english", greedy=True,
                max_new_tokens=FRAMES, **body)
    async with s.post(url + "/v1/audio/speech", json=body) as r:
        data = await r.read()
        return r.status, data


def test_upload_list_speak_restart_speak_delete(ckpt_factory, tmp_path):
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.voices.encode import VoiceEncoder

    ck = ckpt_factory("tiny", "base", 7)
    vdir = tmp_path / "voices"
    settings = ServerSettings(voice_dir=str(vdir))
    ref = _wav()
    data_url = "data:audio/wav;base64," + base64.b64encode(ref).decode()

    # what the server must say: offline synthesis with the same voice
    wav, sr = sf.read(io.BytesIO(ref), dtype="float32")
    clone = VoiceEncoder(ck).encode(wav, sr, ref_text=REF_TEXT)
    synth = Synthesizer.from_path(ck)
    offline = synth.synthesize(PromptRequest(text=TEXT, language="english", clone=clone,
                                             stream_text=True),
                               SamplingParams.greedy(), max_frames=FRAMES)
    expected = np.clip(offline.audio, -1, 1) * 32767.0

    def same_audio(pcm: bytes) -> None:
        got = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
        assert len(got) == len(expected) > 0
        assert np.abs(got - expected).max() <= 1.0 + 1e-6

    async def first_run():
        async with running_server(PipelineBackend(_settings(ck)), settings) as url, \
                aiohttp.ClientSession() as s:
            assert await _voices(s, url) == []
            st, rec = await _upload(s, url, "Me", ref, ref_text=REF_TEXT)
            assert st == 201, rec
            assert rec["name"] == "Me" and rec["mode"] == "icl"
            assert rec["frames"] == -(-len(wav) // 1920)
            st, rec2 = await _upload(s, url, "me-x", ref, x_vector_only="true")
            assert st == 201 and rec2["mode"] == "x_vector" and rec2["frames"] == 0
            # refusals leave the store as it was
            for args, fields, status, code in [
                (("me", ref), dict(ref_text=REF_TEXT), 409, "voice_exists"),  # any case
                (("../evil", ref), dict(ref_text=REF_TEXT), 400, "invalid_voice_name"),
                (("a/b", ref), dict(ref_text=REF_TEXT), 400, "invalid_voice_name"),
                (("noref", ref), {}, 400, "missing_ref_text"),
                (("junk", b"not audio at all" * 50), dict(ref_text=REF_TEXT), 415,
                 "unsupported_audio"),
                (("silent", _wav(amp=0.0)), dict(ref_text=REF_TEXT), 400, "audio_silent"),
                (("short", _wav(seconds=0.3)), dict(ref_text=REF_TEXT), 400, "audio_too_short"),
                (("empty", b""), dict(ref_text=REF_TEXT), 400, "audio_empty"),
                (("noaudio", None), dict(ref_text=REF_TEXT), 400, "missing_audio"),
                (("flag", ref), dict(x_vector_only="maybe"), 400, "invalid_value"),
                (("extra", ref), dict(ref_text=REF_TEXT, consent="yes"), 400, "unknown_field"),
            ]:
                st, body = await _upload(s, url, *args, **fields)
                assert (st, body["error"]["code"]) == (status, code), (args[0], body)
            assert sorted(await _voices(s, url)) == ["Me", "me-x"]
            async with s.get(url + "/v1/audio/voices") as r:
                listing = await r.json()
            assert listing["voice_clone"] is True and {"Me", "me-x"} <= set(listing["voices"])

            st, pcm = await _speak(s, url, voice="me")  # names are case-insensitive
            assert st == 200
            same_audio(pcm)
            st, pcm_inline = await _speak(s, url, ref_audio=data_url, ref_text=REF_TEXT)
            assert st == 200
            same_audio(pcm_inline)
            st, pcm_x = await _speak(s, url, voice="me-x")
            assert st == 200 and len(pcm_x) > 0
            # bad clone requests
            for body, code in [
                (dict(voice="me", ref_audio=data_url, ref_text=REF_TEXT), "invalid_value"),
                (dict(ref_audio=data_url), "missing_ref_text"),
                (dict(ref_text=REF_TEXT), "invalid_value"),
                (dict(ref_audio="https://example.com/a.wav", ref_text=REF_TEXT),
                 "ref_audio_url_refused"),
                (dict(ref_audio="/etc/passwd", ref_text=REF_TEXT), "ref_audio_path_refused"),
                (dict(ref_audio="@@@not base64@@@", ref_text=REF_TEXT), "invalid_ref_audio"),
                (dict(task_type="CustomVoice"), "task_type_mismatch"),
                (dict(voice="nobody"), "invalid_voice"),
            ]:
                async with s.post(url + "/v1/audio/speech",
                                  json=dict(input=TEXT, max_new_tokens=2, **body)) as r:
                    err = await r.json()
                    assert r.status == 400 and err["error"]["code"] == code, (body, err)

    run_async(first_run(), timeout=600)

    async def second_run():
        from clients.codec_stream import stream_codes
        from clients.decoders import TorchDecoder

        async with running_server(PipelineBackend(_settings(ck)), settings) as url, \
                aiohttp.ClientSession() as s:
            assert sorted(await _voices(s, url)) == ["Me", "me-x"]  # survived the restart
            st, pcm = await _speak(s, url, voice="Me", task_type="Base")
            assert st == 200
            # client-side decoding: the server sends the reference frames to prime the decoder
            res = await stream_codes(url, TEXT, TorchDecoder(ck), voice="Me", language="english",
                                     extra=dict(greedy=True, max_new_tokens=FRAMES))
            async with s.delete(url + "/v1/audio/voices/me") as r:
                assert r.status == 200 and (await r.json())["deleted"] is True
            async with s.delete(url + "/v1/audio/voices/me") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "voice_not_found"
            assert await _voices(s, url) == ["me-x"]
            st, _ = await _speak(s, url, voice="Me")
            assert st == 400
            return pcm, res

    pcm2, res = run_async(second_run(), timeout=600)
    same_audio(pcm2)  # the stored voice after the restart speaks as before (pcm1 did)
    local = (np.asarray(res.pcm, dtype=np.float64) * (32767.0 if res.pcm.dtype.kind == "f" else 1))
    assert len(local) == len(expected)
    assert np.abs(local - expected).max() <= 2.0  # fp32 on both sides: rounding only
    assert [p.name for p in vdir.rglob("*") if p.is_file() and "me-x" in p.name.lower()]


def test_models_that_cannot_clone_refuse_by_name(tmp_path):
    settings = ServerSettings(voice_dir=str(tmp_path / "v"))

    async def main():
        async with running_server(FakeBackend(), settings) as url, aiohttp.ClientSession() as s:
            st, body = await _upload(s, url, "me", _wav(), ref_text=REF_TEXT)
            assert st == 400 and body["error"]["code"] == "voice_clone_unsupported"
            assert "Base" in body["error"]["message"]
            data_url = "data:audio/wav;base64," + base64.b64encode(_wav()).decode()
            for body in (dict(ref_audio=data_url, ref_text=REF_TEXT),
                         dict(ref_audio=data_url, x_vector_only=True)):
                async with s.post(url + "/v1/audio/speech", json=dict(input=TEXT, **body)) as r:
                    err = await r.json()
                    assert r.status == 400
                    assert err["error"]["code"] == "voice_clone_unsupported"
            async with s.post(url + "/v1/audio/speech",
                              json=dict(input=TEXT, speaker_wav="x")) as r:
                err = await r.json()
                assert r.status == 400 and "speaker_wav" in err["error"]["message"]
            async with s.post(url + "/v1/audio/speech",
                              json=dict(input=TEXT, task_type="Base")) as r:
                assert (await r.json())["error"]["code"] == "task_type_mismatch"
            async with s.ws_connect(url + "/v1/audio/speech/stream") as ws:
                await ws.receive_json()  # session.created
                await ws.send_json({"type": "session.config", "ref_audio": data_url,
                                    "ref_text": REF_TEXT})
                ev = await ws.receive_json()
                assert ev["type"] == "error" and ev["error"]["code"] == "voice_clone_unsupported"
            async with s.get(url + "/v1/audio/voices") as r:
                body = await r.json()
                assert body["voice_clone"] is False and body["uploaded_voices"] == []
        assert not (tmp_path / "v").exists()

    run_async(main(), timeout=60)
