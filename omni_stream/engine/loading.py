"""A checkpoint loaded for the engine: exact weights, then the chosen weight path on top."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from omni_stream.checkpoints import io
from omni_stream.checkpoints.io import LoadedModel
from omni_stream.config import check_engine
from omni_stream.engine import quant

# the CPU runtime's product kinds (talker, code predictor) for each weight path
NATIVE_KINDS = {"int4": ("q4", "q4"), "int8": ("q8", "q8"), "bf16": ("f32", "f32"),
                "fp32": ("f32", "f32"), None: ("f32", "f32")}


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", weight_path: str | None = None) -> LoadedModel:
    """Load a checkpoint folder strictly (``checkpoints.io.load_model``).

    ``weight_path`` int8/int4 packs the talker's and code predictor's linear weights for the CPU
    low-bit kernels (``engine.quant``); those paths compute in bf16, so ``dtype`` must be
    bfloat16. None/bf16/fp32 keep the weights in ``dtype``. Code2Wav stays in ``dtype``: it is
    compute-bound (no speed to gain) and its weights shape the waveform directly (int8 costs
    ~25 dB of SNR; benchmarks/tts/weight_path_bench.py)."""
    if weight_path is not None:
        quant.check_supported(weight_path, device)
        if weight_path in quant.QUANTIZED and dtype != torch.bfloat16:
            raise ValueError(f"weight path {weight_path} computes in bf16: load with dtype "
                             f"bfloat16 (--dtype bf16), not {str(dtype).replace('torch.', '')}")
    model = io.load_model(path, dtype, device)
    if weight_path in quant.QUANTIZED:
        quant.quantize_talker(model.weights.talker, weight_path)
    return model


def load_for_engine(path: str | Path, dtype: torch.dtype, device: str, weight_path: str | None,
                    engine: str) -> LoadedModel:
    """The checkpoint as ``engine`` wants it: the torch engine applies low-bit weight paths to
    the torch modules; the native engine packs its own from the exact weights."""
    check_engine(engine, device)
    return load_model(path, dtype, device, None if engine == "native" else weight_path)


def pack_cache_path(model_path: str | Path, weight_path: str | None) -> Path:
    """Where the native runtime keeps this checkpoint's packed weights between starts: keyed by
    the weight files (path, size, modification time), the weight path and the packing code."""
    from omni_stream.checkpoints.default import cache_dir
    from omni_stream.engine.cpu import native

    root = Path(model_path).resolve()
    parts = [str(root), str(NATIVE_KINDS[weight_path]), Path(native.__file__).read_text()]
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return cache_dir() / "packed" / f"{key}.safetensors"


def attach_engine(frame_engine, engine: str, weight_path: str | None, threads: int, *,
                  lent_cpus: tuple[int, ...] = (), lease=None, model_path=None) -> None:
    """Switch a ``FrameEngine`` to the native runtime (no-op for the torch engine);
    ``lent_cpus``/``lease``: threads on another stage's cores (``engine.cpu.native.Pool``);
    ``model_path``: keep the packed weights in the cache (``pack_cache_path``) so the next start
    loads them."""
    if engine == "native":
        cache = pack_cache_path(model_path, weight_path) if model_path is not None else None
        frame_engine.use_native(*NATIVE_KINDS[weight_path], threads=threads, lent_cpus=lent_cpus,
                                lease=lease, pack_cache=cache)
    elif lent_cpus:
        raise ValueError("lent cores need the native engine")
