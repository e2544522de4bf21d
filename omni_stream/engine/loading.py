"""A checkpoint loaded for the engine: exact weights, then the chosen weight path on top."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from omni_stream.checkpoints import io
from omni_stream.checkpoints.io import LoadedModel
from omni_stream.config import check_engine
from omni_stream.engine import quant
from omni_stream.engine.cpu.plans import WeightPlan

# The CPU runtime's weight plan (kind of every product) for each weight path. "mixed" spends
# the bytes where the teacher-forced error comes from. Measured on random 0.6B weights, one
# tensor class or third of the layers at a time at 4 bits, the rest exact (logits SNR of the
# stack: benchmarks/tts/results/weight_sensitivity.md): talker q|k|v 14.0 dB, o 13.6, gate|up
# 17.7, down 21.1, first third of the layers 10.7, second 19.2, last 21.2, codec head 21.2 (3 M
# weights); code predictor q|k|v 14.4, o 15.9, gate|up 19.4, down 22.4, thirds 12.4 / 18.2 /
# 23.5, heads 21.3. Per weight the attention products, the early layers and the heads weigh
# 5-10x the later MLPs, so they get 2-3 more bits: 8 for the first third of every stack and the
# heads, 8 (talker) / 6 (code predictor, read 15 times a frame) for the attention, 5 for the
# rest. The 8-bit parts take q8g (per-group scale and offset), which keeps heavy-tailed rows
# ~8 dB closer than q8's per-row scale for 6 % more bytes.
NATIVE_PLANS = {
    "int4": WeightPlan("q4", "q4"), "int5": WeightPlan("q5", "q5"),
    "int6": WeightPlan("q6", "q6"), "int8": WeightPlan("q8", "q8"),
    "mixed": WeightPlan("q5", "q5", talker_attention="q8g", cp_attention="q6",
                        early=(1 / 3, "q8g"), talker_head="q8g", cp_head="q8g"),
    "bf16": WeightPlan("f32", "f32"), "fp32": WeightPlan("f32", "f32"),
    None: WeightPlan("f32", "f32")}


def load_on_weight_path(path: str | Path, dtype: torch.dtype = torch.float32,
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
    if engine == "vllm" and weight_path is not None:
        quant.check_supported(weight_path, device, engine)
    return load_on_weight_path(path, dtype, device, None if engine == "native" else weight_path)


def pack_cache_path(model_path: str | Path, weight_path: str | None) -> Path:
    """Where the native runtime keeps this checkpoint's packed weights between starts: keyed by
    the weight files (path, size, modification time), the weight path and the packing code."""
    from omni_stream.checkpoints.default import cache_dir
    from omni_stream.engine.cpu import native, packing

    root = Path(model_path).resolve()
    parts = [str(root), str(NATIVE_PLANS[weight_path].as_dict()), Path(packing.__file__).read_text(),
             Path(native.__file__).read_text()]
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return cache_dir() / "packed" / f"{key}.safetensors"


def attach_engine(frame_engine, engine: str, weight_path: str | None, threads: int, *,
                  lent_cpus: tuple[int, ...] = (), lease=None, model_path=None) -> None:
    """Switch a ``FrameEngine`` to the native runtime or to vLLM (no-op for the torch engine);
    ``lent_cpus``/``lease``: threads on another stage's cores (``engine.cpu.pool.Pool``);
    ``model_path``: keep the packed weights in the cache (``pack_cache_path``) so the next start
    loads them (native), the checkpoint vLLM reads the talker decoder from (vllm)."""
    if engine == "native":
        cache = pack_cache_path(model_path, weight_path) if model_path is not None else None
        frame_engine.use_native(plan=NATIVE_PLANS[weight_path], threads=threads, lent_cpus=lent_cpus,
                                lease=lease, pack_cache=cache)
    elif lent_cpus:
        raise ValueError("lent cores need the native engine")
    elif engine == "vllm":
        if model_path is None:
            raise ValueError("the vllm engine reads the talker's weights from the checkpoint "
                             "folder: pass model_path")
        frame_engine.use_vllm(model_path, threads)
