"""Code2Wav's streaming kernels: causal and transposed convs as plain GEMMs over the few columns a
streaming call has, and oneDNN's prepacked linear (weights packed once, bf16 or fp32) where it
applies (``models.onednn`` says at which ISA levels). Every packed product goes through
``packed_rows``, which computes each row alike however many rows the call holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


# Streaming kernel choice. Layers at least this wide see <= 32 columns per frame, so a streaming
# call is bound by reading their weights; there one plain GEMM is faster than oneDNN's conv
# (which, in bf16, re-packs the weight on every call) and than the generic conv_transpose kernel.
# Compare with `code2wav_bench.py --gemm-min-channels 1000000000`. The one-pass path keeps the
# official kernels, so ``forward`` is bit-identical to the official decoder in fp32.
DEFAULT_GEMM_MIN_CHANNELS = 768

def onednn_packing_available(w: Tensor) -> bool:
    """oneDNN's prepacked kernels apply: a CPU weight in bf16 or fp32, a torch built with them
    and, for bf16, an ISA level (the CPU's, under any ``ONEDNN_MAX_CPU_ISA`` cap) that has them
    (oneDNN packs fp32 at every level)."""
    from omni_stream.models.onednn import current_level, packing_available

    return (w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (w.dtype == torch.float32 or packing_available(current_level())))

def packed_rows(x: Tensor, packed: Tensor, b: Tensor | None) -> Tensor:
    """``x [M, K]`` times a weight packed by ``_reorder_linear_weight`` (+ ``b``): [M, N], each
    row computed alike whatever M. oneDNN runs a lone row through another kernel, whose sums
    round differently at large K (fp32 and bf16 alike; from K = 1344 on an AVX512-BF16 EPYC:
    the released decoder's pre-conv is K = 1536), so a call of one frame would not give the bits
    of a longer chunk: a lone row goes in beside a copy of itself."""
    if x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), packed, b, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

def pack_onednn_linear(lin: nn.Linear) -> None:
    """Run ``lin`` from a weight packed once in oneDNN's layout (bf16 or fp32 on CPU): the
    kernel of ``F.linear`` without re-packing the weight on every call, each row computed alike
    at any row count (``packed_rows``)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 64)
    bias = lin.bias

    def forward(x: Tensor) -> Tensor:
        y = packed_rows(x.reshape(-1, x.shape[-1]), packed, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    lin.forward = forward

def conv1d_gemm(x: Tensor, w: Tensor, b: Tensor | None, dilation: int,
                 packed: Tensor | None = None) -> Tensor:
    """Valid conv1d as im2col + GEMM. x [B, C, L + (k-1)*d], w [C', C, k] -> [B, C', L].
    ``packed``: w as a linear weight in oneDNN's layout (``CausalConv1d.pack``)."""
    bsz, c, _ = x.shape
    cout, _, k = w.shape
    cols = x.unfold(2, (k - 1) * dilation + 1, 1)[..., ::dilation]  # [B, C, L, k]
    n = cols.shape[2]
    cols = cols.permute(0, 2, 1, 3).reshape(bsz * n, c * k)
    if packed is not None:
        y = packed_rows(cols, packed, b)
    else:
        y = F.linear(cols, w.reshape(cout, c * k), b)
    return y.view(bsz, n, cout).transpose(1, 2)

def conv_transpose1d_gemm(x: Tensor, w: Tensor, b: Tensor | None, stride: int,
                           packed: Tensor | None = None) -> Tensor:
    """conv_transpose1d for kernel k in (s, 2s) without the first s and last k-s outputs when
    k = 2s. x [B, C, L], w [C, C', k] -> [B, C', L*s] (k = s) or [B, C', (L-1)*s] (k = 2s).
    ``packed``: w as a linear weight in oneDNN's layout (``CausalTransConv1d.pack``)."""
    bsz, c, n = x.shape
    _, cout, k = w.shape
    cols = x.transpose(1, 2).reshape(bsz * n, c)
    if packed is not None:
        y = packed_rows(cols, packed, None)
    else:
        y = torch.mm(cols, w.reshape(c, cout * k))
    y = y.view(bsz, n, cout, k // stride, stride)
    o = y[:, :, :, 0] if k == stride else y[:, 1:, :, 0] + y[:, :-1, :, 1]  # [B, L', C', s]
    o = o.permute(0, 2, 1, 3).reshape(bsz, cout, -1)
    return o if b is None else o + b[:, None]
