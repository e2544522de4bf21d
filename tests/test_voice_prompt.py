"""Cloned-voice prompts (x-vector and ICL) position by position, their wire form, and the
codec priming, on a tiny Base checkpoint. Parity with the official code is in
tests/test_voice_clone_parity.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_stream.checkpoints.io import load_model
from omni_stream.engine.sampling import SamplingParams
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.models.prompt import PromptBuilder, PromptError, PromptRequest, ref_text
from omni_stream.transport import CloneSpec, StreamStart
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.models.voice_clone import CODEC_CONTEXT_FRAMES, VoiceClone

TEXT = "Good morning, this is a cloned voice."
REF = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def base(ckpt_factory):
    return load_model(ckpt_factory("tiny", "base", 3), dtype=torch.float32)


@pytest.fixture(scope="module")
def builder(base):
    return PromptBuilder(base.config, base.weights.talker, base.tokenizer)


def _clone(model, frames: int | None = 7, seed: int = 0, text: str | None = REF) -> VoiceClone:
    g = np.random.default_rng(seed)
    xv = g.standard_normal(model.config.talker.lm.hidden_size).astype(np.float32)
    codes = None if frames is None else g.integers(0, 2048, size=(frames, 16))
    return VoiceClone(xv, codes, text if codes is not None else None)


def _rows(builder, req):
    return builder.build(req)


def test_x_vector_fills_the_speaker_slot(base, builder):
    c = _clone(base, frames=None)
    t = base.weights.talker
    p = builder.build(PromptRequest(text=TEXT, language="english", clone=c))
    plain = builder.build(PromptRequest(text=TEXT, language="english"))
    assert p.length == plain.length + 1  # one speaker position more than no speaker at all
    sp = base.config.talker.special
    # role (3), then [think, think_bos, lang, think_eos, SPEAKER, pad] over tts_pad.. tts_bos
    tts_pad = t.text_embed(torch.tensor([sp.tts_pad]))[0]
    got = p.embeds[3 + 4]
    assert torch.allclose(got, tts_pad + torch.from_numpy(c.x_vector), atol=1e-6)
    # same as handing the x-vector in directly
    direct = builder.build(PromptRequest(text=TEXT, language="english",
                                         speaker_embedding=torch.from_numpy(c.x_vector)))
    assert torch.equal(direct.embeds, p.embeds)


@pytest.mark.parametrize("frames", [1, 5, 40])
@pytest.mark.parametrize("stream_text", [False, True])
def test_icl_layout(base, builder, frames, stream_text):
    c = _clone(base, frames=frames)
    t, tok, sp = base.weights.talker, base.tokenizer, base.config.talker.special
    p = builder.build(PromptRequest(text=TEXT, language="english", clone=c,
                                    stream_text=stream_text))
    xv = builder.build(PromptRequest(text=TEXT, language="english",
                                     clone=VoiceClone(c.x_vector)))
    head = 3 + 6  # role + codec prefix with the speaker slot, up to (not including) bos
    assert torch.equal(p.embeds[:head], xv.embeds[:head])
    ref_ids = tok.encode(ref_text(REF))[3:-2]
    text_rows = len(ref_ids) + len(p.text_ids) + 1  # reference, text, tts_eos
    codec_rows = frames + 1  # bos, reference frames
    frame_sum = t.frame_embed(torch.as_tensor(c.ref_codes))
    emb = lambda ids: t.text_embed(torch.tensor(ids))  # noqa: E731
    cemb = lambda ids: t.codec_embed(torch.tensor(ids))  # noqa: E731
    tail = p.embeds[head:]
    if not stream_text:
        assert len(tail) == text_rows + codec_rows and len(p.trailing) == 0
        assert torch.allclose(tail[0], emb([ref_ids[0]])[0] + cemb([sp.codec_pad])[0], atol=1e-6)
        last = tail[text_rows + codec_rows - 1]
        want = frame_sum[-1] + emb([sp.tts_pad])[0]
        assert torch.allclose(last, want, atol=1e-5)
    else:
        assert len(tail) == codec_rows
        assert torch.allclose(tail[0], emb([ref_ids[0]])[0] + cemb([sp.codec_bos])[0], atol=1e-6)
        if text_rows > codec_rows:  # the rest of the text runs on into the decode steps
            assert len(p.trailing) == text_rows - codec_rows
            assert torch.allclose(p.trailing[-1], emb([sp.tts_eos])[0], atol=1e-6)
        else:  # the text ran out first: tts_pad under the remaining frames, nothing trails
            assert len(p.trailing) == 0
            assert torch.allclose(tail[-1], frame_sum[-1] + emb([sp.tts_pad])[0], atol=1e-5)


def test_clone_requests_that_cannot_work_are_refused(base, builder, tiny_model):
    c = _clone(base)
    with pytest.raises(PromptError, match="Base checkpoint"):
        PromptBuilder(tiny_model.config, tiny_model.weights.talker,
                      tiny_model.tokenizer).build(PromptRequest(text=TEXT, clone=c))
    bad = [
        (VoiceClone(np.zeros(5, np.float32)), "expects"),
        (VoiceClone(np.full(c.x_vector.shape, np.nan, np.float32)), "NaN"),
        (VoiceClone(c.x_vector, np.full((3, 16), 2048), REF), r"\[0, 2048\)"),
        (VoiceClone(c.x_vector, np.full((3, 16), -1), REF), r"\[0, 2048\)"),
        (VoiceClone(c.x_vector, np.zeros((3, 8), np.int64), REF), "codebooks"),
    ]
    for clone, match in bad:
        with pytest.raises(PromptError, match=match):
            builder.build(PromptRequest(text=TEXT, clone=clone))
    with pytest.raises(ValueError, match="ref_text"):
        VoiceClone(c.x_vector, c.ref_codes, "  ")
    with pytest.raises(ValueError, match="frames"):
        VoiceClone(c.x_vector, np.zeros((0, 16), np.int64), REF)


def test_clone_spec_and_prime_round_trip(base):
    for c in (_clone(base), _clone(base, frames=None), _clone(base, frames=60)):
        spec = CloneSpec.of(c)
        back = VoiceClone(*spec.arrays(), spec.ref_text)
        assert np.array_equal(back.x_vector, c.x_vector) and back.ref_text == c.ref_text
        assert (back.ref_codes is None) == (c.ref_codes is None)
        if c.ref_codes is not None:
            assert np.array_equal(back.ref_codes, c.ref_codes)
            prime = c.prime_codes()
            assert len(prime) == min(len(c.ref_codes), CODEC_CONTEXT_FRAMES)
            start = StreamStart(ChunkPolicy(), prime_codes=prime.astype("<i8").tobytes())
            got = StreamStart.from_payload(start.to_payload()).prime(16)
            assert np.array_equal(got, c.ref_codes[-CODEC_CONTEXT_FRAMES:])
        else:
            assert c.prime_codes() is None
    with pytest.raises(ValueError, match="byte lengths"):
        CloneSpec(b"\0" * 5).arrays()
    with pytest.raises(ValueError, match="whole number"):
        StreamStart(ChunkPolicy(), prime_codes=b"\0" * 24).prime(16)


def test_offline_icl_audio_is_primed_with_the_reference(base):
    """The synthesizer decodes an ICL voice's speech after the last reference frames and cuts
    their audio: the same samples as decoding reference + speech in one pass."""
    s = Synthesizer(base, max_seq_len=512)
    c = _clone(base, frames=30)
    res = s.synthesize(PromptRequest(text=TEXT, language="english", clone=c, stream_text=True),
                       SamplingParams.greedy(), max_frames=12)
    assert len(res.codes) >= 1
    prime = c.ref_codes[-CODEC_CONTEXT_FRAMES:]
    whole = s.decode_audio(np.concatenate([prime, res.codes]))
    assert np.array_equal(res.audio, whole[len(prime) * 1920:])
    assert not np.allclose(res.audio, s.decode_audio(res.codes))  # the context matters


def test_primed_decoder_state_moves_between_slots(base):
    """The codec stage keeps a voice's primed Code2Wav state and restores it into the next
    stream's slot: that stream must decode exactly as one primed from scratch."""
    from omni_stream.models.code2wav import Code2WavStream

    g = np.random.default_rng(1)
    prime = torch.as_tensor(g.integers(0, 2048, size=(1, 16, 25)))
    speech = torch.as_tensor(g.integers(0, 2048, size=(1, 16, 6)))
    with torch.inference_mode():
        s = Code2WavStream(base.code2wav, max_slots=3)
        s.decode([0], prime)
        snap = s.snapshot(0)
        s.decode([2], speech)  # another stream's traffic in between
        s.restore(1, snap)
        a = s.decode([0], speech)
        b = s.decode([1], speech)
        fresh = Code2WavStream(base.code2wav, max_slots=1)
        fresh.decode([0], prime)
        c = fresh.decode([0], speech)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_synthesize_cli_clones_from_a_file(ckpt_factory, tmp_path):
    """`omni-stream synthesize --ref-audio` speaks the codes offline synthesis gives for the same
    voice; misuse exits with a message naming the fix."""
    import soundfile as sf

    from omni_stream.cli import main as cli_main
    from omni_stream.voices.encode import VoiceEncoder
    from omni_stream.voices.synthetic import voiced_clip

    ck = ckpt_factory("tiny", "base", 3)
    ref = tmp_path / "ref.wav"
    sf.write(ref, voiced_clip(2.5, 16000), 16000, subtype="PCM_16")
    out = tmp_path / "codes.npy"
    assert cli_main(["synthesize", "--model", str(ck), "--text", TEXT, "--language", "english",
                     "--ref-audio", str(ref), "--ref-text", REF, "--greedy", "--max-frames", "8",
                     "--codes-out", str(out)]) == 0
    wav, sr = sf.read(ref, dtype="float32")
    clone = VoiceEncoder(ck).encode(wav, sr, ref_text=REF)
    codes, _, _ = Synthesizer.from_path(ck).generate_codes(
        PromptRequest(text=TEXT, language="english", clone=clone, stream_text=True),
        SamplingParams.greedy(), 0, 8)
    assert np.array_equal(np.load(out), codes)
    for argv, match in ((["--ref-audio", str(ref)], "--ref-text"),
                        (["--ref-text", REF], "--ref-audio"),
                        (["--ref-audio", str(tmp_path / "none.wav"), "--x-vector-only"], "none.wav")):
        with pytest.raises(SystemExit, match=match):
            cli_main(["synthesize", "--model", str(ck), "--text", TEXT, *argv])
