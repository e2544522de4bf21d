"""Client-side decoding end to end: a real pipeline server on the tiny model streams codec frames,
the client decodes them with the ExecuTorch program (exported here once, via the CLI) or eager
torch, and the audio equals what the server decodes itself. Plus every setup error a user can
hit: missing/corrupt program, a manifest for another model, a server without codec frames."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from clients.decoders import DecoderError, FrameDecoder, ProgramDecoder, TorchDecoder
from clients.stream_client import main as client_main
from omni_stream.cli import main as cli_main
from omni_stream.evaluation.metrics import snr_db
from omni_stream.export.manifest import Manifest, codec_identity
from omni_stream.server.testing import serving_in_thread

pytestmark = pytest.mark.timeout(600)

TEXT = "Decoding on the client, frame by frame."


def serving(backend):
    """Serve ``backend`` on a background event-loop thread (the client runs its own loop)."""
    from omni_stream.server.app import start_server

    return serving_in_thread(lambda: start_server(backend, "127.0.0.1", 0), timeout=300)


@pytest.fixture(scope="module")
def pte_manifest(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("dec-pte")
    rc = cli_main(["export-decoder", "--model", str(tiny_ckpt), "--format", "pte",
                   "--out", str(out), "--max-chunk", "8", "--no-progress"])
    assert rc == 0
    return out / "manifest.json"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from omni_stream.orchestrator import PipelineBackend
    from tests.servers import tiny_settings

    backend = PipelineBackend(tiny_settings(tiny_ckpt))
    with serving(backend) as url:
        yield url


def _run(capsys, url, out, *extra) -> dict:
    rc = client_main(["--url", url, "--text", TEXT, "--voice", "ryan", "--language", "english",
                      "--max-new-tokens", "24", "--out", str(out), "--json", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def test_client_backends_give_the_server_audio(server, pte_manifest, tiny_ckpt, tmp_path, capsys):
    """`--decoder-backend executorch --pte-manifest M --seed N` (and torch) write the same wav
    as `--decoder-backend server` for the same seeded request: same samples, within 1 LSB."""
    figs, wavs = {}, {}
    for backend, extra in (("server", ()), ("executorch", ("--pte-manifest", str(pte_manifest))),
                           ("torch", ("--codec-model", str(tiny_ckpt)))):
        out = tmp_path / f"{backend}.wav"
        figs[backend] = _run(capsys, server, out, "--seed", "11", "--decoder-backend", backend,
                             *extra)
        wavs[backend], sr = sf.read(out, dtype="int16")
        assert sr == 24000
    ref = wavs["server"].astype(np.int64)
    assert len(ref) > 0 and len(ref) % 1920 == 0
    for backend in ("executorch", "torch"):
        got = wavs[backend].astype(np.int64)
        assert len(got) == len(ref), backend
        assert int(np.abs(got - ref).max()) <= 1, backend
        assert snr_db(torch.from_numpy(ref), torch.from_numpy(got)) >= 80, backend
        if backend == "torch":  # the codec stage's own kernels: its samples exactly
            assert np.array_equal(got, ref)
        assert figs[backend]["decoder_backend"] == backend
        # codes on the wire: 16 int64 per frame plus a small JSON header per chunk vs 3840 B of PCM
        assert figs[backend]["wire_bytes"] < figs["server"]["wire_bytes"] / 10


class _Recording(FrameDecoder):
    """Passes frames through to ``inner`` and keeps the frames and float samples per chunk."""

    def __init__(self, inner: FrameDecoder) -> None:
        self.inner, self.identity, self.name = inner, inner.identity, inner.name
        self.chunks: list[np.ndarray] = []
        self.pcm: list[np.ndarray] = []

    def check_server(self, announced, server_model=""):
        self.inner.check_server(announced, server_model)

    def reset(self):
        self.inner.reset()

    def decode(self, codes):
        self.chunks.append(np.array(codes))
        self.pcm.append(self.inner.decode(codes))
        return self.pcm[-1]


def test_client_decode_snr_vs_server_decoder_fp32(server, pte_manifest, tiny_ckpt):
    """For one greedy request, each client backend's float audio vs the server's decoder
    (Code2WavStream, fp32, the same chunks the server sent): SNR >= 80 dB, same sample count."""
    from clients.codec_stream import stream_codes
    from omni_stream.checkpoints.io import load_codec
    from omni_stream.models.code2wav import Code2WavStream

    model = load_codec(tiny_ckpt, dtype=torch.float32).eval()
    for dec in (ProgramDecoder(pte_manifest, require_format="pte"), TorchDecoder(tiny_ckpt)):
        rec = _Recording(dec)
        res = asyncio.run(stream_codes(server, TEXT, rec, voice="ryan", language="english",
                                       extra={"greedy": True, "max_new_tokens": 20}))
        assert len(rec.chunks) >= 2 and sum(map(len, rec.chunks)) == 20
        with torch.inference_mode():
            stream = Code2WavStream(model, 1)
            ref = torch.cat([stream.decode([0], torch.from_numpy(c.T.copy())[None])[0]
                             for c in rec.chunks])
        got = torch.from_numpy(np.concatenate(rec.pcm))
        assert got.shape == ref.shape == (20 * 1920,) and len(res.pcm) == 20 * 1920
        assert snr_db(ref, got) >= 80, dec.name


# ----------------------------------------------------------------- bad input: clear errors


def _fails(capsys, argv, match: str) -> None:
    assert client_main(argv) == 2
    err = capsys.readouterr().err
    assert "omni-stream-client: error:" in err and match in err, err


def test_missing_or_corrupt_program_is_a_clear_error(pte_manifest, tmp_path, capsys):
    m = Manifest.read(pte_manifest)
    url = "http://127.0.0.1:9"  # never reached: the decoder is checked first
    base = ["--url", url, "--text", "hi", "--out", str(tmp_path / "x.wav"),
            "--decoder-backend", "executorch"]
    _fails(capsys, base, "needs --pte-manifest")
    _fails(capsys, base + ["--pte-manifest", str(tmp_path / "none.json")], "not found")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(pte_manifest, alone / "manifest.json")
    _fails(capsys, base + ["--pte-manifest", str(alone / "manifest.json")], "is missing")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(pte_manifest.parent, corrupt)
    data = bytearray((corrupt / m.program).read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\x00" * 64
    (corrupt / m.program).write_bytes(bytes(data))
    _fails(capsys, base + ["--pte-manifest", str(corrupt / "manifest.json")], "is corrupt")
    # a garbage program whose hash was recorded (a broken export): the runtime refuses it
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / m.program).write_bytes(b"not a flatbuffer program" * 10)
    raw = json.loads(pte_manifest.read_text())
    from omni_stream.export.manifest import file_sha256

    raw["files"][0].update(sha256=file_sha256(garbage / m.program), bytes=240)
    (garbage / "manifest.json").write_text(json.dumps(raw))
    _fails(capsys, base + ["--pte-manifest", str(garbage / "manifest.json")],
           "cannot load ExecuTorch program")


def test_backend_option_mismatches_are_clear(pte_manifest, tiny_ckpt, tmp_path, capsys):
    base = ["--url", "http://127.0.0.1:9", "--text", "hi", "--out", str(tmp_path / "x.wav")]
    _fails(capsys, base + ["--decoder-backend", "torch"], "needs --codec-model")
    _fails(capsys, base + ["--decoder-backend", "torch", "--codec-model", str(tmp_path)],
           "missing file")
    pt2 = tmp_path / "pt2"
    pt2.mkdir()
    raw = json.loads(pte_manifest.read_text())
    raw["format"] = "pt2"
    (pt2 / "manifest.json").write_text(json.dumps(raw))
    _fails(capsys, base + ["--decoder-backend", "executorch", "--pte-manifest",
                           str(pt2 / "manifest.json")], "describes a 'pt2' program")


def test_manifest_for_another_model_is_refused(pte_manifest, ckpt_factory, tmp_path, capsys):
    """The server announces its codec's weights hash; a manifest exported from another
    checkpoint is refused before any text is sent."""
    from omni_stream.server.fake_backend import FakeBackend

    backend = FakeBackend(model_name="qwen3-tts")
    backend.codec_info = codec_identity(ckpt_factory("tiny", "custom_voice", 1)).as_dict()
    with serving(backend) as url:
        _fails(capsys, ["--url", url, "--text", "hi", "--out", str(tmp_path / "x.wav"),
                        "--decoder-backend", "executorch", "--pte-manifest", str(pte_manifest)],
               "is for another model: its codec weights")
    assert backend.jobs == []  # refused before synthesis
    # and geometry alone: a server at another sample rate
    with serving(FakeBackend(sample_rate=16000)) as url:
        _fails(capsys, ["--url", url, "--text", "hi", "--out", str(tmp_path / "x.wav"),
                        "--decoder-backend", "executorch", "--pte-manifest", str(pte_manifest)],
               "sample_rate 24000 here, 16000")


def test_server_without_codec_frames_is_a_clear_error(pte_manifest, tmp_path, capsys):
    from aiohttp import web

    from omni_stream.server.fake_backend import FakeBackend

    argv = ["--text", "hi", "--out", str(tmp_path / "x.wav"), "--decoder-backend", "executorch",
            "--pte-manifest", str(pte_manifest)]
    with serving(FakeBackend(supports_codec_frames=False)) as url:
        _fails(capsys, ["--url", url, *argv], "does not offer codec frames")

    async def plain_server():  # an HTTP server without the WebSocket endpoint
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def main():
        runner, url = await plain_server()
        try:
            return await asyncio.to_thread(client_main, ["--url", url, *argv])
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 2
    err = capsys.readouterr().err
    assert "does not offer the WebSocket speech stream (HTTP 404" in err, err
    assert "use --decoder-backend server" in err


def test_decoder_rejects_frames_of_another_codec(pte_manifest):
    dec = ProgramDecoder(pte_manifest)
    with pytest.raises(DecoderError, match=r"must be \[frames, 16\]"):
        dec.decode(np.zeros((2, 8), dtype=np.int64))
    with pytest.raises(DecoderError, match=r"must lie in \[0, 2048\)"):
        dec.decode(np.full((1, 16), 4096, dtype=np.int64))


def test_server_decoding_in_bf16_is_noted_not_refused(pte_manifest, tiny_ckpt, tmp_path, capsys):
    """Same codec, but the server decodes in bf16: the client decodes (fp32) and says why its
    audio will not equal --decoder-backend server's, and what gives the server's samples (no
    fp32 program can: the bf16 decode turns any rounding difference into ~30 dB)."""
    from omni_stream.server.fake_backend import FakeBackend

    backend = FakeBackend(model_name="qwen3-tts")
    backend.codec_info = {**codec_identity(tiny_ckpt).as_dict(), "decode_dtype": "bfloat16"}
    out = tmp_path / "x.wav"
    with serving(backend) as url:
        rc = client_main(["--url", url, "--text", "Hello there.", "--out", str(out),
                          "--decoder-backend", "executorch", "--pte-manifest", str(pte_manifest)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "note: the server decodes in bfloat16" in err
    assert "--decoder-backend torch --codec-model" in err and "--codec-dtype fp32" in err
    data, sr = sf.read(out, dtype="int16")
    assert sr == 24000 and len(data) > 0 and len(data) % 1920 == 0


def test_decoders_name_the_way_to_the_servers_samples(pte_manifest, tiny_ckpt):
    """Against a bf16 server an exported (fp32) program cannot give the server's samples and
    says what can; the torch decoder forced to fp32 names --decoder-dtype auto; against an
    fp32 server there is nothing to add."""
    prog = ProgramDecoder(pte_manifest)
    assert prog.dtype == "float32"
    assert "--decoder-backend torch" in prog.dtype_fix("bfloat16")
    assert "--codec-dtype fp32" in prog.dtype_fix("bfloat16")
    assert prog.dtype_fix("float32") == ""
    assert "--decoder-dtype auto" in TorchDecoder(tiny_ckpt, dtype="float32").dtype_fix("bfloat16")
    assert TorchDecoder(tiny_ckpt).dtype_fix("bfloat16") == ""
