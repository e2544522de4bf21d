"""Decoder export: the functional streaming step, the pt2 program and its manifest, and the
server's codec-frame streams (same chunk schedule and end of stream as audio streams).

The ``.pte`` export and the client backends are tested end to end in test_client_decode.py (one
ExecuTorch lowering per session: about a minute on a 2-core CPU). AOTInductor is covered by the
benchmark only (benchmarks/tts/decoder_export_bench.py): compiling the tiny codec takes more
than a minute here, and it runs the same ExportedProgram the pt2 tests check.
"""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
import torch

from omni_stream.cli import main as cli_main
from omni_stream.export.code2wav_step import Code2WavStep, run_steps, state_specs
from omni_stream.evaluation.metrics import snr_db
from omni_stream.export.torch_program import ExportError, export_program
from omni_stream.export.manifest import Manifest, ManifestError, codec_identity, file_sha256
from omni_stream.checkpoints.io import load_codec
from omni_stream.models.code2wav import Code2WavStream

pytestmark = pytest.mark.timeout(300)

MAX_CHUNK = 8


@pytest.fixture(scope="module")
def codec(tiny_ckpt):
    return load_codec(tiny_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 2048, (1, 16, 21), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def pt2_dir(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("dec-pt2")
    rc = cli_main(["export-decoder", "--model", str(tiny_ckpt), "--format", "pt2", "--out",
                   str(out), "--max-chunk", str(MAX_CHUNK), "--no-progress"])
    assert rc == 0
    return out


def test_functional_step_equals_stream_and_one_pass(codec, codes):
    """The exportable step (state in, state out) runs the same layers as Code2WavStream: same
    samples at any chunking, and equal to the one-pass decode to float rounding."""
    step = Code2WavStep(codec).eval()
    with torch.no_grad():
        ref = codec(codes)
    stream = Code2WavStream(codec, 2)
    with torch.inference_mode():
        streamed = torch.cat([stream.decode([1], codes[:, :, a:b])
                              for a, b in ((0, 1), (1, 3), (3, 10), (10, 21))], dim=-1)
    for chunks in ([1] * 6 + [15], [1, 2, 4, 8, 6], [21]):
        got = run_steps(step, codes, chunks)
        assert got.shape == ref.shape
        assert snr_db(ref, got) > 100
        torch.testing.assert_close(got, streamed, rtol=0, atol=1e-5)


def test_state_specs_match_new_state(codec):
    specs = state_specs(codec)
    st = codec.new_state(1)
    flat = [st.pos, *st.keys, *st.values, *st.tails]
    assert [s.shape for s in specs] == [tuple(t.shape) for t in flat]
    assert specs[0].name == "pos" and specs[0].dtype == "int64"
    assert specs[1].name == "attn0.keys" and specs[1].shape[2] == codec.cfg.sliding_window - 1


def test_pt2_program_decodes_exactly_at_any_chunking(pt2_dir, codec, codes):
    from clients.decoders import ProgramDecoder

    with torch.no_grad():
        ref = codec(codes)[0].numpy()
    dec = ProgramDecoder(pt2_dir / "manifest.json")
    frames = codes[0].T.numpy()  # [T, 16]
    for chunks in ([1, 2, 4, 8, 6], [3, 8, 10]):  # 10 > max chunk: the decoder splits it
        dec.reset()
        at, out = 0, []
        for c in chunks:
            out.append(dec.decode(frames[at:at + c]))
            at += c
        got = np.concatenate(out)
        assert got.shape == ref.shape
        assert snr_db(torch.from_numpy(ref), torch.from_numpy(got)) >= 80


def test_export_self_check_catches_a_wrong_program(codec):
    """The exporter's verify step is what stands between a broken lowering and a manifest."""
    from omni_stream.export.torch_program import verify
    from omni_stream.export.code2wav_step import Code2WavStep

    step = Code2WavStep(codec).eval()

    def exact(codes, state):
        wav, *new = step(codes, *state)
        return wav, new

    def forgetful(codes, state):  # drops the state: what a wrongly lowered program might do
        wav, *_ = step(codes, *[torch.zeros_like(s) for s in state])
        return wav, state

    ok = verify(codec, exact, max_chunk=4)
    assert ok["snr_db"] > 100 and ok["chunks"][-1] == 4 and ok["frames"] == sum(ok["chunks"])
    with pytest.raises(ExportError, match="does not match the eager decoder"):
        verify(codec, forgetful, max_chunk=4)


def test_manifest_records_what_a_client_needs(pt2_dir, tiny_ckpt, codec):
    m = Manifest.read(pt2_dir)
    raw = json.loads((pt2_dir / "manifest.json").read_text())
    assert raw["version"] == 2 and raw["codec"]["sample_rate"] == 24000
    assert (m.format, m.part, m.chunk_frames, m.max_chunk_frames) == ("pt2", "code2wav", (1, MAX_CHUNK), MAX_CHUNK)
    assert m.codec.num_codebooks == 16 and m.codec.samples_per_frame == 1920
    assert m.codec.codec_sha256 == codec_identity(tiny_ckpt).codec_sha256
    assert [f.name for f in m.files] == ["code2wav_step.pt2"] and m.check_files() == m.program_path
    assert m.files[0].sha256 == file_sha256(m.program_path)
    assert m.files[0].bytes == m.program_path.stat().st_size
    assert m.source_checkpoint == str(tiny_ckpt.resolve())
    assert list(m.state) == state_specs(codec) and m.state[0].name == "pos"
    assert [t.name for t in m.inputs] == ["codes"] and m.inputs[0].shape == (1, 16, MAX_CHUNK)
    assert [t.name for t in m.outputs] == ["wav"] + [f"{t.name}.next" for t in m.state]
    assert m.step is None and m.quantization == ""
    assert m.verified["snr_db"] >= 80 and m.exporter["torch"] == torch.__version__


def test_codec_identity_tells_checkpoints_apart(tiny_ckpt, ckpt_factory):
    a, b = codec_identity(tiny_ckpt), codec_identity(ckpt_factory("tiny", "custom_voice", 1))
    assert a == codec_identity(tiny_ckpt)
    assert a.codec_sha256 != b.codec_sha256 and a.num_codebooks == b.num_codebooks


def test_manifest_checks_and_errors(pt2_dir, tmp_path, tiny_ckpt, ckpt_factory):
    m = Manifest.read(pt2_dir / "manifest.json")
    m.check_against(codec_identity(tiny_ckpt).as_dict(), "qwen3-tts")  # same model: fine
    other = codec_identity(ckpt_factory("tiny", "custom_voice", 1)).as_dict()
    with pytest.raises(ManifestError, match="is for another model: its codec weights"):
        m.check_against(other, "qwen3-tts")
    with pytest.raises(ManifestError, match="num_codebooks 16 here, 8"):
        m.check_against({"num_codebooks": 8})
    with pytest.raises(ManifestError, match="sample_rate 24000 here, 16000"):
        m.check_against({"sample_rate": 16000})
    with pytest.raises(ManifestError, match="not found: export one"):
        Manifest.read(tmp_path / "nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ManifestError, match="bad JSON"):
        Manifest.read(bad)
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(ManifestError, match="re-export"):
        Manifest.read(bad)


def test_export_refuses_bad_requests(pt2_dir, tiny_ckpt, tmp_path, capsys):
    with pytest.raises(ExportError, match="exists: pass --overwrite"):
        export_program(tiny_ckpt, "pt2", pt2_dir, max_chunk=MAX_CHUNK, progress=False)
    with pytest.raises(ExportError, match="unknown format"):
        export_program(tiny_ckpt, "onnx", tmp_path, progress=False)
    rc = cli_main(["export-decoder", "--model", str(tmp_path / "missing"), "--format", "pt2",
                   "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------- server side: codec streams


class _Out:
    """Stands in for the codec stage's output ring: records what would be sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, object, int]] = []

    def put(self, payload, *, kind, stream_id, flags=0, **kw) -> bool:
        self.sent.append((stream_id, int(kind), payload, int(flags)))
        return True  # taken (the stage fails a stream whose chunk the ring refuses)


def test_codec_frame_streams_follow_the_audio_chunk_schedule(codec, monkeypatch):
    """A codes-only stream fed the same frames as an audio stream is cut into the same chunks
    and ends (END flag) on the same chunk; its chunks are the frames themselves."""
    from omni_stream.scheduling.chunking import ChunkPolicy
    from omni_stream.stages import codec_stage
    from omni_stream.transport import Flags, Message, MsgKind, StreamStart

    clock = types.SimpleNamespace(t=100.0)
    # one fake clock for arrivals and decode timing: the chunk decisions depend on it alone
    monkeypatch.setattr(codec_stage, "time", types.SimpleNamespace(
        monotonic=lambda: clock.t, perf_counter=lambda: clock.t))
    out = _Out()
    stage = codec_stage.CodecStage(codec, max_slots=2, out=out)

    def msg(kind, sid, flags=0, payload=None):
        return Message(int(kind), int(flags), sid, 0, 0, payload, 0, 0, 0, 0)

    policy = ChunkPolicy(first=1, steady=4, growth=2.0)
    for sid, codes_only in ((1, True), (2, False)):
        start = StreamStart(policy, codes_only=codes_only, input_tokens=7)
        stage.on_message(msg(MsgKind.EVENT, sid, Flags.FIRST, start.to_payload()))
    frames = np.random.default_rng(0).integers(0, 2048, (19, 16), dtype=np.int64)
    for i, f in enumerate(frames):
        for sid in (1, 2):
            stage.on_message(msg(MsgKind.CODES, sid, Flags.END if i == len(frames) - 1 else 0,
                                 f[None]))
        clock.t += 0.02  # generation 4x faster than real time: slack builds, chunks grow
        stage.iterate()
    while stage.iterate():
        pass
    codes_chunks = [(p, f) for s, k, p, f in out.sent if s == 1]
    pcm_chunks = [(p, f) for s, k, p, f in out.sent if s == 2]
    assert all(k == MsgKind.CODES for s, k, _, _ in out.sent if s == 1)
    assert [len(p) for p, _ in codes_chunks] == [len(p) // 1920 for p, _ in pcm_chunks]
    assert [f for _, f in codes_chunks] == [f for _, f in pcm_chunks]
    sizes = [len(p) for p, _ in codes_chunks]
    print("chunk sizes", sizes)
    # a ramp; the first chunk is the policy's 1 plus one frame beside another stream
    assert sizes[0] == 2 and 2 < max(sizes) <= 4 and sum(sizes) == len(frames)
    assert codes_chunks[-1][1] & Flags.END and not any(f & Flags.END for _, f in codes_chunks[:-1])
    np.testing.assert_array_equal(np.concatenate([p for p, _ in codes_chunks]), frames)
    assert stage.stats()["streams"] == 0 and not math.isnan(stage.stats()["decode_ms_per_frame"])


def _two_offset_streams(codec, monkeypatch, piggyback: bool, requested_first: bool = False):
    """Two audio streams fed one frame per talker step, the second joining three steps later;
    returns (the stage, each stream's (pcm, flags) chunks, each stream's frames)."""
    from omni_stream.scheduling.chunking import ChunkPolicy
    from omni_stream.stages import codec_stage
    from omni_stream.transport import Flags, Message, MsgKind, StreamStart

    clock = types.SimpleNamespace(t=100.0)
    monkeypatch.setattr(codec_stage, "time", types.SimpleNamespace(
        monotonic=lambda: clock.t, perf_counter=lambda: clock.t))
    out = _Out()
    stage = codec_stage.CodecStage(codec, max_slots=3, out=out)
    if not piggyback:
        stage._piggyback = lambda by_len, ready: None

    def msg(kind, sid, flags=0, payload=None):
        return Message(int(kind), int(flags), sid, 0, 0, payload, 0, 0, 0, 0)

    rng = np.random.default_rng(3)
    frames = {1: rng.integers(0, 2048, (23, 16), dtype=np.int64),
              2: rng.integers(0, 2048, (17, 16), dtype=np.int64)}
    policies = {1: ChunkPolicy(first=1, steady=2), 2: ChunkPolicy(first=2, steady=8)}
    if requested_first:  # stream 2's first size is a request's initial_codec_chunk_frames
        policies[2] = ChunkPolicy(first=1, steady=8).starting_at(2)
    starts, sent = {1: 0, 2: 3}, {1: 0, 2: 0}
    for step in range(40):
        for sid in (1, 2):
            if step == starts[sid]:
                start = StreamStart(policies[sid], codes_only=False, input_tokens=5)
                stage.on_message(msg(MsgKind.EVENT, sid, Flags.FIRST, start.to_payload()))
            i = sent[sid]
            if step >= starts[sid] and i < len(frames[sid]):
                last = i == len(frames[sid]) - 1
                stage.on_message(msg(MsgKind.CODES, sid, Flags.END if last else 0, frames[sid][i][None]))
                sent[sid] += 1
        clock.t += 0.02
        stage.iterate()
    while stage.iterate():
        pass
    chunks = {sid: [(p, f) for s, k, p, f in out.sent if s == sid] for sid in (1, 2)}
    return stage, chunks, frames


def test_streams_not_due_join_a_decode_of_their_length(codec, monkeypatch):
    """A stream holding enough frames rides along in another stream's decode call (one call,
    two rows) instead of a call of its own later: fewer calls than with each stream on its own
    schedule. Each stream's audio is still exactly its own frames' one-pass decode, the last
    chunk carries END, and a first chunk keeps its policy's first size."""
    from omni_stream.transport import Flags

    alone, _, _ = _two_offset_streams(codec, monkeypatch, piggyback=False)
    stage, chunks, frames = _two_offset_streams(codec, monkeypatch, piggyback=True)
    assert stage.calls < alone.calls, (stage.calls, alone.calls)
    # first sizes kept: stream 1 alone (1), stream 2 beside stream 1 (its 2, plus one)
    assert len(chunks[1][0][0]) == 1920 and len(chunks[2][0][0]) >= 3 * 1920
    # a first size the request asked for is kept as it is, beside other streams too
    _, asked, _ = _two_offset_streams(codec, monkeypatch, piggyback=True, requested_first=True)
    assert len(asked[2][0][0]) == 2 * 1920
    for sid in (1, 2):
        pcm = np.concatenate([p for p, _ in chunks[sid]])
        with torch.no_grad():
            ref = codec(torch.from_numpy(frames[sid].T[None].copy()))[0].numpy()
        assert pcm.shape == ref.shape
        np.testing.assert_allclose(pcm, ref, atol=1e-4)
        assert chunks[sid][-1][1] & Flags.END


def test_codec_warm_up_leaves_every_slot_fresh(codec):
    """The start-up warm-up decodes every ramp shape, then resets its slots: a stream decoded
    afterwards is exactly the one-pass decode of its frames."""
    from omni_stream.stages import codec_stage

    stage = codec_stage.CodecStage(codec, max_slots=3, out=_Out())
    assert stage.warm_up(max_frames=3, max_batch=2) > 0
    st = stage.dec.state
    assert int(st.pos.abs().sum()) == 0
    assert all(float(t.abs().sum()) == 0 for t in (*st.keys, *st.values, *st.tails))
    frames = torch.randint(0, 2048, (1, 16, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = torch.cat([stage.dec.decode([1], frames[:, :, :2]), stage.dec.decode([1], frames[:, :, 2:])], -1)
        torch.testing.assert_close(got, codec(frames), atol=1e-4, rtol=0)
