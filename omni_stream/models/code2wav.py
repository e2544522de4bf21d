"""Code2Wav: the Qwen3-TTS 12 Hz speech-tokenizer decoder, one-pass and exactly streamed.

``codes [B, 16, T] -> wav [B, T * 1920]`` (24 kHz, clamped to [-1, 1]). The network is fully causal
(causal convs, transposed convs trimmed on the right, sliding-window attention over 72 frames), so
a prefix of the codes decodes to a prefix of the audio. ``Code2WavStream`` uses that to decode only
the new frames of each stream: per batch slot it keeps every causal conv's last input samples, each
block transposed conv's previous input column, and per transformer layer the rotated keys and the
values of the last ``sliding_window - 1`` frames plus the absolute frame position. Streamed output
equals the one-pass decode at any chunking, to float rounding.

Parameter names equal the official ``Qwen3TTSTokenizerV2Decoder`` state_dict keys with the
``decoder.`` prefix stripped, so a checkpoint loads strictly (``load_state_dict(sd, strict=True)``).

Dtypes: the model runs in the dtype of its parameters (fp32 or bf16). The streaming state is kept
in that same dtype: the tails are exactly the activations a one-pass decode in that dtype would
feed to the same convs, so nothing is gained by holding them in fp32. RMSNorm statistics and the
rotary angles are computed in fp32 as in the official code; the rotary angles are recomputed per
call from integer positions, so casting the model never degrades them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_stream.config import Code2WavConfig

__all__ = ["Code2Wav", "Code2WavState", "Code2WavStream", "random_code2wav_state_dict"]


@dataclass
class Code2WavState:
    """Per-slot streaming state, preallocated for ``max_slots`` slots (leading dim of every tensor).

    pos:    [S] int64: frames decoded so far = absolute rotary position of the slot's next frame.
    keys:   per transformer layer [S, H_kv, W-1, D]: rotated keys of the last W-1 frames, oldest
            first. Entries from before the stream start are masked out using ``pos``.
    values: per transformer layer [S, H_kv, W-1, D], aligned with ``keys``.
    tails:  per stateful conv (in module order) [S, C_in, L]: the last L inputs of that conv
            (L = (kernel-1)*dilation for causal convs, 1 for the block transposed convs). Zeros
            are exactly the causal left padding of a fresh stream.
    """

    pos: Tensor
    keys: list[Tensor]
    values: list[Tensor]
    tails: list[Tensor]

    @property
    def max_slots(self) -> int:
        return self.pos.shape[0]

    def reset(self, slot: int) -> None:
        """Make ``slot`` a fresh stream (position 0, zero history)."""
        self.pos[slot] = 0
        for t in (*self.keys, *self.values, *self.tails):
            t[slot].zero_()


@dataclass
class _Step:
    """What a streaming call threads through the modules: the state and the slots it touches."""

    state: Code2WavState
    idx: Tensor  # [s] int64 slot index per batch row


def _take_tail(step: _Step, state_id: int, x: Tensor, keep: int) -> Tensor:
    """Return ``tail ++ x`` for the selected slots and store its last ``keep`` columns back."""
    buf = step.state.tails[state_id]
    xx = torch.cat([buf.index_select(0, step.idx), x], dim=-1)
    buf.index_copy_(0, step.idx, xx[..., xx.shape[-1] - keep:])
    return xx


# Streaming kernel choice. Layers at least this wide see <= 32 columns per frame, so a streaming
# call is bound by reading their weights; there one plain GEMM is faster than oneDNN's conv
# (which, in bf16, re-packs the weight on every call) and than the generic conv_transpose kernel.
# Compare with `code2wav_bench.py --gemm-min-channels 1000000000`. The one-pass path keeps the
# official kernels, so ``forward`` is bit-identical to the official decoder in fp32.
DEFAULT_GEMM_MIN_CHANNELS = 768


def _conv1d_gemm(x: Tensor, w: Tensor, b: Tensor | None, dilation: int) -> Tensor:
    """Valid conv1d as im2col + GEMM. x [B, C, L + (k-1)*d], w [C', C, k] -> [B, C', L]."""
    bsz, c, _ = x.shape
    cout, _, k = w.shape
    cols = x.unfold(2, (k - 1) * dilation + 1, 1)[..., ::dilation]  # [B, C, L, k]
    n = cols.shape[2]
    cols = cols.permute(0, 2, 1, 3).reshape(bsz * n, c * k)
    return F.linear(cols, w.reshape(cout, c * k), b).view(bsz, n, cout).transpose(1, 2)


def _conv_transpose1d_gemm(x: Tensor, w: Tensor, b: Tensor | None, stride: int) -> Tensor:
    """conv_transpose1d for kernel k in (s, 2s) without the first s and last k-s outputs when
    k = 2s. x [B, C, L], w [C, C', k] -> [B, C', L*s] (k = s) or [B, C', (L-1)*s] (k = 2s)."""
    bsz, c, n = x.shape
    _, cout, k = w.shape
    y = torch.mm(x.transpose(1, 2).reshape(bsz * n, c), w.reshape(c, cout * k))
    y = y.view(bsz, n, cout, k // stride, stride)
    o = y[:, :, :, 0] if k == stride else y[:, 1:, :, 0] + y[:, :-1, :, 1]  # [B, L', C', s]
    o = o.permute(0, 2, 1, 3).reshape(bsz, cout, -1)
    return o if b is None else o + b[:, None]


class CausalConv1d(nn.Module):
    """Stride-1 conv padded on the left only; streaming keeps the last (k-1)*dilation inputs."""

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, dilation=dilation, groups=groups)
        self.dilation = dilation
        self.context = (kernel_size - 1) * dilation
        self.gemm = False  # streaming kernel, chosen by Code2Wav
        self.state_id = -1  # assigned by Code2Wav

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T] -> [B, C', T]
        if self.context == 0:
            return self.conv(x)
        if step is None:
            return self.conv(F.pad(x, (self.context, 0)))
        xx = _take_tail(step, self.state_id, x, self.context)
        if self.gemm:
            return _conv1d_gemm(xx, self.conv.weight, self.conv.bias, self.dilation)
        return self.conv(xx)


class CausalTransConv1d(nn.Module):
    """Transposed conv (kernel = stride or 2*stride) with the right overhang trimmed.

    With kernel 2s, output block t depends on input columns t and t-1, so streaming keeps the
    previous input column; with kernel s the columns are independent and there is no state.
    """

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        assert kernel_size in (stride, 2 * stride), "only kernel = stride or 2*stride occur"
        self.conv = nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride)
        self.stride = stride
        self.trim = kernel_size - stride
        self.context = 1 if self.trim else 0
        self.gemm = False  # streaming kernel, chosen by Code2Wav
        self.state_id = -1

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T] -> [B, C', T*s]
        if step is None:
            y = self.conv(x)
            return y[..., : y.shape[-1] - self.trim]
        if self.context:
            x = _take_tail(step, self.state_id, x, 1)  # [prev column ++ new columns]
        if self.gemm:
            return _conv_transpose1d_gemm(x, self.conv.weight, self.conv.bias, self.stride)
        if self.context == 0:
            return self.conv(x)
        return self.conv(x)[..., self.stride: self.stride * x.shape[-1]]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (log-scale parameters as in the checkpoint)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T]
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T]
        h = self.dwconv(x, step).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T]
        h = self.conv1(self.act1(x), step)
        return x + self.conv2(self.act2(h))


class DecoderBlock(nn.Module):
    """Snake -> transposed conv upsampling by ``rate`` -> residual units with dilation 1, 3, 9."""

    def __init__(self, cfg: Code2WavConfig, i: int) -> None:
        super().__init__()
        cin, cout, rate = cfg.decoder_dim >> i, cfg.decoder_dim >> (i + 1), cfg.upsample_rates[i]
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv1d(cin, cout, 2 * rate, rate)]
                                   + [ResidualUnit(cout, d) for d in (1, 3, 9)])

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:
        for m in self.block:
            x = m(x, step)
        return x


# ---------------------------------------------------------------- transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [B, H, T, D]; cos/sin [B, 1, T, D]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class SlidingWindowAttention(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.head_dim, self.gqa = d, h != hkv
        self.cache_len = cfg.sliding_window - 1
        self.layer_id = -1  # assigned by Code2Wav

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                step: _Step | None = None) -> Tensor:  # x [B, T, hidden]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if step is not None:  # keys/values become [window-1 cached ++ T new]
            kb, vb = step.state.keys[self.layer_id], step.state.values[self.layer_id]
            k = torch.cat([kb.index_select(0, step.idx), k], dim=2)
            v = torch.cat([vb.index_select(0, step.idx), v], dim=2)
            kb.index_copy_(0, step.idx, k[:, :, k.shape[2] - self.cache_len:])
            vb.index_copy_(0, step.idx, v[:, :, v.shape[2] - self.cache_len:])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                           enable_gqa=self.gqa)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = SlidingWindowAttention(cfg)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                step: _Step | None = None) -> Tensor:
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

    def _rotary(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [B, 1, T, D] for integer positions [B, T], computed in fp32."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=pos.device).float() / d))
        freqs = pos.float()[..., None] * inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, T, latent]
        t, dev, w = x.shape[1], x.device, self.window
        ar = torch.arange(t, device=dev)
        if step is None:  # query i sees keys j with i - w < j <= i
            pos = ar[None]
            mask = (ar[None, :] <= ar[:, None]) & (ar[None, :] > ar[:, None] - w)  # [T, T]
        else:  # keys are [w-1 cached ++ t new]; key j has absolute position p - (w-1) + j
            p = step.state.pos.index_select(0, step.idx)  # [s]
            pos = p[:, None] + ar  # [s, T]
            j = torch.arange(w - 1 + t, device=dev)
            mask = (j >= ar[:, None]) & (j <= ar[:, None] + (w - 1))  # [T, w-1+T]
            mask = (mask & (j >= (w - 1) - p[:, None, None]))[:, None]  # [s, 1, T, w-1+T]
            step.state.pos.index_copy_(0, step.idx, p + t)
        cos, sin = self._rotary(pos, x.dtype)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, step)
        return self.output_proj(self.norm(h))


# ---------------------------------------------------------------- quantizer


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def decode(self, codes: Tensor) -> Tensor:  # [B, T] -> [B, T, dim]
        # Gather-then-divide: same elementwise quotients as dividing the whole table first.
        usage = self.cluster_usage.clamp(min=1e-5)
        return F.embedding(codes, self.embedding_sum) / F.embedding(codes, usage[:, None])


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _VQStack(nn.Module):
    def __init__(self, n: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQ(size, dim) for _ in range(n))


class ResidualVQ(nn.Module):
    """Sum of per-codebook embeddings, projected by a 1x1 conv. ``input_proj`` is the encoder's
    projection: unused when decoding, kept so checkpoints load strictly."""

    def __init__(self, n_q: int, size: int, dim: int, io_dim: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = _VQStack(n_q, size, dim)

    def decode(self, codes: Tensor) -> Tensor:  # [B, K, T] -> [B, io_dim, T]
        q = self.vq.layers[0]._codebook.decode(codes[:, 0])
        for k in range(1, codes.shape[1]):
            q = q + self.vq.layers[k]._codebook.decode(codes[:, k])
        return self.output_proj(q.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) have separate output projections."""

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVQ(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def decode(self, codes: Tensor) -> Tensor:  # [B, Q, T] -> [B, codebook_dim, T]
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# ---------------------------------------------------------------- model


class Code2Wav(nn.Module):
    """The speech-tokenizer decoder. ``forward`` decodes in one pass; ``step`` streams.

    ``gemm_min_channels``: streaming runs convs / transposed convs with at least this many input
    channels as plain GEMMs (see ``DEFAULT_GEMM_MIN_CHANNELS``); 0 = all, a huge value = none.
    """

    def __init__(self, cfg: Code2WavConfig,
                 gemm_min_channels: int = DEFAULT_GEMM_MIN_CHANNELS) -> None:
        super().__init__()
        if cfg.num_quantizers < 2:
            raise ValueError("Code2Wav needs num_quantizers >= 2 (1 semantic + acoustic codebooks)")
        self.cfg = cfg
        self.quantizer = SplitResidualVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = DecoderTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv1d(cfg.latent_dim, cfg.latent_dim, r, r),
                           ConvNeXtBlock(cfg.latent_dim)]) for r in cfg.upsampling_ratios)
        out_dim = cfg.decoder_dim >> len(cfg.upsample_rates)
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))]
            + [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)])
        # Number the stateful modules (Code2WavState lists are indexed by these ids) and pick
        # each conv's streaming kernel.
        self._tail_shapes: list[tuple[int, int]] = []
        for m in self.modules():
            if isinstance(m, (CausalConv1d, CausalTransConv1d)):
                m.gemm = m.conv.in_channels >= gemm_min_channels and m.conv.groups == 1
                if m.context > 0:
                    m.state_id = len(self._tail_shapes)
                    self._tail_shapes.append((m.conv.in_channels, m.context))
        for i, layer in enumerate(self.pre_transformer.layers):
            layer.self_attn.layer_id = i

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    def check_codes(self, codes: Tensor) -> Tensor:
        """Validate ``codes [B, Q, T]`` and return them as int64. Reads min/max back to the host
        (one sync); the unchecked ``step`` is the path for callers that validated already."""
        q, size = self.cfg.num_quantizers, self.cfg.codebook_size
        if not isinstance(codes, Tensor) or codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor [batch, {q}, frames]")
        if codes.dim() != 3 or codes.shape[1] != q:
            raise ValueError(f"codes must have shape [batch, {q}, frames] ({q} codebooks), "
                             f"got {tuple(codes.shape)}")
        if codes.shape[0] < 1 or codes.shape[2] < 1:
            raise ValueError(f"codes must hold at least one row and one frame, got {tuple(codes.shape)}")
        lo, hi = torch.stack(torch.aminmax(codes)).tolist()
        if lo < 0 or hi >= size:
            raise ValueError(f"codes must lie in [0, {size}) (codebook_size), got values in [{lo}, {hi}]")
        return codes.long()

    def _run(self, codes: Tensor, step: _Step | None) -> Tensor:  # [B, Q, T] -> [B, T*spf]
        h = self.quantizer.decode(codes)  # [B, codebook_dim, T]
        h = self.pre_conv(h, step).transpose(1, 2)  # [B, T, latent]
        h = self.pre_transformer(h, step).transpose(1, 2)  # [B, latent, T]
        for blocks in self.upsample:
            for m in blocks:
                h = m(h, step)
        for m in self.decoder:
            h = m(h, step)
        return h.clamp(min=-1, max=1).squeeze(1)

    def forward(self, codes: Tensor) -> Tensor:
        """One-pass decode: ``codes [B, Q, T]`` int -> ``wav [B, T * samples_per_frame]``."""
        return self._run(self.check_codes(codes), None)

    def new_state(self, max_slots: int) -> Code2WavState:
        """Zeroed streaming state for ``max_slots`` slots, on the parameters' device and dtype."""
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        p = self.pre_conv.conv.weight
        kw = dict(device=p.device, dtype=p.dtype)
        cfg = self.cfg
        kv = (max_slots, cfg.num_key_value_heads, cfg.sliding_window - 1, cfg.head_dim)
        n = cfg.num_hidden_layers
        return Code2WavState(
            pos=torch.zeros(max_slots, dtype=torch.long, device=p.device),
            keys=[torch.zeros(kv, **kw) for _ in range(n)],
            values=[torch.zeros(kv, **kw) for _ in range(n)],
            tails=[torch.zeros(max_slots, c, L, **kw) for c, L in self._tail_shapes])

    @torch.no_grad()
    def step(self, state: Code2WavState, idx: Tensor, codes: Tensor) -> Tensor:
        """Hot path, unchecked: decode ``codes [s, Q, n]`` (int64) as the next frames of slots
        ``idx [s]`` (distinct, int64) and return exactly the new samples ``[s, n * spf]``."""
        return self._run(codes, _Step(state, idx))


class Code2WavStream:
    """Exact streaming decoder over ``max_slots`` fixed batch slots (one stream per slot).

    ``decode(slots, codes)`` runs one batched pass over the listed slots; the other slots' state
    is untouched. Create and use it under the same grad mode: state allocated inside
    ``torch.inference_mode()`` cannot be updated outside it.
    """

    def __init__(self, model: Code2Wav, max_slots: int) -> None:
        self.model = model
        self.state = model.new_state(max_slots)

    @property
    def max_slots(self) -> int:
        return self.state.max_slots

    def decode(self, slots: Sequence[int] | Tensor, codes: Tensor) -> Tensor:
        """``codes [len(slots), Q, n]`` -> the ``[len(slots), n * samples_per_frame]`` samples
        that these frames add to each slot's stream."""
        idx = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        codes = self.model.check_codes(codes)
        if idx.numel() != codes.shape[0]:
            raise ValueError(f"got {idx.numel()} slots for {codes.shape[0]} rows of codes")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.max_slots):
            raise ValueError(f"slots must lie in [0, {self.max_slots}), got {idx.tolist()}")
        if idx.unique().numel() != idx.numel():
            raise ValueError(f"slots must be distinct within one call, got {idx.tolist()}")
        return self.model.step(self.state, idx.to(self.state.pos.device),
                               codes.to(self.state.pos.device))

    def reset(self, slot: int) -> None:
        """Start a new stream in ``slot``."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must lie in [0, {self.max_slots}), got {slot}")
        self.state.reset(slot)


# ---------------------------------------------------------------- random weights


def random_code2wav_state_dict(cfg: Code2WavConfig, seed: int = 0, *,
                               layer_scale: float | None = None,
                               convnext_gamma: float = 1e-6) -> dict[str, Tensor]:
    """Random weights (fp32, keys without the ``decoder.`` prefix) that make audible, non-silent,
    non-saturated audio: random codebooks (the official init is zeros, hence silence), weights
    ~ N(0, 1/fan_in), small random biases and Snake parameters. ``layer_scale`` defaults to the
    config's value and ``convnext_gamma`` to the official 1e-6; tests raise both so the
    attention window and the ConvNeXt convs visibly shape the output."""
    g = torch.Generator().manual_seed(seed)
    ls = cfg.layer_scale_initial_scale if layer_scale is None else layer_scale
    with torch.device("meta"):
        shapes = {k: (v.shape, m) for k, v, m in _params_with_owner(Code2Wav(cfg))}

    def randn(shape: torch.Size, std: float) -> Tensor:
        return torch.randn(shape, generator=g) * std

    out: dict[str, Tensor] = {}
    for name, (shape, owner) in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embedding_sum":
            t = randn(shape, 1.0)
        elif leaf == "cluster_usage":
            t = torch.ones(shape)
        elif leaf in ("alpha", "beta"):
            t = randn(shape, 0.1)
        elif leaf == "scale":
            t = torch.full(shape, ls)
        elif leaf == "gamma":
            t = torch.full(shape, convnext_gamma)
        elif isinstance(owner, (RMSNorm, nn.LayerNorm)) and leaf == "weight":
            t = 1.0 + randn(shape, 0.05)
        elif leaf == "bias":
            t = randn(shape, 0.02)
        elif isinstance(owner, nn.ConvTranspose1d):  # [Cin, Cout, k]: Cin * k/stride taps
            t = randn(shape, (shape[0] * (owner.kernel_size[0] // owner.stride[0])) ** -0.5)
        else:  # Linear [out, in] / Conv1d [out, in/groups, k]
            fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1)
            t = randn(shape, fan_in ** -0.5)
        out[name] = t
    # Residual branches scaled down so the stack does not compound; the output conv scaled so
    # the waveform RMS is ~0.2-0.3 (audible, rarely clipped) at tiny and released dims alike.
    last = f"decoder.{len(cfg.upsample_rates) + 2}.conv.weight"
    for name in out:
        if name.endswith(".conv2.conv.weight"):
            out[name] = out[name] * 0.3
    out[last] = out[last] * 0.1
    return out


def _params_with_owner(model: nn.Module):
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            yield (f"{mname}.{pname}" if mname else pname), p, m
