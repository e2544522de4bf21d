"""Checks that run inside the vLLM environment (``omni_stream.engine.vllm.env``); the pytest side
(tests/test_vllm_engine.py) starts them with that environment's python and asserts on the JSON
they print. Each runs the same calls on a torch ``FrameEngine`` and on one with
``use_vllm`` and reports what the two produced.

    python -m tests.vllm_checks scenario CKPT DTYPE [POISON|- [FRAMES]]  # multi-stream schedule
    python -m tests.vllm_checks fidelity CKPT FRAMES  # bf16 teacher-forced, vllm vs torch
    python -m tests.vllm_checks plugin CKPT OUT       # entry point; a tensor missing for vLLM
"""

from __future__ import annotations

import json
import sys

import torch

from omni_stream.checkpoints.io import load_model
from omni_stream.config import SamplingParams
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.sampling import INVALID
from omni_stream.models.prompt import PromptBuilder, PromptRequest

TEXTS = ["Hello there, this is a test of the talker.",
         "A second, somewhat longer sentence that runs on for a while, to be fed in pieces.",
         "Short one.",
         "The fourth stream reuses a slot that another stream left."]


def _requests(model) -> list[PromptRequest]:
    speakers = sorted(model.config.talker.speakers) or [None]
    return [PromptRequest(text=t, speaker=speakers[i % len(speakers)], stream_text=(i == 2))
            for i, t in enumerate(TEXTS)]


class Driver:
    """A scripted multi-stream schedule over one engine: whole and chunked prefills between
    frame steps, a held stream, a released slot taken by a new stream, a poisoned stream."""

    def __init__(self, engine: FrameEngine, builder: PromptBuilder, reqs, params, max_frames):
        self.e, self.params, self.max_frames = engine, params, max_frames
        self.prompts = [builder.build(r) for r in reqs]
        self.slot_of: dict[int, int] = {}
        self.codes: dict[int, list[list[int]]] = {i: [] for i in range(len(reqs))}
        self.ended: dict[int, str] = {}

    def prefill(self, i: int, slot: int, piece: int | None = None, steps_between: int = 0) -> None:
        p = self.prompts[i]
        n = len(p.embeds)
        piece = piece or n
        for start in range(0, n, piece):
            t = min(piece, n - start)
            c = self.e.prefill(slot, p.embeds[start:start + t], p.trailing, self.params, seed=i,
                               start=start, final=start + t == n, total=n)
            if start + t < n:
                for _ in range(steps_between):  # the running streams go on between pieces
                    self.step()
        self.slot_of[i] = slot
        if c == self.e.cfg.special.codec_eos:
            self._end(i, "eos")

    def _end(self, i: int, why: str) -> None:
        self.ended[i] = why
        slot = self.slot_of.pop(i)
        (self.e.scrub if why == "invalid" else self.e.release)(slot)

    def step(self, held: tuple[int, ...] = ()) -> None:
        if not self.slot_of:
            return
        p = max(self.slot_of.values()) + 1
        hold = [self.slot_of[i] for i in held if i in self.slot_of]
        with self.e.holding(hold):
            codes, nxt = self.e.step(p)
        for i, slot in list(self.slot_of.items()):
            if slot in hold:
                continue
            nx = int(nxt[slot])
            if nx == INVALID:
                self._end(i, "invalid")
                continue
            self.codes[i].append(codes[slot].tolist())
            if nx == self.e.cfg.special.codec_eos:
                self._end(i, "eos")
            elif len(self.codes[i]) >= self.max_frames:
                self._end(i, "length")

    def run(self, poison: int | None = None) -> dict:
        self.prefill(0, 0)
        for _ in range(3):
            self.step()
        self.prefill(1, 1, piece=7, steps_between=1)  # chunked, stream 0 runs between pieces
        for _ in range(2):
            self.step()
        self.prefill(2, 2)
        for k in range(12):
            self.step(held=(1,) if 3 <= k < 7 else ())  # stream 1 waits (no text) 4 steps
            if poison is not None and k == 5 and poison in self.slot_of:
                self.e.inject_fault(self.slot_of[poison], "talker")
        if 0 in self.slot_of:
            self._end(0, "cancelled")
        self.prefill(3, 0)  # slot 0 again: a fresh request
        while self.slot_of:
            self.step()
        return {"codes": {str(i): c for i, c in self.codes.items()}, "ended": self.ended}


def scenario(ckpt: str, dtype: str, max_frames: int = 60, poison: int | None = None) -> dict:
    dt = getattr(torch, dtype)
    out = {}
    for name in ("torch", "vllm"):
        model = load_model(ckpt, dt)
        engine = FrameEngine(model.weights.talker, EngineShape(max_slots=3, max_seq_len=512))
        if name == "vllm":
            engine.use_vllm(ckpt, 2)
        builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
        with torch.inference_mode():
            out[name] = Driver(engine, builder, _requests(model), SamplingParams.greedy(),
                               max_frames).run(poison)
        if name == "vllm":
            v = engine.runtime
            out["vllm_left"] = {"requests": sum(r is not None for r in v.req),
                                "scheduler": len(v.scheduler.requests),
                                "kv_usage": float(v.scheduler.kv_cache_manager.usage)}
    return out


def fidelity(ckpt: str, frames: int) -> dict:
    """Teacher-forced talker/code-predictor logits of bf16 vllm and bf16 torch against the fp32
    torch reference (``evaluation.fidelity``): the two bf16 engines should sit as far from fp32
    as each other."""
    from omni_stream.evaluation.fidelity import load_path, reference, report_row, teacher_forced

    ref, reqs, seq = reference(ckpt, frames)
    rows = {}
    for engine in ("torch", "vllm"):
        test = load_path(ckpt, "bf16", engine, 2, max_seq_len=seq)
        rows[engine] = report_row("bf16", engine, teacher_forced(ref, test, reqs, frames))
    return rows


def plugin(ckpt: str, cut: str) -> dict:
    """The entry point registers the talker; a checkpoint without one decoder tensor is refused
    by vLLM's load naming it (the frame engine's weights stay whole: only vLLM reads ``cut``)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    registered = "OmniStreamTalker" in ModelRegistry.get_supported_archs()
    shutil.copytree(ckpt, cut)
    tensors = load_file(f"{cut}/model.safetensors")
    del tensors["talker.model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f"{cut}/model.safetensors")
    model = load_model(ckpt, torch.float32)
    engine = FrameEngine(model.weights.talker, EngineShape(max_slots=1, max_seq_len=64))
    try:
        engine.use_vllm(cut, 2)
        err = ""
    except Exception as e:  # vLLM wraps the loader's error
        err = f"{type(e).__name__}: {e}"
    return {"registered": registered, "missing_error": err}


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "scenario":
        poison = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
        frames = int(argv[4]) if len(argv) > 4 else 60
        res = scenario(argv[1], argv[2], frames, poison)
    elif cmd == "plugin":
        res = plugin(argv[1], argv[2])
    elif cmd == "fidelity":
        res = fidelity(argv[1], int(argv[2]))
    else:
        raise SystemExit(f"unknown check {cmd!r}")
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
