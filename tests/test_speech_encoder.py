"""The speech tokenizer encoder (reference audio -> ICL codes) and the voice-clone encoder.

Unit tests run on tiny random weights. The parity tests (marked reference/slow) write random
Base checkpoints (tiny, and 0.6B-shaped with the talker cut to one layer: the speech encoder and
speaker encoder keep their released sizes) and compare with the official
``create_voice_clone_prompt`` run by tests/reference/official_runner.py ``voice-prompt``:
reference codes identical, x-vector max abs diff <= 1e-4 (fp32), at 24 kHz and through the
resampling path (16 kHz, 44.1 kHz). Set OMNI_STREAM_SKIP_REFERENCE=1 to skip those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from omni_stream.checkpoints import presets
from omni_stream.checkpoints.io import CheckpointError, load_codec, load_speech_encoder
from omni_stream.config import ConfigError
from omni_stream.models.speech_encoder import (SpeechEncoder, SpeechEncoderConfig, expected_keys,
                                               random_state_dict)
from omni_stream.voices.encode import VoiceEncoder, resample_to

ROOT = Path(__file__).resolve().parents[1]


def _clip(sr: int, samples: int, seed: int = 0) -> np.ndarray:
    """A voice-ish test signal: two enveloped tones, a chirp and seeded noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / sr
    env = 0.5 * (1 - np.cos(2 * np.pi * np.minimum(t / max(t[-1], 1e-9), 1.0)))
    wav = (0.3 * np.sin(2 * np.pi * 180 * t) * env
           + 0.15 * np.sin(2 * np.pi * (400 + 300 * t) * t) * np.exp(-0.3 * t)
           + 0.1 * np.sin(2 * np.pi * 2300 * t) * (np.sin(2 * np.pi * 3 * t) > 0)
           + 0.03 * rng.standard_normal(samples))
    return wav.astype(np.float32)


@pytest.fixture(scope="module")
def tiny_cfg() -> SpeechEncoderConfig:
    return SpeechEncoderConfig.from_codec_dict(presets.codec_config_dict("tiny"))


@pytest.fixture(scope="module")
def tiny_encoder(tiny_cfg) -> SpeechEncoder:
    enc = SpeechEncoder(tiny_cfg)
    enc.load_weights({f"encoder.{k}": v for k, v in random_state_dict(tiny_cfg, 5).items()})
    return enc.eval()


# ------------------------------------------------------------------------------ config, keys
def test_config_presets_parse():
    tiny = SpeechEncoderConfig.from_codec_dict(presets.codec_config_dict("tiny"))
    big = SpeechEncoderConfig.from_codec_dict(presets.codec_config_dict("0.6b"))
    assert tiny.hidden_size < big.hidden_size and tiny.num_filters < big.num_filters
    assert big == SpeechEncoderConfig.from_codec_dict(presets.codec_config_dict("1.7b"))
    assert big.hidden_size == 512 and big.num_hidden_layers == 8 and big.valid_num_quantizers == 16
    assert big.downsample_rate == 1920


@pytest.mark.parametrize("key,value", [
    ("hidden_act", "swishy"), ("num_filters", 0), ("codebook_dim", 17), ("frame_rate", 25.0),
    ("upsampling_ratios", [8, 6, 5, 0]), ("num_attention_heads", 3), ("use_causal_conv", False),
    ("pad_mode", "reflect"), ("head_dim", 15),
])
def test_bad_config_names_key(key, value):
    codec = presets.codec_config_dict("tiny")
    codec["encoder_config"][key] = value
    with pytest.raises(ConfigError) as e:
        SpeechEncoderConfig.from_codec_dict(codec)
    assert key in str(e.value) or (key == "num_attention_heads" and "num_key_value_heads" in str(e.value))


def test_bad_top_level_config_names_key():
    codec = presets.codec_config_dict("tiny")
    codec["encoder_valid_num_quantizers"] = 40
    with pytest.raises(ConfigError, match="encoder_valid_num_quantizers"):
        SpeechEncoderConfig.from_codec_dict(codec)
    codec = presets.codec_config_dict("tiny")
    del codec["encoder_config"]
    with pytest.raises(ConfigError, match="encoder_config"):
        SpeechEncoderConfig.from_codec_dict(codec)


def test_random_state_dict_matches_keys_and_has_live_codebooks(tiny_cfg):
    sd = random_state_dict(tiny_cfg, 0)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_keys(tiny_cfg)
    usage = [v for k, v in sd.items() if k.endswith("cluster_usage")]
    embed = [v for k, v in sd.items() if k.endswith("embed_sum")]
    assert len(usage) == len(embed) == tiny_cfg.num_quantizers
    assert all(bool((u > 0).all()) for u in usage) and all(float(e.abs().mean()) > 0.05 for e in embed)
    again = random_state_dict(tiny_cfg, 0)
    assert all(torch.equal(sd[k], again[k]) for k in sd)


# ------------------------------------------------------------------------------ encoding
@pytest.mark.parametrize("samples", [1, 1919, 1920, 1921, 3839, 3840, 3841, 24000 + 17])
def test_frames_are_ceil_of_samples_over_1920(tiny_encoder, samples):
    codes = tiny_encoder.encode(torch.from_numpy(_clip(24000, samples)))
    assert codes.dtype == torch.int64 and codes.shape == (-(-samples // 1920), 16)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2048


def test_codes_deterministic_and_informative(tiny_encoder):
    wav = torch.from_numpy(_clip(24000, 3 * 24000 + 111))
    a, b = tiny_encoder.encode(wav), tiny_encoder.encode(wav.clone())
    assert torch.equal(a, b)
    assert all(len(torch.unique(a[:, k])) > 5 for k in range(16)), "codes collapsed"


@pytest.mark.parametrize("bad,msg", [
    (torch.zeros(2, 4000), "mono"), (torch.zeros(0), "too short"),
    (torch.tensor([0.0, float("nan")] * 2000), "NaN"), (torch.zeros(4000, dtype=torch.int16), "float"),
])
def test_bad_audio_raises(tiny_encoder, bad, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_encoder.encode(bad)


def test_strict_load_names_keys(tiny_cfg):
    sd = {f"encoder.{k}": v for k, v in random_state_dict(tiny_cfg, 1).items()}
    enc = SpeechEncoder(tiny_cfg)
    missing = dict(sd)
    del missing["encoder.quantizer.acoustic_residual_vector_quantizer.layers.30.codebook.embed_sum"]
    with pytest.raises(ValueError, match="missing tensors: encoder.quantizer.acoustic_residual_vector_quantizer.layers.30"):
        enc.load_weights(missing)
    extra = dict(sd, **{"encoder.encoder.layers.99.conv.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected tensors: encoder.encoder.layers.99.conv.weight"):
        enc.load_weights(extra)
    bad = dict(sd)
    bad["encoder.downsample.conv.weight"] = torch.zeros(3, 3, 4)
    with pytest.raises(ValueError, match=r"encoder.downsample.conv.weight has shape \(3, 3, 4\)"):
        enc.load_weights(bad)
    enc.load_weights(dict(sd, **{"decoder.x": torch.zeros(1)}))  # other prefixes are not ours


# ------------------------------------------------------------------------------ checkpoints
def test_base_checkpoint_carries_encoder(ckpt_factory, tmp_path):
    base = ckpt_factory("tiny", "base", 0)
    stored = load_file(str(base / "speech_tokenizer" / "model.safetensors"))
    cfg = SpeechEncoderConfig.from_codec_dict(json.loads((base / "speech_tokenizer" / "config.json").read_text()))
    assert {k[len("encoder."):] for k in stored if k.startswith("encoder.")} == set(expected_keys(cfg))
    assert isinstance(load_speech_encoder(base), SpeechEncoder)
    load_codec(base)  # the decoder loader still ignores encoder.*

    cv = ckpt_factory("tiny", "custom_voice", 0)
    assert not any(k.startswith("encoder.") for k in load_file(str(cv / "speech_tokenizer" / "model.safetensors")))
    with pytest.raises(CheckpointError, match="Base checkpoint"):
        load_speech_encoder(cv)
    with pytest.raises(CheckpointError, match="base checkpoint|Base checkpoint"):
        VoiceEncoder(cv)

    # a Base folder whose speech tokenizer lacks the encoder (e.g. a decoder-only copy)
    import shutil
    stripped = tmp_path / "stripped"
    shutil.copytree(base, stripped)
    save_file({k: v for k, v in stored.items() if not k.startswith("encoder.")},
              str(stripped / "speech_tokenizer" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no encoder.. tensors"):
        load_speech_encoder(stripped)
    save_file({k: v for k, v in stored.items() if not k.endswith("layers.3.codebook.embed_sum")},
              str(stripped / "speech_tokenizer" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.3.codebook.embed_sum"):
        load_speech_encoder(stripped)


def test_voice_encoder_modes_and_threads(ckpt_factory):
    ve = VoiceEncoder(ckpt_factory("tiny", "base", 0))
    assert ve.sample_rate == 24000 and ve.x_vector_dim == 64
    wav = _clip(16000, 16000 * 2 + 33)
    icl = ve.encode(wav, 16000, ref_text="Hello there.")
    n24 = int(np.ceil(wav.shape[0] * 24000 / 16000))
    assert icl.icl and icl.ref_codes.shape == (-(-n24 // 1920), 16) and icl.x_vector.shape == (64,)
    xv = ve.encode(wav, 16000, x_vector_only=True)
    assert not xv.icl and np.array_equal(xv.x_vector, icl.x_vector)
    with pytest.raises(ValueError, match="ref_text"):
        ve.encode(wav, 16000)
    with pytest.raises(ValueError, match="sample rate"):
        ve.encode(wav, 0, ref_text="x")
    stereo = np.stack([wav, wav], axis=1)
    assert np.array_equal(ve.encode(stereo, 16000, ref_text="x").ref_codes, icl.ref_codes)

    results: list = [None, None]

    def work(i: int) -> None:
        results[i] = ve.encode(wav, 16000, ref_text="Hello there.")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert np.array_equal(r.ref_codes, icl.ref_codes) and np.array_equal(r.x_vector, icl.x_vector)


def test_resample_length_rule():
    wav = _clip(44100, 44100 + 5)
    out = resample_to(wav, 44100, 24000)
    assert out.dtype == np.float32 and out.shape == (int(np.ceil(wav.shape[0] * 24000 / 44100)),)
    assert resample_to(wav, 24000, 24000) is wav


# ------------------------------------------------------------------------------ parity
_skip_reference = pytest.mark.skipif(os.environ.get("OMNI_STREAM_SKIP_REFERENCE") == "1",
                                     reason="OMNI_STREAM_SKIP_REFERENCE=1")

# id: (sample rate, samples, ref_text or None for x-vector-only); no length is a multiple of 1920
CLIPS = {
    "sr24k": (24000, 24000 * 3 + 1234, "Hello, this is my reference voice."),
    "sr16k": (16000, 16000 * 2 + 777, "A sixteen kilohertz clip."),
    "sr44k": (44100, 44100 * 2 + 99, "Forty four point one."),
    "xvec16k": (16000, 16000 * 2 + 777, None),
}
LONG = {"long24k": (24000, int(24000 * 10.6) + 5, "Longer than the 250-frame sliding window.")}
SHAPES = {"tiny": ("tiny", {}, CLIPS), "0.6b": ("0.6b", dict(talker_layers=1, cp_layers=1), {**CLIPS, **LONG})}


@pytest.fixture(scope="module")
def refpy() -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.reference.refenv import ensure_reference_env

    return ensure_reference_env()


@pytest.fixture(scope="module")
def official_prompts(refpy, ckpt_factory, tmp_path_factory):
    """Per shape: (checkpoint dir, {id: (wav, sr, ref_text)}, official npz) from one runner call."""
    out = {}
    for shape, (preset, overrides, clips) in SHAPES.items():
        ck = ckpt_factory(preset, "base", 3, **overrides)
        tmp = tmp_path_factory.mktemp(f"voice-{shape}")
        reqs, audio = [], {}
        for i, (rid, (sr, n, text)) in enumerate(clips.items()):
            wav = _clip(sr, n, seed=i)
            path = tmp / f"{rid}.wav"
            sf.write(str(path), wav, sr, subtype="FLOAT")
            audio[rid] = (wav, sr, text)
            reqs.append(dict(id=rid, ref_audio=str(path), ref_text=text, x_vector_only=text is None))
        (tmp / "requests.json").write_text(json.dumps(reqs))
        res = tmp / "official.npz"
        r = subprocess.run([str(refpy), str(ROOT / "tests" / "reference" / "official_runner.py"),
                            "voice-prompt", "--model", str(ck), "--requests", str(tmp / "requests.json"),
                            "--out", str(res), "--threads", "2"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        out[shape] = (ck, audio, dict(np.load(res)))
    return out


@pytest.mark.reference
@pytest.mark.slow
@_skip_reference
@pytest.mark.parametrize("shape", list(SHAPES))
def test_voice_prompt_matches_official(shape, official_prompts):
    ck, audio, official = official_prompts[shape]
    ve = VoiceEncoder(ck, dtype=torch.float32)
    for rid, (wav, sr, text) in audio.items():
        # the official loader reads the file back: use the same float32 samples
        ours = ve.encode(wav, sr, ref_text=text, x_vector_only=text is None)
        diff = float(np.abs(ours.x_vector - official[f"{rid}.x_vector"]).max())
        assert diff <= 1e-4, f"{shape}/{rid}: x-vector max abs diff {diff}"
        if text is None:
            assert ours.ref_codes is None and f"{rid}.ref_codes" not in official
            continue
        theirs = official[f"{rid}.ref_codes"]
        assert ours.ref_codes.shape == theirs.shape, (rid, ours.ref_codes.shape, theirs.shape)
        mism = np.argwhere(ours.ref_codes != theirs)
        assert mism.size == 0, f"{shape}/{rid}: first code mismatch at frame/codebook {mism[:1].tolist()}"
