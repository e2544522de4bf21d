"""Speaker encoder (ECAPA-TDNN x-vector) and its log-mel front-end, on a tiny config.

Expected values come from three independent places: closed-form Slaney formulas evaluated here
one entry at a time, a numpy STFT written out frame by frame, and numbers stored from librosa 0.11
and from the official qwen-tts 0.1.1 classes (same random weights, same audio).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from omni_stream.config import ConfigError, SpeakerEncoderConfig
from omni_stream.models.speaker_encoder import (MelSettings, SpeakerEncoder, expected_keys,
                                                 mel_spectrogram, min_samples, random_state_dict,
                                                 slaney_mel_filterbank)

TINY = SpeakerEncoderConfig(
    mel_dim=128, enc_dim=64, enc_channels=(32, 32, 32, 32, 96), enc_kernel_sizes=(5, 3, 3, 3, 1),
    enc_dilations=(1, 2, 3, 4, 1), enc_attention_channels=16, enc_res2net_scale=4,
    enc_se_channels=16, sample_rate=24000)
PREFIX = "speaker_encoder."


def _tiny(seed: int = 0) -> SpeakerEncoder:
    enc = SpeakerEncoder(TINY).eval()
    enc.load_weights({PREFIX + k: v for k, v in random_state_dict(TINY, seed).items()}, prefix=PREFIX)
    return enc


def _clip(samples: int = 12000) -> np.ndarray:
    """Two tones with a slow modulation: the clip the stored official outputs were computed on."""
    t = np.arange(samples, dtype=np.float64) / 24000
    wav = 0.4 * np.sin(2 * np.pi * 220.0 * t) + 0.2 * np.sin(2 * np.pi * 1330.0 * t) * np.cos(2 * np.pi * 2.0 * t)
    return wav.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# keys and loading
# ---------------------------------------------------------------------------------------------

def test_expected_keys_match_module_and_official_names():
    keys = expected_keys(TINY)
    module = {k: tuple(v.shape) for k, v in SpeakerEncoder(TINY).state_dict().items()}
    assert module == keys
    for name in ("blocks.0.conv.weight", "blocks.1.tdnn1.conv.weight",
                 "blocks.1.res2net_block.blocks.0.conv.weight", "blocks.3.res2net_block.blocks.2.conv.bias",
                 "blocks.1.tdnn2.conv.bias", "blocks.1.se_block.conv1.weight", "blocks.3.se_block.conv2.bias",
                 "mfa.conv.weight", "asp.tdnn.conv.weight", "asp.conv.weight", "fc.weight", "fc.bias"):
        assert name in keys, name
    # 1 TDNN + 3 SE-Res2Net blocks x (tdnn1, 3 res2net convs, tdnn2, 2 SE convs) + mfa + asp x2 + fc
    assert len(keys) == 2 * (1 + 3 * 7 + 4)
    assert keys["blocks.0.conv.weight"] == (32, 128, 5)
    assert keys["blocks.2.res2net_block.blocks.1.conv.weight"] == (8, 8, 3)
    assert keys["asp.tdnn.conv.weight"] == (16, 288, 1)
    assert keys["fc.weight"] == (64, 192, 1)


def test_released_shapes():
    keys = expected_keys(SpeakerEncoderConfig(enc_dim=1024))  # class defaults = released 0.6B Base
    assert keys["blocks.0.conv.weight"] == (512, 128, 5)
    assert keys["blocks.1.res2net_block.blocks.6.conv.weight"] == (64, 64, 3)
    assert keys["mfa.conv.weight"] == (1536, 1536, 1)
    assert keys["fc.weight"] == (1024, 3072, 1)


def test_strict_load_ignores_other_prefixes():
    sd = {PREFIX + k: v for k, v in random_state_dict(TINY, 1).items()}
    sd["talker.model.norm.weight"] = torch.ones(4)  # rest of the checkpoint is not ours
    enc = SpeakerEncoder(TINY)
    enc.load_weights(sd, prefix=PREFIX)
    assert torch.equal(enc.fc.weight, sd[PREFIX + "fc.weight"])


def test_wrong_shape_names_the_key():
    sd = random_state_dict(TINY, 0)
    sd["blocks.2.se_block.conv1.weight"] = torch.zeros(16, 32, 3)
    with pytest.raises(ValueError, match=r"blocks\.2\.se_block\.conv1\.weight"):
        SpeakerEncoder(TINY).load_weights(sd)


def test_missing_and_unexpected_keys_are_named():
    sd = random_state_dict(TINY, 0)
    del sd["asp.conv.bias"]
    with pytest.raises(ValueError, match=r"missing speaker_encoder\.asp\.conv\.bias"):
        SpeakerEncoder(TINY).load_weights({PREFIX + k: v for k, v in sd.items()}, prefix=PREFIX)
    sd = random_state_dict(TINY, 0)
    sd["asp.norm.weight"] = torch.ones(96)
    with pytest.raises(ValueError, match=r"asp\.norm\.weight"):
        SpeakerEncoder(TINY).load_weights(sd)


def test_meta_build_then_assign():
    with torch.device("meta"):
        enc = SpeakerEncoder(TINY)
    enc.load_weights(random_state_dict(TINY, 0), assign=True)
    assert torch.allclose(enc.eval().embed(_clip(4000)), _tiny(0).embed(_clip(4000)))


@pytest.mark.parametrize("change, match", [
    (dict(enc_channels=(32, 32, 32, 96)), "same length"),
    (dict(enc_channels=(32, 32, 32, 32, 64)), "sum of the SE-Res2Net widths"),
    (dict(enc_channels=(32, 30, 30, 30, 90)), "unprojected"),
    (dict(enc_res2net_scale=5), "divisible"),
])
def test_bad_config_raises(change, match):
    import dataclasses
    with pytest.raises(ConfigError, match=match):
        SpeakerEncoder(dataclasses.replace(TINY, **change))


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

def test_output_shapes():
    enc = _tiny()
    with torch.inference_mode():
        assert enc(torch.randn(3, 40, 128)).shape == (3, 64)
    emb = enc.embed(_clip())
    assert emb.shape == (64,) and emb.dtype == torch.float32 and torch.isfinite(emb).all()


def test_deterministic_and_batch_independent():
    a, b = _tiny(0), _tiny(0)
    assert torch.equal(a.embed(_clip()), b.embed(_clip()))
    assert torch.equal(a.embed(_clip()), a.embed(torch.from_numpy(_clip())))
    assert not torch.allclose(a.embed(_clip()), _tiny(1).embed(_clip()))
    mels = torch.randn(2, 30, 128)
    with torch.inference_mode():
        both = a(mels)
        assert torch.allclose(both[1], a(mels[1:])[0], atol=1e-5)


def test_matches_stored_official_embedding():
    # qwen-tts 0.1.1 Qwen3TTSSpeakerEncoder + mel_spectrogram(n_fft 1024, 128 mels, hop 256,
    # win 1024, fmin 0, fmax 12000), loaded with random_state_dict(TINY, seed=0), on _clip().
    emb = _tiny(0).embed(_clip())
    official = [0.669773, 8.687937, -4.399246, -2.583597, 1.543113, 2.138585, -5.493469, -0.541554]
    assert torch.allclose(emb[:8], torch.tensor(official), atol=2e-5)
    assert math.isclose(float(emb.norm()), 42.169308, abs_tol=2e-4)


def test_too_short_audio_raises():
    enc = _tiny()
    need = min_samples(TINY)
    assert need == 1280  # 5 frames: the dilation-4 conv reflects 4 frames each side
    with pytest.raises(ValueError, match="too short"):
        enc.embed(np.zeros(need - 1, np.float32))
    with pytest.raises(ValueError, match="too short"):
        enc.embed(np.zeros(10, np.float32))
    assert enc.embed(_clip(need)).shape == (64,)
    with pytest.raises(ValueError, match="too short"):
        enc(torch.zeros(1, 4, 128))


def test_bad_audio_inputs_raise():
    enc = _tiny()
    with pytest.raises(ValueError, match="mono"):
        enc.embed(np.zeros((2, 4000), np.float32))
    with pytest.raises(ValueError, match="float"):
        enc.embed(np.zeros(4000, np.int16))


# ---------------------------------------------------------------------------------------------
# mel front-end
# ---------------------------------------------------------------------------------------------

def _slaney_hz_to_mel(f: float) -> float:
    return f * 3.0 / 200.0 if f < 1000.0 else 15.0 + 27.0 * math.log(f / 1000.0) / math.log(6.4)


def _slaney_mel_to_hz(m: float) -> float:
    return m * 200.0 / 3.0 if m < 15.0 else 1000.0 * 6.4 ** ((m - 15.0) / 27.0)


def _closed_form_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    lo, hi = _slaney_hz_to_mel(fmin), _slaney_hz_to_mel(fmax)
    edge = [_slaney_mel_to_hz(lo + (hi - lo) * i / (n_mels + 1)) for i in range(n_mels + 2)]
    out = np.zeros((n_mels, n_fft // 2 + 1))
    for m in range(n_mels):
        left, centre, right = edge[m], edge[m + 1], edge[m + 2]
        for k in range(n_fft // 2 + 1):
            f = k * sr / n_fft
            if left < f <= centre:
                tri = (f - left) / (centre - left)
            elif centre < f < right:
                tri = (right - f) / (right - centre)
            else:
                tri = 0.0
            out[m, k] = tri * 2.0 / (right - left)  # Slaney norm: unit area
    return out


@pytest.mark.parametrize("sr, n_fft, n_mels, fmin, fmax", [
    (16000, 64, 6, 50.0, 7000.0), (24000, 256, 20, 0.0, 12000.0), (24000, 1024, 128, 0.0, 12000.0)])
def test_filterbank_closed_form(sr, n_fft, n_mels, fmin, fmax):
    ours = slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    assert ours.shape == (n_mels, n_fft // 2 + 1) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, _closed_form_filterbank(sr, n_fft, n_mels, fmin, fmax), rtol=0, atol=1e-8)


def test_filterbank_matches_stored_librosa():
    # librosa 0.11 filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    stored = {(0, 1): 0.03355042636394501, (0, 2): 0.00856908317655325, (1, 3): 0.012853624299168587,
              (9, 11): 0.028539981693029404, (10, 13): 0.01786407083272934,
              (30, 35): 0.03645404428243637, (30, 36): 0.0029036165215075016,
              (64, 89): 0.01410350389778614, (64, 90): 0.013717172667384148,
              (100, 239): 0.006238921079784632, (127, 498): 0.003086800454184413,
              (127, 511): 0.0002281783672515303, (5, 12): 0.0, (127, 484): 0.0}
    fb = slaney_mel_filterbank(24000, 1024, 128, 0.0, 12000.0)
    for (m, k), v in stored.items():
        assert abs(float(fb[m, k]) - v) < 1e-8, (m, k)
    assert abs(float(fb.sum()) - 5.459415435791016) < 1e-5


def test_mel_spectrogram_matches_numpy_stft():
    s = MelSettings()
    wav = _clip(3000)
    ours = mel_spectrogram(torch.from_numpy(wav).unsqueeze(0), s)[0].numpy()  # [T, M]
    padded = np.pad(wav.astype(np.float64), s.pad, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(s.win_size) / s.win_size)  # periodic Hann
    frames = [padded[i * s.hop_size: i * s.hop_size + s.n_fft] * window
              for i in range((len(padded) - s.n_fft) // s.hop_size + 1)]
    mag = np.sqrt(np.abs(np.fft.rfft(np.stack(frames), axis=1)) ** 2 + 1e-9)  # [T, F]
    ref = np.log(np.maximum(mag @ _closed_form_filterbank(24000, 1024, 128, 0.0, 12000.0).T, 1e-5))
    assert ours.shape == ref.shape == (3000 // 256, 128)
    # float32 FFT noise is ~1e-7 of the peak, so compare linear magnitudes against the peak ...
    np.testing.assert_allclose(np.exp(ours), np.exp(ref), rtol=1e-4, atol=1e-6 * np.exp(ref).max())
    # ... and log values where the band holds real energy
    loud = ref > -6.0
    assert loud.mean() > 0.2
    np.testing.assert_allclose(ours[loud], ref[loud], rtol=0, atol=1e-4)
    # silence sits on the log floor
    floor = mel_spectrogram(torch.zeros(1, 2048), s)
    assert torch.allclose(floor, torch.full_like(floor, math.log(1e-5)))


def test_mel_spectrogram_matches_stored_official():
    mel = mel_spectrogram(torch.from_numpy(_clip()).unsqueeze(0))
    assert mel.shape == (1, 46, 128)
    official = [-5.859345, -5.510355, -5.017606, -4.384523, -3.558202, -2.383176]
    assert torch.allclose(mel[0, 10, :6], torch.tensor(official), atol=2e-5)
