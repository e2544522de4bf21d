"""The codec stage's process: pin oneDNN's ISA level, load Code2Wav with the stage's kernels, warm
it up and check its decode, then consume the frames ring and produce the audio ring
(``CodecStage``), answering cost measurements on its control channel."""

from __future__ import annotations

import logging
import os

import torch

from omni_stream.models.onednn import pin_decode_isa
from omni_stream.observability import stepstats
from omni_stream.stages.codec_kernels import stage_kernels
from omni_stream.stages.codec_stage import READY_STREAM_ID, CodecStage
from omni_stream.stages.faults import FaultPlan
from omni_stream.stages.proc import orphan_cleanup, parent_alive, start_stage
from omni_stream.transport import (ChannelClosed, ControlChannel, MeasureCosts, MsgKind,
                                   StatsReply)

log = logging.getLogger(__name__)


def run_codec_stage(spec, ctrl: ControlChannel, frames_handle, audio_handle) -> None:
    """Process entry point: consume ``frames``, produce ``audio``; answer cost measurements
    (``MeasureCosts``) on ``ctrl``."""
    level = pin_decode_isa() if spec.device == "cpu" else None  # before any oneDNN primitive
    start_stage("codec", spec)
    from omni_stream.checkpoints.io import load_codec

    inp = frames_handle.open()
    out = audio_handle.open()
    model = stage_kernels(load_codec(spec.model_path, dtype=getattr(torch, spec.dtype),
                                     device=spec.device))
    stage = CodecStage(model, spec.max_slots, out, faults=FaultPlan.from_env())
    if spec.device == "cpu":
        log.info("codec warm-up: %.1f s", stage.warm_up())
        if model.packed:
            same = stage.check_invariance()
            log.log(logging.INFO if same else logging.WARNING,
                    "%s decode at oneDNN level %s: %s", spec.dtype, level,
                    "the same bits at any chunk plan and batch (checked)" if same else
                    "NOT the same bits at any chunk plan (a stream's audio follows its chunking "
                    "within rounding: a seeded request may differ in its last bits from one "
                    "run to the next)")
    if spec.lends_cores:  # take the lent cores back from the talker for each decode
        from omni_stream.engine.cpu.pool import CoreLease
        from omni_stream.transport.ring import LEASE_OFF

        stage.lease = CoreLease.open(frames_handle.path, LEASE_OFF)
    out.put(None, kind=MsgKind.EVENT, stream_id=READY_STREAM_ID, timeout=5.0)
    try:
        did = False
        while parent_alive():
            m = inp.get(timeout=0 if did else 0.05)  # an arriving frame wakes the wait at once
            while m is not None:
                stage.on_message(m)
                m = inp.get(timeout=0)
            did = stage.iterate()
            _control(stage, ctrl)
    finally:
        stepstats.dump()
        inp.close()
        out.close()
        orphan_cleanup()


def _control(stage: CodecStage, ctrl: ControlChannel) -> None:
    """Requests on the stage's control channel: ``MeasureCosts`` (the answer is a StatsReply
    of its id)."""
    try:
        while (msg := ctrl.recv(timeout=0)) is not None:
            if isinstance(msg, MeasureCosts):
                ctrl.send(StatsReply(stage="codec", pid=os.getpid(), request_id=msg.request_id,
                                     stats=stage.measure()))
    except (ChannelClosed, OSError):
        pass  # the server is going away: parent_alive() ends the loop
