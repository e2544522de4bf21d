"""Numeric yardsticks shared by tests, benchmarks, exporters and the fidelity report."""

from __future__ import annotations

import math

import numpy as np
import torch


def snr_db(ref: torch.Tensor | np.ndarray, test: torch.Tensor | np.ndarray) -> float:
    """Signal-to-noise ratio of ``test`` against ``ref``, 10 log10(|ref|^2 / |ref - test|^2)
    in dB over all elements (float64); inf when identical."""
    r = torch.as_tensor(np.asarray(ref) if not isinstance(ref, torch.Tensor) else ref)
    t = torch.as_tensor(np.asarray(test) if not isinstance(test, torch.Tensor) else test)
    r, t = r.detach().double().reshape(-1), t.detach().double().reshape(-1)
    if r.shape != t.shape:
        raise ValueError(f"SNR needs equal shapes, got {tuple(r.shape)} and {tuple(t.shape)}")
    noise = float(((r - t) ** 2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(float((r ** 2).sum()), 1e-30) / noise)
