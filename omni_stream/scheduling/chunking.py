"""Adaptive chunk schedule: how many codec frames the next audio chunk of a stream carries.

A chunk of n frames reaches the listener only when its last frame is made, so while it is made
the listener plays from its buffer (the stream's slack, see ``throttle.slack_s``). Small chunks
arrive early but pay the per-chunk costs (a Code2Wav call, a hop, an encode) more often; big
chunks amortise them but leave a longer silence if the buffer is short. Hence:

- the first chunk is tiny (1-2 frames) for fast first audio;
- later chunks ramp up by at most x2 per chunk (a sudden 1 -> 25 jump leaves an audible gap
  while the big chunk is made) towards ``steady``;
- a step up is taken only while the buffer stays above ``min_slack_s`` until the bigger chunk
  arrives; when the slack is low the chunk shrinks to what the buffer covers, never below 1.

This is the one chunk-schedule type: the orchestrator sends it to the codec stage inside
``AddStream`` / ``StreamStart`` (a msgspec struct, so it crosses processes as msgpack), the codec
stage sizes every chunk with ``next_chunk``, and the fake backend ramps with ``ramp``.

``calibrate_fit`` picks the parameters from chunk costs: the server's come from its one timing
model (``scheduling.capacity``: measured per deployment and cached), ``calibrate`` fits them to
measured chunk arrivals.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from omni_stream.config import FRAME_S
log = logging.getLogger(__name__)

MAX_GROWTH = 2.0


class ChunkPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``first`` frames, then growth towards ``steady`` (x ``growth`` per chunk, <= x2), gated on
    ``min_slack_s`` of buffered audio remaining when the next chunk lands. A frozen msgspec
    struct: validated in ``__post_init__`` whether built here or decoded from a message."""

    first: int = 1
    steady: int = 8
    growth: float = 2.0
    min_slack_s: float = 0.16
    audio_frame_s: float = FRAME_S
    first_requested: bool = False  # ``first`` is a request's own: the server does not adjust it
    # the listener starts playing this long after the first chunk (the server's hold-back on a
    # machine slower than real time): that much more audio is buffered than sent minus played
    hold_s: float = 0.0

    def __post_init__(self) -> None:
        if self.first < 1 or self.steady < self.first:
            raise ValueError(f"need 1 <= first ({self.first}) <= steady ({self.steady})")
        if not 1.0 <= self.growth <= MAX_GROWTH:
            raise ValueError(f"growth must be in [1, {MAX_GROWTH}], got {self.growth}")
        if self.min_slack_s < 0 or self.audio_frame_s <= 0:
            raise ValueError("min_slack_s must be >= 0 and audio_frame_s > 0")
        if not (math.isfinite(self.hold_s) and self.hold_s >= 0):
            raise ValueError(f"hold_s must be a finite number >= 0, got {self.hold_s}")

    def starting_at(self, first: int) -> "ChunkPolicy":
        """This policy with a first chunk of ``first`` frames (a request's
        ``initial_codec_chunk_frames``); ``steady`` is raised to ``first`` if it is smaller."""
        return msgspec.structs.replace(self, first=first, steady=max(self.steady, first),
                                       first_requested=True)

    def held(self, hold_s: float) -> "ChunkPolicy":
        """This policy for a stream whose first audio is held back ``hold_s`` seconds."""
        return msgspec.structs.replace(self, hold_s=hold_s)

    def grow(self, prev: int) -> int:
        """The ramp's next size after ``prev``: x growth (at least +1), at most x2 and steady."""
        return max(1, min(self.steady, 2 * prev, max(prev + 1, int(prev * self.growth))))

    def ramp(self, index: int) -> int:
        """Chunk ``index``'s size when slack never limits it."""
        n = self.first
        for _ in range(index):
            n = self.grow(n)
        return n

    def next_chunk(self, index: int, slack_s: float, frame_time_s: float,
                   decode_ms_per_frame: float, prev: int | None = None) -> int:
        """Frames in chunk ``index`` (0-based).

        ``slack_s``: audio buffered at the client now; ``frame_time_s``: measured wall time to
        generate one frame (talker + code predictor step); ``decode_ms_per_frame``: measured
        Code2Wav cost per frame. ``prev``: the previous chunk's actual size (default: the ramp's),
        so growth is x2 at most relative to what was really sent."""
        if index == 0:
            return self.first
        prev = self.ramp(index - 1) if prev is None else max(1, prev)
        per_frame = max(0.0, frame_time_s) + max(0.0, decode_ms_per_frame) / 1e3
        spare = slack_s - self.min_slack_s
        affordable = math.inf if per_frame == 0 else math.floor(spare / per_frame + 1e-9)
        target = self.grow(prev)
        if target <= affordable:
            return target
        return int(max(1, min(prev, self.steady, affordable)))

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChunkPolicy":
        return cls(first=int(d["first"]), steady=int(d["steady"]), growth=float(d["growth"]),
                   min_slack_s=float(d["min_slack_s"]),
                   audio_frame_s=float(d.get("audio_frame_s", FRAME_S)))


@dataclass(frozen=True)
class ChunkCostFit:
    """Time between chunk arrivals ~= per_chunk_s + per_frame_s x frames."""

    per_chunk_s: float
    per_frame_s: float
    residual_s: float  # RMS residual: the jitter the slack reserve must cover
    samples: int


def fit_chunk_costs(arrivals: Sequence[tuple[int, float]]) -> ChunkCostFit:
    """Fit arrival gaps of one stream's chunks ((frames, arrival time) in order, from a run where
    the pipeline never waited on the listener). Chunk i's gap is arrival[i] - arrival[i-1]; chunk
    0 has none (its wait holds the prefill). Needs later chunks of at least two sizes (a ramp
    gives them)."""
    pts = [(arrivals[i][0], arrivals[i][1] - arrivals[i - 1][1]) for i in range(1, len(arrivals))]
    if len(pts) < 2 or len({n for n, _ in pts}) < 2:
        raise ValueError("calibration needs >= 2 chunks after the first, of >= 2 distinct sizes "
                         "(run a ramp such as first=1, growth=2, steady=16)")
    if any(g < 0 for _, g in pts):
        raise ValueError("chunk arrival times must be non-decreasing")
    xs, ys = [float(n) for n, _ in pts], [g for _, g in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if b < 0:
        a, b = my, 0.0
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    rms = math.sqrt(sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / len(xs))
    return ChunkCostFit(per_chunk_s=a, per_frame_s=b, residual_s=rms, samples=len(xs))


def calibrate(arrivals: Sequence[tuple[int, float]], **kw: Any) -> ChunkPolicy:
    """``calibrate_fit`` of the costs fitted to measured chunk arrivals (``fit_chunk_costs``)."""
    return calibrate_fit(fit_chunk_costs(arrivals), **kw)


def calibrate_fit(fit: ChunkCostFit, *, audio_frame_s: float = FRAME_S,
                  target_rtf: float = 0.8, max_first: int = 2, max_steady: int = 32,
                  growth: float = MAX_GROWTH, min_slack_floor_s: float = 0.08,
                  jitter_sigmas: float = 3.0, min_steady: int = 1) -> ChunkPolicy:
    """Chunk-policy parameters from chunk costs (a chunk of n frames arrives ~ per_chunk_s +
    n x per_frame_s after the previous one). The server's costs come from one timing model
    (``scheduling.capacity.chunk_policy``); ``calibrate`` fits them to arrivals.

    - steady: the smallest size >= ``min_steady`` whose cost per frame of audio, (per_chunk +
      n per_frame) / (n audio_frame_s), stays within ``target_rtf`` (the real-time margin);
      ``max_steady`` if no size does (the hardware cannot keep the margin: logged). The server
      passes its uncalibrated steady size as ``min_steady``: arrival gaps do not show what a
      decode call costs when it runs beside the language models (on a CPU each call reads the
      decoder's weights once and takes a core the talker borrows), so calibration may raise
      the steady size but never lower it;
    - first: the smallest size (<= max_first) whose playback covers making the second chunk;
    - min_slack_s: ``jitter_sigmas`` x the RMS residual of the fit, at least the floor."""
    if not 0 < target_rtf <= 1:
        raise ValueError(f"target_rtf must be in (0, 1], got {target_rtf}")
    room = target_rtf * audio_frame_s - fit.per_frame_s
    if room <= 0:
        log.warning("per-frame cost %.1f ms exceeds %.0f%% of real time: no chunk size keeps "
                    "the margin; using steady=%d", fit.per_frame_s * 1e3, target_rtf * 100,
                    max_steady)
        steady = max_steady
    else:
        steady = min(max_steady, max(1, math.ceil(fit.per_chunk_s / room - 1e-9)))
    steady = max(steady, min(min_steady, max_steady))
    first = max_first
    for n1 in range(1, max_first + 1):
        n2 = min(steady, max(n1 + 1, int(n1 * growth)), 2 * n1)
        if fit.per_chunk_s + fit.per_frame_s * n2 <= n1 * audio_frame_s:
            first = n1
            break
    first = min(first, steady)
    min_slack = max(min_slack_floor_s, jitter_sigmas * fit.residual_s)
    return ChunkPolicy(first=first, steady=steady, growth=growth, min_slack_s=min_slack,
                       audio_frame_s=audio_frame_s)


__all__ = ["ChunkCostFit", "ChunkPolicy", "calibrate", "calibrate_fit",
           "fit_chunk_costs",
           "MAX_GROWTH"]
