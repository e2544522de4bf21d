"""Code-predictor stage: the 15 residual-codebook sub-steps in their own process.

Placement "split" puts the code predictor beside the talker instead of inside it (a deployment
choice for many-core CPUs, where the two can run on disjoint cores). Per frame the talker sends,
for slots [0, P):
  1. float32 [P, C + 3]: talker hidden state ++ (greedy flag, temperature, top-p) of the code
     predictor's sampler;
  2. int64 [P, 4]: codebook-0 id, stream seed, draw counter, top-k;
and gets back int64 [P, G-1]: codes 1..G-1, each checked here before it leaves (a row that
failed the check, or a request the stage could not compute, comes back as INVALID in every
column, and the talker fails that stream). The draw counters travel with the request, so the
split placement draws exactly what the co-located one does (same codes, tested).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.sampling import INVALID
from omni_stream.observability import stepstats
from omni_stream.transport import MsgKind, Ring
from omni_stream.stages.proc import parent_alive, start_stage

log = logging.getLogger(__name__)

READY = -1  # seq of the stage's ready message on its output ring


class CodePredictorUnavailable(RuntimeError):
    pass


class RemoteResidual:
    """Drop-in for ``FrameEngine.predict_residual`` that asks the code-predictor stage."""

    def __init__(self, engine: FrameEngine, to_cp: Ring, from_cp: Ring, timeout: float = 30.0) -> None:
        self.e, self.to_cp, self.from_cp, self.timeout = engine, to_cp, from_cp, timeout
        self.seq = 0

    def wait_ready(self, timeout: float) -> None:
        m = self.from_cp.get(timeout=timeout)
        if m is None or m.seq != READY:
            raise CodePredictorUnavailable("code-predictor stage did not start")

    def __call__(self, p: int) -> torch.Tensor:
        e = self.e
        floats, ints = e.cp_rows(p)
        self.seq += 1
        ok = self.to_cp.put(floats, kind=MsgKind.HIDDEN, seq=self.seq, timeout=self.timeout)
        ok = ok and self.to_cp.put(ints, kind=MsgKind.DATA, seq=self.seq, timeout=self.timeout)
        m = self.from_cp.get(timeout=self.timeout) if ok else None
        if m is None or m.seq != self.seq:
            raise CodePredictorUnavailable("code-predictor stage stopped answering")
        e.advance_counters(p, e.cfg.num_code_groups - 1)
        codes = torch.from_numpy(m.payload).to(e.device)
        # trust nothing that crossed a hop: a row with any value outside the codebook is INVALID
        ok = ((codes >= 0) & (codes < e.codebook_size)).all(dim=1, keepdim=True)
        return torch.where(ok, codes, torch.full_like(codes, INVALID))


def serve_residuals(engine: FrameEngine, inp: Ring, out: Ring, should_run) -> None:
    """The stage loop: answer each (hidden, ints) request with the residual codes."""
    with torch.inference_mode():
        while should_run():
            m1 = inp.get(timeout=0.1)
            if m1 is None:
                continue
            m2 = inp.get(timeout=5.0)
            if m2 is None or m2.seq != m1.seq:
                raise RuntimeError("code-predictor stage: request arrived incomplete")
            p = engine.load_cp_rows(torch.from_numpy(m1.payload), torch.from_numpy(m2.payload))
            stepstats.record_ns("hop.cp.put_get", m1.put_ns, m1.get_ns)
            try:
                with stepstats.phase("cp.predict"):
                    codes = engine.predict_residual(p)
            except Exception:  # fail this request's streams (the talker sees INVALID), not the stage
                log.exception("code-predictor step failed for %d rows", p)
                codes = torch.full((p, engine.cfg.num_code_groups - 1), INVALID, dtype=torch.int64)
            out.put(codes.numpy().astype(np.int64), kind=MsgKind.CODES, seq=m1.seq, timeout=30.0)


def run_cp_stage(spec, in_handle, out_handle) -> None:
    """Process entry point."""
    start_stage("cp", spec)

    from omni_stream.engine.loading import attach_engine, load_for_engine

    inp, out = in_handle.open(), out_handle.open()
    model = load_for_engine(spec.model_path, getattr(torch, spec.dtype), spec.device,
                            spec.weight_path, spec.engine)
    engine = FrameEngine(model.weights.talker, EngineShape(max_slots=spec.max_slots, max_seq_len=2,
                                                           max_trailing=1), device=spec.device)
    attach_engine(engine, spec.engine, spec.weight_path, spec.threads)
    if spec.compile:
        from omni_stream.engine.compiled import compile_engine, warm_up

        compile_engine(engine)
        warm_up(engine, code_predictor_only=True)
    out.put(None, kind=MsgKind.EVENT, seq=READY, timeout=30.0)
    try:
        serve_residuals(engine, inp, out, lambda: parent_alive() and inp.peer_alive())
    finally:
        stepstats.dump()
        inp.close()
        out.close()
