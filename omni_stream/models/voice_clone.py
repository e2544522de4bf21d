"""What a cloned voice puts into a talker prompt, as the official ``create_voice_clone_prompt``
builds it.

- x-vector mode (``ref_codes is None``): the speaker encoder's embedding of the reference audio
  fills the prompt's speaker slot.
- ICL mode (the official default): additionally the reference transcript and the reference
  audio's own 16-codebook codes (12 Hz tokenizer encoder) are placed in the prompt before the
  text to speak, and Code2Wav is primed with those codes so the first generated frame is decoded
  with the reference as its left context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CODEC_CONTEXT_FRAMES", "VoiceClone"]

# Reference frames that prime Code2Wav before an ICL stream's first frame. The official decoder
# gives every chunk after its first this much left context (``chunked_decode``,
# left_context_size=25), so it is the context its own output is built with; priming with all
# of a 30 s reference would cost up to 375 frames of decoding before the first audio.
CODEC_CONTEXT_FRAMES = 25


@dataclass(frozen=True, eq=False)
class VoiceClone:
    x_vector: np.ndarray  # float32 [speaker encoder dim] (= talker hidden size)
    ref_codes: np.ndarray | None = None  # int64 [frames, 16]; None: x-vector-only mode
    ref_text: str | None = None  # the reference transcript (ICL mode)

    def __post_init__(self) -> None:
        x = np.ascontiguousarray(self.x_vector, dtype=np.float32).reshape(-1)
        object.__setattr__(self, "x_vector", x)
        if self.ref_codes is not None:
            c = np.ascontiguousarray(self.ref_codes, dtype=np.int64)
            if c.ndim != 2 or c.shape[0] < 1:
                raise ValueError(f"ref_codes must be [frames, codebooks], got {list(c.shape)}")
            object.__setattr__(self, "ref_codes", c)
            if not self.ref_text or not self.ref_text.strip():
                raise ValueError("an ICL voice needs its reference transcript (ref_text)")

    @property
    def icl(self) -> bool:
        """ICL mode: reference transcript and codes in the prompt (else x-vector only)."""
        return self.ref_codes is not None

    @property
    def mode(self) -> str:
        return "icl" if self.icl else "x_vector"

    def prime_codes(self, frames: int = CODEC_CONTEXT_FRAMES) -> np.ndarray | None:
        """The reference frames that prime Code2Wav (the last ``frames``), or None."""
        if self.ref_codes is None or frames <= 0:
            return None
        return self.ref_codes[-frames:]
