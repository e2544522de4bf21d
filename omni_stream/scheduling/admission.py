"""Admission control: KV budget + slot cap, a bounded waiting queue with deadlines, no preemption.

A stream is admitted only when the KV it can ever need (``KVBudget.need_bytes``) fits in what
the admitted streams leave of the budget AND a slot is free (``max_streams``). Once admitted it
runs to completion or cancellation: nothing here ever takes KV or a slot back (no preemption),
so a running stream can never be stalled or evicted by newcomers.

Everything else waits in a bounded FIFO queue with a deadline:

- queue full -> 429 ``server_busy`` (reason queue_full) at once;
- deadline passed while queued -> 503 ``queue_timeout`` (reason deadline);
- a need larger than the whole budget -> 400 ``request_too_large`` (reason too_large, param
  max_new_tokens) at once (waiting cannot help; the client must ask for fewer frames).

Each is an ``errors.RequestError`` the server sends as it is. Both 429 and 503 carry a retry
delay (``retry_after``): (position in the queue + 1) x the observed mean stream
duration / the streams running, clamped to [min_retry_s, max_retry_s].

Head of line. Strict FIFO lets one large request at the head idle KV that would serve several
smaller ones behind it; free overtaking can starve the large one forever. We take the middle
road: a later request may be admitted past earlier waiting ones only if it fits now and every
earlier one has been overtaken fewer than ``max_overtakes`` times (each overtake counts against
all of them). A request that reaches the bound blocks everything behind it until it fits, which
it will: its need is within the budget and running streams always finish. ``max_overtakes=0``
is strict FIFO.

Concurrency: the controller is plain single-threaded bookkeeping. Use it from one asyncio event
loop thread only (the server's); other threads must hop in with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable

from omni_stream.errors import RequestError

log = logging.getLogger(__name__)

QUEUE_FULL = "queue_full"
DEADLINE = "deadline"
TOO_LARGE = "too_large"
CANCELLED = "cancelled"

# reason -> the error code on the wire
_CODES = {QUEUE_FULL: "server_busy", DEADLINE: "queue_timeout", TOO_LARGE: "request_too_large",
          CANCELLED: "cancelled"}


def rejected(status: int, reason: str, message: str,
             retry_after_s: float | None = None) -> RequestError:
    """A request admission refused: HTTP ``status`` (429 / 503 / 400), ``reason`` (one of
    queue_full, deadline, too_large, cancelled; its wire code from ``_CODES``) and
    ``retry_after_s`` (None: retrying will not help). A need past the whole budget names
    max_new_tokens, the request field that sets it."""
    return RequestError(status, _CODES[reason], message, retry_after=retry_after_s,
                        param="max_new_tokens" if reason == TOO_LARGE else None, reason=reason)


@dataclass(eq=False)
class Ticket:
    """One waiting (or finished waiting) request. ``state``: queued -> admitted | rejected |
    cancelled."""

    req_id: Hashable
    need: int
    deadline: float
    enqueued_at: float
    state: str = "queued"
    overtaken: int = 0
    admitted_at: float | None = None
    rejection: RequestError | None = None
    _waker: asyncio.Future | None = field(default=None, repr=False)

    @property
    def admitted(self) -> bool:
        return self.state == "admitted"

    @property
    def wait_s(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.enqueued_at

    def _wake(self) -> None:
        if self._waker is not None and not self._waker.done():
            self._waker.set_result(None)


@dataclass
class _Running:
    need: int
    since: float


class AdmissionController:
    """See the module docstring. ``kv_budget_bytes`` is the usable budget
    (``KVBudget.usable_bytes``); ``clock`` is injectable for tests."""

    def __init__(self, kv_budget_bytes: int, max_streams: int, max_queue: int, *,
                 max_overtakes: int = 4, prior_stream_s: float = 10.0, ewma_alpha: float = 0.2,
                 min_retry_s: float = 1.0, max_retry_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if kv_budget_bytes < 0 or max_streams < 1 or max_queue < 0 or max_overtakes < 0:
            raise ValueError("need kv_budget_bytes >= 0, max_streams >= 1, max_queue >= 0, "
                             "max_overtakes >= 0")
        if prior_stream_s <= 0 or not 0 < ewma_alpha <= 1 or not 0 <= min_retry_s <= max_retry_s:
            raise ValueError("need prior_stream_s > 0, 0 < ewma_alpha <= 1, "
                             "0 <= min_retry_s <= max_retry_s")
        self.budget = int(kv_budget_bytes)
        self.max_streams = max_streams
        self.max_queue = max_queue
        self.max_overtakes = max_overtakes
        self.min_retry_s = min_retry_s
        self.max_retry_s = max_retry_s
        self._alpha = ewma_alpha
        self._mean_s = float(prior_stream_s)
        self._observed = 0
        self._clock = clock
        self._running: dict[Hashable, _Running] = {}
        self._queue: list[Ticket] = []
        self._used = 0
        self._admitted_total = 0
        self._rejected: Counter[str] = Counter()

    # ------------------------------------------------------------------ state
    @property
    def kv_used_bytes(self) -> int:
        return self._used

    @property
    def admitted_count(self) -> int:
        return len(self._running)

    @property
    def queued_count(self) -> int:
        return len(self._queue)

    @property
    def mean_stream_s(self) -> float:
        return self._mean_s

    def set_capacity(self, streams: int) -> None:
        """The streams admitted at once from now on (the measured real-time capacity). A lower
        value takes nothing from admitted streams: it only stops admissions until enough of
        them have ended; a higher one admits whoever waits and now fits."""
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 0:
            raise ValueError(f"capacity must be an integer >= 0, got {streams!r}")
        raise_ = streams > self.max_streams
        self.max_streams = streams
        if raise_:
            self._pump()

    def is_admitted(self, req_id: Hashable) -> bool:
        return req_id in self._running

    def _fits(self, need: int) -> bool:
        return len(self._running) < self.max_streams and self._used + need <= self.budget

    def _check_new(self, req_id: Hashable, need: int) -> None:
        if need < 0:
            raise ValueError(f"need must be >= 0 bytes, got {need}")
        if req_id in self._running or any(t.req_id == req_id for t in self._queue):
            raise ValueError(f"request {req_id!r} is already admitted or queued")
        if need > self.budget:
            self._rejected[TOO_LARGE] += 1
            raise rejected(400, TOO_LARGE, f"this request needs {need} bytes of KV cache, more "
                           f"than the server's whole budget ({self.budget}): lower max_new_tokens "
                           "or shorten the text")

    def _admit(self, req_id: Hashable, need: int) -> None:
        self._running[req_id] = _Running(need, self._clock())
        self._used += need
        self._admitted_total += 1

    # ------------------------------------------------------------------ sync API
    def try_admit(self, req_id: Hashable, need: int) -> bool:
        """Admit now if the request fits and may pass whoever is waiting; never queues.
        Raises a 400 RequestError if ``need`` exceeds the whole budget."""
        self._check_new(req_id, need)
        if not self._fits(need) or not self._may_pass(len(self._queue)):
            return False
        for t in self._queue:
            t.overtaken += 1
        self._admit(req_id, need)
        return True

    def enqueue(self, req_id: Hashable, need: int, deadline: float) -> Ticket:
        """Queue a request until ``deadline`` (on ``clock``); it is admitted as soon as it may
        (possibly right here). Raises a 429 RequestError when the queue is full."""
        self._check_new(req_id, need)
        if len(self._queue) >= self.max_queue:
            self._rejected[QUEUE_FULL] += 1
            raise rejected(429, QUEUE_FULL, f"all {self.max_streams} streams busy or the KV "
                           f"budget is taken, and {len(self._queue)} requests queued: retry later",
                           self.retry_after_s(len(self._queue)))
        t = Ticket(req_id, need, deadline, self._clock())
        self._queue.append(t)
        self._pump()
        return t

    def release(self, req_id: Hashable) -> bool:
        """Free an admitted stream's slot and KV (completion or cancellation), or withdraw a
        queued request; then admit whoever now may. Idempotent: False if unknown."""
        r = self._running.pop(req_id, None)
        if r is not None:
            self._used -= r.need
            self._observe(self._clock() - r.since)
            self._pump()
            return True
        for t in self._queue:
            if t.req_id == req_id:
                self._queue.remove(t)
                t.state = CANCELLED
                t.rejection = rejected(503, CANCELLED, "request withdrawn while queued")
                self._rejected[CANCELLED] += 1
                t._wake()
                self._pump()
                return True
        return False

    def expire(self, now: float | None = None) -> list[Ticket]:
        """Reject (503) every queued ticket whose deadline has passed; returns them. ``acquire``
        does this itself; call it only for tickets from ``enqueue``."""
        now = self._clock() if now is None else now
        gone = [t for t in self._queue if t.deadline <= now]
        for t in gone:
            self._reject_deadline(t)
        if gone:
            self._pump()
        return gone

    def retry_after_s(self, position: int) -> float:
        """Seconds until a request at queue ``position`` (0 = next) can expect a slot."""
        running = max(1, len(self._running))
        est = (position + 1) * self._mean_s / running
        return min(self.max_retry_s, max(self.min_retry_s, est))

    # ------------------------------------------------------------------ asyncio API
    async def acquire(self, req_id: Hashable, need: int, timeout: float) -> Ticket:
        """Admit now, or wait in the queue up to ``timeout`` seconds. Raises RequestError (400
        too large, 429 queue full, 503 deadline). If the awaiting task is cancelled (client gone)
        the request leaves the queue, or is released if it was admitted meanwhile."""
        now = self._clock()
        if self.try_admit(req_id, need):
            t = Ticket(req_id, need, now + timeout, now, state="admitted", admitted_at=now)
            return t
        t = self.enqueue(req_id, need, now + timeout)
        if t.admitted:
            return t
        t._waker = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait({t._waker}, timeout=max(0.0, timeout))
        except asyncio.CancelledError:
            self.release(req_id)
            raise
        if t.state == "queued":  # the deadline passed first
            self._reject_deadline(t)
            self._pump()
        if t.admitted:
            return t
        assert t.rejection is not None
        raise t.rejection

    # ------------------------------------------------------------------ internals
    def _may_pass(self, index: int) -> bool:
        """May the request at queue ``index`` (len(queue) = a newcomer) go before those ahead?"""
        return all(t.overtaken < self.max_overtakes for t in self._queue[:index])

    def _pump(self) -> None:
        """Admit waiting tickets in FIFO order, overtaking within the bound."""
        i = 0
        while i < len(self._queue) and len(self._running) < self.max_streams:
            t = self._queue[i]
            if self._fits(t.need) and self._may_pass(i):
                for ahead in self._queue[:i]:
                    ahead.overtaken += 1
                del self._queue[i]
                self._admit(t.req_id, t.need)
                t.state, t.admitted_at = "admitted", self._clock()
                t._wake()
                continue
            if not self._may_pass(i + 1):
                break  # someone at or before i has used up its overtakes: nobody behind may go
            i += 1

    def _reject_deadline(self, t: Ticket) -> None:
        pos = self._queue.index(t)
        self._queue.remove(t)
        t.state = "rejected"
        t.rejection = rejected(503, DEADLINE, f"no stream slot / KV budget within the queue "
                               f"deadline ({self._clock() - t.enqueued_at:.1f} s waited): retry later",
                               self.retry_after_s(pos))
        self._rejected[DEADLINE] += 1
        t._wake()

    def _observe(self, duration_s: float) -> None:
        if self._observed == 0:
            self._mean_s = duration_s
        else:
            self._mean_s += self._alpha * (duration_s - self._mean_s)
        self._observed += 1

    def snapshot(self) -> dict[str, float]:
        """Flat numeric gauges for /metrics (``omni_stream_backend_<key>``)."""
        now = self._clock()
        oldest = max((now - t.enqueued_at for t in self._queue), default=0.0)
        return dict(
            admitted=len(self._running), queued=len(self._queue),
            kv_used_bytes=self._used, kv_budget_bytes=self.budget,
            kv_free_bytes=self.budget - self._used, max_streams=self.max_streams,
            max_queue=self.max_queue, admitted_total=self._admitted_total,
            mean_stream_s=self._mean_s, oldest_queued_s=oldest,
            rejected_queue_full=self._rejected[QUEUE_FULL],
            rejected_deadline=self._rejected[DEADLINE],
            rejected_too_large=self._rejected[TOO_LARGE],
            cancelled_queued=self._rejected[CANCELLED],
        )


__all__ = ["AdmissionController", "Ticket", "rejected", "QUEUE_FULL", "DEADLINE", "TOO_LARGE",
           "CANCELLED"]
