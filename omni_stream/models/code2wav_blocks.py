"""Code2Wav's building blocks: causal convs with streaming tails, Snake, ConvNeXt, residual
and upsampling blocks and the split residual VQ (the sliding-window transformer:
``code2wav_transformer``; the streaming state: ``code2wav_state``; the GEMM kernels and oneDNN
packing: ``code2wav_gemm``).

Each streaming-capable module takes an optional ``Step`` (the slot state and the slots a call
touches) and, with it, reads and updates that state in place; without it, it computes the
one-pass forward. The model that wires them together is ``models/code2wav.py``.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni_stream.config import Code2WavConfig
from omni_stream.models.code2wav_gemm import conv1d_gemm, conv_transpose1d_gemm, packed_rows
from omni_stream.models.code2wav_state import Step


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

    def forward(self, x: Tensor, step: Step | None = None) -> Tensor:  # [B, C, T] -> [B, C', T]
        if step is None:
            return self.conv(F.pad(x, (self.context, 0)) if self.context else x)
        xx = step.tail(self.state_id, x, self.context) if self.context else x
        if self.packed is not None:
            return conv1d_gemm(xx, self.conv.weight, self.conv.bias, self.dilation, self.packed)
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
            return conv1d_gemm(xx, self.conv.weight, self.conv.bias, self.dilation)
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

    def forward(self, x: Tensor, step: Step | None = None) -> Tensor:  # [B, C, T] -> [B, C', T*s]
        if step is None:
            y = self.conv(x)
            return y[..., : y.shape[-1] - self.trim]
        if self.context:
            x = step.tail(self.state_id, x, 1)  # [prev column ++ new columns]
        if self.packed is not None:
            return conv_transpose1d_gemm(x, self.conv.weight, self.conv.bias, self.stride, self.packed)
        if self.gemm:
            return conv_transpose1d_gemm(x, self.conv.weight, self.conv.bias, self.stride)
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

    def forward(self, x: Tensor, step: Step | None = None) -> Tensor:  # [B, C, T]
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

    def forward(self, x: Tensor, step: Step | None = None) -> Tensor:  # [B, C, T]
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

    def forward(self, x: Tensor, step: Step | None = None) -> Tensor:  # [B, C, T]
        h = self.conv1(self.act1(x, step), step)
        return x + self.conv2(self.act2(h, step), step)


class DecoderBlock(nn.Module):
    """Snake -> transposed conv upsampling by ``rate`` -> residual units with dilation 1, 3, 9."""

    def __init__(self, cfg: Code2WavConfig, i: int) -> None:
        super().__init__()
        cin, cout, rate = cfg.decoder_dim >> i, cfg.decoder_dim >> (i + 1), cfg.upsample_rates[i]
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv1d(cin, cout, 2 * rate, rate)]
                                   + [ResidualUnit(cout, d) for d in (1, 3, 9)])

    def forward(self, x: Tensor, step: Step | None = None) -> Tensor:
        for m in self.block:
            x = m(x, step)
        return x


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
        self.packed: Tensor | None = None  # output_proj as a packed linear (Code2Wav.pack)

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            self.output_proj.weight.detach()[:, :, 0].contiguous(), 64)

    def decode(self, codes: Tensor, rows: bool = False) -> Tensor:  # [B, K, T] -> [B, io_dim, T]
        """``rows``: project each frame as a row of one product (streaming: the conv kernel's
        algorithm, hence its rounding, depends on the length T, i.e. on the chunk plan; so does
        fp32 ``F.linear``'s on the row count, hence the packed product where there is one)."""
        q = self.vq.layers[0]._codebook.decode(codes[:, 0])
        for k in range(1, codes.shape[1]):
            q = q + self.vq.layers[k]._codebook.decode(codes[:, k])
        if rows and self.packed is not None:
            b, t, d = q.shape
            return packed_rows(q.reshape(b * t, d), self.packed, None).view(b, t, -1).transpose(1, 2)
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
