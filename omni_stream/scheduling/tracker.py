"""Capacity kept current while serving: each stream's steady pace, and the tracker that
compares it with what was measured at start-up (``scheduling.capacity``).

The probes and the tracker measure one quantity, the same way (``StreamPace``): a stream's
pace past its ramp, the arrival gap per frame of its chunks once the ramp is over (a chunk of
the steady size has arrived, or of ``RAMP_DONE_FRAMES`` where the steady size is larger, or
``RAMP_MAX_FRAMES`` frames have), weighted by the frames each chunk carries. The ramp's first
chunks are sized to the listener's buffer (one frame while it is short), each pays a whole
Code2Wav call, so their gaps per frame are far above the pace that follows: counting them
against probes that timed fixed 8-frame chunks is how the first request of a fresh server
used to lower capacity (``capacity 2 -> 1 stream(s): wall time per frame is 1.51x``). Where
the buffer never grows (near capacity a stream can stay on 1-frame chunks), the ramp still
ends after ``RAMP_MAX_FRAMES``: that pace is what such streams get, probes and serving alike.

The running server's ``contention`` is the frame-weighted median ratio of those samples to the
start-up model's T(n) at the width they were taken; capacity follows it down within seconds
and up slowly, with hysteresis, and never by failing a stream that runs.
"""

from __future__ import annotations

import math
from collections import deque

from omni_stream.scheduling.attribution import describe_growth
from omni_stream.scheduling.capacity import (DEFAULT_MARGIN, FRAME_S, RAISE_BAND, Capacity,
                                             MachineCosts, capacity)


RAMP_DONE_FRAMES = 8  # a chunk this long (or the steady size, if smaller) ends the ramp
RAMP_MAX_FRAMES = 24  # ... and so do this many frames (~2 s of audio), whatever the chunks


class StreamPace:
    """One stream's pace past its ramp, from its chunk arrivals: what the start-up probes
    measure and what the tracker compares with them (the module docstring).

    ``arrived(frames, t, final)`` returns the seconds per frame of this chunk's arrival gap
    when it is a sample (its weight is ``frames``), else None. A gap is a sample once the
    stream's ramp is over before it: an earlier chunk had at least ``reach`` = min(``steady``,
    ``RAMP_DONE_FRAMES``) frames, or ``RAMP_MAX_FRAMES`` frames have arrived; never the
    stream's last chunk (a tail of any size) nor a gap over a wait for text (``skip_next``)."""

    __slots__ = ("reach", "last_t", "reached", "frames", "skip")

    def __init__(self, steady: int) -> None:
        if steady < 1:
            raise ValueError(f"steady must be >= 1, got {steady}")
        self.reach = min(steady, RAMP_DONE_FRAMES)
        self.last_t: float | None = None
        self.reached = False  # the ramp is over
        self.frames = 0  # frames arrived so far
        self.skip = False

    def skip_next(self) -> None:
        """The stream waited (for its text): the next gap is not the pipeline's pace."""
        self.skip = True

    def arrived(self, frames: int, t: float, final: bool = False) -> float | None:
        if frames < 1:
            return None
        sample = None
        if self.last_t is not None and self.reached and not self.skip and not final:
            sample = max(0.0, t - self.last_t) / frames
        self.frames += frames
        self.reached |= frames >= self.reach or self.frames >= RAMP_MAX_FRAMES
        self.last_t, self.skip = t, False
        return sample


def tracker_window_s(steady: int, minimum: float = 4.0, chunks: int = 4) -> float:
    """The tracker's sample window: at least ``minimum`` seconds and ``chunks`` steady chunks
    of one stream at real time (a 16-frame steady chunk arrives every ~1.3 s)."""
    return max(minimum, chunks * min(steady, 2 * RAMP_DONE_FRAMES) * FRAME_S)


class CapacityTracker:
    """Keeps ``contention`` and the capacity current from the server's own per-frame times.

    ``observe(n, seconds_per_frame, now, frames)``: one stream's sample (``StreamPace``): its
    chunk of ``frames`` frames arrived ``seconds_per_frame`` per frame after its previous one
    while ``n`` streams ran. The contention estimate is the median weighted by frames, over the
    last ``window_s`` (default ``tracker_window_s(steady)``), of observed / modelled T(n) (at
    least ``min_samples`` samples), never below ``floor`` (default 1: no faster than measured
    at start-up).
    ``update(now)`` moves the
    capacity: down once the lower value has held for ``down_s``, up once T(capacity + 1)
    has stayed under (margin - RAISE_BAND) x 80 ms for ``up_s``. Admitted streams are never
    touched: a lower capacity only stops new admissions until enough streams have ended."""

    def __init__(self, costs: MachineCosts, *, slots: int, kv_streams: int | None = None,
                 steady: int = 8, margin: float = DEFAULT_MARGIN, window_s: float | None = None,
                 min_samples: int = 4, down_s: float = 1.0, up_s: float = 5.0,
                 floor: float | None = None) -> None:
        self.costs = costs
        self.slots, self.kv_streams, self.steady, self.margin = slots, kv_streams, steady, margin
        self.window_s = tracker_window_s(steady) if window_s is None else window_s
        self.min_samples, self.down_s, self.up_s = min_samples, down_s, up_s
        self.floor = 1.0 if floor is None else floor
        self.contention = costs.contention
        # (time, ratio, streams, frames)
        self._samples: deque[tuple[float, float, int, int]] = deque(maxlen=256)
        self.current = capacity(costs, slots=slots, kv_streams=kv_streams, steady=steady,
                                margin=margin)
        self._lower_since: float | None = None
        self._raise_since: float | None = None
        self.changes = 0

    def observe(self, n: int, seconds_per_frame: float, now: float, frames: int = 1) -> None:
        if (n < 1 or frames < 1 or not math.isfinite(seconds_per_frame)
                or seconds_per_frame < 0):
            return
        model = self.costs.frame_time_s(n, self.steady, contention=1.0)
        if model <= 0 or not math.isfinite(model):
            return
        self._samples.append((now, seconds_per_frame / model, n, frames))

    def _estimate(self, now: float) -> float | None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        if len(self._samples) < self.min_samples:
            return None
        return max(self.floor, weighted_median([(r, w) for _, r, _, w in self._samples]))

    def width(self) -> int | None:
        """The stream count most of the window's frames were measured at, or None."""
        if not self._samples:
            return None
        by: dict[int, int] = {}
        for _, _, n, w in self._samples:
            by[n] = by.get(n, 0) + w
        return max(by, key=lambda n: (by[n], n))

    def update(self, now: float) -> bool:
        """Re-estimate; True when the capacity changed."""
        est = self._estimate(now)
        if est is not None:
            self.contention = est
        cand = capacity(self.costs, slots=self.slots, kv_streams=self.kv_streams,
                        steady=self.steady, margin=self.margin, contention=self.contention)
        cur = self.current
        changed = False
        if cand.streams < cur.streams:
            self._raise_since = None
            self._lower_since = now if self._lower_since is None else self._lower_since
            if now - self._lower_since >= self.down_s:
                self.current, changed, self._lower_since = cand, True, None
        elif cand.streams > cur.streams:
            self._lower_since = None
            nxt = cur.streams + 1
            room = (self.margin - RAISE_BAND) * FRAME_S
            if self.costs.frame_time_s(nxt, self.steady, self.contention) <= room:
                self._raise_since = now if self._raise_since is None else self._raise_since
                if now - self._raise_since >= self.up_s:
                    self.current = Capacity(nxt, True, cand.rtf,
                                            cand.limit if nxt == cand.streams else "speed")
                    changed, self._raise_since = True, None
            else:
                self._raise_since = None
            if not changed:
                self.current = Capacity(cur.streams, cur.realtime, cand.rtf, cur.limit)
        else:
            self._lower_since = self._raise_since = None
            self.current = cand
        if changed:
            self.changes += 1
        return changed

    def rtf_estimate(self) -> float:
        return self.costs.rtf(1, self.steady, self.contention)

    def explain(self, before: Capacity, live_parts: dict[str, float] | None) -> str:
        """The log line of a capacity change from ``before`` to ``current`` (or of one stream
        turning real time or not): the wall time per frame now against the start-up probes'
        at the width most samples were taken, and which part of the frame step moved it
        (``live_parts``: seconds per step by part over the window, ``scheduling.attribution``;
        None: not read)."""
        after = self.current
        n = self.width() or max(1, before.streams)
        model = self.costs.frame_time_s(n, self.steady, contention=1.0)
        base = self.costs.parts_at(n)
        width, parts = base if base is not None else (None, None)
        fell = (after.streams, after.realtime) < (before.streams, before.realtime)
        flip = "" if after.realtime == before.realtime else \
            (", real time again" if after.realtime else ", NOT real time: first audio is held back")
        return (f"capacity {before.streams} -> {after.streams} stream(s){flip}: wall time per "
                f"frame at {n} stream{'s' if n != 1 else ''} is {1e3 * self.contention * model:.1f}"
                f" ms, {self.contention:.2f}x the {1e3 * model:.1f} ms measured at start-up "
                f"(RTF estimate {self.rtf_estimate():.2f}); "
                + describe_growth(parts, live_parts, width, fell=fell))


def weighted_median(samples: list[tuple[float, float]]) -> float:
    """The median of ``(value, weight)`` samples (weights > 0): the value at which half of
    the total weight lies on each side (the mean of the two middle values at an exact tie)."""
    if not samples:
        raise ValueError("weighted_median of no samples")
    r = sorted(samples)
    half = 0.5 * sum(w for _, w in r)
    acc = 0.0
    for i, (v, w) in enumerate(r):
        acc += w
        if acc > half + 1e-12:
            return v
        if abs(acc - half) <= 1e-12:
            return 0.5 * (v + r[i + 1][0]) if i + 1 < len(r) else v
    return r[-1][0]


__all__ = ["RAMP_DONE_FRAMES", "RAMP_MAX_FRAMES", "CapacityTracker", "StreamPace",
           "tracker_window_s", "weighted_median"]
