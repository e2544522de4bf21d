"""Talker-stage scheduler without a model: slots, the pending FIFO, prefill throttling, ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_stream.scheduling.throttle import Action
from omni_stream.stages.talker_scheduler import FrameEnd, TalkerScheduler, ThrottleSettings

EOS, INVALID = 2150, -1


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sched(slots=3, throttle=None, clock=None) -> TalkerScheduler:
    return TalkerScheduler(slots, eos=EOS, invalid=INVALID, frame_audio_s=0.08,
                           throttle=throttle or ThrottleSettings(), clock=clock or Clock())


def admit(s: TalkerScheduler, sid: int, prompt_len: int = 10, max_frames: int = 100):
    """Submit, assign and prefill a stream whole, as the runner does; returns its state."""
    st = s.submit(sid, max_frames)
    assert s.head() is st and s.assign(st, prompt_len)
    n, final = s.piece(st, prompt_len)
    assert (n, final) == (prompt_len, True)
    s.prefilled(st, n, 1e-3)
    s.start_decoding(st)
    return st


def test_imports_without_torch():
    code = ("import sys, omni_stream.stages.talker_scheduler; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_slots_are_taken_lowest_first_and_the_step_covers_the_highest():
    s = sched(slots=3)
    a, b, c = (admit(s, i) for i in (1, 2, 3))
    assert [st.slot for st in (a, b, c)] == [0, 1, 2] and s.width() == 3 and s.free_slots() == 0
    d = s.submit(4, 50)
    assert not s.assign(d, 5)  # full: waits at the head
    assert s.release(b) == 1 and s.width() == 3 and s.free_slots() == 1
    assert s.assign(d, 5) and d.slot == 1  # the freed lowest slot
    assert s.release(c) == 2 and s.width() == 1  # d is still prefilling: not in the step
    assert [st.stream_id for st in s.decoding()] == [1]
    s.prefilled(d, 5, 1e-3)
    s.start_decoding(d)
    assert s.width() == 2 and [st.stream_id for st in s.decoding()] == [1, 4]


def test_pending_is_fifo_and_find_prefers_the_waiting():
    s = sched()
    for sid in (5, 6, 7):
        s.submit(sid, 10)
    assert [st.stream_id for st in s.pending] == [5, 6, 7] and s.head().stream_id == 5
    six = s.find(6)
    assert six is not None and s.release(six) is None  # no slot yet
    assert [st.stream_id for st in s.pending] == [5, 7] and s.find(6) is None
    assert s.busy() and s.find(99) is None


def test_cancel_of_a_prefilling_stream_frees_its_slot():
    s = sched(slots=1)
    st = s.submit(1, 10)
    assert s.assign(st, 200)
    n, final = s.piece(st, 64)
    assert (n, final) == (64, False)
    s.prefilled(st, n, 0.01)
    assert st.fed == 64 and s.piece(st, 500) == (136, True)  # the last piece takes the rest
    assert s.release(st) == 0 and not s.pending and s.free_slots() == 1 and not s.busy()


def test_frame_ends_eos_length_invalid():
    s = sched()
    a = admit(s, 1, max_frames=2)
    b = admit(s, 2)
    c = admit(s, 3)
    assert s.advance(a, 7, now=5.0) is FrameEnd.NONE and a.frames == 1 and a.first_t == 5.0
    assert s.advance(a, 7, now=5.1) is FrameEnd.LENGTH and a.frames == 2  # the frame cap
    assert s.advance(b, EOS, now=5.1) is FrameEnd.EOS and b.frames == 1
    assert s.advance(c, INVALID, now=5.1) is FrameEnd.INVALID and c.frames == 0  # not counted
    assert c.first_t is None


def test_throttle_defers_runs_or_splits_from_the_playback_slack():
    clock = Clock()
    th = ThrottleSettings(margin_s=0.1, max_split_tokens=64, min_split_tokens=8, starvation_s=2.0)
    s = sched(throttle=th, clock=clock)
    # nothing running: the whole prompt at once
    new = s.submit(1, 100)
    s.assign(new, 300)
    d = s.decide(new)
    assert (d.action, d.tokens) == (Action.RUN, 300)
    s.prefilled(new, 300, 0.3)
    s.start_decoding(new)
    # a running stream with 3 frames sent just now (0.24 s buffered): little slack
    s.advance(new, 7, now=clock.t)
    s.advance(new, 7, now=clock.t)
    s.advance(new, 7, now=clock.t)
    s.stepped(0.05)
    late = s.submit(2, 100)
    s.assign(late, 2000)  # 0.2 s at the prior cost: more than the 0.09 s budget
    d = s.decide(late)
    assert (d.action, d.tokens) == (Action.SPLIT, 64)
    # the listener has run dry: defer
    clock.t += 1.0
    assert s.decide(late).action is Action.DEFER
    # waited past the starvation guard: runs anyway, in pieces of at most max_split_tokens
    clock.t += 2.0
    d = s.decide(late)
    assert (d.action, d.tokens) == (Action.SPLIT, 64)
    assert s.decisions[Action.DEFER.value] >= 1 and s.decisions[Action.SPLIT.value] >= 1
    off = sched(throttle=ThrottleSettings(enabled=False))
    admit(off, 9)
    st = off.submit(10, 100)
    off.assign(st, 400)
    assert (off.decide(st).action, off.decide(st).tokens) == (Action.RUN, 400)


def test_prefill_costs_and_step_times_are_learned():
    s = sched()
    st = s.submit(1, 100)
    s.assign(st, 200)
    s.prefilled(st, 50, 0.050 + 0.002)
    before = s.cost
    s.prefilled(st, 100, 0.100 + 0.002)  # two sizes: a fit
    assert s.cost != before
    assert s.cost.per_token_s == pytest.approx(1e-3) and s.cost.fixed_s == pytest.approx(2e-3)
    f0 = s.frame_s
    s.stepped(1.0)
    assert s.frame_s == pytest.approx(0.8 * f0 + 0.2)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_slots"):
        sched(slots=0)


def test_a_stream_waiting_for_text_does_not_throttle_prefills():
    """A continuous stream that ran out of text is not late (its writer is): its dry buffer must
    not defer a new prefill, and when its text comes its playback clock restarts at zero slack."""
    clock = Clock()
    th = ThrottleSettings(margin_s=0.1, max_split_tokens=64, min_split_tokens=8, starvation_s=60)
    s = sched(throttle=th, clock=clock)
    st = admit(s, 1)
    st.text_open, st.rows_in = True, 2
    for _ in range(2):
        s.advance(st, 7, now=clock.t)
    assert st.starved()  # 2 frames made, 2 text rows used: the next step needs more text
    st.waiting_since = clock.t
    clock.t += 5.0  # the listener ran dry 5 s ago, waiting for the writer
    new = s.submit(2, 100)
    s.assign(new, 2000)
    assert s.decide(new).action is not Action.DEFER
    st.new_ids.append(42)
    assert not st.starved()
    assert s.resumed(st, clock.t) == pytest.approx(5.0)
    assert st.waiting_since is None
    assert st.first_t == pytest.approx(clock.t - 2 * 0.08)  # slack 0, not -5 s
    # with the same stream late but NOT waiting for text, the prefill is deferred
    clock.t += 1.0
    assert s.decide(new).action is Action.DEFER
