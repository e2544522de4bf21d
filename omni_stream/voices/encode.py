"""Reference audio -> :class:`VoiceClone`, exactly as the official ``create_voice_clone_prompt``.

The official wrapper (qwen-tts 0.1.1) does, per reference clip:
1. resample to 24 kHz with ``librosa.resample`` when the clip is at another rate. librosa 0.11's
   default ``res_type`` is ``soxr_hq``: ``soxr.resample(y, sr, 24000, quality="soxr_hq")``, then
   ``fix_length`` to ``ceil(len * 24000 / sr)`` samples (trim, or zero-pad on the right). Done
   here with the ``soxr`` package directly, same call, same length rule;
2. x-vector: the speaker encoder's embedding of that 24 kHz clip;
3. ICL mode only: the speech tokenizer encoder's 16-codebook codes of the same 24 kHz clip
   (``ceil(samples / 1920)`` frames), plus the transcript, which ICL mode requires.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import soxr
import torch

from omni_stream.checkpoints.io import load_speaker_encoder, load_speech_encoder
from omni_stream.models.voice_clone import VoiceClone

log = logging.getLogger(__name__)

__all__ = ["VoiceEncoder", "resample_to"]


def resample_to(wav: np.ndarray, sr: int, target_sr: int) -> np.ndarray:
    """librosa 0.11 ``resample(res_type="soxr_hq", fix=True)`` semantics, float32 in and out."""
    if sr == target_sr:
        return wav
    n_out = int(np.ceil(wav.shape[-1] * (float(target_sr) / sr)))
    y = soxr.resample(wav, sr, target_sr, quality="soxr_hq")
    if y.shape[-1] > n_out:
        y = y[:n_out]
    elif y.shape[-1] < n_out:
        y = np.pad(y, (0, n_out - y.shape[-1]))
    return np.asarray(y, dtype=wav.dtype)


class VoiceEncoder:
    """Speaker encoder + speech-tokenizer encoder of a Base checkpoint.

    ``encode`` may be called from worker threads (each call runs under ``torch.inference_mode``;
    the modules are read-only after loading).
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        # both loaders raise CheckpointError naming the need for a Base checkpoint
        self.speaker_encoder = load_speaker_encoder(model_dir, dtype)
        self.speech_encoder = load_speech_encoder(model_dir, dtype)

    @property
    def sample_rate(self) -> int:
        """Rate both encoders run at (24 kHz); other rates are resampled."""
        return self.speech_encoder.sample_rate

    @property
    def x_vector_dim(self) -> int:
        return self.speaker_encoder.cfg.enc_dim

    def encode(self, wav: np.ndarray, sr: int, ref_text: str | None = None,
               x_vector_only: bool = False) -> VoiceClone:
        """One mono reference clip (float32 samples in [-1, 1] at ``sr`` Hz) -> VoiceClone.

        ICL mode (``x_vector_only=False``, the official default) needs the clip's transcript.
        """
        if not x_vector_only and (ref_text is None or not ref_text.strip()):
            raise ValueError("ICL voice cloning needs ref_text, the transcript of the reference "
                             "audio; pass x_vector_only=True to clone from the x-vector alone")
        wav = np.asarray(wav)
        if wav.dtype.kind != "f":
            raise ValueError(f"reference audio must be float samples in [-1, 1], got {wav.dtype}")
        if wav.ndim == 2:  # [samples, channels], as soundfile reads it: the official mean
            wav = wav.mean(axis=-1)
        if wav.ndim != 1:
            raise ValueError(f"reference audio must be mono [samples] (or [samples, channels]), "
                             f"got shape {wav.shape}")
        if isinstance(sr, bool) or not isinstance(sr, (int, np.integer)) or sr <= 0:
            raise ValueError(f"sample rate must be a positive int, got {sr!r}")
        wav = wav.astype(np.float32)
        if wav.shape[0] == 0:
            raise ValueError("reference audio is empty")
        if not np.isfinite(wav).all():
            raise ValueError("reference audio contains NaN or infinite samples")
        wav24 = resample_to(wav, int(sr), self.sample_rate)
        with torch.inference_mode():
            x_vector = self.speaker_encoder.embed(wav24).float().cpu().numpy()
            codes = None
            if not x_vector_only:
                codes = self.speech_encoder.encode(torch.from_numpy(wav24)).numpy()
        return VoiceClone(x_vector=x_vector, ref_codes=codes, ref_text=ref_text)
