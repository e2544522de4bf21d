"""Scheduling policies as plain Python: KV pricing and budget, admission, prefill throttling,
the adaptive chunk schedule and the hardware fingerprint its calibration is cached under.

No torch, no I/O at import time; the orchestrator and the talker stage call these pure
functions and small classes (see shared/design/architecture.md, "Scheduling policies").
"""

from omni_stream.scheduling.admission import AdmissionController, Ticket
from omni_stream.scheduling.capacity import Capacity, CostCache, MachineCosts
from omni_stream.scheduling.chunking import (ChunkCostFit, ChunkPolicy, calibrate, calibrate_fit,
                                             fit_chunk_costs)
from omni_stream.scheduling.fingerprint import fingerprint_info, hardware_fingerprint
from omni_stream.scheduling.kv_budget import (KVBudget, KVCost, KVGeometry,
                                              code_predictor_scratch_bytes, kv_budget_for,
                                              kv_bytes_per_token, kv_geometry, plan_slots)
from omni_stream.scheduling.throttle import (Action, Decision, PendingPrefill, PrefillCostModel,
                                             RunningStream, decide_prefill, slack_s)
from omni_stream.scheduling.tracker import CapacityTracker, StreamPace

__all__ = [
    "Action", "AdmissionController", "Capacity", "CapacityTracker", "ChunkCostFit", "ChunkPolicy",
    "CostCache", "MachineCosts", "calibrate_fit",
    "Decision", "KVBudget", "KVCost", "KVGeometry", "PendingPrefill", "PrefillCostModel",
    "RunningStream", "StreamPace", "Ticket", "calibrate",
    "code_predictor_scratch_bytes", "decide_prefill", "fingerprint_info", "fit_chunk_costs",
    "hardware_fingerprint", "kv_budget_for", "kv_bytes_per_token", "kv_geometry", "plan_slots",
    "slack_s",
]
