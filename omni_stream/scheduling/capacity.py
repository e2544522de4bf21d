"""What a frame costs on this machine, and what follows from it: capacity, RTF, hold-back.

One timing model (``MachineCosts``) feeds every promise the server makes about streaming:

- admission: how many streams run at once (``capacity``);
- the chunk schedule: first and steady chunk sizes (``chunk_policy``);
- the prefill throttle: the prefill cost model and the decode-step time the talker starts from;
- the hold-back: how long a stream's first audio waits when even one stream is slower than
  real time (``holdback_s``).

The costs are measured once per deployment fingerprint at start-up (``orchestrator.costs``):
the talker + code-predictor frame step alone at each batch size, Code2Wav calls per chunk size
and batch, the prefill, the memory read bandwidth; then probe streams through the real
pipeline, 1 at a time, then 2, ... until a width misses the margin (or the slots are full),
give ``observed_s``: the wall time per frame past the ramp at each width
(``scheduling.tracker.StreamPace``), with everything the parts alone do not show (the cores
the codec lends the talker, the memory bandwidth both stages share, the hops, the chunk
schedule the requests get). The running server keeps ``contention``, the ratio of the
per-frame times it sees to those, current from its own chunk arrivals
(``scheduling.tracker``): a noisy neighbour raises it, capacity follows within seconds, with
hysteresis, and never by failing a stream that runs.

Per-frame wall time with ``n`` streams (every stream gets one frame per step):

    T(n) = contention x observed_s[n - 1]                     for the widths the probes ran
         = contention x parts(n) x observed_s[-1] / parts(k)  past them (k probed widths)
    parts(n) = talker(n) + codec(n)       where the codec shares the talker's cores (no pinning)
             = max(talker(n), codec(n))   where it decodes on cores of its own (pinned; lent
                                          cores run the talker only while the codec is idle)
    talker(n) = frame_s[n - 1] (extrapolated past it); codec(n) = (codec_call_s + codec_frame_s
                x steady x n) / steady (one batched call per ``steady`` frames of n streams)

A stream is real time when T(n) <= margin x 80 ms. ``DEFAULT_MARGIN`` 0.85 keeps 15 % for the
jitter of a shared host, the prefills the throttle lets in and the ramp's small first chunks
(whose codec calls cost more per frame than the steady chunk's).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from omni_stream.config import FRAME_S
from omni_stream.scheduling.attribution import LABELS
from omni_stream.scheduling.chunking import ChunkCostFit, ChunkPolicy, calibrate_fit

log = logging.getLogger(__name__)

DEFAULT_MARGIN = 0.85
# capacity rises only while T(capacity + 1) stays this far under the margin (hysteresis band)
RAISE_BAND = 0.05
MAX_HOLDBACK_S = 600.0


class MachineCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Measured costs of one deployment (seconds). ``frame_s[i]``: one talker + code-predictor
    frame step with ``i + 1`` streams; codec call = ``codec_call_s + codec_frame_s x rows``
    (rows = frames x streams in the call); prefill = ``prefill_fixed_s + prefill_token_s x
    tokens``. ``shared_cores``: the codec runs on the talker's cores (the stages are not
    pinned apart), so their times add. ``observed_s[i]``: the probes' wall time per frame with
    ``i + 1`` streams (empty: the parts' model alone). ``contention`` >= 0: the running
    server's per-frame times over those (1 = as measured at start-up). ``bandwidth_gbs`` /
    ``bandwidth_1t_gbs``: memory read bandwidth with the talker's threads / one thread (0:
    not measured). ``probe_parts[i]``: where a frame step's time went while the probes ran
    ``i + 1`` streams (``scheduling.attribution``: seconds per step by part), what a change
    of capacity is explained against. ``probe_schedule``: the chunk schedule the probes ran,
    the one the server serves with (None: ``chunk_policy`` of these costs)."""

    frame_s: tuple[float, ...]
    observed_s: tuple[float, ...] = ()
    codec_call_s: float = 0.0
    codec_frame_s: float = 0.0
    prefill_fixed_s: float = 0.0
    prefill_token_s: float = 0.0
    shared_cores: bool = True
    contention: float = 1.0
    bandwidth_gbs: float = 0.0
    bandwidth_1t_gbs: float = 0.0
    measured_unix: float = 0.0
    emulated: bool = False  # measured under OMNI_STREAM_EMULATE_COSTS (never cached)
    probe_parts: tuple[dict[str, float], ...] = ()
    probe_schedule: ChunkPolicy | None = None

    def __post_init__(self) -> None:
        if not self.frame_s:
            raise ValueError("frame_s needs the cost of at least one batch size")
        for name in ("codec_call_s", "codec_frame_s", "prefill_fixed_s", "prefill_token_s",
                     "contention", "bandwidth_gbs", "bandwidth_1t_gbs"):
            _check_cost(name, getattr(self, name))
        for i, v in enumerate(self.frame_s):
            _check_cost(f"frame_s[{i}]", v)
        for i, v in enumerate(self.observed_s):
            _check_cost(f"observed_s[{i}]", v)
        for i, parts in enumerate(self.probe_parts):
            for k, v in parts.items():
                _check_cost(f"probe_parts[{i}][{k!r}]", v)

    # ------------------------------------------------------------------ the model
    def talker_s(self, n: int) -> float:
        """The frame step alone with ``n`` streams; past the measured sizes, the last two
        points' slope (never less than the last point)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        f = self.frame_s
        if n <= len(f):
            return f[n - 1]
        slope = max(0.0, f[-1] - f[-2]) if len(f) > 1 else f[-1]
        return f[-1] + slope * (n - len(f)) if math.isfinite(slope) else math.inf

    def codec_s(self, n: int, steady: int) -> float:
        """Code2Wav time per frame step of ``n`` streams decoded ``steady`` frames at a time."""
        if n < 1 or steady < 1:
            raise ValueError(f"n and steady must be >= 1, got {n}, {steady}")
        return (self.codec_call_s + self.codec_frame_s * steady * n) / steady

    def parts_s(self, n: int, steady: int) -> float:
        """The parts' model of a frame with ``n`` streams (the module docstring's parts(n))."""
        t, c = self.talker_s(n), self.codec_s(n, steady)
        return t + c if self.shared_cores else max(t, c)

    def frame_time_s(self, n: int, steady: int, contention: float | None = None) -> float:
        """Wall time per frame with ``n`` streams (the module docstring's T(n))."""
        k = self.contention if contention is None else contention
        obs = self.observed_s
        if n <= len(obs):
            base = obs[n - 1]
        elif obs:
            at, here = self.parts_s(len(obs), steady), self.parts_s(n, steady)
            base = here if at == 0 else (math.inf if math.isinf(at) else here * obs[-1] / at)
            base = max(base, obs[-1])  # more streams never take less time per frame
        else:
            base = self.parts_s(n, steady)
        if k == 0 or base == 0:
            return 0.0
        return k * base

    def rtf(self, n: int = 1, steady: int = 8, contention: float | None = None) -> float:
        """Seconds to make one second of audio per stream with ``n`` streams."""
        return self.frame_time_s(n, steady, contention) / FRAME_S

    def with_contention(self, contention: float) -> "MachineCosts":
        return msgspec.structs.replace(self, contention=contention)

    def with_observed(self, observed_s: tuple[float, ...],
                      probe_parts: tuple[dict[str, float], ...] | None = None,
                      schedule: ChunkPolicy | None = None) -> "MachineCosts":
        parts = self.probe_parts if probe_parts is None else tuple(dict(p) for p in probe_parts)
        return msgspec.structs.replace(self, observed_s=tuple(observed_s), probe_parts=parts,
                                       probe_schedule=schedule or self.probe_schedule)

    def parts_at(self, n: int) -> tuple[int, dict[str, float]] | None:
        """(width, parts) the probes measured at ``n`` streams, or at the widest probed width
        below it; None when none was measured."""
        for w in range(min(n, len(self.probe_parts)), 0, -1):
            if self.probe_parts[w - 1]:
                return w, self.probe_parts[w - 1]
        return None

    def to_dict(self) -> dict[str, Any]:
        d = msgspec.structs.asdict(self)
        d["frame_s"] = list(self.frame_s)
        d["observed_s"] = list(self.observed_s)
        d["probe_parts"] = [dict(p) for p in self.probe_parts]
        d["probe_schedule"] = None if self.probe_schedule is None else self.probe_schedule.to_dict()
        return d


def _check_cost(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise ValueError(f"{name} must be a number >= 0 (inf allowed), got {v!r}")


@dataclass(frozen=True)
class Capacity:
    """``streams`` admitted at once; ``realtime``: each of them keeps the margin (False: even
    one stream is slower than real time, and is served with a hold-back); ``rtf``: one
    stream's RTF at these settings; ``limit``: what bounds ``streams`` ('speed', 'slots',
    'kv', 'none')."""

    streams: int
    realtime: bool
    rtf: float
    limit: str


def capacity(costs: MachineCosts, *, slots: int, kv_streams: int | None = None,
             steady: int = 8, margin: float = DEFAULT_MARGIN,
             contention: float | None = None) -> Capacity:
    """The most streams (<= ``slots`` and <= ``kv_streams``) whose frames all keep
    T(n) <= margin x 80 ms. When not even one does, 1 stream (served with a hold-back,
    ``realtime`` False), or 0 when a frame never finishes (infinite cost) or there is no slot."""
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    cap = slots if kv_streams is None else min(slots, kv_streams)
    rtf1 = costs.rtf(1, steady, contention)
    if cap < 1:
        return Capacity(0, False, rtf1, "kv" if kv_streams is not None and kv_streams < slots
                        else "slots")
    budget = margin * FRAME_S
    n = 0
    while n < cap and costs.frame_time_s(n + 1, steady, contention) <= budget:
        n += 1
    if n == 0:
        return Capacity(0 if math.isinf(rtf1) else 1, False, rtf1, "speed")
    limit = "speed" if n < cap else ("kv" if kv_streams is not None and kv_streams < slots
                                      else "slots")
    return Capacity(n, True, rtf1, limit)


def holdback_s(frame_time_s: float, frames: int, *, steady: int = 8,
               margin: float = DEFAULT_MARGIN) -> float:
    """How long a stream's first audio is held back so that ``frames`` frames made at
    ``frame_time_s`` each play without a gap (0 when the frames keep real time with the margin).

    Frame k is made at ~k x T' (T' = frame_time_s / margin, the margin covering jitter) and
    played at H + k x 80 ms; the worst k is the last, so H = frames x (T' - 80 ms), plus one
    steady chunk made at T' (audio leaves in chunks). Capped at ``MAX_HOLDBACK_S``."""
    if frames < 0 or steady < 1:
        raise ValueError(f"frames must be >= 0 and steady >= 1, got {frames}, {steady}")
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    if math.isnan(frame_time_s) or frame_time_s < 0:
        raise ValueError(f"frame_time_s must be >= 0, got {frame_time_s}")
    t = frame_time_s / margin
    if frames == 0 or t <= FRAME_S:
        return 0.0
    return min(MAX_HOLDBACK_S, frames * (t - FRAME_S) + min(steady, frames) * t)


def chunk_policy(costs: MachineCosts, base: ChunkPolicy, *, margin: float = DEFAULT_MARGIN,
                 jitter_s: float = 0.0) -> ChunkPolicy:
    """The chunk schedule from the costs: a chunk of n frames arrives ~ per_chunk + n x
    per_frame after the previous one, with per_chunk the Code2Wav call's fixed cost and
    per_frame one stream's T(1) less that share. ``base``'s steady size is the floor
    (``calibrate_fit``'s ``min_steady``: the steady chunk is never lowered)."""
    per_frame = costs.frame_time_s(1, base.steady)
    per_chunk = costs.codec_call_s
    fit = ChunkCostFit(per_chunk_s=per_chunk,
                       per_frame_s=max(0.0, per_frame - per_chunk / base.steady),
                       residual_s=jitter_s, samples=0)
    if not math.isfinite(fit.per_frame_s) or not math.isfinite(per_chunk):
        return base
    return calibrate_fit(fit, audio_frame_s=base.audio_frame_s, target_rtf=margin,
                         max_first=max(2, base.first), min_steady=base.steady,
                         growth=base.growth)


# ---------------------------------------------------------------- cache


class CostCache:
    """``MachineCosts`` as JSON, one file per deployment fingerprint in ``directory``
    (``costs-<fingerprint>.json``). ``load()`` is None for a missing, unreadable, other-schema
    or other-fingerprint file (measure again); writes are atomic (temp file + rename).
    Version 2: probes of the serving schedule measured by ``StreamPace`` (version 1 timed
    fixed 8-frame chunks: measured again)."""

    VERSION = 2

    def __init__(self, directory: str | os.PathLike, fingerprint: str) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint

    @property
    def path(self) -> Path:
        return self.directory / f"costs-{self.fingerprint}.json"

    def load(self) -> MachineCosts | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable cost file %s: %s", self.path, e)
            return None
        if (not isinstance(data, dict) or data.get("version") != self.VERSION
                or data.get("fingerprint") != self.fingerprint):
            log.info("cost file %s is of another schema or deployment: measuring again",
                     self.path)
            return None
        try:
            return msgspec.convert(data["costs"], MachineCosts)
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as e:
            log.warning("ignoring invalid cost file %s: %s", self.path, e)
            return None

    def store(self, costs: MachineCosts) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = dict(version=self.VERSION, fingerprint=self.fingerprint, written_unix=time.time(),
                    costs=costs.to_dict())
        fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.path

    def invalidate(self) -> bool:
        try:
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False


def format_costs(costs: MachineCosts, cap: Capacity, *, steady: int,
                 margin: float = DEFAULT_MARGIN) -> str:
    """Human-readable lines: bandwidth, frame costs per batch, codec, prefill, capacity."""
    ms = lambda s: "inf" if math.isinf(s) else f"{1e3 * s:.1f}"  # noqa: E731
    lines = [
        f"memory read bandwidth: {costs.bandwidth_gbs:.1f} GB/s (talker's threads), "
        f"{costs.bandwidth_1t_gbs:.1f} GB/s (1 thread)",
        "frame step (talker + code predictor) alone, ms: "
        + ", ".join(f"{i + 1} stream{'s' if i else ''} {ms(v)}" for i, v in enumerate(costs.frame_s)),
        f"Code2Wav call: {ms(costs.codec_call_s)} ms + {ms(costs.codec_frame_s)} ms per frame row"
        f" (chunk {steady}, 1 stream: {ms(costs.codec_call_s + steady * costs.codec_frame_s)} ms)",
        f"prefill: {ms(costs.prefill_fixed_s)} ms + {1e3 * costs.prefill_token_s:.2f} ms per token",
        "probe streams, wall time per frame, ms: " + (", ".join(
            f"{i + 1} stream{'s' if i else ''} {ms(v)}" for i, v in enumerate(costs.observed_s))
            or "none ran"),
        *[f"probe streams, where a frame step's time went at {w + 1} stream{'s' if w else ''}, "
          "ms: " + ", ".join(f"{LABELS[k]} {ms(v)}" for k, v in parts.items() if k in LABELS)
          for w, parts in enumerate(costs.probe_parts) if parts],
        f"contention (while serving, over the probes): {costs.contention:.2f}"
        f" ({'codec shares the talker cores' if costs.shared_cores else 'codec on its own cores'})",
        "wall time per frame, ms: " + ", ".join(
            f"{n} {ms(costs.frame_time_s(n, steady))}" for n in range(1, len(costs.frame_s) + 1)),
        f"capacity: {cap.streams} stream(s) real time within {margin:.0%} of each 80 ms frame "
        f"(bound by {cap.limit}); RTF estimate {cap.rtf:.2f} for one stream"
        + ("" if cap.realtime else " -- NOT real time: first audio is held back"),
    ]
    if costs.emulated:
        lines.append("costs are EMULATED (OMNI_STREAM_EMULATE_COSTS)")
    return "\n".join(lines)


def advice(costs: MachineCosts, *, steady: int, weight_path: str | None, engine: str,
           model_size: str = "") -> str:
    """One start-up line for a machine where not even one stream keeps real time."""
    rtf = costs.rtf(1, steady)
    helps = []
    if weight_path not in ("int4",):
        helps.append("--weight-path int4 (faster, less faithful)")
    if engine != "native":
        helps.append("--engine native")
    if "0.6" not in model_size:
        helps.append("a smaller model (0.6B)")
    helps += ["client-side decoding (codec frames over the WebSocket, Code2Wav on the "
              "client)", "more cores or memory bandwidth"]
    return (f"not real time here: one stream's measured RTF is {rtf:.2f} (frame "
            f"{1e3 * costs.frame_time_s(1, steady):.0f} ms of each 80 ms; memory bandwidth "
            f"{costs.bandwidth_gbs:.1f} GB/s); every stream's first audio is held back so it "
            f"plays without gaps (TTFA grows with its length). What would help: "
            + "; ".join(helps))


__all__ = ["Capacity", "CostCache", "DEFAULT_MARGIN", "FRAME_S", "MachineCosts", "advice",
           "capacity", "chunk_policy", "format_costs", "holdback_s"]
