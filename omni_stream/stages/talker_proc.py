"""The talker stage's process: load the model onto the engine its spec names, then loop over
control messages (streams, stats, cost measurement) and frame steps (``TalkerStage``), and ship
the step timings to the server every second."""

from __future__ import annotations

import logging
import os
import time

import torch

from omni_stream.engine.frame import EngineShape
from omni_stream.observability import stepstats
from omni_stream.stages.faults import FaultPlan
from omni_stream.stages.proc import StageSpec, orphan_cleanup, start_stage
from omni_stream.stages.talker_scheduler import ThrottleSettings
from omni_stream.stages.talker_stage import TalkerStage
from omni_stream.transport import (ChannelClosed, ControlChannel, MeasureCosts, StatsReply,
                                   StatsRequest)

log = logging.getLogger(__name__)


def run_talker_stage(spec: StageSpec, ctrl: ControlChannel, frames_handle,
                     cp_handles: tuple | None = None) -> None:
    """Process entry point. ``cp_handles`` (to_cp producer, from_cp consumer) selects the split
    placement: the code predictor runs in its own stage process."""
    start_stage("talker", spec)
    from omni_stream.engine.loading import attach_engine, load_for_engine

    out = frames_handle.open()
    model = load_for_engine(spec.model_path, getattr(torch, spec.dtype), spec.device,
                            spec.weight_path, spec.engine)
    stage = TalkerStage(model, EngineShape(max_slots=spec.max_slots, max_seq_len=spec.max_seq_len),
                        out, device=spec.device, throttle=ThrottleSettings(enabled=spec.throttle),
                        faults=FaultPlan.from_env())
    lease = None
    if spec.lent_cpus:
        from omni_stream.engine.cpu.pool import CoreLease
        from omni_stream.transport.ring import LEASE_OFF

        lease = CoreLease.open(frames_handle.path, LEASE_OFF)
    attach_engine(stage.engine, spec.engine, spec.weight_path, spec.threads,
                  lent_cpus=spec.lent_cpus, lease=lease, model_path=spec.model_path)
    if spec.compile or spec.engine == "native":
        from omni_stream.engine.compiled import compile_engine, warm_up

        if spec.compile:
            compile_engine(stage.engine)
        warm_up(stage.engine)  # compiles (or loads) the graphs; pages the packed weights in
    if spec.speculative_cp:  # PipelineSettings checked engine, graphs and placement
        from omni_stream.engine import speculative

        speculative.enable(stage.engine, *spec.speculative_cp)
    if spec.cuda_graphs:  # StageSpec checked the device; the split placement is refused upstream
        assert cp_handles is None, "CUDA graphs need the code predictor in this process"
        stage.enable_graphs()
    if cp_handles is not None:
        from omni_stream.stages.cp_stage import RemoteResidual

        remote = RemoteResidual(stage.engine, cp_handles[0].open(), cp_handles[1].open())
        remote.wait_ready(timeout=300)
        stage.engine.use_residual(remote)
    stage.engine.use_residual(_timed(stage.engine.residual_source, "talker.code_predictor"))
    ctrl.send(StatsReply(stage="talker", pid=os.getpid(), stats={"ready": 1}))
    try:
        running = True
        last_push = time.monotonic()
        pushed: dict = stepstats.snapshot()
        while running:
            busy = stage.busy()
            msg = ctrl.recv(timeout=0 if busy else 0.05)
            t_top = time.perf_counter()
            steps_before = stage.steps
            while msg is not None and running:
                if isinstance(msg, StatsRequest):
                    ctrl.send(StatsReply(stage="talker", pid=os.getpid(), request_id=msg.request_id,
                                         stats=stage.stats()))
                elif isinstance(msg, MeasureCosts):
                    got = _bandwidth(spec)
                    if msg.parts:
                        got.update(stage.measure())
                    ctrl.send(StatsReply(stage="talker", pid=os.getpid(), request_id=msg.request_id,
                                         stats=got))
                else:
                    running = stage.handle(msg)
                msg = ctrl.recv(timeout=0) if running else None
            stepstats.record("talker.control", time.perf_counter() - t_top)
            if running:
                stage.iterate()
                if stage.steps != steps_before:
                    stepstats.record("frame.total", time.perf_counter() - t_top)
            if time.monotonic() - last_push >= 1.0:  # ship new timings to the server's /metrics
                snap = stepstats.snapshot()
                delta = stepstats.diff_snapshots(snap, pushed)
                if delta.get("phases"):
                    ctrl.send(StatsReply(stage="talker", pid=os.getpid(), request_id=-1,
                                         stats=stepstats.flatten_snapshot(delta)))
                pushed, last_push = snap, time.monotonic()
    except ChannelClosed:
        log.info("control channel closed: exiting")
    finally:
        stepstats.dump()
        out.close()
        orphan_cleanup()


def _bandwidth(spec: StageSpec) -> dict[str, float]:
    """Memory read bandwidth on the CPUs this stage's runtime runs on (its own and any the
    codec lends it), with as many threads, and on one thread (``edge.measure``)."""
    from omni_stream.edge.measure import memory_bandwidth_gbs

    if spec.device != "cpu":
        return {}
    cpus = tuple(spec.cpus) + tuple(spec.lent_cpus)
    threads = max(1, spec.threads + len(spec.lent_cpus))
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if cpus and before is not None:
            os.sched_setaffinity(0, set(cpus))
        return dict(bandwidth_gbs=memory_bandwidth_gbs(threads),
                    bandwidth_1t_gbs=memory_bandwidth_gbs(1))
    except (OSError, RuntimeError) as e:
        log.warning("memory bandwidth not measured: %s", e)
        return {}
    finally:
        if cpus and before is not None:
            os.sched_setaffinity(0, before)


def _timed(fn, name: str):
    def wrapped(p: int):
        with stepstats.phase(name):
            return fn(p)
    return wrapped
