"""How long a stream may run when the request does not say: a frame cap that follows the text.

A model that never emits end-of-speech (a random checkpoint, a degenerate sampled path) must not
stream for minutes on "Hi.". Speech runs at roughly 3-6 codec frames (80 ms each) per text
token: English at ~150 words a minute is ~3.8 frames per Qwen token, a spelled-out digit
~5, a CJK character ~3. The default cap allows ``base_frames + frames_per_token * tokens``,
about three times a slow reading, plus a floor for very short inputs:

    cap = 40 + 12 * text_tokens      ("Hi." = 2 tokens -> 64 frames = 5.1 s)

never above the server's per-stream ceiling (``PipelineSettings.default_max_frames``) nor the
positions left in a stream's slot. An explicit ``max_new_tokens`` replaces the formula (still
within the server's limits). A stream that reaches its cap ends with ``finish_reason: length``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FrameCap:
    base_frames: int = 40
    frames_per_token: float = 12.0

    def __post_init__(self) -> None:
        if self.base_frames < 1:
            raise ValueError(f"base_frames must be >= 1, got {self.base_frames}")
        if not (math.isfinite(self.frames_per_token) and self.frames_per_token > 0):
            raise ValueError(f"frames_per_token must be a finite number > 0, got "
                             f"{self.frames_per_token}")

    def frames(self, text_tokens: int) -> int:
        """The default cap for a text of ``text_tokens`` tokens (before the server's limits)."""
        return self.base_frames + math.ceil(self.frames_per_token * max(0, text_tokens))


def stream_frame_cap(requested: int | None, text_tokens: int, cap: FrameCap, server_max: int,
                     room: int) -> int:
    """Frames a stream may generate: the request's ``max_new_tokens`` if given, else the text's
    default cap; never more than ``server_max`` or the ``room`` left in its slot (>= 1)."""
    want = requested if requested is not None else min(cap.frames(text_tokens), server_max)
    return max(1, min(want, room))
