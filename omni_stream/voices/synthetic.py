"""A voiced, speech-like test signal: what the voice tests and benchmarks clone from.

Harmonics of a gliding pitch (110 +- 25 Hz) under a syllable-rate envelope, plus a little
seeded noise: real enough for the speaker encoder and the tokenizer's encoder to give varied,
non-degenerate outputs, and made on the spot (no audio in git).
"""

from __future__ import annotations

import numpy as np


def voiced_clip(seconds: float, sr: int = 24000, seed: int = 0) -> np.ndarray:
    """float32 mono samples in about [-0.33, 0.33]."""
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 110 + 25 * np.sin(2 * np.pi * 0.9 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 9)) * np.clip(np.sin(2 * np.pi * 3.3 * t), 0, None)
    wav = 0.3 * wav / np.abs(wav).max() + 0.01 * g.standard_normal(t.size)
    return wav.astype(np.float32)
