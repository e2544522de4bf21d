"""Admission: KV + slot cap, bounded FIFO with deadlines, 429/503 with Retry-After, no preemption."""

from __future__ import annotations

import asyncio

import pytest

from omni_stream.errors import RequestError
from omni_stream.scheduling.admission import AdmissionController


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ctl(budget=100, streams=4, queue=4, **kw) -> AdmissionController:
    return AdmissionController(budget, streams, queue, **kw)


def test_admits_only_when_kv_fits_and_a_slot_is_free():
    a = ctl(budget=100, streams=2)
    assert a.try_admit("a", 60)
    assert not a.try_admit("b", 50)  # 60 + 50 > 100
    assert a.try_admit("c", 40)  # exactly fills the budget
    assert a.kv_used_bytes == 100
    a.release("c")
    assert a.try_admit("d", 10)
    assert not a.try_admit("e", 0)  # KV left but both slots taken
    assert a.snapshot()["admitted"] == 2
    with pytest.raises(ValueError, match="already"):
        a.try_admit("a", 1)


def test_need_above_the_whole_budget_is_refused_at_once():
    a = ctl(budget=100)
    with pytest.raises(RequestError) as e:
        a.try_admit("x", 101)
    assert (e.value.status, e.value.reason, e.value.retry_after_s) == (400, "too_large", None)
    be = e.value  # admission's refusal is the error the server sends
    assert (be.status, be.code, be.param) == (400, "request_too_large", "max_new_tokens")
    assert a.snapshot()["rejected_too_large"] == 1


def test_strict_fifo_big_head_blocks_smaller_ones():
    clock = FakeClock()
    a = ctl(budget=100, streams=4, max_overtakes=0, clock=clock)
    assert a.try_admit("r1", 50) and a.try_admit("r2", 30)
    big = a.enqueue("big", 60, deadline=clock.t + 10)  # 20 free: waits
    small = a.enqueue("small", 10, deadline=clock.t + 10)  # would fit, but FIFO
    assert not big.admitted and not small.admitted
    assert not a.try_admit("newcomer", 5)  # nobody passes a waiting request
    a.release("r2")  # 50 free: still not enough for big, small stays behind it
    assert not big.admitted and not small.admitted
    a.release("r1")
    assert big.admitted and small.admitted  # in order, both fit now
    assert a.kv_used_bytes == 70


def test_small_requests_overtake_a_blocked_head_a_bounded_number_of_times():
    clock = FakeClock()
    a = ctl(budget=100, streams=8, queue=8, max_overtakes=2, clock=clock)
    assert a.try_admit("r1", 80)
    big = a.enqueue("big", 60, deadline=clock.t + 10)
    assert a.try_admit("s1", 5)  # overtake 1
    s2 = a.enqueue("s2", 5, deadline=clock.t + 10)
    assert s2.admitted  # overtake 2 (pumped on enqueue)
    assert big.overtaken == 2
    assert not a.try_admit("s3", 5)  # bound reached: the head now blocks everyone
    s4 = a.enqueue("s4", 5, deadline=clock.t + 10)
    assert not s4.admitted
    a.release("r1")  # 90 free -> big (60) then s4 (5), FIFO
    assert big.admitted and s4.admitted


def test_queue_full_is_429_with_retry_after_from_position_and_mean_duration():
    clock = FakeClock()
    a = ctl(budget=100, streams=2, queue=2, clock=clock, prior_stream_s=10.0)
    assert a.try_admit("a", 10) and a.try_admit("b", 10)
    clock.t += 6.0
    a.release("a")  # observed stream duration: 6 s
    assert a.mean_stream_s == pytest.approx(6.0)
    assert a.try_admit("c", 10)
    a.enqueue("q1", 10, deadline=clock.t + 5)
    a.enqueue("q2", 10, deadline=clock.t + 5)
    with pytest.raises(RequestError) as e:
        a.enqueue("q3", 10, deadline=clock.t + 5)
    r = e.value
    assert (r.status, r.reason, r.code) == (429, "queue_full", "server_busy")
    assert r.retry_after_s == pytest.approx((2 + 1) * 6.0 / 2)  # position 2, 2 streams running
    assert r.retry_after == r.retry_after_s
    snap = a.snapshot()
    assert snap["rejected_queue_full"] == 1 and snap["queued"] == 2
    assert a.retry_after_s(1000) == a.max_retry_s and a.retry_after_s(0) >= a.min_retry_s


def test_no_queue_means_immediate_429():
    a = ctl(budget=100, streams=1, queue=0)
    assert a.try_admit("a", 1)

    async def main():
        with pytest.raises(RequestError) as e:
            await a.acquire("b", 1, timeout=1.0)
        assert e.value.status == 429

    asyncio.run(main())


def test_sync_deadline_expiry_is_503():
    clock = FakeClock()
    a = ctl(budget=100, streams=1, clock=clock)
    assert a.try_admit("a", 10)
    t = a.enqueue("b", 10, deadline=clock.t + 2)
    assert a.expire() == []
    clock.t += 2.5
    assert a.expire() == [t]
    assert t.state == "rejected" and t.rejection.status == 503 and t.rejection.reason == "deadline"
    assert t.rejection.code == "queue_timeout" and t.rejection.retry_after_s >= 1.0
    assert a.snapshot()["rejected_deadline"] == 1 and a.queued_count == 0


def test_acquire_waits_and_release_admits_the_next():
    async def main():
        a = ctl(budget=100, streams=1, queue=4)
        first = await a.acquire("a", 50, timeout=1.0)
        assert first.admitted
        waiter = asyncio.create_task(a.acquire("b", 50, timeout=5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done() and a.queued_count == 1
        a.release("a")
        t = await asyncio.wait_for(waiter, 1.0)
        assert t.admitted and a.is_admitted("b") and t.wait_s is not None
        assert a.snapshot()["admitted_total"] == 2

    asyncio.run(main())


def test_acquire_deadline_raises_503_and_leaves_the_queue():
    async def main():
        a = ctl(budget=100, streams=1, queue=4)
        await a.acquire("a", 10, timeout=1.0)
        with pytest.raises(RequestError) as e:
            await a.acquire("b", 10, timeout=0.05)
        assert e.value.status == 503 and e.value.reason == "deadline"
        assert e.value.retry_after_s is not None
        assert a.queued_count == 0 and a.is_admitted("a")  # the running stream is untouched

    asyncio.run(main())


def test_cancelled_waiter_leaves_the_queue_and_releases_if_admitted_meanwhile():
    async def main():
        a = ctl(budget=100, streams=1, queue=4)
        await a.acquire("a", 10, timeout=1.0)
        w = asyncio.create_task(a.acquire("b", 10, timeout=5.0))
        await asyncio.sleep(0.01)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert a.queued_count == 0
        # admitted and cancelled in the same loop iteration: the slot comes back
        w2 = asyncio.create_task(a.acquire("c", 10, timeout=5.0))
        await asyncio.sleep(0.01)
        a.release("a")
        assert a.is_admitted("c")
        w2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w2
        assert not a.is_admitted("c") and a.kv_used_bytes == 0

    asyncio.run(main())


def test_withdrawing_a_queued_request():
    async def main():
        a = ctl(budget=100, streams=1, queue=4)
        await a.acquire("a", 10, timeout=1.0)
        w = asyncio.create_task(a.acquire("b", 10, timeout=5.0))
        await asyncio.sleep(0.01)
        assert a.release("b")
        with pytest.raises(RequestError) as e:
            await w
        assert e.value.reason == "cancelled"
        assert not a.release("b") and a.snapshot()["cancelled_queued"] == 1

    asyncio.run(main())


def test_never_preempts():
    clock = FakeClock()
    a = ctl(budget=100, streams=3, queue=10, max_overtakes=0, clock=clock)
    running = {"a": 40, "b": 40, "c": 20}
    for k, n in running.items():
        assert a.try_admit(k, n)
    tickets = [a.enqueue(f"q{i}", 10 + i, deadline=clock.t + 1) for i in range(10)]
    with pytest.raises(RequestError):
        a.enqueue("overflow", 1, deadline=clock.t + 1)
    clock.t += 5
    a.expire()
    assert all(t.state == "rejected" for t in tickets)
    assert all(a.is_admitted(k) for k in running) and a.kv_used_bytes == 100
    snap = a.snapshot()
    assert snap["admitted"] == 3 and snap["rejected_deadline"] == 10
    assert snap["rejected_queue_full"] == 1 and snap["kv_budget_bytes"] == 100


def test_snapshot_is_flat_and_numeric():
    clock = FakeClock()
    a = ctl(clock=clock)
    a.try_admit("a", 30)
    snap = a.snapshot()
    assert all(isinstance(v, (int, float)) for v in snap.values())
    assert {"admitted", "queued", "kv_used_bytes", "kv_budget_bytes"} <= set(snap)
    assert snap["kv_used_bytes"] == 30 and snap["kv_free_bytes"] == 70
