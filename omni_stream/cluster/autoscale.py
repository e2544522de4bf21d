"""Serve autoscaling on real-time capacity in use.

Each replica reports (``record_autoscaling_stats``) the streams it holds (running and queued)
and how many it can run in real time. The policy wants enough replicas that the streams held
fill ``target_utilisation`` of their capacity:

    desired = streams held in all replicas / (target_utilisation x mean capacity per replica)

Serve's wrapper then applies the configured bounds (``--min-replicas`` / ``--max-replicas``) and
the up and down delays (``--upscale-delay`` / ``--downscale-delay``). Until replicas report,
ongoing requests stand in for streams held, at one stream of capacity each.

Serve pickles this module by value into its controller: it imports nothing of omni-stream.
"""

from __future__ import annotations

from typing import Any


def desired_replicas(held: dict, capacity: dict, current: int, ongoing: float,
                     target_utilisation: float) -> float:
    """Replicas wanted for ``held`` streams (per replica) given each one's ``capacity``."""
    caps = [float(c) for c in capacity.values() if c and c > 0]
    per_replica = sum(caps) / len(caps) if caps else 1.0
    total = float(sum(held.values())) if held else float(ongoing)
    if current == 0 and total == 0:
        return 0.0
    return total / (target_utilisation * per_replica)


class CapacityPolicy:
    def __init__(self, target_utilisation: float = 0.8) -> None:
        if not 0 < target_utilisation <= 1:
            raise ValueError(f"target_utilisation {target_utilisation} must be in (0, 1]")
        self.target = float(target_utilisation)

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        want = desired_replicas(metrics.get("streams_held") or {},
                                metrics.get("capacity_streams") or {},
                                ctx.current_num_replicas, ctx.total_num_requests, self.target)
        return want, {}
