"""Code2Wav's building blocks: causal convs with streaming tails, Snake, ConvNeXt, residual
and upsampling blocks, the sliding-window transformer and the split residual VQ.

Each streaming-capable module takes an optional ``_Step`` (the slot state and the slots a call
touches) and, with it, reads and updates that state in place; without it, it computes the
one-pass forward. The model that wires them together is ``models/code2wav.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_stream.config import Code2WavConfig
from omni_stream.models.layers import MLP, RMSNorm, apply_rope, attend, rope_angles


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

    def snapshot(self, slot: int) -> list[Tensor]:
        """A copy of ``slot``'s state (for :meth:`restore` into any slot)."""
        return [t[slot].clone() for t in (self.pos, *self.keys, *self.values, *self.tails)]

    def restore(self, slot: int, snap: list[Tensor]) -> None:
        """Make ``slot`` continue the stream ``snap`` was taken from."""
        for t, s in zip((self.pos, *self.keys, *self.values, *self.tails), snap, strict=True):
            t[slot].copy_(s)


@dataclass
class _Step:
    """What a streaming call threads through the modules: the state and the slots it touches.

    The modules reach the state only through the three methods below, so an exporter can stand
    in a subclass that takes the state as explicit inputs and returns the update as outputs
    (``omni_stream/export/code2wav_step.py``) and run these very modules."""

    state: Code2WavState
    idx: Tensor  # [s] int64 slot index per batch row
    keys_transposed = False  # past keys as [s, H_kv, D, W-1] (NPU graphs) instead of [.., W-1, D]
    # each query attends its own window of W keys in a product of fixed shape
    # (``windowed_attend``): a query's output is then the same whatever the chunk it came in
    windowed = True

    def advance(self, t: int) -> Tensor:
        """The selected slots' positions [s] before this call's ``t`` frames; moves them on."""
        p = self.state.pos.index_select(0, self.idx)
        self.state.pos.index_copy_(0, self.idx, p + t)
        return p

    def tail(self, state_id: int, x: Tensor, keep: int) -> Tensor:
        """Return ``tail ++ x`` for the selected slots and store its last ``keep`` columns back."""
        buf = self.state.tails[state_id]
        # a part running in another dtype than the state (a mixed-precision decode) reads and
        # writes its tail in its own dtype: bf16 values are exact in an fp32 state
        xx = torch.cat([buf.index_select(0, self.idx).to(x.dtype), x], dim=-1)
        buf.index_copy_(0, self.idx, xx[..., xx.shape[-1] - keep:].to(buf.dtype))
        return xx

    def kv(self, layer_id: int, k: Tensor, v: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer_id``'s past keys/values of the selected slots (for attention over
        ``[past ++ new]``); stores the last ``keep`` entries of ``[past ++ new]`` back.
        k, v [s, H_kv, T, D] are the new frames' rotated keys and values."""
        kb, vb = self.state.keys[layer_id], self.state.values[layer_id]
        past_k = kb.index_select(0, self.idx).to(k.dtype)  # a part in its own dtype (see tail)
        past_v = vb.index_select(0, self.idx).to(v.dtype)
        kk, vv = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        kb.index_copy_(0, self.idx, kk[:, :, kk.shape[2] - keep:].to(kb.dtype))
        vb.index_copy_(0, self.idx, vv[:, :, vv.shape[2] - keep:].to(vb.dtype))
        return past_k, past_v


# Streaming kernel choice. Layers at least this wide see <= 32 columns per frame, so a streaming
# call is bound by reading their weights; there one plain GEMM is faster than oneDNN's conv
# (which, in bf16, re-packs the weight on every call) and than the generic conv_transpose kernel.
# Compare with `code2wav_bench.py --gemm-min-channels 1000000000`. The one-pass path keeps the
# official kernels, so ``forward`` is bit-identical to the official decoder in fp32.
DEFAULT_GEMM_MIN_CHANNELS = 768


def onednn_packing_available(w: Tensor) -> bool:
    """oneDNN's prepacked bf16 kernels apply: a CPU bf16 weight, a torch built with them and an
    ISA level (the CPU's, under any ``ONEDNN_MAX_CPU_ISA`` cap) that has them."""
    from omni_stream.models.onednn import current_level, packing_available

    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and packing_available(current_level()))


def pack_linear(lin: nn.Linear) -> None:
    """Run ``lin`` from a weight packed once in oneDNN's layout (bf16 on CPU): the kernel of
    ``F.linear`` without re-packing the weight on every call."""
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 64)
    bias = lin.bias

    def forward(x: Tensor) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    lin.forward = forward


def _conv1d_gemm(x: Tensor, w: Tensor, b: Tensor | None, dilation: int,
                 packed: Tensor | None = None) -> Tensor:
    """Valid conv1d as im2col + GEMM. x [B, C, L + (k-1)*d], w [C', C, k] -> [B, C', L].
    ``packed``: w as a linear weight in oneDNN's layout (``CausalConv1d.pack``)."""
    bsz, c, _ = x.shape
    cout, _, k = w.shape
    cols = x.unfold(2, (k - 1) * dilation + 1, 1)[..., ::dilation]  # [B, C, L, k]
    n = cols.shape[2]
    cols = cols.permute(0, 2, 1, 3).reshape(bsz * n, c * k)
    if packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(cols, packed, b, "none", [], "")
    else:
        y = F.linear(cols, w.reshape(cout, c * k), b)
    return y.view(bsz, n, cout).transpose(1, 2)


def _conv_transpose1d_gemm(x: Tensor, w: Tensor, b: Tensor | None, stride: int,
                           packed: Tensor | None = None) -> Tensor:
    """conv_transpose1d for kernel k in (s, 2s) without the first s and last k-s outputs when
    k = 2s. x [B, C, L], w [C, C', k] -> [B, C', L*s] (k = s) or [B, C', (L-1)*s] (k = 2s).
    ``packed``: w as a linear weight in oneDNN's layout (``CausalTransConv1d.pack``)."""
    bsz, c, n = x.shape
    _, cout, k = w.shape
    cols = x.transpose(1, 2).reshape(bsz * n, c)
    if packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(cols, packed, None, "none", [], "")
    else:
        y = torch.mm(cols, w.reshape(c, cout * k))
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
        self.packed: Tensor | None = None  # streaming weight in oneDNN's layout (Code2Wav.pack)
        self.pointwise: Tensor | None = None  # a narrow 1x1 conv's [C', C] (Code2Wav.pack)

    def pack(self) -> None:
        w = self.conv.weight.detach()
        if self.gemm:  # the wide convs run as im2col + GEMM (the narrow ones: oneDNN's conv)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.reshape(w.shape[0], -1).contiguous(), 64)
        elif w.shape[2] == 1 and self.conv.groups == 1:
            # a narrow 1x1 conv is W [C', C] @ x [C, T] per row: a plain GEMM on the [C, T]
            # layout (oneDNN's conv converts long inputs to its blocked layout and back)
            self.pointwise = w[:, :, 0].contiguous()

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T] -> [B, C', T]
        if step is None:
            return self.conv(F.pad(x, (self.context, 0)) if self.context else x)
        xx = step.tail(self.state_id, x, self.context) if self.context else x
        if self.packed is not None:
            return _conv1d_gemm(xx, self.conv.weight, self.conv.bias, self.dilation, self.packed)
        if self.pointwise is not None:
            y = xx.new_empty(xx.shape[0], self.pointwise.shape[0], xx.shape[2])
            b = self.conv.bias
            for i in range(xx.shape[0]):
                if b is None:
                    torch.mm(self.pointwise, xx[i], out=y[i])
                else:
                    torch.addmm(b[:, None], self.pointwise, xx[i], out=y[i])
            return y
        if self.context == 0:
            return self.conv(xx)
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
        self.packed: Tensor | None = None  # streaming weight in oneDNN's layout (Code2Wav.pack)

    def pack(self) -> None:
        w = self.conv.weight.detach()  # [C, C', k]: as a linear map C -> C' k, packed
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.reshape(w.shape[0], -1).t().contiguous(), 64)

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T] -> [B, C', T*s]
        if step is None:
            y = self.conv(x)
            return y[..., : y.shape[-1] - self.trim]
        if self.context:
            x = step.tail(self.state_id, x, 1)  # [prev column ++ new columns]
        if self.packed is not None:
            return _conv_transpose1d_gemm(x, self.conv.weight, self.conv.bias, self.stride, self.packed)
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
        self.kernel = None  # a one-pass streaming kernel (Code2Wav.pack)

    def pack(self, kernel) -> None:
        """Stream through ``kernel(x, alpha, inv_beta)`` (one pass, e.g. the CPU runtime's)."""
        self.kernel = kernel
        self.consts = (self.alpha.detach().float().exp().contiguous(),
                       (1.0 / (self.beta.detach().float().exp() + 1e-9)).contiguous())

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:  # [B, C, T]
        if step is not None and self.kernel is not None:
            return self.kernel(x, *self.consts)
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
        h = self.conv1(self.act1(x, step), step)
        return x + self.conv2(self.act2(h, step), step)


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
                step: _Step | None = None) -> Tensor:  # x [B, T, hidden]
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
    kw = torch.cat((past_k, k), dim=2).unfold(2, w, 1)  # [B, Hkv, T, D, W]: query t's keys
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

    def forward(self, x: Tensor, step: _Step | None = None, cos: Tensor | None = None,
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

    def _angles_and_mask(self, x: Tensor, step: _Step | None) -> tuple[Tensor, Tensor, Tensor]:
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

    def decode(self, codes: Tensor, rows: bool = False) -> Tensor:  # [B, K, T] -> [B, io_dim, T]
        """``rows``: project each frame as a row of one product (streaming: the conv kernel's
        algorithm, hence its rounding, depends on the length T, i.e. on the chunk plan)."""
        q = self.vq.layers[0]._codebook.decode(codes[:, 0])
        for k in range(1, codes.shape[1]):
            q = q + self.vq.layers[k]._codebook.decode(codes[:, k])
        if rows:
            return F.linear(q, self.output_proj.weight[:, :, 0]).transpose(1, 2)
        return self.output_proj(q.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) have separate output projections."""

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVQ(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def decode(self, codes: Tensor, rows: bool = False) -> Tensor:  # [B, Q, T] -> [B, codebook_dim, T]
        return self.rvq_first.decode(codes[:, :1], rows) + self.rvq_rest.decode(codes[:, 1:], rows)
