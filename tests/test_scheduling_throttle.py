"""Playback-slack prefill throttling over constructed situations."""

from __future__ import annotations

import pytest

from omni_stream.scheduling.throttle import (Action, PendingPrefill, PrefillCostModel,
                                             RunningStream, decide_prefill, slack_s)

COST = PrefillCostModel(per_token_s=0.001, fixed_s=0.010)  # 10 ms + 1 ms per token
FRAME = 0.030  # one decode step of the running batch
MARGIN = 0.050


def decide(pending, running, **kw):
    kw.setdefault("max_split_tokens", 256)
    return decide_prefill(pending, running, COST, FRAME, MARGIN, **kw)


def test_slack_is_delivered_minus_played():
    assert slack_s(2.0, first_chunk_t=10.0, now=10.5) == pytest.approx(1.5)
    assert slack_s(2.0, first_chunk_t=10.0, now=13.0) == pytest.approx(-1.0)  # ran dry
    assert slack_s(0.16, first_chunk_t=None, now=99.0) == 0.0  # no audio yet: nothing buffered
    assert slack_s(0.5, first_chunk_t=10.0, now=9.0) == 0.5  # clock not started yet
    assert RunningStream.at(10.5, 2.0, 10.0, "s").slack_s == pytest.approx(1.5)


def test_cost_model_fit_least_squares_and_clamps():
    m = PrefillCostModel.fit([(t, 0.02 + 0.0005 * t) for t in (10, 50, 200, 800)])
    assert m.per_token_s == pytest.approx(0.0005) and m.fixed_s == pytest.approx(0.02)
    assert m.cost(100) == pytest.approx(0.07)
    assert m.tokens_within(0.07) == 100 and m.tokens_within(0.01) == 0
    neg = PrefillCostModel.fit([(10, 0.001), (100, 0.1), (200, 0.2)])  # intercept < 0
    assert neg.fixed_s == 0.0 and neg.per_token_s > 0
    flat = PrefillCostModel.fit([(10, 0.05), (100, 0.04)])  # slope < 0 -> constant
    assert flat.per_token_s == 0.0 and flat.fixed_s == pytest.approx(0.045)
    one = PrefillCostModel.fit([(100, 0.2), (100, 0.2)])
    assert one.cost(100) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        PrefillCostModel.fit([])


def test_no_stream_running_always_runs():
    d = decide([PendingPrefill(5000, 0.0)], [])
    assert d.action is Action.RUN and d.tokens == 5000 and d.index == 0


def test_ample_slack_runs_whole_prefill():
    d = decide([PendingPrefill(100, 0.0)], [RunningStream(2.0), RunningStream(1.0)])
    assert d.action is Action.RUN and d.tokens == 100
    assert d.budget_s == pytest.approx(1.0 - MARGIN - FRAME)


def test_tight_slack_splits_to_what_fits():
    # budget = 0.2 - 0.05 - 0.03 = 0.12 s -> 110 tokens fit (10 ms + 110 ms)
    d = decide([PendingPrefill(300, 0.0)], [RunningStream(5.0), RunningStream(0.2)])
    assert d.action is Action.SPLIT and d.tokens == 110
    assert COST.cost(d.tokens) <= d.budget_s < COST.cost(d.tokens + 1)
    capped = decide([PendingPrefill(300, 0.0)], [RunningStream(0.2)], max_split_tokens=64)
    assert capped.action is Action.SPLIT and capped.tokens == 64


def test_no_slack_defers():
    d = decide([PendingPrefill(100, 0.0)], [RunningStream(0.085)])  # budget 5 ms < fixed 10 ms
    assert d.action is Action.DEFER and d.tokens == 0
    neg = decide([PendingPrefill(100, 0.0)], [RunningStream(-0.5)])
    assert neg.action is Action.DEFER
    # a split below min_split_tokens is not worth it
    small = decide([PendingPrefill(100, 0.0)], [RunningStream(0.095)], min_split_tokens=8)
    assert small.action is Action.DEFER  # 5 tokens would fit
    assert decide([], [RunningStream(1.0)]).action is Action.DEFER


def test_starvation_guard_runs_anyway_in_bounded_chunks():
    starving = PendingPrefill(100, waited_s=2.5)
    d = decide([starving], [RunningStream(0.0)], starvation_s=2.0)
    assert d.action is Action.RUN and d.tokens == 100 and "starvation" in d.reason
    big = decide([PendingPrefill(1000, waited_s=3.0)], [RunningStream(0.0)], starvation_s=2.0,
                 max_split_tokens=256)
    assert big.action is Action.SPLIT and big.tokens == 256
    fresh = decide([PendingPrefill(100, waited_s=1.9)], [RunningStream(0.0)], starvation_s=2.0)
    assert fresh.action is Action.DEFER


def test_several_pending_are_served_fifo():
    pending = [PendingPrefill(500, 0.3, "old-big"), PendingPrefill(5, 0.1, "new-small")]
    d = decide(pending, [RunningStream(0.2)])  # the small one would fit whole; the head goes first
    assert d.index == 0 and d.action is Action.SPLIT and d.tokens == 110
    nothing = decide(pending, [RunningStream(0.05)])
    assert nothing.action is Action.DEFER and nothing.index == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        decide([PendingPrefill(1)], [], max_split_tokens=0)
    with pytest.raises(ValueError):
        PrefillCostModel(per_token_s=-1.0)
