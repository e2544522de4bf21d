"""Qwen3 decoder building blocks over an explicit static KV cache.

Every attention call takes the cache tensors for the rows it computes and the positions to
write, so the same layer serves a single-slot prefill (a view of one slot), a batched decode
over slots ``[0, P)`` (a view of the first P slots, no gather) and the code predictor's
per-frame scratch cache. Shapes are fixed for a given (rows, tokens, cache length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.config import DecoderLMConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back before the weight (as the reference does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_tables(head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, head_dim] in fp32 (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_pos, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D] already in x's dtype."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        kv = cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None  # set by models.quant: q, k, v in one matmul

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, C]; caches [B, Hkv, L, D] (views); rows/pos [B, T] write indices;
        mask [B, 1, T, Lk] bool (True = attend), Lk <= L is the live cache length."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            hq, hk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = self.qkv_proj(x).split((hq, hk, hk), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.reshape(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.reshape(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache[rows, :, pos] = k.transpose(1, 2).to(k_cache.dtype)  # [B, T, Hkv, D]
        v_cache[rows, :, pos] = v.transpose(1, 2).to(v_cache.dtype)
        lk = mask.shape[-1]
        keys = k_cache[:, :, :lk].to(q.dtype)
        values = v_cache[:, :, :lk].to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by models.quant: gate and up at once

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
                k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, rows, pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm; the caller owns the caches (one K and one V tensor per layer)."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run(self, x: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
            caches: list[tuple[torch.Tensor, torch.Tensor]], live_len: int,
            rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, T, C], pos [B, T] absolute positions, rows [B, T] cache rows; returns normed
        hidden [B, T, C]. Keys at positions <= the query's position are visible."""
        cos = rope[0][pos].unsqueeze(1).to(x.dtype)  # [B, 1, T, D]
        sin = rope[1][pos].unsqueeze(1).to(x.dtype)
        key_pos = torch.arange(live_len, device=x.device)
        mask = (key_pos.view(1, 1, 1, -1) <= pos.unsqueeze(1).unsqueeze(-1))  # [B,1,T,Lk]
        for layer, (kc, vc) in zip(self.layers, caches):
            x = layer(x, cos, sin, kc, vc, rows, pos, mask)
        return self.norm(x)


def new_caches(cfg: DecoderLMConfig, rows: int, length: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One K and one V buffer per layer, [rows, Hkv, length, D] (never one stacked tensor:
    compiled steps copy a whole stacked cache on every write)."""
    shape = (rows, cfg.num_key_value_heads, length, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_hidden_layers)]
