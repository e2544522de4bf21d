"""ECAPA-TDNN speaker encoder of the Base variant (its log-mel front-end: ``models/mel.py``).

The Base checkpoint stores this network under ``speaker_encoder.*``; it maps a 24 kHz reference
clip to one x-vector (``enc_dim`` wide, the talker hidden size) that x-vector voice cloning puts in
the speaker slot of the prompt. Module and parameter names mirror the checkpoint keys exactly so
loading is a strict one-to-one copy (see :func:`expected_keys`).

Numerics follow the official package: every convolution pads ``same`` by *reflection* (not zeros),
the mel front-end pre-pads by reflection and runs an uncentred STFT, and the Slaney mel filterbank
is computed here in closed form (same values as ``librosa.filters.mel(htk=False, norm='slaney')``)
so the product does not depend on librosa.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.config import ConfigError, SpeakerEncoderConfig
from omni_stream.models.mel import MelSettings, mel_spectrogram, slaney_mel_filterbank

logger = logging.getLogger(__name__)

__all__ = [
    "MelSettings",
    "SpeakerEncoder",
    "expected_keys",
    "mel_spectrogram",
    "min_samples",
    "random_state_dict",
    "slaney_mel_filterbank",
    "validate_config",
]


# ----------------------------------------------------------------------------------------------
# Config checks and key map
# ----------------------------------------------------------------------------------------------

def validate_config(cfg: SpeakerEncoderConfig) -> None:
    """Raise ConfigError for configs the ECAPA-TDNN topology cannot be built from."""
    n = len(cfg.enc_channels)
    if n < 3 or len(cfg.enc_kernel_sizes) != n or len(cfg.enc_dilations) != n:
        raise ConfigError(
            "speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations need the same "
            f"length >= 3, got {n}, {len(cfg.enc_kernel_sizes)}, {len(cfg.enc_dilations)}")
    for name in ("mel_dim", "enc_dim", "enc_attention_channels", "enc_res2net_scale",
                 "enc_se_channels", "sample_rate"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v <= 0:
            raise ConfigError(f"speaker_encoder_config.{name} must be a positive int, got {v!r}")
    for name in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
        if any(not isinstance(v, int) or v <= 0 for v in getattr(cfg, name)):
            raise ConfigError(f"speaker_encoder_config.{name} must hold positive ints, got {getattr(cfg, name)}")
    mid = cfg.enc_channels[1:-1]
    for i, c in enumerate(mid, start=1):
        if c != cfg.enc_channels[i - 1]:
            raise ConfigError(
                f"speaker_encoder_config.enc_channels[{i}]={c} must equal enc_channels[{i - 1}]="
                f"{cfg.enc_channels[i - 1]}: SE-Res2Net blocks add their input back unprojected")
        if c % cfg.enc_res2net_scale:
            raise ConfigError(
                f"speaker_encoder_config.enc_channels[{i}]={c} is not divisible by "
                f"enc_res2net_scale={cfg.enc_res2net_scale}")
    if sum(mid) != cfg.enc_channels[-1]:
        raise ConfigError(
            f"speaker_encoder_config.enc_channels[-1]={cfg.enc_channels[-1]} must equal the sum of the "
            f"SE-Res2Net widths {sum(mid)}: feature aggregation concatenates them")


def expected_keys(cfg: SpeakerEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every ``speaker_encoder.``-stripped checkpoint key with its shape, in module order."""
    validate_config(cfg)
    keys: dict[str, tuple[int, ...]] = {}

    def conv(name: str, c_in: int, c_out: int, k: int) -> None:
        keys[f"{name}.weight"] = (c_out, c_in, k)
        keys[f"{name}.bias"] = (c_out,)

    ch, ks = cfg.enc_channels, cfg.enc_kernel_sizes
    conv("blocks.0.conv", cfg.mel_dim, ch[0], ks[0])
    for i in range(1, len(ch) - 1):
        c, sub = ch[i], ch[i] // cfg.enc_res2net_scale
        conv(f"blocks.{i}.tdnn1.conv", ch[i - 1], c, 1)
        for j in range(cfg.enc_res2net_scale - 1):
            conv(f"blocks.{i}.res2net_block.blocks.{j}.conv", sub, sub, ks[i])
        conv(f"blocks.{i}.tdnn2.conv", c, c, 1)
        conv(f"blocks.{i}.se_block.conv1", c, cfg.enc_se_channels, 1)
        conv(f"blocks.{i}.se_block.conv2", cfg.enc_se_channels, c, 1)
    conv("mfa.conv", ch[-1], ch[-1], ks[-1])
    conv("asp.tdnn.conv", 3 * ch[-1], cfg.enc_attention_channels, 1)
    conv("asp.conv", cfg.enc_attention_channels, ch[-1], 1)
    conv("fc", 2 * ch[-1], cfg.enc_dim, 1)
    return keys


def random_state_dict(cfg: SpeakerEncoderConfig, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Reproducible random weights with fan-in scaling, so activations stay O(1) through the stack."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_keys(cfg).items():
        if name.endswith(".weight"):
            fan_in = shape[1] * shape[2]
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        else:
            t = 0.1 * torch.randn(shape, generator=gen)
        out[name] = t.to(dtype)
    return out


def min_samples(cfg: SpeakerEncoderConfig, settings: MelSettings | None = None) -> int:
    """Shortest clip :meth:`SpeakerEncoder.embed` accepts (the reflection pads need enough frames)."""
    settings = settings if settings is not None else MelSettings()
    frames = SpeakerEncoder.min_frames_for(cfg)
    return max(settings.pad + 1, settings.n_fft - 2 * settings.pad + (frames - 1) * settings.hop_size)


# ----------------------------------------------------------------------------------------------
# Network
# ----------------------------------------------------------------------------------------------

def _same_pad(kernel_size: int, dilation: int) -> tuple[int, int]:
    """(left, right) padding that keeps the length, split like PyTorch's padding='same'."""
    total = dilation * (kernel_size - 1)
    return total // 2, total - total // 2


class _TDNN(nn.Module):
    """Conv1d over time with reflection 'same' padding, then ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation)
        self.pad = _same_pad(kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C', T]
        if self.pad != (0, 0):
            x = F.pad(x, self.pad, mode="reflect")
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    """Split channels into `scale` groups; group i>0 is convolved after adding group i-1's output,
    so later groups see a growing receptive field. Group 0 passes through unchanged."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        sub = channels // scale
        self.blocks = nn.ModuleList(_TDNN(sub, sub, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        groups = x.chunk(self.scale, dim=1)
        outs = [groups[0]]
        prev: torch.Tensor | None = None
        for conv, g in zip(self.blocks, groups[1:]):
            prev = conv(g if prev is None else g + prev)
            outs.append(prev)
        return torch.cat(outs, dim=1)


class _SqueezeExcite(nn.Module):
    """Channel gates from the time-averaged features."""

    def __init__(self, channels: int, bottleneck: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, bottleneck, 1)
        self.conv2 = nn.Conv1d(bottleneck, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        gate = x.mean(dim=2, keepdim=True)  # [B, C, 1]
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(gate))))
        return x * gate


class _SERes2NetBlock(nn.Module):
    """1x1 TDNN -> Res2Net -> 1x1 TDNN -> squeeze-excitation, plus the identity shortcut."""

    def __init__(self, channels: int, scale: int, se_channels: int, kernel_size: int,
                 dilation: int) -> None:
        super().__init__()
        self.tdnn1 = _TDNN(channels, channels, 1, 1)
        self.res2net_block = _Res2Net(channels, scale, kernel_size, dilation)
        self.tdnn2 = _TDNN(channels, channels, 1, 1)
        self.se_block = _SqueezeExcite(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time of x [B, C, T] under weights w (summing to 1 over T) -> 2 x [B, C]."""
    mean = (w * x).sum(dim=2)
    var = (w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, torch.sqrt(var.clamp(min=eps))


class _AttentivePooling(nn.Module):
    """Attentive statistics pooling: per-channel softmax attention over time, conditioned on the
    utterance's global mean/std, returning the attended mean and std concatenated."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = _TDNN(3 * channels, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, 2C, 1]
        t = x.shape[2]
        uniform = torch.full((1, 1, t), 1.0 / t, dtype=x.dtype, device=x.device)
        mean, std = _weighted_stats(x, uniform, self.eps)  # [B, C] each
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        scores = self.conv(torch.tanh(self.tdnn(context)))  # [B, C, T]
        mean, std = _weighted_stats(x, F.softmax(scores, dim=2), self.eps)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: mels ``[B, T, mel_dim]`` -> x-vector ``[B, enc_dim]``.

    State-dict keys equal the checkpoint's ``speaker_encoder.*`` keys with the prefix stripped.
    """

    def __init__(self, cfg: SpeakerEncoderConfig, mel: MelSettings | None = None) -> None:
        super().__init__()
        validate_config(cfg)
        self.cfg = cfg
        self.mel = mel if mel is not None else MelSettings(sample_rate=cfg.sample_rate,
                                                           num_mels=cfg.mel_dim,
                                                           fmax=cfg.sample_rate / 2)
        if self.mel.num_mels != cfg.mel_dim:
            raise ConfigError(f"MelSettings.num_mels {self.mel.num_mels} != speaker encoder mel_dim {cfg.mel_dim}")
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([_TDNN(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(_SERes2NetBlock(ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels,
                                               ks[i], dil[i]))
        self.mfa = _TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = _AttentivePooling(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(2 * ch[-1], cfg.enc_dim, 1)
        self.min_frames = self.min_frames_for(cfg)

    @staticmethod
    def min_frames_for(cfg: SpeakerEncoderConfig) -> int:
        """Reflection padding needs pad < length, so the widest dilated conv sets a floor on T."""
        widest = max(max(_same_pad(k, d)) for k, d in zip(cfg.enc_kernel_sizes, cfg.enc_dilations))
        return widest + 1

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels ``[B, T, mel_dim]`` (log-mel from :func:`mel_spectrogram`) -> ``[B, enc_dim]``."""
        if mels.dim() != 3 or mels.shape[2] != self.cfg.mel_dim:
            raise ValueError(
                f"SpeakerEncoder expects mels [batch, frames, {self.cfg.mel_dim}], got {tuple(mels.shape)}")
        if mels.shape[1] < self.min_frames:
            raise ValueError(
                f"reference audio too short: {mels.shape[1]} mel frames, the speaker encoder needs at "
                f"least {self.min_frames}")
        x = mels.transpose(1, 2)  # [B, mel_dim, T]
        feats = []
        for block in self.blocks:
            x = block(x)
            feats.append(x)
        x = self.mfa(torch.cat(feats[1:], dim=1))  # [B, C_last, T]
        return self.fc(self.asp(x)).squeeze(2)  # [B, enc_dim]

    @torch.inference_mode()
    def embed(self, wav_24k: np.ndarray | torch.Tensor) -> torch.Tensor:
        """x-vector of one mono clip at ``cfg.sample_rate`` (24 kHz), samples in [-1, 1] -> ``[enc_dim]``.

        Resampling is the caller's job. The result has the module's dtype and device.
        """
        wav = torch.as_tensor(np.ascontiguousarray(wav_24k) if isinstance(wav_24k, np.ndarray) else wav_24k)
        if not wav.is_floating_point():
            raise ValueError(f"embed expects float samples in [-1, 1], got {wav.dtype}: scale integer PCM first")
        if wav.dim() == 2 and wav.shape[0] == 1:
            wav = wav[0]
        if wav.dim() != 1:
            raise ValueError(f"embed expects one mono clip [samples], got shape {tuple(wav.shape)}")
        need = min_samples(self.cfg, self.mel)
        if wav.shape[0] < need:
            raise ValueError(
                f"reference audio too short: {wav.shape[0]} samples "
                f"({wav.shape[0] / self.mel.sample_rate:.3f} s at {self.mel.sample_rate} Hz), need at "
                f"least {need} ({need / self.mel.sample_rate:.3f} s); several seconds work best")
        param = self.fc.weight
        mels = mel_spectrogram(wav.to(device=param.device, dtype=torch.float32).unsqueeze(0), self.mel)
        return self.forward(mels.to(param.dtype))[0]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "",
                     assign: bool = False) -> None:
        """Strictly load ``prefix``-ed keys (e.g. ``"speaker_encoder."`` on a whole checkpoint).

        Keys outside ``prefix`` are ignored; under it every expected key must be present with its
        exact shape and nothing else may appear. ``assign=True`` adopts the tensors as they are
        (dtype included), e.g. memory-mapped safetensors into a module built on ``meta``.
        """
        want = expected_keys(self.cfg)
        got = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing = [k for k in want if k not in got]
        if missing:
            raise ValueError(f"speaker encoder checkpoint is missing {prefix}{missing[0]}"
                           + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        unexpected = sorted(k for k in got if k not in want)
        if unexpected:
            raise ValueError(f"unexpected speaker encoder key {prefix}{unexpected[0]}"
                           + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
        for k, shape in want.items():
            if tuple(got[k].shape) != shape:
                raise ValueError(f"speaker encoder key {prefix}{k} has shape {tuple(got[k].shape)}, "
                                 f"expected {shape}: is the checkpoint's speaker_encoder_config right?")
        self.load_state_dict(got, strict=True, assign=assign)
