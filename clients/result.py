"""What every client path returns or raises (shared by the PCM and the codec-frame clients)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from clients.playback import PlaybackReport, simulate_playback

SAMPLE_RATE = 24000


class ClientError(RuntimeError):
    """A failure the user can act on; the message says what to do."""


@dataclass
class StreamResult:
    pcm: np.ndarray  # int16 mono
    ttfa_s: float
    total_s: float
    arrivals: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    wire_bytes: int = 0  # payload bytes received (audio, or codec frames and their headers)
    notes: list[str] = field(default_factory=list)  # things the user should know (not errors)

    @property
    def audio_s(self) -> float:
        return len(self.pcm) / SAMPLE_RATE

    @property
    def rtf(self) -> float:
        return self.total_s / max(self.audio_s, 1e-9)

    def playback(self, prebuffer_s: float = 0.0) -> PlaybackReport:
        return simulate_playback(self.arrivals, self.durations, prebuffer_s)
