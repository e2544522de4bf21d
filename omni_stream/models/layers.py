"""Qwen3 decoder building blocks, and the math every attention in omni-stream shares.

One home per idea: ``rms_norm``, rotary angles (``rope_angles`` / ``rope_tables``) and their
application (``apply_rope``), and ``attend``: queries over ``[past keys ++ new keys]`` with one
softmax. The talker, the code predictor and Code2Wav's transformer use them; a decoder layer's
forward IS the decode step: it takes the new tokens, their rotary angles, an additive mask and
the layer's past keys/values, and returns its output plus the new tokens' keys/values for the
caller to store (``engine/step.py`` runs it over static caches; ``export/onnx_step.py`` over
explicit graph inputs). Nothing here writes a cache, so the same forward serves eager torch,
torch.compile, CUDA graphs and exported programs.

Rotary tables carry the rotate-half sign folded into ``sin`` (``[-sin(a), sin(a)]``), so applying
them is ``x * cos + swap_halves(x) * sin``: the same floats as the rotate-half form (negation is
exact) without a Neg in exported graphs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.config import DecoderLMConfig

KV = tuple[torch.Tensor, torch.Tensor]
SHORT_PAST = 64  # attend(): up to this many past keys, join them and use the fused kernel


# ---------------------------------------------------------------- norm
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to x's dtype before the weight (as the reference)."""
    xf = x.float()
    xf = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------- rotary
def rope_angles(pos: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sign-folded sin [..., D] for integer positions ``pos`` [...], computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=pos.device).float() / head_dim))
    freqs = pos.float()[..., None] * inv_freq  # [..., D/2]
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    s = freqs.sin()
    return cos.to(dtype), torch.cat((-s, s), dim=-1).to(dtype)


def rope_tables(head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sign-folded sin tables [max_pos, D] in fp32, indexed by position."""
    return rope_angles(torch.arange(max_pos, dtype=torch.int64), head_dim, theta)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos / sign-folded sin broadcastable to it ([B, 1, T, D])."""
    return x * cos + swap_halves(x) * sin


# ---------------------------------------------------------------- attention
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor | None,
           past_v: torch.Tensor | None, mask: torch.Tensor | None, scale: float,
           keys_transposed: bool = False) -> torch.Tensor:
    """Scaled dot-product attention of T new queries over ``[past ++ new]`` keys.

    q [B, H, T, D]; k, v [B, Hkv, T, D] (the new tokens); past_k [B, Hkv, L, D] (or
    [B, Hkv, D, L] with ``keys_transposed``, the layout NPU graphs want), past_v [B, Hkv, L, D]
    (None: L = 0); mask [B, 1, T, L + T] additive (0 keep, -inf drop) or None (everything
    visible). Grouped-query heads share their kv head by reshaping the queries, never by
    expanding keys. Scores are computed in the inputs' dtype, scaled, masked, softmaxed in
    fp32 and cast back, as the reference's eager attention does. Returns [B, H, T, D]."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    if mask is None and not keys_transposed and (past_k is None or past_k.shape[2] <= SHORT_PAST):
        # the same attention through torch's fused kernel: cheaper than the ops below when the
        # keys are few (the code predictor's sub-steps), where joining them costs nothing
        if past_k is not None:
            k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=g > 1)
    qg = q.reshape(b, hkv, g * t, d)  # [B, Hkv, G*T, D] (head h = kv * G + g)
    kt = k.transpose(-1, -2)  # [B, Hkv, D, T]
    scores = torch.matmul(qg, kt)
    if past_k is not None:
        pk = past_k if keys_transposed else past_k.transpose(-1, -2)
        scores = torch.cat((torch.matmul(qg, pk), scores), dim=-1)  # [B, Hkv, G*T, L + T]
    scores = scores * scale
    if mask is not None:  # [B, 1, T, L+T] -> [B, 1, 1, T, L+T] over the G query groups
        n = scores.shape[-1]
        scores = (scores.reshape(b, hkv, g, t, n) + mask.unsqueeze(2)).reshape(b, hkv, g * t, n)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(p[..., scores.shape[-1] - t:], v)
    if past_v is not None:
        out = torch.matmul(p[..., :scores.shape[-1] - t], past_v) + out
    return out.reshape(b, h, t, d)


# ---------------------------------------------------------------- Qwen3 decoder
class Attention(nn.Module):
    """Qwen3 attention: q/k/v projections without bias, per-head RMSNorm on q and k, rotary,
    grouped-query heads."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        kv = cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.head_dim = h, kv, d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None  # set by engine.quant: q, k, v in one matmul

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, keys_transposed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C]; cos/sin [B, T, D]; returns (out [B, T, C], k, v [B, Hkv, T, D])."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            hq, hk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = self.qkv_proj(x).split((hq, hk, hk), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.reshape(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.reshape(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attend(q, k, v, past_k, past_v, mask, self.scale, keys_transposed)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1)), k, v


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by engine.quant: gate and up at once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, keys_transposed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v,
                                 keys_transposed)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class DecoderStack(nn.Module):
    """Layers + final norm. ``forward`` is the decode step over explicit state:

        x [B, T, C] new tokens' inputs; cos, sin [B, T, D] their rotary angles;
        mask [B, 1, T, L + T] additive over [past ++ new] (None: all visible);
        past: per layer (k, v) [B, Hkv, L, D] (keys [B, Hkv, D, L] with keys_transposed), or
              None for no past (L = 0)
        -> normed hidden [B, T, C], and per layer the new tokens' (k, v) [B, Hkv, T, D]."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, past: Sequence[KV] | None,
                keys_transposed: bool = False) -> tuple[torch.Tensor, list[KV]]:
        new: list[KV] = []
        for i, layer in enumerate(self.layers):
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = layer(x, cos, sin, mask, pk, pv, keys_transposed)
            new.append((k, v))
        return self.norm(x), new
