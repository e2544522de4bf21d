"""A real-time player model: given when each chunk arrived, how often would playback starve?

Playback starts ``prebuffer_s`` after the first chunk arrives and consumes audio at real time.
When the next chunk has not arrived by the time the buffered audio runs out, that is an
underrun: playback stalls until the chunk arrives, then continues (so one late chunk counts
once, and the stall delays everything after it, as a real player would).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlaybackReport:
    underruns: int
    underrun_s: float
    max_gap_s: float  # longest time between two consecutive chunk arrivals
    played_s: float


def simulate_playback(arrivals: list[float], durations: list[float],
                      prebuffer_s: float = 0.0) -> PlaybackReport:
    """``arrivals`` [s, monotonic] and ``durations`` [s of audio] per chunk, in order."""
    if len(arrivals) != len(durations):
        raise ValueError("arrivals and durations must have the same length")
    if not arrivals:
        return PlaybackReport(0, 0.0, 0.0, 0.0)
    clock = arrivals[0] + prebuffer_s  # when the player needs the next chunk
    underruns, stalled = 0, 0.0
    for a, d in zip(arrivals, durations):
        if a > clock + 1e-9:
            underruns += 1
            stalled += a - clock
            clock = a
        clock += d
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return PlaybackReport(underruns, stalled, max(gaps, default=0.0), sum(durations))
