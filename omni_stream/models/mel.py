"""The log-mel front-end of the speaker encoder, as the official package computes it.

Pre-padding by reflection, an uncentred STFT with a Hann window, magnitude, a Slaney mel
filterbank computed here in closed form (the same values as
``librosa.filters.mel(htk=False, norm='slaney')``, so nothing depends on librosa), log with a
floor.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from omni_stream.config import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["MelSettings", "mel_spectrogram", "slaney_mel_filterbank"]


@dataclass(frozen=True)
class MelSettings:
    """STFT/mel parameters. The defaults are the ones the official x-vector extraction hard-codes."""

    sample_rate: int = 24000
    n_fft: int = 1024
    num_mels: int = 128
    hop_size: int = 256
    win_size: int = 1024
    fmin: float = 0.0
    fmax: float | None = 12000.0  # None: sample_rate / 2
    clip_val: float = 1e-5  # floor before the log (dynamic range compression)

    def __post_init__(self) -> None:
        for name in ("sample_rate", "n_fft", "num_mels", "hop_size", "win_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"MelSettings.{name} must be a positive int, got {v!r}")
        if self.win_size > self.n_fft:
            raise ConfigError(f"MelSettings.win_size {self.win_size} exceeds n_fft {self.n_fft}")
        top = self.sample_rate / 2 if self.fmax is None else self.fmax
        if not 0.0 <= self.fmin < top <= self.sample_rate / 2:
            raise ConfigError(
                f"MelSettings needs 0 <= fmin < fmax <= sample_rate/2, got fmin={self.fmin}, "
                f"fmax={self.fmax}, sample_rate={self.sample_rate}")

    @property
    def pad(self) -> int:
        """Reflection padding on each side before the uncentred STFT."""
        return (self.n_fft - self.hop_size) // 2

    def num_frames(self, samples: int) -> int:
        """Mel frames produced for a clip of ``samples`` samples (0 if too short for one frame)."""
        padded = samples + 2 * self.pad
        return 0 if padded < self.n_fft else (padded - self.n_fft) // self.hop_size + 1


# Slaney mel scale (librosa htk=False): linear below 1 kHz, logarithmic above.
_SLANEY_HZ_PER_MEL = 200.0 / 3.0
_SLANEY_BREAK_HZ = 1000.0
_SLANEY_BREAK_MEL = _SLANEY_BREAK_HZ / _SLANEY_HZ_PER_MEL  # 15 mel
_SLANEY_LOG_STEP = math.log(6.4) / 27.0  # mel step is log-spaced above the break


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _SLANEY_HZ_PER_MEL
    high = hz >= _SLANEY_BREAK_HZ
    mel[high] = _SLANEY_BREAK_MEL + np.log(hz[high] / _SLANEY_BREAK_HZ) / _SLANEY_LOG_STEP
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * _SLANEY_HZ_PER_MEL
    high = mel >= _SLANEY_BREAK_MEL
    hz[high] = _SLANEY_BREAK_HZ * np.exp(_SLANEY_LOG_STEP * (mel[high] - _SLANEY_BREAK_MEL))
    return hz


def slaney_mel_filterbank(sample_rate: int, n_fft: int, num_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> np.ndarray:
    """Triangular Slaney-scale filters with Slaney area normalisation, ``[num_mels, n_fft//2+1]``.

    Equal to ``librosa.filters.mel(sr=..., n_fft=..., n_mels=..., fmin=..., fmax=...)`` with its
    defaults (``htk=False, norm='slaney'``), float32. Computed in float64 and rounded once.
    """
    fmax = sample_rate / 2 if fmax is None else float(fmax)
    bin_hz = np.arange(n_fft // 2 + 1, dtype=np.float64) * (sample_rate / n_fft)  # [F]
    # num_mels + 2 band edges equally spaced in mel: filter m spans edges m .. m+2, peak at m+1.
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array([fmin]))[0],
                                   _hz_to_mel(np.array([fmax]))[0], num_mels + 2))
    widths = np.diff(edges)  # [M+1]
    rising = (bin_hz[None, :] - edges[:-2, None]) / widths[:-1, None]  # [M, F]
    falling = (edges[2:, None] - bin_hz[None, :]) / widths[1:, None]  # [M, F]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # unit area per filter
    return weights.astype(np.float32)


@functools.lru_cache(maxsize=8)
def _cached_filterbank(settings: MelSettings) -> torch.Tensor:
    fb = slaney_mel_filterbank(settings.sample_rate, settings.n_fft, settings.num_mels,
                               settings.fmin, settings.fmax)
    return torch.from_numpy(fb)


def mel_spectrogram(wav: torch.Tensor, settings: MelSettings | None = None) -> torch.Tensor:
    """Log-mel features of ``wav`` ``[B, samples]`` (float32, nominally in [-1, 1]) -> ``[B, T, num_mels]``.

    Same values as the official ``mel_spectrogram(...).transpose(1, 2)``: reflection pre-pad of
    ``(n_fft - hop) // 2`` per side, uncentred Hann STFT, magnitude ``sqrt(re^2 + im^2 + 1e-9)``,
    Slaney mel projection, ``log(max(x, 1e-5))``. ``T = samples // hop`` for the default settings.
    """
    settings = settings if settings is not None else MelSettings()
    if wav.dim() != 2:
        raise ValueError(f"mel_spectrogram expects wav of shape [batch, samples], got {tuple(wav.shape)}")
    if not wav.is_floating_point():
        raise ValueError(f"mel_spectrogram expects a float waveform, got {wav.dtype}")
    samples = wav.shape[-1]
    if samples <= settings.pad or settings.num_frames(samples) < 1:
        raise ValueError(
            f"audio too short for a mel frame: {samples} samples, need at least "
            f"{max(settings.pad + 1, settings.n_fft - 2 * settings.pad)}")
    lo, hi = float(wav.min()), float(wav.max())
    if lo < -1.0 or hi > 1.0:
        logger.warning("waveform exceeds [-1, 1] (min %.3f, max %.3f): expected normalised audio", lo, hi)

    wav = wav.float()
    padded = F.pad(wav.unsqueeze(1), (settings.pad, settings.pad), mode="reflect").squeeze(1)
    window = torch.hann_window(settings.win_size, device=wav.device)
    spec = torch.stft(padded, settings.n_fft, hop_length=settings.hop_size,
                      win_length=settings.win_size, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)  # [B, F, T]
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, F, T]
    mel = torch.matmul(_cached_filterbank(settings).to(wav.device), magnitude)  # [B, M, T]
    return torch.log(torch.clamp(mel, min=settings.clip_val)).transpose(1, 2)  # [B, T, M]
