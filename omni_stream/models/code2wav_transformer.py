"""Code2Wav's sliding-window transformer: attention over a window of past frames whose keys and
values a streaming call keeps per slot (``Step.kv``), layer scale, the layer and the stack."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from omni_stream.config import Code2WavConfig
from omni_stream.models.code2wav_state import Step
from omni_stream.models.layers import MLP, RMSNorm, apply_rope, attend, rope_angles


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x

class SlidingWindowAttention(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.head_dim = d
        self.cache_len = cfg.sliding_window - 1
        self.layer_id = -1  # assigned by Code2Wav

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                step: Step | None = None) -> Tensor:  # x [B, T, hidden]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past_k = past_v = None
        if step is not None:  # keys/values are [window-1 cached ++ T new]; keep the last W-1
            past_k, past_v = step.kv(self.layer_id, k, v, self.cache_len)
        if step is not None and step.windowed:
            o = windowed_attend(q, k, v, past_k, past_v, mask, self.head_dim ** -0.5)
        else:
            o = attend(q, k, v, past_k, past_v, mask, self.head_dim ** -0.5,
                       keys_transposed=step is not None and step.keys_transposed)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

def windowed_attend(q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor,
                    mask: Tensor, scale: float) -> Tensor:
    """Sliding-window attention of T new queries, each over exactly its own window: the W-1
    keys before it and itself (``W = past + 1``), as one product of fixed shape per query.

    q [B, H, T, D]; k, v [B, Hkv, T, D] new; past_k, past_v [B, Hkv, W-1, D]; mask [B, 1, T,
    W-1+T] additive over [past ++ new]. ``attend`` computes the same over [past ++ new] at
    once, so how many queries share a call (the chunk plan) changes the shapes of its
    products and softmax, hence their rounding; in bf16 that rounding then grows through the
    decoder (two chunk plans of one stream ~30 dB apart). Here each query's scores, softmax
    and weighted sum have the same shapes at any T. Returns [B, H, T, D]."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g, w = h // hkv, past_k.shape[2] + 1
    # [B, Hkv, T, D, W]: query t's keys. Contiguous: as a view, one query's window (T = 1)
    # reaches the product in another layout than several queries' (which matmul copies), and
    # fp32 then runs another kernel for it, whose sums round differently
    kw = torch.cat((past_k, k), dim=2).unfold(2, w, 1).contiguous()
    vw = torch.cat((past_v, v), dim=2).unfold(2, w, 1)
    qg = q.reshape(b, hkv, g, t, d).transpose(2, 3)  # [B, Hkv, T, G, D]
    scores = torch.matmul(qg, kw) * scale  # [B, Hkv, T, G, W]
    mw = mask.unfold(-1, w, 1).diagonal(dim1=2, dim2=3)  # [B, 1, W, T]: query t's window
    scores = scores + mw.permute(0, 1, 3, 2).unsqueeze(3)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(p, vw.transpose(-1, -2))  # [B, Hkv, T, G, D]
    return out.transpose(2, 3).reshape(b, h, t, d)

class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = SlidingWindowAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                step: Step | None = None) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, step))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))

class DecoderTransformer(nn.Module):
    """latent -> hidden -> sliding-window layers -> RMSNorm -> latent, over frames."""

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.window, self.head_dim, self.theta = cfg.sliding_window, cfg.head_dim, cfg.rope_theta

    def forward(self, x: Tensor, step: Step | None = None, cos: Tensor | None = None,
                sin: Tensor | None = None, mask: Tensor | None = None) -> Tensor:  # [B, T, latent]
        """``cos``, ``sin`` [B, 1, T, D] (sign-folded sin) and the additive ``mask`` [B, 1, T, K]
        over the keys, all given or none: a caller that computes them (an NPU runtime) owns the
        positions, and the step's positions are then neither read nor moved."""
        if cos is None:
            cos, sin, mask = self._angles_and_mask(x, step)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, step)
        return self.output_proj(self.norm(h))

    def _angles_and_mask(self, x: Tensor, step: Step | None) -> tuple[Tensor, Tensor, Tensor]:
        t, dev, w = x.shape[1], x.device, self.window
        ar = torch.arange(t, device=dev)
        if step is None:  # query i sees keys j with i - w < j <= i
            pos = ar[None]
            mask = ((ar[None, :] <= ar[:, None]) & (ar[None, :] > ar[:, None] - w))[None, None]  # [1, 1, T, T]
        else:  # keys are [w-1 cached ++ t new]; key j has absolute position p - (w-1) + j
            p = step.advance(t)  # [s]
            pos = p[:, None] + ar  # [s, T]
            j = torch.arange(w - 1 + t, device=dev)
            mask = (j >= ar[:, None]) & (j <= ar[:, None] + (w - 1))  # [T, w-1+T]
            mask = (mask & (j >= (w - 1) - p[:, None, None]))[:, None]  # [s, 1, T, w-1+T]
        mask = torch.zeros(mask.shape, dtype=x.dtype, device=dev).masked_fill(~mask, float("-inf"))
        cos, sin = (a.unsqueeze(1) for a in rope_angles(pos, self.head_dim, self.theta, x.dtype))
        return cos, sin, mask
