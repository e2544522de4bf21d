"""One-frame Code2Wav step with every piece of streaming state as explicit tensors.

    inputs   codes [1, Q, 1] int64; rope_cos, rope_sin [1, 1, 1, D] (sin sign-folded, as in
             ``step.py``); mask [1, 1, 1, W] over [W-1 cached frames ++ this frame];
             past_key_<i> [1, Hkv, D, W-1], past_value_<i> [1, Hkv, W-1, D] per transformer
             layer; tail_<j> [1, C_j, L_j] per stateful conv (its last L_j inputs)
    outputs  audio [1, samples_per_frame]; present_* (roll) or new_* (ring) per layer;
             tail_out_<j> per stateful conv

It mirrors ``Code2Wav.step`` (``omni_stream.models.code2wav``) with the module's own weights:
the same conv tails, the same sliding window (W = ``sliding_window`` frames, so the ring holds
W-1 entries), one frame at a time. The context must equal the model's window: a shorter one
would change the output, a longer one would attend frames the model never sees.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.export.onnx_step import LAYOUTS, StepError
from omni_stream.models.layers import swap_halves as _swap_halves


class Code2WavStep(nn.Module):
    def __init__(self, model: nn.Module, layout: str, context: int) -> None:
        super().__init__()
        from omni_stream.models.code2wav import Code2Wav

        if not isinstance(model, Code2Wav):
            raise StepError(f"code2wav: expected a Code2Wav module, got {type(model).__name__}; "
                            "load it with omni_stream.checkpoints.io.load_codec")
        cfg = model.cfg
        layers = model.pre_transformer.layers
        if len(layers) != cfg.num_hidden_layers or len(layers) == 0:
            raise StepError(f"code2wav: {len(layers)} transformer layers but the config declares "
                            f"{cfg.num_hidden_layers}; the codec checkpoint and its config disagree")
        if layout not in LAYOUTS:
            raise StepError(f"unknown cache layout '{layout}': expected one of {', '.join(LAYOUTS)}")
        if context != cfg.sliding_window:
            raise StepError(f"code2wav: context {context} differs from the codec's sliding window of "
                            f"{cfg.sliding_window} frames; use --context {cfg.sliding_window}")
        self.model, self.layout, self.context = model, layout, context
        self.n_layers = cfg.num_hidden_layers
        self.n_kv, self.n_heads, self.head_dim = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.rope_theta = cfg.rope_theta
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.tail_shapes = list(model._tail_shapes)

    @property
    def cache_len(self) -> int:
        return self.context - 1

    def input_names(self) -> list[str]:
        names = ["codes", "rope_cos", "rope_sin", "mask"]
        for i in range(self.n_layers):
            names += [f"past_key_{i}", f"past_value_{i}"]
        return names + [f"tail_{j}" for j in range(len(self.tail_shapes))]

    def output_names(self) -> list[str]:
        kind = "present" if self.layout == "roll" else "new"
        names = ["audio"]
        for i in range(self.n_layers):
            names += [f"{kind}_key_{i}", f"{kind}_value_{i}"]
        return names + [f"tail_out_{j}" for j in range(len(self.tail_shapes))]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        d, n = self.head_dim, self.cache_len
        args = [torch.zeros(1, self.model.cfg.num_quantizers, 1, dtype=torch.int64),
                torch.ones(1, 1, 1, d), torch.zeros(1, 1, 1, d), torch.zeros(1, 1, 1, self.context)]
        for _ in range(self.n_layers):
            args += [torch.zeros(1, self.n_kv, d, n), torch.zeros(1, self.n_kv, n, d)]
        return tuple(args + [torch.zeros(1, c, L) for c, L in self.tail_shapes])

    # -------------------------------------------------------------- stateful pieces
    def _conv(self, m: nn.Module, x: torch.Tensor, tails: list, outs: list) -> torch.Tensor:
        """CausalConv1d over [tail ++ x] (valid padding)."""
        if m.context == 0:
            return m.conv(x)
        xx = torch.cat((tails[m.state_id], x), dim=-1)
        outs[m.state_id] = xx[..., xx.shape[-1] - m.context:]
        c = m.conv
        return F.conv1d(xx, c.weight, c.bias, dilation=c.dilation, groups=c.groups)

    def _tconv(self, m: nn.Module, x: torch.Tensor, tails: list, outs: list) -> torch.Tensor:
        if m.context == 0:
            return m.conv(x)
        xx = torch.cat((tails[m.state_id], x), dim=-1)  # [previous column ++ new columns]
        outs[m.state_id] = xx[..., xx.shape[-1] - 1:]
        return m.conv(xx)[..., m.stride: m.stride * xx.shape[-1]]

    @staticmethod
    def _snake(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s = torch.sin(x * m.alpha.exp()[None, :, None])
        return x + (1.0 / (m.beta.exp()[None, :, None] + 1e-9)) * (s * s)

    @staticmethod
    def _rms(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m.weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + m.eps))

    def _attention(self, attn: nn.Module, x, cos, sin, mask, past_k, past_v):
        h, kv, d, g, n = self.n_heads, self.n_kv, self.head_dim, self.group, self.cache_len
        q = attn.q_proj(x).reshape(1, 1, h, d)
        k = attn.k_proj(x).reshape(1, 1, kv, d)
        v = attn.v_proj(x).reshape(1, kv, 1, d)
        q = (q * cos + _swap_halves(q) * sin).reshape(1, kv, g, d) * self.scale
        k_new = (k * cos + _swap_halves(k) * sin).reshape(1, kv, d, 1)
        if self.layout == "roll":
            keys = torch.cat((past_k, k_new), dim=-1)
            values = torch.cat((past_v, v), dim=2)
            out = torch.matmul(torch.softmax(torch.matmul(q, keys) + mask, dim=-1), values)
            k_out, v_out = keys[..., 1:], values[:, :, 1:]
        else:
            scores = torch.cat((torch.matmul(q, past_k), torch.matmul(q, k_new)), dim=-1)
            p = torch.softmax(scores + mask, dim=-1)
            out = torch.matmul(p[..., :n], past_v) + p[..., n:] * v
            k_out, v_out = k_new, v
        return attn.o_proj(out.reshape(1, 1, h * d)), k_out, v_out

    def forward(self, codes: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                mask: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from omni_stream.models.code2wav_blocks import (CausalConv1d, CausalTransConv1d, ConvNeXtBlock,
                                                        DecoderBlock, ResidualUnit, SnakeBeta)

        m = self.model
        kv = state[: 2 * self.n_layers]
        tails = list(state[2 * self.n_layers:])
        outs: list = [None] * len(tails)
        h = m.quantizer.decode(codes)  # [1, codebook_dim, 1]
        h = self._conv(m.pre_conv, h, tails, outs).transpose(1, 2)  # [1, 1, latent]
        tr = m.pre_transformer
        x = tr.input_proj(h)
        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(tr.layers):
            a, k_out, v_out = self._attention(layer.self_attn, self._rms(layer.input_layernorm, x),
                                              rope_cos, rope_sin, mask, kv[2 * i], kv[2 * i + 1])
            x = x + layer.self_attn_layer_scale.scale * a
            x = x + layer.mlp_layer_scale.scale * layer.mlp(self._rms(layer.post_attention_layernorm, x))
            new_kv += [k_out, v_out]
        h = tr.output_proj(self._rms(tr.norm, x)).transpose(1, 2)  # [1, latent, 1]

        def run(mod: nn.Module, h: torch.Tensor) -> torch.Tensor:
            if isinstance(mod, CausalConv1d):
                return self._conv(mod, h, tails, outs)
            if isinstance(mod, CausalTransConv1d):
                return self._tconv(mod, h, tails, outs)
            if isinstance(mod, SnakeBeta):
                return self._snake(mod, h)
            if isinstance(mod, ConvNeXtBlock):
                y = self._conv(mod.dwconv, h, tails, outs).transpose(1, 2)
                y = mod.pwconv2(F.gelu(mod.pwconv1(mod.norm(y))))
                return h + (mod.gamma * y).transpose(1, 2)
            if isinstance(mod, ResidualUnit):
                y = self._conv(mod.conv1, self._snake(mod.act1, h), tails, outs)
                return h + mod.conv2.conv(self._snake(mod.act2, y))
            if isinstance(mod, DecoderBlock):
                for sub in mod.block:
                    h = run(sub, h)
                return h
            raise StepError(f"code2wav: unexpected module {type(mod).__name__} in the decoder")

        for blocks in m.upsample:
            for mod in blocks:
                h = run(mod, h)
        for mod in m.decoder:
            h = run(mod, h)
        audio = h.clamp(min=-1, max=1).reshape(1, -1)
        assert all(o is not None for o in outs), "every stateful conv must have run"
        return tuple([audio] + new_kv + outs)
