"""The kernels the codec stage decodes with, and the bit-exact comparison its checks use: on a
CPU (bf16 or fp32) the weights packed once for oneDNN and the CPU runtime's one-pass Snake
(``stage_kernels``); a client decoding on the same kind of CPU with them gets the stage's
samples."""

from __future__ import annotations

import logging

import torch

from omni_stream.models.code2wav import Code2Wav

log = logging.getLogger(__name__)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (``torch.equal`` calls -0.0 and 0.0 equal and NaN unequal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


def stage_kernels(model: Code2Wav) -> Code2Wav:
    """``model`` set up to run as the codec stage runs it: on a CPU in bf16 or fp32, weights packed once
    and the runtime's one-pass Snake (the kernels whose output is the same bits at any chunk
    plan where oneDNN runs at ``onednn.DECODE_LEVEL``: ``pin_decode_isa`` before the process's
    first oneDNN call); unchanged elsewhere. A client decoding on the same kind of CPU with it
    gets the stage's samples."""
    model.pack(snake=snake_for(model))
    return model


def snake_for(model: Code2Wav):
    """The CPU runtime's one-pass SnakeBeta for a bf16 or fp32 model on CPU (None elsewhere, or
    when the runtime cannot be built here: torch's ops then run it). In fp32 it is about a tenth
    of a decode call on an AVX2 CPU, whose codec runs in fp32 (no bf16 arithmetic)."""
    p = model.pre_conv.conv.weight
    if p.device.type != "cpu" or p.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        from omni_stream.engine.cpu.abi import snake_kernel

        return snake_kernel()
    except Exception as e:  # no compiler, or a failed build: the torch ops are correct too
        log.warning("the CPU runtime's Snake kernel is unavailable (%s): using torch's ops", e)
        return None
