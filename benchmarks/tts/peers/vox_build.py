"""vox-tts's own converter (``python -m vox build``) at the precisions compared.

vox reads a ``.tmod`` built from the released safetensors layout. Precision names here are the
benchmark's (8-bit, 4-bit, bf16, fp32); ``q4full`` puts every talker and code-predictor linear
in 4 bits (vox's ``q4`` keeps the code predictor and heads in 8 bits), as omni-stream's int4
and qwentts.cpp's Q4_K_M do. The codec stays f32 (vox's default).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["VOX_PRECISIONS", "vox_build_command"]

VOX_PRECISIONS = {  # precision: (--dtype, --quant)
    "8-bit": ("bf16", "q8"),
    "4-bit": ("bf16", "q4full"),
    "bf16": ("bf16", ""),
    "fp32": ("f32", ""),
}


def vox_build_command(python: str | Path, checkpoint: str | Path, out: str | Path,
                      precision: str) -> list[str]:
    """The command line that converts ``checkpoint`` to ``out`` (.tmod) at ``precision``."""
    if precision not in VOX_PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(VOX_PRECISIONS)}")
    dtype, quant = VOX_PRECISIONS[precision]
    cmd = [str(python), "-m", "vox", "build", "--model", str(checkpoint), "--dtype", dtype]
    if quant:
        cmd += ["--quant", quant]
    return cmd + ["--no-hash", "-o", str(out)]
