"""Serve's request router for omni-stream replicas: the most free real-time capacity first.

Each replica reports, through Serve's routing stats (``record_routing_stats``), how many
streams it can run in real time (``capacity_streams``, measured on its node and tracked while
it serves) and how many it holds. Those reports lag (a stats period plus the controller's
broadcast), so the router also counts what it sent itself: a request is counted on the replica
it was ranked first for the moment it is ranked (a burst of requests that arrive together is
spread instead of piling onto the replica that looked emptiest), moved to the replica that
accepted it when Serve says so, and dropped when it completes (or after ``PROVISIONAL_S`` if
it was never sent). Free capacity is ``capacity_streams - max(counted here, reported)``;
replicas are tried from the most free to the least, and among equals the one holding fewest.
A replica not yet reporting counts as one stream of capacity; an unhealthy one comes last.
When no replica has free capacity the least loaded one still gets the request and answers
with the single server's contract: it queues it within its bound, or answers 429 / 503 with
Retry-After. A WebSocket session is one request for its whole life, so it stays on the
replica it was routed to.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PROVISIONAL_S = 5.0  # a ranked request Serve never reports as routed is forgotten after this


def free_capacity(stats: dict | None, in_flight: int | None) -> tuple[float, int]:
    """(free real-time streams, requests held) of one replica from its routing stats and the
    router's count of requests in flight to it (None: unknown)."""
    stats = stats or {}
    cap = stats.get("capacity_streams")
    held_reported = int(stats.get("streams_held", 0) or 0)
    held = max(int(in_flight or 0), held_reported)
    if not stats.get("healthy", True):
        return float("-inf"), held
    if cap is None:  # still starting or not measured yet
        cap = 1
    return float(cap) - held, held


def rank(replicas: list, stats_of: Callable, in_flight_of: Callable) -> list[list]:
    """Replicas ordered by (free capacity desc, held asc), one per rank; ties keep the given
    order."""
    scored = []
    for i, r in enumerate(replicas):
        free, held = free_capacity(stats_of(r), in_flight_of(r))
        scored.append((-free, held, i, r))
    scored.sort(key=lambda t: t[:3])
    return [[t[3]] for t in scored]


class InFlight:
    """Requests this router has sent (or is about to send) to each replica."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.where: dict[str, tuple[object, bool, float]] = {}  # id -> (replica, sent, t)

    def ranked(self, request_id: str, replica_id) -> None:
        """The request is about to go to ``replica_id`` (its first choice)."""
        self.where[request_id] = (replica_id, False, self.clock())

    def routed(self, request_id: str, replica_id) -> None:
        self.where[request_id] = (replica_id, True, self.clock())

    def completed(self, request_id: str) -> None:
        self.where.pop(request_id, None)

    def drop_replica(self, replica_id) -> None:
        for rid in [k for k, v in self.where.items() if v[0] == replica_id]:
            del self.where[rid]

    def counts(self) -> dict:
        now = self.clock()
        stale = [k for k, (_, sent, t) in self.where.items()
                 if not sent and now - t > PROVISIONAL_S]
        for k in stale:
            del self.where[k]
        out: dict = {}
        for replica_id, _, _ in self.where.values():
            out[replica_id] = out.get(replica_id, 0) + 1
        return out


class CapacityRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.in_flight = InFlight()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        cache = self.replica_queue_len_cache
        counts = self.in_flight.counts()
        ranks = rank(candidate_replicas, lambda r: r.routing_stats,
                     lambda r: max(counts.get(r.replica_id, 0), cache.get(r.replica_id) or 0))
        if pending_request is not None:
            self.in_flight.ranked(pending_request.metadata.internal_request_id,
                                  ranks[0][0].replica_id)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.in_flight.routed(pending_request.metadata.internal_request_id, replica_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.in_flight.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.drop_replica(replica_id)
