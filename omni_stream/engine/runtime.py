"""What computes a frame engine's step: the one boundary between ``FrameEngine`` (slots, inputs,
draws, validation, bookkeeping) and the code that runs the talker and the code predictor.

A runtime is chosen once, when the engine is loaded (``engine.loading.attach_engine``), and the
engine calls only the methods below. Three implementations:

- ``TalkerRuntime`` here: torch ops over the engine's own KV caches (any device);
- ``engine.cpu.native.NativeRunner``: the CPU runtime's packed low-bit products;
- ``engine.vllm.runner.VllmTalker``: the talker decoder and its KV on vLLM (the heads and the
  code predictor stay on torch: it inherits them from ``TalkerRuntime``).

A fourth (a GPU megakernel, an NPU runtime) is one new file: a subclass that overrides what it
computes itself. Every method receives the engine's state through the engine it was built for
(``self.e``) and writes only the KV caches it owns and the sampling counters it is given; the
engine does the rest. Shapes: C the talker's hidden size, G the code groups, V a vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from omni_stream.engine.sampling import INVALID, sample
from omni_stream.engine.step import run_step, step_mask
from omni_stream.models.layers import DecoderStack


class TalkerRuntime:
    """The contract, and its torch implementation."""

    name = "torch"

    def __init__(self, engine) -> None:
        self.e = engine

    # ------------------------------------------------------------------ stream lifecycle
    def start(self, slot: int, total: int | None) -> None:
        """A stream begins in ``slot`` with a prompt of ``total`` positions (None: fed in pieces
        of a length not given), before its first prefill piece. The torch runtime has nothing
        to set up: the slot's cache rows are overwritten by the prefill."""

    def release(self, slot: int) -> None:
        """The stream in ``slot`` is over (finished, failed or cancelled)."""

    # ------------------------------------------------------------------ the talker
    def prefill(self, slot: int, x: torch.Tensor, start: int) -> torch.Tensor:
        """Prompt rows x [t, C] (engine dtype) at positions [start, start + t) of ``slot``,
        attending its cache [0, start) -> the last row's normed hidden state [1, C] (engine
        dtype); writes their K/V."""
        e = self.e
        pos = torch.arange(start, start + x.shape[0], device=e.device).unsqueeze(0)
        return run_step(e.talker.model, e.kv, e.rope, x.unsqueeze(0), pos,
                        slice(slot, slot + 1), e._arange[slot:slot + 1], start)[:, -1]

    def step(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode row per slot [0, p): x [p, C] at positions pos [p] -> normed hidden
        [p, C] (engine dtype); writes their K/V. Rows of idle slots are computed and ignored."""
        e = self.e
        p = x.shape[0]
        if e.static_live:
            live = e.shape.max_seq_len
        else:  # the one deliberate host sync per frame: attend only over the live prefix
            live = int(pos.max())
        return run_step(e.talker.model, e.kv, e.rope, x.unsqueeze(1), pos.unsqueeze(1),
                        slice(0, p), e._arange[:p], live, valid=pos)[:, -1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The codec head on normed hidden states [B, C] -> fp32 logits [B, V]."""
        return self.e.talker.codec_head(hidden).float()

    # ------------------------------------------------------------------ the code predictor
    def residual(self, p: int) -> torch.Tensor:
        """The code predictor's frame for slots [0, p), from the engine's last hidden states and
        codebook-0 ids: codes 1..G-1 [p, G-1] int64, INVALID in every column of a row with a
        draw outside the codebook. Advances the rows' draw counters by G-1."""
        e = self.e
        cpm = e.talker.code_predictor
        proj = cpm.small_to_mtp_projection
        g, size = e.cfg.num_code_groups, e.codebook_size
        rows, idx = slice(0, p), e._arange[:p]
        sp = e.cp_sp.rows(p)
        cand = max(e._cand_cp[:p])
        code0 = e.last_code0[:p].clamp(0, e.cfg.lm.vocab_size - 1)
        x = torch.stack((e.last_hidden[:p], e.talker.codec_embed(code0)), dim=1)
        x = proj(x)  # [p, 2, Ccp]
        # a fresh cache per frame: the 2-token prefill attends nothing cached
        h = run_step(cpm.model, e.cp_kv, e.cp_rope, x, e._cp_pos0[:p], rows, idx, 0)[:, -1]
        out = []
        for j in range(g - 1):
            logits = cpm.lm_head[j](h).float()
            code = sample(logits, sp, e.seed[:p], e.counter[:p], cand)
            e.counter[:p] += 1
            out.append(code)
            if j == g - 2:
                break
            x = proj(cpm.model.codec_embedding[j](code.clamp(0, size - 1))).unsqueeze(1)
            h = run_step(cpm.model, e.cp_kv, e.cp_rope, x, e._cp_pos[j + 2][:p], rows, idx,
                         j + 2)[:, -1]
        codes = torch.stack(out, dim=1)  # [p, G-1]
        ok = ((codes >= 0) & (codes < size)).all(dim=1, keepdim=True)  # validation at the source
        return torch.where(ok, codes, torch.full_like(codes, INVALID))

    def cp_teacher_forced(self, x: torch.Tensor) -> torch.Tensor:
        """The code predictor's logits [G-1, V] fp32 over given inputs x [G, C] (engine dtype:
        hidden state, codebook-0 embedding, codes 1..G-2 embeddings), leaving the engine's
        state alone (``FrameEngine.cp_logits_teacher_forced``). Torch: the whole sequence in
        one causal pass."""
        e = self.e
        g, cpm = e.cfg.num_code_groups, e.talker.code_predictor
        x = cpm.small_to_mtp_projection(x).unsqueeze(0)  # [1, G, Ccp]
        cos, sin = e.cp_rope(torch.arange(g, device=e.device).unsqueeze(0), x.dtype)
        h, _ = cpm.model(x, cos, sin, step_mask(None, 0, g, x.dtype, e.device), None)
        return torch.stack([cpm.lm_head[j](h[0, j + 1]) for j in range(g - 1)]).float()

    def cp_parts(self, draft_layers: int) -> "TorchPredictorParts":
        """The code predictor's pieces, one call each, for speculative prediction
        (``engine.speculative``): a draft of its first ``draft_layers`` layers and the full
        stack, projection, heads and embedding tables over its KV cache."""
        return TorchPredictorParts(self.e, draft_layers)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, int]:
        """Counters of the runtime's own (the talker stage's stats carry them)."""
        return {}


class FirstLayers(nn.Module):
    """The first ``n`` layers of a decoder stack and its final norm (shared, not copied): the
    same decode step over explicit state as ``DecoderStack``."""

    def __init__(self, stack: DecoderStack, n: int) -> None:
        super().__init__()
        self.cfg = dataclasses.replace(stack.cfg, num_hidden_layers=n)
        self.layers = nn.ModuleList(list(stack.layers)[:n])
        self.norm = stack.norm

    forward = DecoderStack.forward


class TorchPredictorParts:
    """The code predictor's pieces on torch (``TalkerRuntime.cp_parts``)."""

    def __init__(self, engine, draft_layers: int) -> None:
        cpm = engine.talker.code_predictor
        self.e, self.cpm = engine, cpm
        self.full = cpm.model
        self.draft = FirstLayers(cpm.model, draft_layers)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [p, T, talker C] -> [p, T, C]
        return self.cpm.small_to_mtp_projection(x)

    def run(self, stack, x: torch.Tensor, start: int, p: int) -> torch.Tensor:
        """Feed x [p, T, C] at positions start.. of cache rows [0, p) (attending positions <
        start) -> normed hidden [p, T, C]."""
        e = self.e
        pos = torch.arange(start, start + x.shape[1], device=x.device).expand(p, -1)
        return run_step(stack, e.cp_kv, e.cp_rope, x, pos, slice(0, p), e._arange[:p], start)

    def logits(self, j: int, h: torch.Tensor) -> torch.Tensor:  # head of code j -> fp32 [p, V]
        return self.cpm.lm_head[j](h).float()

    def embed(self, j: int, codes: torch.Tensor) -> torch.Tensor:  # code j's table -> [p, talker C]
        return self.cpm.model.codec_embedding[j](codes)

    def embed0(self, codes: torch.Tensor) -> torch.Tensor:
        return self.e.talker.codec_embed(codes)
