"""Adaptive chunk schedule, its calibration, the calibration cache and the hardware fingerprint."""

from __future__ import annotations

import random
import re

import pytest

from omni_stream.scheduling.chunking import ChunkPolicy, calibrate, fit_chunk_costs
from omni_stream.scheduling.fingerprint import fingerprint_info, hardware_fingerprint


def test_ramp_starts_small_and_grows_at_most_x2_to_steady():
    p = ChunkPolicy(first=1, steady=12, growth=2.0)
    assert [p.ramp(i) for i in range(6)] == [1, 2, 4, 8, 12, 12]
    slow = ChunkPolicy(first=2, steady=6, growth=1.0)
    assert [slow.ramp(i) for i in range(6)] == [2, 3, 4, 5, 6, 6]
    with pytest.raises(ValueError):
        ChunkPolicy(growth=3.0)  # x2 per chunk is the cap
    with pytest.raises(ValueError):
        ChunkPolicy(first=4, steady=2)


def test_ample_slack_follows_the_ramp():
    p = ChunkPolicy(first=1, steady=8, growth=2.0, min_slack_s=0.1)
    sizes, prev = [], None
    for i in range(6):
        prev = p.next_chunk(i, slack_s=5.0, frame_time_s=0.03, decode_ms_per_frame=5.0, prev=prev)
        sizes.append(prev)
    assert sizes == [1, 2, 4, 8, 8, 8]


def test_never_grows_more_than_x2_and_never_below_one():
    rng = random.Random(0)
    p = ChunkPolicy(first=2, steady=32, growth=2.0, min_slack_s=0.1)
    prev = p.first
    for i in range(1, 2000):
        n = p.next_chunk(i, slack_s=rng.uniform(-1.0, 4.0), frame_time_s=rng.uniform(0.0, 0.2),
                         decode_ms_per_frame=rng.uniform(0.0, 50.0), prev=prev)
        assert 1 <= n <= min(2 * prev, p.steady)
        prev = n


def test_low_slack_holds_then_shrinks():
    p = ChunkPolicy(first=1, steady=16, growth=2.0, min_slack_s=0.1)
    per_frame = 0.05 + 0.010  # 50 ms generation + 10 ms decode per frame
    # 8 -> 16 would need 0.96 s of buffer above the reserve; 0.6 s covers the current 8
    assert p.next_chunk(4, slack_s=0.6, frame_time_s=0.05, decode_ms_per_frame=10.0, prev=8) == 8
    # 0.34 s: only 4 frames can be made before the reserve is reached
    assert p.next_chunk(4, slack_s=0.1 + 4 * per_frame + 0.001, frame_time_s=0.05,
                        decode_ms_per_frame=10.0, prev=8) == 4
    assert p.next_chunk(4, slack_s=0.0, frame_time_s=0.05, decode_ms_per_frame=10.0, prev=8) == 1
    assert p.next_chunk(4, slack_s=-2.0, frame_time_s=0.05, decode_ms_per_frame=10.0, prev=8) == 1
    # comfortable again: grows back, x2 at most
    assert p.next_chunk(5, slack_s=9.0, frame_time_s=0.05, decode_ms_per_frame=10.0, prev=1) == 2


def test_first_chunk_is_the_first_size_whatever_the_slack():
    p = ChunkPolicy(first=2, steady=8)
    assert p.next_chunk(0, slack_s=0.0, frame_time_s=1.0, decode_ms_per_frame=100.0) == 2


@pytest.mark.parametrize("growth", [2.0001, 2.5, 3.0, 4.0, float("inf"), float("nan")])
def test_any_growth_above_x2_is_refused(growth):
    with pytest.raises(ValueError, match="growth"):
        ChunkPolicy(growth=growth)


def test_one_growth_rule_for_every_growth_and_start():
    """``grow`` is the only ramp: x growth, at least +1, at most x2 and steady; ``ramp`` and
    ``starting_at`` (a request's first chunk) follow it."""
    for growth in (1.0, 1.25, 1.5, 2.0):
        for first in (1, 2, 3, 5):
            p = ChunkPolicy(first=first, steady=16, growth=growth)
            sizes = [p.ramp(i) for i in range(20)]
            assert sizes[0] == first and sizes[-1] == 16
            for a, b in zip(sizes, sizes[1:]):
                assert b == min(16, 2 * a, max(a + 1, int(a * growth)))
    q = ChunkPolicy(first=1, steady=4).starting_at(6)
    assert (q.first, q.steady, q.growth) == (6, 6, 2.0)
    assert ChunkPolicy(first=1, steady=8).starting_at(3) == ChunkPolicy(first=3, steady=8, first_requested=True)


def test_policy_is_a_frozen_msgspec_struct_that_validates_on_decode():
    import msgspec

    p = ChunkPolicy(first=2, steady=6, growth=1.5, min_slack_s=0.2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=ChunkPolicy) == p
    assert ChunkPolicy.from_dict(p.to_dict()) == p and hash(p) == hash(ChunkPolicy.from_dict(p.to_dict()))
    with pytest.raises(AttributeError):
        p.first = 3  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError, match="growth"):
        msgspec.json.decode(b'{"growth": 3.0}', type=ChunkPolicy)
    with pytest.raises(msgspec.ValidationError, match="first"):
        msgspec.json.decode(b'{"first": "one"}', type=ChunkPolicy)


def synthetic_arrivals(sizes, per_chunk_s, per_frame_s, t0=1.0, jitter=0.0, seed=0):
    rng = random.Random(seed)
    t, out = t0, [(sizes[0], t0)]
    for n in sizes[1:]:
        t += per_chunk_s + per_frame_s * n + rng.uniform(-jitter, jitter)
        out.append((n, t))
    return out


def test_calibration_fits_chunk_costs_and_picks_the_smallest_steady_size():
    arr = synthetic_arrivals([1, 2, 4, 8, 16, 16, 16], per_chunk_s=0.10, per_frame_s=0.05)
    fit = fit_chunk_costs(arr)
    assert fit.per_chunk_s == pytest.approx(0.10) and fit.per_frame_s == pytest.approx(0.05)
    assert fit.residual_s == pytest.approx(0.0, abs=1e-12)
    p = calibrate(arr, target_rtf=0.8)
    # (0.10 + 0.05 n) / (0.08 n) <= 0.8  <=>  n >= 0.10 / 0.014 = 7.14
    assert p.steady == 8
    assert p.first == 2  # no first size covers making the second chunk here: the cap
    assert p.growth == 2.0 and p.min_slack_s == pytest.approx(0.08)

    fast = calibrate(synthetic_arrivals([1, 2, 4, 8, 8], per_chunk_s=0.005, per_frame_s=0.02))
    assert fast.first == 1 and fast.steady == 1  # cheap chunks: smallest sizes keep the margin

    jittery = calibrate(synthetic_arrivals([1, 2, 4, 8, 16] * 4, 0.1, 0.05, jitter=0.1))
    assert jittery.min_slack_s > 0.08  # the reserve covers the measured jitter

    slow = calibrate(synthetic_arrivals([1, 2, 4, 8], 0.01, 0.1), max_steady=24)
    assert slow.steady == 24  # slower than real time: no size keeps the margin


def test_calibration_raises_the_steady_size_but_never_below_the_floor():
    """The server passes its uncalibrated steady size: gaps that look cheap (a decode hidden
    behind the talker) do not shrink the chunks below it, a costly chunk still raises it."""
    cheap = synthetic_arrivals([1, 2, 4, 8, 8], per_chunk_s=0.005, per_frame_s=0.02)
    assert calibrate(cheap, min_steady=8).steady == 8
    assert calibrate(cheap, min_steady=8).first == 1  # the first chunk is still the smallest that covers
    costly = synthetic_arrivals([1, 2, 4, 8, 16, 16, 16], per_chunk_s=0.10, per_frame_s=0.05)
    assert calibrate(costly, min_steady=4).steady == 8
    assert calibrate(costly, min_steady=12).steady == 12
    assert calibrate(cheap, min_steady=64, max_steady=32).steady == 32  # the cap holds


def test_calibration_needs_two_sizes():
    with pytest.raises(ValueError, match="distinct sizes"):
        calibrate(synthetic_arrivals([4, 4, 4, 4], 0.1, 0.05))
    with pytest.raises(ValueError, match="non-decreasing"):
        fit_chunk_costs([(1, 0.0), (2, 1.0), (4, 0.5)])


def test_hardware_fingerprint_is_stable_and_tracks_relevant_changes():
    info = fingerprint_info()
    assert {"cpu_model", "cpu_count", "isa", "ram_gib", "torch", "gpus"} <= set(info)
    assert hardware_fingerprint() == hardware_fingerprint()
    fp = hardware_fingerprint(info)
    assert re.fullmatch(r"[0-9a-f]{16}", fp), fp  # 16 lowercase hex digits (a file-name key)
    assert hardware_fingerprint(dict(info)) == fp  # a function of the fields only
    assert hardware_fingerprint(dict(reversed(list(info.items())))) == fp  # not of their order
    assert hardware_fingerprint({**info, "cpu_model": info["cpu_model"] + " v2"}) != fp
    assert hardware_fingerprint({**info, "ram_gib": (info["ram_gib"] or 0) + 1}) != fp
    assert hardware_fingerprint(fingerprint_info({"isa": ["avx2"]})) != hardware_fingerprint(
        fingerprint_info({"isa": ["avx2", "avx512f"]}))
    assert hardware_fingerprint({**info, "gpus": ["NVIDIA H200"]}) != fp
    assert hardware_fingerprint({**info, "torch": "0.0"}) != fp
