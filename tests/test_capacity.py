"""Capacity, RTF and hold-back rules as pure functions, at their edges (scheduling.capacity)."""

from __future__ import annotations

import json
import math

import pytest

from omni_stream.scheduling import AdmissionController
from omni_stream.scheduling.capacity import (FRAME_S, MAX_HOLDBACK_S, CostCache, MachineCosts,
                                             capacity, chunk_policy, holdback_s)
from omni_stream.scheduling.tracker import CapacityTracker
from omni_stream.scheduling.chunking import ChunkPolicy


def costs(frame_ms, call_ms=0.0, per_frame_ms=0.0, shared=True, contention=1.0):
    return MachineCosts(frame_s=tuple(f / 1e3 for f in frame_ms), codec_call_s=call_ms / 1e3,
                        codec_frame_s=per_frame_ms / 1e3, shared_cores=shared,
                        contention=contention)


def test_frame_time_adds_shared_codec_and_takes_the_max_on_own_cores():
    c = costs([40, 50], call_ms=16, per_frame_ms=2)  # codec per step: 16/8 + 2 n
    assert c.frame_time_s(1, 8) == pytest.approx(0.040 + 0.002 + 0.002)
    assert c.frame_time_s(2, 8) == pytest.approx(0.050 + 0.002 + 0.004)
    own = costs([40, 50], call_ms=16, per_frame_ms=2, shared=False)
    assert own.frame_time_s(2, 8) == pytest.approx(0.050)
    slow_codec = costs([10], call_ms=400, per_frame_ms=0, shared=False)
    assert slow_codec.frame_time_s(1, 8) == pytest.approx(0.050)
    # past the measured sizes: the last slope, never below the last point
    assert c.talker_s(4) == pytest.approx(0.050 + 2 * 0.010)
    assert costs([50, 40]).talker_s(3) == pytest.approx(0.040)
    assert costs([30]).talker_s(3) == pytest.approx(0.090)
    assert c.frame_time_s(1, 8, contention=2.0) == pytest.approx(2 * 0.044)


def test_probed_widths_are_the_truth_and_the_parts_extrapolate_past_them():
    c = costs([40, 50, 60, 70], call_ms=16, per_frame_ms=2, shared=False)
    probed = c.with_observed((0.045, 0.070))
    assert probed.frame_time_s(1, 8) == pytest.approx(0.045)
    assert probed.frame_time_s(2, 8) == pytest.approx(0.070)
    # past the probes: the parts' shape, scaled to the last probed width
    scale = 0.070 / c.parts_s(2, 8)
    assert probed.frame_time_s(3, 8) == pytest.approx(c.parts_s(3, 8) * scale)
    assert probed.frame_time_s(2, 8, contention=1.5) == pytest.approx(1.5 * 0.070)
    # more streams never cost less per frame than the last probe saw
    flat = costs([40, 10], shared=False).with_observed((0.050, 0.060))
    assert flat.frame_time_s(3, 8) >= 0.060
    assert capacity(probed, slots=4).streams == 1  # 70 ms > 68 ms at 2 streams
    assert capacity(probed.with_observed((0.045, 0.065)), slots=4).streams == 2
    with pytest.raises(ValueError):
        c.with_observed((math.nan,))


def test_costs_reject_nan_negative_and_empty_but_take_zero_and_inf():
    for bad in (dict(frame_s=()), dict(frame_s=(math.nan,)), dict(frame_s=(-1e-3,)),
                dict(frame_s=(0.01,), codec_call_s=math.nan),
                dict(frame_s=(0.01,), contention=-1.0), dict(frame_s=(0.01,), contention=True)):
        with pytest.raises(ValueError):
            MachineCosts(**bad)
    assert MachineCosts(frame_s=(0.0,)).rtf() == 0.0
    assert math.isinf(MachineCosts(frame_s=(math.inf,)).rtf())


@pytest.mark.parametrize("margin", [1.0, 0.85])
def test_capacity_at_rtf_exactly_one_just_above_and_below(margin):
    t = margin * FRAME_S * 1e3  # the frame budget in ms
    at = capacity(costs([t, t, t]), slots=3, margin=margin)
    assert (at.streams, at.realtime, at.limit) == (3, True, "slots")
    above = capacity(costs([t * 1.001] * 3), slots=3, margin=margin)
    assert (above.streams, above.realtime, above.limit) == (1, False, "speed")
    assert above.rtf == pytest.approx(margin * 1.001)
    below = capacity(costs([t * 0.999] * 3), slots=3, margin=margin)
    assert (below.streams, below.realtime) == (3, True)
    # the first batch size over the budget bounds it
    mixed = capacity(costs([t * 0.5, t * 0.999, t * 1.001]), slots=3, margin=margin)
    assert (mixed.streams, mixed.realtime, mixed.limit) == (2, True, "speed")


def test_capacity_edges_zero_and_infinite_cost_one_and_no_slot():
    free = capacity(costs([0.0]), slots=7)
    assert (free.streams, free.realtime, free.rtf) == (7, True, 0.0)
    never = capacity(costs([math.inf]), slots=4)
    assert (never.streams, never.realtime) == (0, False) and math.isinf(never.rtf)
    one = capacity(costs([10]), slots=1)
    assert (one.streams, one.realtime, one.limit) == (1, True, "slots")
    assert capacity(costs([10]), slots=0).streams == 0
    kv = capacity(costs([10]), slots=8, kv_streams=3)
    assert (kv.streams, kv.limit) == (3, "kv")
    assert capacity(costs([10]), slots=8, kv_streams=0).streams == 0
    with pytest.raises(ValueError):
        capacity(costs([10]), slots=2, margin=0.0)
    with pytest.raises(ValueError):
        capacity(costs([10]), slots=2, margin=1.5)
    assert capacity(costs([10]), slots=2, contention=0.0).streams == 2


def test_holdback_covers_the_deficit_of_the_whole_stream_and_only_then():
    m = 0.85
    assert holdback_s(m * FRAME_S, 500, margin=m) == 0.0  # exactly real time with the margin
    assert holdback_s(0.0, 500) == 0.0
    assert holdback_s(1.0, 0) == 0.0  # nothing to play
    t = 0.1  # RTF 1.25
    h = holdback_s(t, 100, steady=8, margin=m)
    assert h == pytest.approx(100 * (t / m - FRAME_S) + 8 * t / m)
    # frame k made at k T' after the first audio, played at h + (k - 1) 80 ms: never late
    tp = t / m
    assert all(k * tp <= h + (k - 1) * FRAME_S + 1e-9 for k in range(1, 101))
    assert holdback_s(t, 200, margin=m) > h  # longer streams wait longer
    assert holdback_s(math.inf, 10) == MAX_HOLDBACK_S
    for bad in (dict(frame_time_s=math.nan, frames=1), dict(frame_time_s=-1.0, frames=1),
                dict(frame_time_s=0.1, frames=-1), dict(frame_time_s=0.1, frames=1, steady=0)):
        with pytest.raises(ValueError):
            holdback_s(**bad)


def test_chunk_policy_follows_the_costs_and_keeps_the_steady_floor():
    base = ChunkPolicy(first=1, steady=8)
    fast = chunk_policy(costs([5], call_ms=2, per_frame_ms=1), base)
    assert fast.first == 1 and fast.steady == 8
    slow = chunk_policy(costs([60], call_ms=20, per_frame_ms=5), base)
    assert slow.first == 2 and slow.steady >= 8  # a 1-frame first chunk runs dry here
    assert chunk_policy(costs([math.inf]), base) == base


def test_tracker_follows_drift_down_fast_and_up_slowly_with_hysteresis():
    c = costs([20, 30, 40, 50], shared=True)  # 4 slots; budget 68 ms
    tr = CapacityTracker(c, slots=4, margin=0.85, window_s=4.0, min_samples=4, down_s=1.0,
                         up_s=5.0)
    assert tr.current.streams == 4
    now = 0.0
    # a noisy neighbour: every frame takes 2x the model (3 streams running)
    lowered = None
    for i in range(12):
        now += 0.25
        tr.observe(3, 2.0 * c.frame_time_s(3, 8, 1.0), now)
        if tr.update(now):
            lowered = now
    assert tr.contention == pytest.approx(2.0)
    assert tr.current.streams == 2  # 2 x 30 = 60 <= 68 < 2 x 40
    assert lowered is not None and 1.0 <= lowered - 1.0 <= 2.0  # 4 samples, then down_s
    # back to normal: capacity rises one step at a time, each after up_s of good samples
    rises = []
    for i in range(200):
        now += 0.25
        tr.observe(2, c.frame_time_s(2, 8, 1.0), now)
        if tr.update(now):
            rises.append((now, tr.current.streams))
    assert [n for _, n in rises] == [3, 4]
    assert rises[1][0] - rises[0][0] >= 5.0
    assert tr.contention == pytest.approx(1.0)


def test_tracker_ignores_bad_samples_and_needs_enough_of_them():
    c = costs([20, 30])
    tr = CapacityTracker(c, slots=2, min_samples=4)
    for v in (math.nan, math.inf, -1.0):
        tr.observe(1, v, 1.0)
    tr.observe(0, 0.05, 1.0)
    tr.observe(1, 10.0, 1.0)  # one slow sample is not enough
    assert not tr.update(1.0) and tr.contention == 1.0 and tr.current.streams == 2


def test_admission_capacity_lowered_keeps_admitted_and_raised_admits_waiting():
    adm = AdmissionController(10**9, max_streams=3, max_queue=4)
    for i in range(3):
        assert adm.try_admit(i, 1)
    adm.set_capacity(1)
    assert adm.admitted_count == 3  # nothing taken back
    adm.release(0)
    assert not adm.try_admit(9, 1)  # 2 running > capacity 1
    t = adm.enqueue(10, 1, deadline=1e18)
    assert not t.admitted
    adm.set_capacity(4)
    assert t.admitted and adm.admitted_count == 3
    adm.set_capacity(0)
    assert not adm.try_admit(11, 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            adm.set_capacity(bad)


def test_cost_cache_roundtrip_and_rejects_foreign_or_broken_files(tmp_path):
    c = costs([20, 30], call_ms=10, per_frame_ms=1)
    a = CostCache(tmp_path, "aaaa")
    assert a.load() is None
    a.store(c)
    assert CostCache(tmp_path, "aaaa").load() == c
    assert CostCache(tmp_path, "bbbb").load() is None
    data = json.loads(a.path.read_text())
    a.path.write_text(json.dumps({**data, "fingerprint": "zzzz"}))
    assert a.load() is None
    a.path.write_text("{not json")
    assert a.load() is None
    a.path.write_text(json.dumps({**data, "costs": {**data["costs"], "frame_s": [math.nan]}}
                                 ).replace("NaN", '"x"'))
    assert a.load() is None
    assert a.invalidate() and not a.invalidate()


def test_bandwidth_drift_measures_again_past_the_threshold():
    """Cached costs are measured again when this start's read bandwidth differs from theirs by
    more than BANDWIDTH_DRIFT, up or down; a missing or zero figure on either side never counts
    as drift (nothing to compare)."""
    from omni_stream.orchestrator.costs import BANDWIDTH_DRIFT, bandwidth_drifted

    cached = MachineCosts(frame_s=(0.05,), codec_call_s=0.01, codec_frame_s=0.005,
                          bandwidth_gbs=20.0)
    inside, outside = 20.0 * (1 + 0.99 * BANDWIDTH_DRIFT), 20.0 * (1 + 1.01 * BANDWIDTH_DRIFT)
    assert not bandwidth_drifted(cached, {"bandwidth_gbs": inside})
    assert not bandwidth_drifted(cached, {"bandwidth_gbs": 20.0 * (1 - 0.99 * BANDWIDTH_DRIFT)})
    assert bandwidth_drifted(cached, {"bandwidth_gbs": outside})
    assert bandwidth_drifted(cached, {"bandwidth_gbs": 20.0 * (1 - 1.01 * BANDWIDTH_DRIFT)})
    assert not bandwidth_drifted(cached, {})
    assert not bandwidth_drifted(cached, {"bandwidth_gbs": 0.0})
    unknown = MachineCosts(frame_s=(0.05,), codec_call_s=0.01, codec_frame_s=0.005)
    assert not bandwidth_drifted(unknown, {"bandwidth_gbs": 9.0})
