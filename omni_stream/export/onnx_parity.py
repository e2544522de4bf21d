"""Eager decode histories and step replays: the evidence that an exported step is the model.

``record_eager`` runs the frame engine (the eager model the server uses) greedily and records,
per talker position, the input row and, where the engine computes them, the logits; per frame,
the code predictor's 16 input rows (before its in-graph projection) and its 15 logits. Replaying
those inputs through a step runner (ONNX Runtime or torch) with the runtime's cache handling
gives logits to compare one for one: teacher-forced, so a single flip cannot cascade.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_stream.export.manifest import Manifest
from omni_stream.export.runtime_onnx import StepCache, StepRunner


@dataclass
class EagerHistory:
    prompt: np.ndarray  # [T, C] prefill rows
    trailing: np.ndarray  # [N, C] text-track rows of the first decode steps
    talker_x: np.ndarray  # [T + F, C] talker input rows, positions 0..T+F-1
    talker_logits: np.ndarray  # [F + 1, V] at positions T-1 .. T+F-1
    cp_x: np.ndarray  # [F, G, C] code-predictor input rows (talker width)
    cp_logits: np.ndarray  # [F, G-1, Vcp]
    codes: np.ndarray  # [F, G] greedy codes

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])


@torch.inference_mode()
def record_eager(model, req, frames: int, seed: int = 0) -> EagerHistory:
    """Greedy-decode ``frames`` frames of ``req`` with the frame engine (eos ignored, so the
    history has exactly ``frames`` frames) and record every step's inputs and logits."""
    from omni_stream.engine.frame import EngineShape, FrameEngine
    from omni_stream.models.prompt import PromptBuilder
    from omni_stream.engine.sampling import SamplingParams

    talker = model.weights.talker
    builder = PromptBuilder(model.config, talker, model.tokenizer)
    prompt = builder.build(req)
    eng = FrameEngine(talker, EngineShape(max_slots=1, max_seq_len=prompt.length + frames + 2))
    rec: dict[str, list] = {"tx": [], "tl": [], "cx": [], "cl": []}
    cpm = talker.code_predictor
    hooks = [talker.codec_head.register_forward_hook(lambda m, i, o: rec["tl"].append(o[0].float().clone())),
             cpm.small_to_mtp_projection.register_forward_hook(
                 lambda m, i, o: rec["cx"].append(i[0][0].float().reshape(-1, i[0].shape[-1]).clone()))]
    hooks += [h.register_forward_hook(lambda m, i, o: rec["cl"].append(o[0].float().clone()))
              for h in cpm.lm_head]
    hooks.append(talker.model.register_forward_pre_hook(
        lambda m, args: rec["tx"].append(args[0][0].float().clone())))
    try:
        eng.prefill(0, prompt.embeds, prompt.trailing, SamplingParams.greedy(), seed)
        codes = [eng.step(1)[0][0].clone() for _ in range(frames)]
    finally:
        for h in hooks:
            h.remove()
    g = talker.cfg.num_code_groups
    cp_x = torch.cat(rec["cx"]).reshape(frames, g, -1)
    return EagerHistory(prompt=prompt.embeds.float().numpy(), trailing=prompt.trailing.float().numpy(),
                        talker_x=torch.cat(rec["tx"]).numpy(), talker_logits=torch.stack(rec["tl"]).numpy(),
                        cp_x=cp_x.numpy(), cp_logits=torch.stack(rec["cl"]).reshape(frames, g - 1, -1).numpy(),
                        codes=torch.stack(codes).numpy())


def replay_talker(runner: StepRunner, manifest: Manifest, hist: EagerHistory,
                  steps: int | None = None) -> np.ndarray:
    """Feed the recorded talker rows through the step; logits at the eager positions [F+1, V]."""
    cache = StepCache(manifest, rope_len=len(hist.talker_x) + 1)
    t = hist.prompt_len
    out = []
    n = len(hist.talker_x) if steps is None else min(len(hist.talker_x), t + steps)
    for p in range(n):
        o = cache.step(runner, hist.talker_x[p])
        if p >= t - 1:
            out.append(o["logits"][0])
    return np.stack(out)


def replay_code_predictor(runner: StepRunner, manifest: Manifest, hist: EagerHistory,
                          frames: int | None = None) -> np.ndarray:
    """Feed each frame's 16 recorded rows through the step (fresh cache per frame) -> [F, G-1, V]."""
    cache = StepCache(manifest)
    out = []
    for rows in hist.cp_x[:frames]:
        cache.reset()
        cache.step(runner, rows[0])
        out.append([cache.step(runner, r, head=j)["logits"][0] for j, r in enumerate(rows[1:])])
    return np.asarray(out)


def compare_logits(ref: np.ndarray, test: np.ndarray, k: int = 5) -> dict[str, float]:
    """SNR (dB) over all logits, and per-row top-1 and top-k (as a set) agreement."""
    from omni_stream.evaluation.metrics import snr_db

    ref = ref.reshape(-1, ref.shape[-1])
    test = test.reshape(-1, test.shape[-1])
    top1 = float(np.mean(ref.argmax(-1) == test.argmax(-1)))
    rk = np.sort(np.argsort(-ref, axis=-1)[:, :k], axis=-1)
    tk = np.sort(np.argsort(-test, axis=-1)[:, :k], axis=-1)
    return {"rows": int(ref.shape[0]), "snr_db": snr_db(ref, test), "top1": top1,
            f"top{k}": float(np.mean(np.all(rk == tk, axis=-1)))}
