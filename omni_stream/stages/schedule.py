"""Chunk schedule: how many codec frames each audio chunk of a stream carries.

A small first chunk gets audio to the listener fast; later chunks grow geometrically up to a
steady size so the decoder works on bigger batches once the listener has a buffer. Growth is
gradual (x2 at most per chunk) because a sudden jump (1 -> 25 frames) leaves an audible gap
while the big chunk is produced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSchedule:
    first: int = 1
    growth: float = 2.0
    steady: int = 8

    def __post_init__(self) -> None:
        if self.first < 1 or self.steady < 1:
            raise ValueError("chunk sizes must be >= 1 frame")
        if self.first > self.steady:
            raise ValueError(f"first chunk ({self.first}) larger than steady chunk ({self.steady})")
        if not 1.0 <= self.growth <= 4.0:
            raise ValueError("growth must be in [1, 4]")

    def size(self, index: int) -> int:
        """Frames in chunk ``index`` (0-based)."""
        n = float(self.first)
        for _ in range(index):
            n = min(float(self.steady), max(n + 1, n * self.growth))
            if n >= self.steady:
                return self.steady
        return int(n)

    def as_list(self) -> list[int]:
        return [self.first, int(self.growth * 1000), self.steady]

    @classmethod
    def from_list(cls, v: list[int]) -> "ChunkSchedule":
        return cls(first=int(v[0]), growth=v[1] / 1000.0, steady=int(v[2]))
