"""Voice cloning plumbing, no model: uploaded bytes -> audio (and every refusal), the on-disk
voice store, and ``omni-stream voices`` against a small server implementing the HTTP contract."""

from __future__ import annotations

import base64
import io
import json
import stat
import threading

import numpy as np
import pytest
import soundfile as sf
from aiohttp import web

from omni_stream.server.testing import serving_in_thread
from omni_stream.voices import audio as audio_mod
from omni_stream.voices import store as store_mod
from omni_stream.errors import RequestError
from omni_stream.voices.audio import (MAX_SECONDS, MAX_UPLOAD_BYTES, decode_audio,
                                      decode_ref_audio_field)
from omni_stream.models.voice_clone import VoiceClone
from omni_stream.voices.store import VoiceStore, default_voice_dir, validate_name

pytestmark = pytest.mark.timeout(120)


def tone(secs: float, sr: int, channels: int = 1, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(secs * sr))) / sr
    x = amp * np.sin(2 * np.pi * 220.0 * t)
    if channels == 1:
        return x.astype(np.float32)
    return np.stack([x * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def encode(x: np.ndarray, sr: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    b = io.BytesIO()
    sf.write(b, x, sr, format=fmt, subtype=subtype)
    return b.getvalue()


def refused(fn, *args, **kw) -> RequestError:
    with pytest.raises(RequestError) as ei:
        fn(*args, **kw)
    return ei.value


# --- decode_audio ------------------------------------------------------------------------

LOSSLESS = [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", "PCM_16"), ("FLAC", "PCM_24")]


@pytest.mark.parametrize("fmt,subtype", LOSSLESS)
@pytest.mark.parametrize("sr", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("channels", [1, 2, 3])
def test_decode_lossless_mixes_to_mono_at_original_rate(fmt, subtype, sr, channels):
    x = tone(1.5, sr, channels)
    wav, got_sr = decode_audio(encode(x, sr, fmt, subtype))
    assert got_sr == sr and wav.dtype == np.float32 and wav.ndim == 1
    assert wav.shape[0] == x.shape[0]
    want = x if channels == 1 else x.mean(axis=1)  # the official downmix: mean over channels
    np.testing.assert_allclose(wav, want, atol=2e-4 if subtype == "PCM_16" else 1e-6)


LOSSY = [("OGG", "VORBIS", [16000, 44100, 48000]), ("OGG", "OPUS", [16000, 48000]),
         ("MP3", "MPEG_LAYER_III", [16000, 44100, 48000])]


@pytest.mark.parametrize("fmt,subtype,rates", LOSSY, ids=[s for _, s, _ in LOSSY])
@pytest.mark.parametrize("channels", [1, 2])
def test_decode_lossy(fmt, subtype, rates, channels):
    if fmt not in sf.available_formats() or subtype not in sf.available_subtypes(fmt):
        pytest.skip(f"libsndfile {sf.__libsndfile_version__} has no {fmt}/{subtype}")
    for sr in rates:
        x = tone(2.0, sr, channels)
        wav, got_sr = decode_audio(encode(x, sr, fmt, subtype))
        assert got_sr == sr and wav.dtype == np.float32 and wav.ndim == 1
        assert abs(wav.shape[0] - x.shape[0]) <= 0.1 * sr  # codec padding/priming
        want_rms = np.sqrt(np.mean((x if channels == 1 else x.mean(axis=1)) ** 2))
        assert np.sqrt(np.mean(wav ** 2)) == pytest.approx(want_rms, rel=0.15)


def test_mp3_is_readable_here():
    """libsndfile >= 1.1 reads MP3; the server advertises it, so this build must have it."""
    assert "MP3" in sf.available_formats(), sf.__libsndfile_version__


@pytest.mark.parametrize("data,status,code", [
    (b"", 400, "audio_empty"),
    (b"this is not audio at all, just some text" * 10, 415, "unsupported_audio"),
    (b"RIFF\x00\x00\x00\x00WAVEfmt garbage", 415, "unsupported_audio"),
    (encode(np.zeros((0, 1), np.float32), 16000), 400, "audio_empty"),
    (encode(tone(0.2, 16000), 16000), 400, "audio_too_short"),
    (encode(tone(MAX_SECONDS + 1, 8000), 8000), 400, "audio_too_long"),
    (encode(np.zeros(16000 * 2, np.float32), 16000), 400, "audio_silent"),
    (encode(tone(2.0, 16000, amp=10 ** (-70 / 20)), 16000, subtype="FLOAT"), 400, "audio_silent"),
], ids=["empty-bytes", "text", "broken-wav", "no-samples", "0.2s", "31s", "zeros", "-70dBFS"])
def test_decode_refusals(data, status, code):
    e = refused(decode_audio, data, param="audio")
    assert (e.status, e.code, e.param) == (status, code, "audio"), e
    assert isinstance(e, ValueError) and e.message == str(e)


def test_voice_error_converts_to_api_error():
    from omni_stream.server.errors import error_body

    e = refused(decode_audio, b"")
    api = e  # the voice refusal is the error the server sends
    assert api.status == 400 and error_body(api) == {"error": {
        "message": e.message, "type": "invalid_request_error", "param": "audio",
        "code": "audio_empty"}}


def test_unsupported_names_accepted_formats():
    e = refused(decode_audio, b"\x00\x01garbage" * 100, param="ref_audio")
    assert e.param == "ref_audio"
    for fmt in ("WAV", "FLAC", "MP3", "OGG"):
        assert fmt in e.message


@pytest.mark.parametrize("sr,channels,code", [(4000, 1, "unsupported_sample_rate"),
                                               (384000, 1, "unsupported_sample_rate"),
                                               (16000, 9, "too_many_channels")])
def test_rate_and_channel_bounds(sr, channels, code):
    e = refused(decode_audio, encode(tone(1.5, sr, channels), sr))
    assert (e.status, e.code, e.param) == (400, code, "audio")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_decode_non_finite(bad):
    x = tone(2.0, 16000)
    x[100] = bad
    e = refused(decode_audio, encode(x, 16000, subtype="FLOAT"))
    assert (e.status, e.code) == (400, "audio_not_finite")


def test_quiet_but_audible_passes():
    wav, _ = decode_audio(encode(tone(2.0, 16000, amp=10 ** (-50 / 20)), 16000, subtype="FLOAT"))
    assert np.abs(wav).max() > 10 ** (-60 / 20)


def test_too_long_is_refused_without_decoding_it_all(monkeypatch):
    """A file claiming hours is read only up to the limit (a 10 min 8 kHz 8-bit WAV)."""
    data = encode(np.full(8000 * 600, 0.1, np.float32), 8000, subtype="PCM_U8")
    reads = []
    real = sf.SoundFile.read

    def spy(self, frames=-1, *a, **kw):
        reads.append(frames)
        return real(self, frames, *a, **kw)

    monkeypatch.setattr(sf.SoundFile, "read", spy)
    e = refused(decode_audio, data)
    assert e.code == "audio_too_long" and "600.0 s" in e.message
    assert reads and all(0 < f <= MAX_SECONDS * 8000 + 2 for f in reads)


def test_upload_too_large(monkeypatch):
    monkeypatch.setattr(audio_mod, "MAX_UPLOAD_BYTES", 1000)
    e = refused(decode_audio, encode(tone(2.0, 16000), 16000))
    assert (e.status, e.code) == (413, "upload_too_large")
    e = refused(decode_ref_audio_field, base64.b64encode(b"x" * 2000).decode())
    assert (e.status, e.code, e.param) == (413, "upload_too_large", "ref_audio")


def test_limits_are_documented_constants():
    assert MAX_UPLOAD_BYTES == 25 * 2**20 and audio_mod.MIN_SECONDS == 1.0 and MAX_SECONDS == 30.0
    assert audio_mod.SILENCE_DBFS == -60.0


# --- decode_ref_audio_field --------------------------------------------------------------

WAV = encode(tone(1.5, 24000), 24000)


@pytest.mark.parametrize("form", [
    "data:audio/wav;base64,{b}", "DATA:audio/x-wav;base64,{b}", "data:;base64,{b}",
    "data:application/octet-stream;name=a.wav;base64,{b}", "{b}", "  {b}\n", "{wrapped}",
])
def test_ref_audio_field_forms(form):
    b = base64.b64encode(WAV).decode()
    wrapped = "\n".join(b[i:i + 76] for i in range(0, len(b), 76))
    raw = decode_ref_audio_field(form.format(b=b, wrapped=wrapped))
    assert raw == WAV
    wav, sr = decode_audio(raw, param="ref_audio")
    assert sr == 24000 and wav.shape == (36000,)


def test_ref_audio_base64_starting_with_slash_is_not_a_path():
    """Raw MP3 frames (0xFF 0xFB...) encode as '//s...': that is base64, not a path."""
    data = b"\xff\xfb\x90\x64" + bytes(range(256)) * 4
    s = base64.b64encode(data).decode()
    assert s.startswith("//")
    assert decode_ref_audio_field(s) == data


@pytest.mark.parametrize("s,code", [
    ("not base64 at all!", "invalid_ref_audio"),
    ("QUJD*", "invalid_ref_audio"),
    ("QUJDRA", "invalid_ref_audio"),  # missing padding: strict
    ("data:audio/wav;base64,@@@@", "invalid_ref_audio"),
    ("data:audio/wav,UklGRg==", "invalid_ref_audio"),  # no ;base64
    ("data:audio/wav;base64", "invalid_ref_audio"),  # no comma
    ("", "audio_empty"),
    ("   ", "audio_empty"),
    ("data:audio/wav;base64,", "audio_empty"),
])
def test_ref_audio_field_bad_base64(s, code):
    e = refused(decode_ref_audio_field, s)
    assert (e.status, e.code, e.param) == (400, code, "ref_audio"), e
    if code == "invalid_ref_audio":
        assert "data URL" in e.message and "base64" in e.message


@pytest.mark.parametrize("s", ["http://example.com/a.wav", "https://10.0.0.1/voice.mp3",
                               "HTTPS://Example.com/x", "ftp://host/a.wav", "file:///etc/passwd"])
def test_ref_audio_urls_refused(s):
    e = refused(decode_ref_audio_field, s, param="ref_audio")
    assert (e.status, e.code, e.param) == (400, "ref_audio_url_refused", "ref_audio")
    assert "does not fetch URLs" in e.message and "base64" in e.message


@pytest.mark.parametrize("s", ["/etc/passwd", "/tmp/abc", "./voice.wav", "../x.wav", "~/a.wav",
                               "C:\\voices\\a.wav", "file:/etc/passwd"])
def test_ref_audio_paths_refused(s):
    e = refused(decode_ref_audio_field, s)
    assert (e.status, e.code) == (400, "ref_audio_path_refused")
    assert "file path" in e.message and "POST /v1/audio/voices" in e.message


def test_ref_audio_non_string():
    assert refused(decode_ref_audio_field, b"abc").code == "invalid_ref_audio"


# --- store -------------------------------------------------------------------------------

def clone(seed: int = 0, icl: bool = True, frames: int = 37) -> VoiceClone:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(64).astype(np.float32)
    if not icl:
        return VoiceClone(x_vector=x)
    return VoiceClone(x_vector=x, ref_codes=rng.integers(0, 2048, (frames, 16)),
                      ref_text=f"reference transcript {seed}, with [brackets] and ünïcode")


def test_validate_name_accepts():
    for n in ["a", "A", "0", "Ryan_2", "my.voice-v1", "x" * 64, "a.b.c"]:
        assert validate_name(n) == n


@pytest.mark.parametrize("name", ["", "../x", "a/b", "a\\b", ".hidden", "-x", "_x", "x" * 65,
                                  "a..b", "ab\x00", "ab\n", "a\u200bb", "a\x1fb", "voix é",
                                  "a b", "名字", None, 7])
def test_validate_name_refuses(name):
    e = refused(validate_name, name)
    assert (e.status, e.code, e.param) == (400, "invalid_voice_name", "name")


def test_add_get_list_delete(tmp_path):
    s = VoiceStore(tmp_path / "v")
    a = s.add("Alice", clone(1), duration_s=4.25, sample_rate=44100)
    b = s.add("bob", clone(2, icl=False), duration_s=2.0, sample_rate=16000)
    assert s.get("alice") is a and s.get("ALICE") is a and s.get("carol") is None
    assert s.get("../etc") is None and "BOB" in s and len(s) == 2
    assert [r.name for r in s.list()] == ["Alice", "bob"]
    j = a.as_json()
    assert j == {"object": "voice", "name": "Alice", "mode": "icl", "ref_text": a.clone.ref_text,
                 "duration_s": 4.25, "frames": 37, "created_at": a.created_at}
    assert b.as_json()["mode"] == "x_vector" and b.as_json()["frames"] == 0
    assert json.dumps(j)  # JSON-ready, no arrays
    assert s.delete("ALICE") is True and s.delete("alice") is False and s.delete("../x") is False
    assert [r.name for r in s.list()] == ["bob"]
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["bob.safetensors"]


def test_duplicate_is_case_insensitive(tmp_path):
    s = VoiceStore(tmp_path)
    s.add("Ryan2", clone(1), 3.0, 24000)
    e = refused(s.add, "RYAN2", clone(2), 3.0, 24000)
    assert (e.status, e.code, e.param) == (409, "voice_exists", "name")
    assert "Ryan2" in e.message
    assert s.get("ryan2").clone.ref_text == clone(1).ref_text


def test_bad_name_on_add(tmp_path):
    s = VoiceStore(tmp_path)
    assert refused(s.add, "../evil", clone(), 3.0, 24000).code == "invalid_voice_name"
    assert list(tmp_path.iterdir()) == []


def test_persistence_bit_identical(tmp_path):
    s = VoiceStore(tmp_path)
    recs = {n: s.add(n, clone(i, icl=i % 2 == 0), 1.5 + i, 22050) for i, n in
            enumerate(["Zed", "amy", "Bob.v2"])}
    s2 = VoiceStore(tmp_path)
    assert [r.name for r in s2.list()] == ["amy", "Bob.v2", "Zed"]
    for n, r in recs.items():
        r2 = s2.get(n)
        assert r2.name == n and r2.as_json() == r.as_json()
        assert r2.sample_rate == 22050 and r2.duration_s == r.duration_s
        assert r2.clone.x_vector.dtype == np.float32
        assert r2.clone.x_vector.tobytes() == r.clone.x_vector.tobytes()
        if r.clone.ref_codes is None:
            assert r2.clone.ref_codes is None
        else:
            assert r2.clone.ref_codes.dtype == np.int64
            assert np.array_equal(r2.clone.ref_codes, r.clone.ref_codes)
        assert r2.clone.ref_text == r.clone.ref_text


def test_file_and_dir_modes(tmp_path):
    root = tmp_path / "a" / "b"
    s = VoiceStore(root)
    s.add("m", clone(), 2.0, 24000)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "m.safetensors").stat().st_mode) == 0o600


def test_file_is_self_describing(tmp_path):
    from safetensors import safe_open

    VoiceStore(tmp_path).add("Desc", clone(3), 2.5, 48000)
    with safe_open(str(tmp_path / "desc.safetensors"), framework="numpy") as f:
        meta = json.loads(f.metadata()["omni_stream.voice"])
        assert set(f.keys()) == {"x_vector", "ref_codes"}
    assert meta["format_version"] == store_mod.FORMAT_VERSION
    assert (meta["name"], meta["sample_rate"], meta["duration_s"]) == ("Desc", 48000, 2.5)


def test_corrupt_files_skipped_with_warning(tmp_path, caplog):
    s = VoiceStore(tmp_path)
    s.add("good", clone(1), 2.0, 24000)
    (tmp_path / "junk.safetensors").write_bytes(b"\x07\x00")
    (tmp_path / "trunc.safetensors").write_bytes((tmp_path / "good.safetensors").read_bytes()[:50])
    (tmp_path / "other.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "renamed.safetensors").write_bytes((tmp_path / "good.safetensors").read_bytes())
    (tmp_path / "notes.txt").write_text("not a voice")
    with caplog.at_level("WARNING", logger="omni_stream.voices.store"):
        s2 = VoiceStore(tmp_path)
    assert [r.name for r in s2.list()] == ["good"]
    text = caplog.text
    for bad in ("junk.safetensors", "trunc.safetensors", "other.safetensors", "renamed.safetensors"):
        assert bad in text
    assert "notes.txt" not in text


def test_newer_format_version_skipped(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(store_mod, "FORMAT_VERSION", 99)
    VoiceStore(tmp_path).add("future", clone(), 2.0, 24000)
    monkeypatch.setattr(store_mod, "FORMAT_VERSION", 1)
    with caplog.at_level("WARNING"):
        assert VoiceStore(tmp_path).list() == []
    assert "future.safetensors" in caplog.text and "format version" in caplog.text


def test_leftover_temp_removed(tmp_path):
    VoiceStore(tmp_path).add("keep", clone(), 2.0, 24000)
    tmp = tmp_path / ".half.1234abcd.tmp"
    tmp.write_bytes(b"partial")
    s = VoiceStore(tmp_path)
    assert not tmp.exists() and [r.name for r in s.list()] == ["keep"]


def test_atomic_when_replace_fails(tmp_path, monkeypatch):
    s = VoiceStore(tmp_path)
    s.add("first", clone(1), 2.0, 24000)
    before = sorted(p.name for p in tmp_path.iterdir())

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod.os, "replace", boom)
    with pytest.raises(OSError):
        s.add("second", clone(2), 2.0, 24000)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial or temp file
    assert s.get("second") is None
    assert s.add("second", clone(2), 2.0, 24000).name == "second"  # still usable
    assert [r.name for r in VoiceStore(tmp_path).list()] == ["first", "second"]


def test_atomic_when_write_fails(tmp_path, monkeypatch):
    s = VoiceStore(tmp_path)

    def boom(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(store_mod.os, "fsync", boom)
    with pytest.raises(OSError):
        s.add("x", clone(), 2.0, 24000)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and len(s) == 0


def test_store_full(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "MAX_VOICES", 2)
    s = VoiceStore(tmp_path)
    s.add("a", clone(1), 2.0, 24000)
    s.add("b", clone(2), 2.0, 24000)
    e = refused(s.add, "c", clone(3), 2.0, 24000)
    assert (e.status, e.code) == (507, "voice_store_full")
    s.delete("a")
    assert s.add("c", clone(3), 2.0, 24000).name == "c"


def test_concurrent_adds(tmp_path):
    s = VoiceStore(tmp_path)
    errors: list[RequestError] = []

    def worker(i):
        try:
            s.add(f"v{i % 10}", clone(i), 2.0, 24000)  # each name raced by 3 threads
        except RequestError as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(s) == 10 and len(errors) == 20 and {e.code for e in errors} == {"voice_exists"}
    assert len(VoiceStore(tmp_path)) == 10


def test_default_voice_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path / "cache"))
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    for m in (m1, m2):
        m.mkdir()
        (m / "config.json").write_text('{"a": 1}')
    d1 = default_voice_dir(m1)
    assert d1.parent == tmp_path / "cache" / "voices" and d1.name.startswith("m1-")
    assert default_voice_dir(str(m1) + "/") == d1  # same resolved path
    assert default_voice_dir(m2) != d1  # another checkpoint, same config
    (m1 / "config.json").write_text('{"a": 2}')
    assert default_voice_dir(m1) != d1  # config changed
    with pytest.raises(FileNotFoundError):
        default_voice_dir(tmp_path / "missing")


# --- omni-stream voices (CLI) against a small server implementing the contract -----------

UPLOADS = web.AppKey("uploads", list)  # (filename, name) of each upload the server saw

def _contract_app(store: VoiceStore):
    def error(status, message, code, param=None):
        t = "invalid_request_error" if status < 500 else "server_error"
        return web.json_response({"error": {"message": message, "type": t, "param": param,
                                            "code": code}}, status=status)

    async def add(request):
        form = await request.post()
        f = form.get("audio")
        if f is None or not hasattr(f, "file"):
            return error(400, "the 'audio' file is required", "missing_audio", "audio")
        try:
            wav, sr = decode_audio(f.file.read(), param="audio")
            x_only = form.get("x_vector_only") == "true"
            ref_text = form.get("ref_text")
            if not x_only and not ref_text:
                return error(400, "ref_text is required unless x_vector_only", "missing_ref_text",
                             "ref_text")
            c = VoiceClone(x_vector=np.full(8, wav.std(), np.float32),
                           ref_codes=None if x_only else np.zeros((len(wav) * 12 // sr, 16), np.int64),
                           ref_text=ref_text)
            request.app[UPLOADS].append((f.filename, form.get("name")))
            rec = store.add(form.get("name", ""), c, len(wav) / sr, sr)
        except RequestError as e:
            return error(e.status, e.message, e.code, e.param)
        return web.json_response(rec.as_json(), status=201)

    async def listing(request):
        recs = store.list()
        return web.json_response({"voices": ["ryan", "vivian"] + [r.name for r in recs],
                                  "uploaded_voices": [r.as_json() for r in recs]})

    async def delete(request):
        name = request.match_info["name"]
        if not store.delete(name):
            return error(404, f"no uploaded voice named {name!r}", "voice_not_found", "name")
        return web.json_response({"name": name, "deleted": True})

    app = web.Application()
    app[UPLOADS] = []
    app.router.add_post("/v1/audio/voices", add)
    app.router.add_get("/v1/audio/voices", listing)
    app.router.add_delete("/v1/audio/voices/{name}", delete)
    return app


def serving(app):
    """Serve ``app`` on an ephemeral port from a background loop (the CLI runs its own loop)."""

    async def up():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    return serving_in_thread(up)


@pytest.fixture
def server(tmp_path):
    app = _contract_app(VoiceStore(tmp_path / "voices"))
    with serving(app) as url:
        yield url, app


def cli(*argv):
    from omni_stream.cli import main

    return main(list(argv))


def test_cli_add_list_delete(server, tmp_path, capsys):
    url, app = server
    clip = tmp_path / "My Clip.flac"
    sf.write(clip, tone(2.0, 44100, 2), 44100)
    assert cli("voices", "add", "Narrator", str(clip), "--ref-text", "Hello there.",
               "--url", url) == 0
    out = capsys.readouterr().out
    assert "Narrator" in out and "icl" in out and "2.00 s" in out
    assert app[UPLOADS] == [("My Clip.flac", "Narrator")]  # filename kept

    wav = tmp_path / "b.wav"
    sf.write(wav, tone(1.5, 16000), 16000)
    assert cli("voices", "add", "robot", str(wav), "--x-vector-only",
               "--url", url + "/", "--json") == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["mode"] == "x_vector" and rec["frames"] == 0 and rec["object"] == "voice"

    assert cli("voices", "list", "--url", url) == 0
    out = capsys.readouterr().out
    assert "ryan, vivian" in out and "Narrator" in out and "robot" in out
    assert "Hello there." in out and "x_vector" in out

    assert cli("voices", "list", "--url", url, "--json") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["voices"] == ["ryan", "vivian", "Narrator", "robot"]
    assert [r["name"] for r in body["uploaded_voices"]] == ["Narrator", "robot"]

    assert cli("voices", "delete", "narrator", "--url", url) == 0
    assert "deleted" in capsys.readouterr().out
    assert cli("voices", "list", "--url", url, "--json") == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)["uploaded_voices"]] == ["robot"]


def test_cli_server_errors_exit_2(server, tmp_path, capsys):
    url, _ = server
    clip = tmp_path / "a.wav"
    sf.write(clip, tone(2.0, 16000), 16000)
    assert cli("voices", "add", "dup", str(clip), "--x-vector-only", "--url", url) == 0
    capsys.readouterr()
    assert cli("voices", "add", "DUP", str(clip), "--x-vector-only", "--url", url) == 2
    err = capsys.readouterr().err
    assert "409" in err and "voice_exists" in err and "already exists" in err

    short = tmp_path / "short.wav"
    sf.write(short, tone(0.2, 16000), 16000)
    assert cli("voices", "add", "s", str(short), "--x-vector-only", "--url", url) == 2
    assert "at least 1 s is needed" in capsys.readouterr().err

    assert cli("voices", "delete", "nobody", "--url", url) == 2
    assert "no uploaded voice named 'nobody'" in capsys.readouterr().err


def test_cli_missing_file_exit_2(tmp_path, capsys):
    assert cli("voices", "add", "x", str(tmp_path / "nope.wav"), "--url", "http://127.0.0.1:9") == 2
    assert "nope.wav is not a file" in capsys.readouterr().err


def test_cli_unreachable_exit_1(capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert cli("voices", "list", "--url", url) == 1
    err = capsys.readouterr().err
    assert url in err and "--url" in err


def test_cli_sends_api_key(tmp_path, capsys, monkeypatch):
    seen = []

    async def listing(request):
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"voices": [], "uploaded_voices": []})

    app = web.Application()
    app.router.add_get("/v1/audio/voices", listing)
    with serving(app) as url:
        assert cli("voices", "list", "--url", url, "--api-key", "k1") == 0
        monkeypatch.setenv("OMNI_STREAM_API_KEY", "k2")
        assert cli("voices", "list", "--url", url) == 0
    assert seen == ["Bearer k1", "Bearer k2"]
    assert "uploaded voices: none" in capsys.readouterr().out


def test_cli_non_json_5xx_exit_1(tmp_path, capsys):
    async def broken(request):
        return web.Response(status=502, text="Bad Gateway from a proxy")

    app = web.Application()
    app.router.add_get("/v1/audio/voices", broken)
    with serving(app) as url:
        assert cli("voices", "list", "--url", url) == 1
    assert "502" in capsys.readouterr().err
