"""The decode step over static caches: what every native backend runs.

The step itself is ``DecoderStack.forward`` (``models/layers.py``): new tokens in, their rotary
angles, an additive mask over ``[past ++ new]`` keys and each layer's past keys/values in; the
normed hidden state and the new tokens' keys/values out. Nothing in it writes state, so the
same function is run eagerly, compiled (``engine/compiled.py``), captured in CUDA graphs
(``engine/graphs.py``) and exported with its state as graph inputs and outputs
(``export/onnx_step.py``); a faster CPU kernel swaps the linears under it (``engine/quant.py``).

This module is the native side of that contract: ``KVCache`` holds one K and one V buffer per
layer for fixed batch slots (never one stacked tensor: compiled steps copy a whole stacked cache
on every write), ``step_inputs`` builds the rotary angles and mask for tokens at given
positions, and ``run_step`` runs the step over the cache and stores the new entries where the
tokens sit. Shapes are fixed for a given (rows, tokens, attended length).
"""

from __future__ import annotations

import torch

from omni_stream.config import DecoderLMConfig
from omni_stream.models.layers import KV, DecoderStack, rope_tables


class KVCache:
    """Per-layer K and V buffers [slots, Hkv, length, D] of one decoder stack."""

    def __init__(self, cfg: DecoderLMConfig, slots: int, length: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (slots, cfg.num_key_value_heads, length, cfg.head_dim)
        self.layers: list[KV] = [(torch.zeros(shape, dtype=dtype, device=device),
                                  torch.zeros(shape, dtype=dtype, device=device))
                                 for _ in range(cfg.num_hidden_layers)]
        self.length = length

    def past(self, rows: slice, length: int) -> list[KV]:
        """Views of the first ``length`` positions of ``rows`` (no copy)."""
        return [(k[rows, :, :length], v[rows, :, :length]) for k, v in self.layers]

    def write(self, new: list[KV], rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Store the new tokens' entries: row ``rows[b]`` at positions ``pos[b, t]`` ([B, T])."""
        r = rows.unsqueeze(1).expand_as(pos)
        for (kc, vc), (k, v) in zip(self.layers, new):
            kc[r, :, pos] = k.transpose(1, 2).to(kc.dtype)  # [B, T, Hkv, D]
            vc[r, :, pos] = v.transpose(1, 2).to(vc.dtype)

    def clear(self, slot: int, upto: int | None = None) -> None:
        """Zero ``slot``'s first ``upto`` positions (all by default)."""
        n = self.length if upto is None else min(upto, self.length)
        for k, v in self.layers:
            k[slot, :, :n].zero_()
            v[slot, :, :n].zero_()


class Rope:
    """Rotary tables of one stack on the engine's device: angles for positions [..]."""

    def __init__(self, cfg: DecoderLMConfig, max_pos: int, device: torch.device | str) -> None:
        self.cos, self.sin = (t.to(device) for t in rope_tables(cfg.head_dim, cfg.rope_theta, max_pos))

    def __call__(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[pos].to(dtype), self.sin[pos].to(dtype)


def step_mask(valid: torch.Tensor | None, past_len: int, t: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Additive mask [B, 1, T, L + T]: row b sees past positions j < valid[b] (``valid`` [B];
    None: all L) and the new tokens causally (token i sees new tokens 0..i)."""
    # torch.full, not torch.tensor: a host-to-device copy cannot be captured in a CUDA graph
    neg = torch.full((), float("-inf"), dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    i = torch.arange(t, device=device)
    causal = torch.where(i.view(1, -1) <= i.view(-1, 1), zero, neg)  # [T, T]
    if valid is None:
        past = torch.zeros(t, past_len, dtype=dtype, device=device)
        return torch.cat((past, causal), dim=-1).view(1, 1, t, past_len + t)
    j = torch.arange(past_len, device=device)
    past = torch.where(j.view(1, 1, -1) < valid.view(-1, 1, 1), zero, neg)  # [B, 1, L]
    b = valid.shape[0]
    return torch.cat((past.expand(b, t, past_len), causal.expand(b, t, t)), dim=-1).unsqueeze(1)


def run_step(stack: DecoderStack, cache: KVCache, rope: Rope, x: torch.Tensor, pos: torch.Tensor,
             rows: slice, rows_idx: torch.Tensor, past_len: int,
             valid: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of ``stack`` for cache rows ``rows`` (a contiguous range; ``rows_idx``
    the same as a tensor [B]) with new tokens x [B, T, C] at positions pos [B, T]: attends the
    first ``past_len`` cached positions (those >= ``valid[b]`` masked; None: all valid) and
    the new tokens causally, then stores the new entries at ``pos``. Returns the normed hidden
    state [B, T, C]."""
    t = x.shape[1]
    past = cache.past(rows, past_len) if past_len > 0 else None
    cos, sin = rope(pos, x.dtype)
    mask = step_mask(valid, past_len, t, x.dtype, x.device) if (t > 1 or valid is not None) else None
    hidden, new = stack(x, cos, sin, mask, past)
    cache.write(new, rows_idx, pos)
    return hidden
