"""Playback-slack prefill throttling, as a pure function.

A prefill runs between two decode steps of the running batch, so every running stream's next
frame waits for it. That is harmless while each listener still has audio buffered: a stream's
*slack* is the audio delivered to its client minus the audio the client has played, with the
client's playback clock estimated to start at the stream's first chunk and run in real time.
The clock never pauses in the estimate, so after a real underrun the client holds more audio
than we think, never less: the estimate errs on the safe side.

``decide_prefill`` looks at the head of the pending prefills (strict FIFO: a later prefill never
jumps a waiting one, so first-audio latency follows arrival order) and returns

- RUN: the whole prefill fits in ``min(slack) - margin - one decode step`` (the step the running
  streams still need after it), or nothing is running (nobody to protect);
- SPLIT: only the first N tokens fit (chunked prefill); N is the largest that fits, at most
  ``max_split_tokens`` and at least ``min_split_tokens`` (smaller chunks cost more in fixed
  per-call overhead than they save);
- DEFER: not even ``min_split_tokens`` fit; try again after the next decode step.

Starvation guard: a prefill that has waited ``starvation_s`` or longer runs anyway, in chunks of
at most ``max_split_tokens`` so the running streams lose at most one chunk's time per decode
step rather than the whole prefill at once. Slack-driven deferral can therefore delay a new
stream's first audio by at most ``starvation_s`` plus its own prefill.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

DEFAULT_STARVATION_S = 2.0


def slack_s(delivered_s: float, first_chunk_t: float | None, now: float) -> float:
    """Audio buffered at the client: delivered minus played, the playback clock starting at the
    first chunk. A stream still waiting for its first chunk has nothing buffered: 0. Negative
    means the client has (by this estimate) run dry by that much."""
    if first_chunk_t is None:
        return 0.0
    return delivered_s - max(0.0, now - first_chunk_t)


@dataclass(frozen=True)
class PrefillCostModel:
    """Prefill wall time ~= fixed_s + per_token_s x tokens (both >= 0)."""

    per_token_s: float
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.per_token_s < 0 or self.fixed_s < 0:
            raise ValueError("prefill cost coefficients must be >= 0")

    def cost(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens whose prefill takes at most ``seconds`` (a huge number if tokens are
        free)."""
        spare = seconds - self.fixed_s
        if spare < 0:
            return 0
        if self.per_token_s == 0:
            return 1 << 30
        return int(math.floor(spare / self.per_token_s + 1e-9))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> "PrefillCostModel":
        """Least-squares fit to measured (tokens, seconds), clamped to non-negative coefficients
        (a negative intercept refits through the origin, a negative slope as a constant)."""
        if not samples:
            raise ValueError("PrefillCostModel.fit needs at least one (tokens, seconds) sample")
        xs = [float(t) for t, _ in samples]
        ys = [float(s) for _, s in samples]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx > 0:
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
            a = my - b * mx
        elif mx > 0:  # one distinct size: the terms cannot be separated; charge it per token
            a, b = 0.0, my / mx
        else:
            a, b = my, 0.0
        if b < 0:
            a, b = my, 0.0
        if a < 0:
            sx2 = sum(x * x for x in xs)
            a, b = 0.0, (sum(x * y for x, y in zip(xs, ys)) / sx2 if sx2 > 0 else 0.0)
        return cls(per_token_s=max(0.0, b), fixed_s=max(0.0, a))


@dataclass(frozen=True)
class PendingPrefill:
    """A prompt (or the rest of a split one) waiting to prefill, oldest first."""

    tokens: int
    waited_s: float = 0.0
    req_id: Hashable | None = None


@dataclass(frozen=True)
class RunningStream:
    slack_s: float
    stream_id: Hashable | None = None

    @classmethod
    def at(cls, now: float, delivered_s: float, first_chunk_t: float | None,
           stream_id: Hashable | None = None) -> "RunningStream":
        return cls(slack_s(delivered_s, first_chunk_t, now), stream_id)


class Action(enum.Enum):
    RUN = "run"
    SPLIT = "split"
    DEFER = "defer"


@dataclass(frozen=True)
class Decision:
    """What to do with ``pending[index]`` now: run ``tokens`` of it (0 for DEFER)."""

    action: Action
    tokens: int = 0
    index: int | None = None
    budget_s: float = math.inf  # time available for prefill before the tightest stream suffers
    reason: str = ""


def decide_prefill(pending: Sequence[PendingPrefill], running: Sequence[RunningStream],
                   cost_model: PrefillCostModel, frame_s: float, margin_s: float,
                   max_split_tokens: int, *, min_split_tokens: int = 1,
                   starvation_s: float = DEFAULT_STARVATION_S) -> Decision:
    """Decide the head prefill (see the module docstring). ``frame_s`` is the wall time of one
    decode step of the running batch (not the 80 ms of audio a frame holds)."""
    if max_split_tokens < 1 or min_split_tokens < 1 or min_split_tokens > max_split_tokens:
        raise ValueError("need 1 <= min_split_tokens <= max_split_tokens")
    if frame_s < 0 or margin_s < 0 or starvation_s < 0:
        raise ValueError("frame_s, margin_s and starvation_s must be >= 0")
    if not pending:
        return Decision(Action.DEFER, reason="nothing pending")
    head = pending[0]
    if head.tokens <= 0:
        return Decision(Action.RUN, 0, 0, reason="empty prefill")
    if not running:
        return Decision(Action.RUN, head.tokens, 0, reason="no stream running")
    budget = min(r.slack_s for r in running) - margin_s - frame_s
    if head.waited_s >= starvation_s:
        n = min(head.tokens, max_split_tokens)
        return Decision(Action.RUN if n == head.tokens else Action.SPLIT, n, 0, budget,
                        f"starvation guard: waited {head.waited_s:.2f} s >= {starvation_s:.2f} s")
    if cost_model.cost(head.tokens) <= budget:
        return Decision(Action.RUN, head.tokens, 0, budget, "whole prefill fits in the slack")
    n = min(cost_model.tokens_within(budget), max_split_tokens, head.tokens - 1)
    if n >= min_split_tokens:
        return Decision(Action.SPLIT, n, 0, budget, f"{n} of {head.tokens} tokens fit in the slack")
    return Decision(Action.DEFER, 0, 0, budget,
                    f"slack budget {budget * 1e3:.1f} ms too small for {min_split_tokens} token(s)")


__all__ = ["Action", "Decision", "PendingPrefill", "PrefillCostModel", "RunningStream",
           "decide_prefill", "slack_s", "DEFAULT_STARVATION_S"]
