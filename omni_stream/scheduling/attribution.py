"""Where a frame's wall time goes, part by part, and which part grew when capacity changes.

The capacity tracker (``scheduling.tracker``) sees one number per chunk: wall time per frame.
When it moves, that ratio alone does not say what to do about it (a neighbour's processes on
the stages' cores, a code predictor that got slower, a codec that falls behind, the server's
own work). So the pipeline keeps cumulative counters (``PartCounters``: the talker's own
step-timing sums, the CPU time of the codec and the server processes, and the CPU time of
everything else on the pipeline's cores) and compares their per-step rates over the window
the tracker saw against the same rates measured while the start-up probes ran at that width.

Parts, each in seconds per talker frame step (one frame of every running stream):

- ``talker_lm``: the talker's language-model part of the frame step (the step less the code
  predictor);
- ``code_predictor``: the code predictor's 15 sub-steps;
- ``scheduling``: the talker loop around the step (control messages, prefill pieces, handing
  frames to the codec);
- ``codec``: CPU time of the Code2Wav stage;
- ``transport``: CPU time of the server process (audio ring reader, chunk routing, HTTP);
- ``others``: CPU time of every other process (and hypervisor steal) on the pipeline's cores;
- ``wall``: wall time per step (what the listener waits for, per frame).

Pure functions over plain values: the counters are read by ``orchestrator.meter``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PARTS = ("talker_lm", "code_predictor", "scheduling", "codec", "transport", "others")
LABELS = {
    "talker_lm": "talker step (LM)",
    "code_predictor": "code predictor",
    "scheduling": "scheduling (talker loop: control, prefill, emit)",
    "codec": "codec (Code2Wav CPU)",
    "transport": "transport (server process CPU)",
    "others": "other processes on the pipeline's cores",
    "wall": "wall time per step",
}
MIN_STEPS = 8  # fewer frame steps in a window: no rate (one step's noise would be the answer)
TALKER_PHASES = ("talker.step", "talker.code_predictor", "frame.total")


@dataclass(frozen=True)
class PartCounters:
    """Cumulative counters at monotonic time ``t`` (seconds): the talker's frame steps and
    the sums of its phase timings, and CPU seconds of the codec, the server and the rest.
    A field the platform cannot read is NaN (its part is then left out)."""

    t: float
    steps: int
    step_s: float
    cp_s: float
    loop_s: float
    codec_cpu_s: float = math.nan
    server_cpu_s: float = math.nan
    other_cpu_s: float = math.nan


def talker_phase_sums(phases: dict) -> dict[str, float]:
    """The talker stage's reply fields for the part counters (``<phase>|sum_s``,
    ``<phase>|count``), from a ``stepstats.snapshot()``'s ``phases``."""
    out: dict[str, float] = {}
    for name in TALKER_PHASES:
        p = phases.get(name) or {}
        out[f"{name}|sum_s"] = float(p.get("sum_s", 0.0))
        out[f"{name}|count"] = float(p.get("count", 0))
    return out


def parts_per_step(a: PartCounters, b: PartCounters,
                   min_steps: int = MIN_STEPS) -> dict[str, float] | None:
    """The parts' seconds per frame step between ``a`` and ``b`` (``b`` later), with
    ``wall`` and ``steps``; None when fewer than ``min_steps`` steps ran between them."""
    steps = b.steps - a.steps
    if steps < max(1, min_steps):
        return None

    def rate(x: float, y: float) -> float | None:
        d = y - x
        return None if math.isnan(d) else max(0.0, d) / steps

    step, cp, loop = rate(a.step_s, b.step_s), rate(a.cp_s, b.cp_s), rate(a.loop_s, b.loop_s)
    out = {"talker_lm": None if step is None or cp is None else max(0.0, step - cp),
           "code_predictor": cp,
           "scheduling": None if loop is None or step is None else max(0.0, loop - step),
           "codec": rate(a.codec_cpu_s, b.codec_cpu_s),
           "transport": rate(a.server_cpu_s, b.server_cpu_s),
           "others": rate(a.other_cpu_s, b.other_cpu_s),
           "wall": rate(a.t, b.t)}
    res = {k: v for k, v in out.items() if v is not None}
    res["steps"] = float(steps)
    return res


@dataclass(frozen=True)
class Growth:
    part: str
    before_s: float
    after_s: float

    @property
    def delta_s(self) -> float:
        return self.after_s - self.before_s


def what_grew(before: dict[str, float], after: dict[str, float],
              fell: bool = True) -> list[Growth]:
    """The parts both measurements have, the largest growth (seconds per step) first; with
    ``fell`` False (capacity rose) the largest shrinkage first."""
    got = [Growth(p, before[p], after[p]) for p in PARTS if p in before and p in after]
    return sorted(got, key=lambda g: -g.delta_s if fell else g.delta_s)


def describe_growth(before: dict[str, float] | None, after: dict[str, float] | None,
                    width: int | None = None, fell: bool = True) -> str:
    """One line: the part that grew most (``fell`` False: shrank most) and the others'
    changes, in ms per frame step, e.g. ``code predictor grew most: 21.0 -> 35.2 ms per frame
    step (+14.2); ...``. ``width``: the probed width ``before`` was measured at."""
    if after is None:
        return "no part timings for this window (too few frame steps)"
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    if not before:
        return "parts now, ms per frame step (none measured at start-up to compare with): " + \
            ", ".join(f"{LABELS[p]} {ms(after[p])}" for p in PARTS if p in after)
    moved = what_grew(before, after, fell)
    if not moved:
        return "no part measured both at start-up and now"
    top, rest = moved[0], moved[1:]
    at = f" (start-up probes at {width} stream{'s' if width != 1 else ''})" if width else ""
    head = (f"{LABELS[top.part]} {'grew' if fell else 'shrank'} most: {ms(top.before_s)} -> "
            f"{ms(top.after_s)} ms per frame step ({1e3 * top.delta_s:+.1f}){at}")
    tail = ", ".join(f"{LABELS[g.part]} {1e3 * g.delta_s:+.1f} ({ms(g.before_s)} -> "
                     f"{ms(g.after_s)})" for g in rest)
    wall = ""
    if "wall" in before and "wall" in after:
        wall = f"; wall time per frame step {ms(before['wall'])} -> {ms(after['wall'])} ms"
    return head + (f"; {tail}" if tail else "") + wall


__all__ = ["LABELS", "MIN_STEPS", "PARTS", "TALKER_PHASES", "Growth", "PartCounters",
           "describe_growth", "parts_per_step", "talker_phase_sums", "what_grew"]
