"""CPU weight paths: int8 and 4-bit weights with bf16 activations.

A decode frame reads every talker weight once and every code-predictor weight 15 times, with a
batch of 1..4 rows: the cost is reading weights, not arithmetic. Storing them in 8 or 4 bits cuts
the bytes read per frame 2x or 4x against bf16. Both paths use the CPU kernels that ship with
torch (no extra build):

- ``int8``: symmetric per-output-channel int8 (``aten._weight_int8pack_mm``);
- ``int4``: asymmetric 4-bit in groups of ``group_size`` input channels with a bf16 scale and
  offset per group (``aten._weight_int4pack_mm_for_cpu``, packed once at load).

Activations stay bf16 (both kernels take bf16 in and give bf16 out; fp32 activations fall back
to a scalar loop 40x slower, so a quantized model runs in bf16). Embedding tables, norms and the
codec's convolutions are left alone: tables are gathered (a few rows per frame), convolutions are
compute-bound. What is quantized: every ``nn.Linear`` of the talker and code-predictor decoder
layers, the codec head, the 15 code-predictor heads and the 2048->1024 projection where present.
``quantize_codec`` does the codec decoder's transformer projections (measured, not served).
"""

from __future__ import annotations

import torch
from torch import nn

from omni_stream.config import LOW_BIT_WEIGHT_PATHS as QUANTIZED
from omni_stream.config import NATIVE_ONLY_WEIGHT_PATHS as NATIVE_ONLY
from omni_stream.config import WEIGHT_PATHS

QUANTIZED_TORCH = tuple(p for p in QUANTIZED if p not in NATIVE_ONLY)  # int8, int4
DEFAULT_GROUP = 32  # same speed as 64/128 here (bench: int4 3072x1024 ~110 us at 32/64/128)


class QuantizedLinear(nn.Module):
    """Drop-in for a bias-optional ``nn.Linear`` holding packed low-bit weights."""

    def __init__(self, linear: nn.Linear, mode: str, group_size: int = DEFAULT_GROUP) -> None:
        super().__init__()
        if mode not in QUANTIZED_TORCH:
            raise ValueError(f"unknown quantized weight path {mode!r}: use one of {', '.join(QUANTIZED_TORCH)}")
        w = linear.weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.mode = mode
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().to(torch.bfloat16), requires_grad=False)
        if mode == "int8":
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale.to(torch.bfloat16))
            self.group_size = 0
        else:
            g = _int4_group(self.in_features, group_size)
            self.group_size = g
            wg = w.view(self.out_features, self.in_features // g, g)
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = (hi - lo).clamp(min=1e-8) / 15.0
            q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15)
            q = q.to(torch.int32).view(self.out_features, self.in_features)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # the kernel computes (q - 8) * scale + zero: zero = lo + 8 * scale gives q * scale + lo
            sz = torch.stack((scale, lo + 8.0 * scale), dim=-1)  # [N, K/g, 2]
            self.register_buffer("scale_zero", sz.transpose(0, 1).contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size,
                                                           self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this module multiplies by, in fp32 (tests, error reports)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).float().t().contiguous()
        finally:
            self.bias = bias

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"in={self.in_features}, out={self.out_features}, mode={self.mode}{g}"


def _int4_group(k: int, group_size: int) -> int:
    for g in (group_size, 128, 64, 32):
        if g in (32, 64, 128, 256) and k % g == 0:
            return g
    raise ValueError(f"4-bit weights need an input width divisible by 32; this layer has {k}: "
                     "use weight path int8")


def check_supported(mode: str, device: torch.device | str = "cpu", engine: str = "torch") -> None:
    """Fail early, with the fix, where the quantized kernels are not available."""
    if mode not in WEIGHT_PATHS:
        raise ValueError(f"unknown weight path {mode!r}: use one of {', '.join(WEIGHT_PATHS)}")
    if engine == "vllm" and mode not in ("bf16", "fp32"):
        raise ValueError(f"weight path {mode} is not a vLLM path: the vllm engine runs the "
                         "talker's weights as they are (--weight-path fp32 or bf16, or none)")
    if mode in NATIVE_ONLY and engine != "native":
        raise ValueError(f"weight path {mode} runs on the native CPU runtime only (--engine "
                         f"native); the torch engine has {', '.join(QUANTIZED_TORCH)}")
    if mode in QUANTIZED and torch.device(device).type != "cpu":
        raise ValueError(f"weight path {mode} is a CPU path; on {torch.device(device).type} use bf16")


def _fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the given ones' outputs concatenated (same input)."""
    w = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    return fused


def _fuse_projections(root: nn.Module, mode: str, group_size: int) -> int:
    """q/k/v and gate/up read the same input: pack each group as one matrix (one kernel call
    instead of three or two; per output row the arithmetic is unchanged). The separate
    projections are dropped. Returns the matrices fused."""
    from omni_stream.models.layers import MLP, Attention

    n = 0
    for mod in root.modules():
        if isinstance(mod, Attention) and mod.qkv_proj is None and all(
                isinstance(p, nn.Linear) and p.bias is None for p in (mod.q_proj, mod.k_proj, mod.v_proj)):
            mod.qkv_proj = QuantizedLinear(_fuse([mod.q_proj, mod.k_proj, mod.v_proj]), mode, group_size)
            del mod.q_proj, mod.k_proj, mod.v_proj
            n += 3
        elif isinstance(mod, MLP) and mod.gate_up_proj is None and all(
                isinstance(p, nn.Linear) and p.bias is None for p in (mod.gate_proj, mod.up_proj)):
            mod.gate_up_proj = QuantizedLinear(_fuse([mod.gate_proj, mod.up_proj]), mode, group_size)
            del mod.gate_proj, mod.up_proj
            n += 2
    return n


def _replace_linears(root: nn.Module, mode: str, group_size: int) -> int:
    n = 0
    for name, child in list(root.named_children()):
        if isinstance(child, nn.Linear):
            setattr(root, name, QuantizedLinear(child, mode, group_size))
            n += 1
        else:
            n += _replace_linears(child, mode, group_size)
    return n


def quantize_talker(talker: nn.Module, mode: str, group_size: int = DEFAULT_GROUP) -> int:
    """Swap the talker's and code predictor's linear layers for ``mode`` weights in place.
    Returns how many layers were swapped. The text projection (prompt only) stays as loaded."""
    check_supported(mode, next(talker.parameters()).device)
    if mode not in QUANTIZED:
        return 0
    n = _fuse_projections(talker, mode, group_size)
    n += _replace_linears(talker.model, mode, group_size)
    n += _replace_linears(talker.code_predictor, mode, group_size)
    talker.codec_head = QuantizedLinear(talker.codec_head, mode, group_size)
    return n + 1


def quantize_codec(code2wav: nn.Module, mode: str, group_size: int = DEFAULT_GROUP) -> int:
    """Swap the linear layers of the codec decoder (its transformer) in place."""
    check_supported(mode, next(code2wav.parameters()).device)
    return _replace_linears(code2wav, mode, group_size) if mode in QUANTIZED else 0


def weight_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers (what a decode step reads at most)."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
