"""How close a fast path (quantized weights, another dtype) stays to a reference model.

Free-running greedy decodes of two models part ways at the first flipped argmax and never meet
again, which says little about how good each step is. So the comparison is teacher-forced: both
models see the reference's history every frame, and each frame we compare
- codebook 0: the talker's argmax and its logits (SNR in dB),
- codebooks 1..15: the code predictor's greedy codes given the same codebook-0 id,
and the audio: the test's own per-frame codes (its codebook-0 argmax and its residual codes,
each given the reference history) and the reference codes through the same Code2Wav, as the SNR
of the two waveforms. On random-weight checkpoints logits have small margins, so these figures
are pessimistic next to a trained model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from omni_stream.config import SamplingParams
from omni_stream.models.prompt import PromptRequest
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.evaluation.metrics import snr_db


@dataclass
class Fidelity:
    frames: int
    code0_agreement: float  # teacher-forced top-1 agreement of the talker
    code0_top5_overlap: float  # mean |top5(ref) & top5(test)| / 5
    logits_snr_db: float  # talker logits, all frames together
    residual_agreement: float  # codebooks 1..15, given the same codebook 0
    audio_snr_db: float | None  # waveform of the test's codes vs the reference's codes

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v)
                for k, v in self.__dict__.items()}


@torch.inference_mode()
def teacher_forced(ref: Synthesizer, test: Synthesizer, req: PromptRequest, frames: int,
                   codec: bool = True) -> Fidelity:
    """Compare ``test`` with ``ref`` over ``frames`` greedy frames of the reference's history."""
    if ref.engine is test.engine:
        raise ValueError("teacher_forced needs two synthesizers (each steps its own engine); "
                         "load the reference twice to compare a path with itself")
    params = SamplingParams.greedy()
    er, et = ref.engine, test.engine
    pr, pt = ref.builder.build(req), test.builder.build(req)
    c_ref = er.prefill(0, pr.embeds, pr.trailing, params, 0)
    c_test = et.prefill(0, pt.embeds, pt.trailing, params, 0)
    agree0 = [c_ref == c_test]
    top5, lr, lt = [], [], []
    res_agree: list[float] = []
    codes: list[torch.Tensor] = []
    test_codes: list[torch.Tensor] = []
    pred0 = c_test
    eos = ref.model.config.talker.special.codec_eos
    saved = er.residual_fn, et.residual_fn
    try:
        for _ in range(frames):
            if c_ref == eos:
                break
            et.last_code0[:1] = er.last_code0[:1]
            et.seen[:1] = er.seen[:1]
            res_r = er._predict_residual(1)
            res_t = et._predict_residual(1)
            res_agree.append(float((res_r == res_t).float().mean()))
            er.residual_fn = et.residual_fn = (lambda _p, r=res_r: r)
            frame, nxt_r = er.step(1)
            _, nxt_t = et.step(1)
            codes.append(frame[0].clone())
            test_codes.append(torch.cat((torch.tensor([pred0]), res_t[0].cpu())))
            pred0 = int(nxt_t[0])
            lg_r = er.talker_logits(er.last_hidden[:1])[0]
            lg_t = et.talker_logits(et.last_hidden[:1])[0]
            lr.append(lg_r)
            lt.append(lg_t)
            top5.append(len(set(lg_r.topk(5).indices.tolist()) & set(lg_t.topk(5).indices.tolist())) / 5)
            agree0.append(int(nxt_r[0]) == int(nxt_t[0]))
            c_ref = int(nxt_r[0])
    finally:
        er.residual_fn, et.residual_fn = saved
    audio_snr = None
    if codec and codes:
        dev = next(ref.model.code2wav.parameters()).device
        wr = ref.model.code2wav(torch.stack(codes).T.unsqueeze(0).to(dev)).float()
        wt = ref.model.code2wav(torch.stack(test_codes).T.unsqueeze(0).to(dev)).float()
        audio_snr = snr_db(wr, wt)
    n = len(codes)
    return Fidelity(
        frames=n, code0_agreement=float(np.mean(agree0)),
        code0_top5_overlap=float(np.mean(top5)) if top5 else float("nan"),
        logits_snr_db=snr_db(torch.stack(lr), torch.stack(lt)) if lr else float("nan"),
        residual_agreement=float(np.mean(res_agree)) if res_agree else float("nan"),
        audio_snr_db=audio_snr)
