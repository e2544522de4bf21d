"""How each knob of the deployment profile follows from the machine (``edge.adapt`` layers them):
the weight path priced by the measured read bandwidth (``priced_weight_path``,
``priced_frame_s``), the codec's dtype, threads and CPU sets per stage, and the memory for
weights and KV (how many streams fit). Pure functions of the probe's facts and the inputs."""

from __future__ import annotations

import math
from typing import Any, Mapping

from omni_stream.config import FRAME_S
from omni_stream.edge.probe import HardwareProfile
from omni_stream.engine.cpu import isa as cpu_isa
from omni_stream.scheduling.kv_budget import KVBudget, plan_slots

# Native bf16 matmul: x86 AVX512-BF16 / AMX, Arm BF16 (BFMMLA). Without it bf16 is emulated
# (slower than fp32) so the fidelity-first choice is fp32.
BF16_ISA = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# Up to this many physical cores, one intra-op thread per stage: on the 2-core build machine
# 1/1 had the best TTFA and no underruns, the naive 2/2 the worst (oversubscription):
# benchmarks/tts/results/cpu_thread_sweep.json.
SMALL_CPU_CORES = 4
# Low-bit weights: the native runtime's kernels (engine/cpu) run them wherever it runs (AVX-512,
# AVX2 and NEON kernel sets: engine.cpu.isa). torch's int8/int4 CPU kernels (models.quant)
# take bf16 activations, so on the torch engine they pay off where bf16 is native (x86
# AVX512-BF16/AMX). 0.6B talker + code predictor per frame on
# the 2-core build machine (benchmarks/tts/results/weight_path_bench.json), 1 / 2 threads:
# bf16 493 / 347 ms, int8 468 / 263 ms, int4 215 / 131 ms. Up to SMALL_CPU_CORES cores even
# int4 is short of real time, so speed comes first there (int4); bigger CPUs get int8, which
# keeps more fidelity (teacher-forced logits SNR vs bf16 28 dB vs 10 dB on random weights).
# Models smaller than LOWBIT_MIN_MODEL_BYTES are bound by per-op overhead, not weight bytes.
LOWBIT_ISA = frozenset({"avx512_bf16", "amx_bf16"})
LOWBIT_MIN_MODEL_BYTES = 512 << 20
# Weight paths priced by the measured read bandwidth (priced_weight_path), most faithful first
# (teacher-forced against fp32, benchmarks/tts/results/cpu_engine_bench.md). A frame's time is
# about its weight bytes over NATIVE_READ_EFFICIENCY of the bandwidth that torch.sum measures
# (the native kernels' frames read at 0.85-1.03x of it on 2 threads of the AMD EPYC, same
# benchmark; q8 up to 1.2x, q4 at 1 thread 0.8x); the talker and code
# predictor may take REALTIME_MODEL_SHARE of each 80 ms frame, the rest is the codec's share of
# the lent core, scheduling and the margin that keeps one stream at RTF <= 0.8.
# Ranked by the worst of the four figures of PATH_FIDELITY: mixed (22.7 dB) is ahead of int8
# (21.3: its per-row scales lose to heavy tails) and reads fewer bytes, so int8 is never priced
# in; it stays selectable.
NATIVE_PATHS_BY_FIDELITY = ("mixed", "int8", "int6", "int5", "int4")
# (engine, weight path): talker and code-predictor logits SNR (dB) from fp32, teacher-forced on
# the random 0.6B checkpoints, plain and with outlier channels (make-checkpoint --outliers):
# benchmarks/tts/results/cpu_engine_bench.md (the torch engine's rows: talker only, the run of
# that file before the code predictor was measured). Printed at start-up with the path.
PATH_FIDELITY = {
    ("native", "mixed"): dict(talker=25.9, cp=24.8, talker_outliers=24.0, cp_outliers=22.7),
    ("native", "int8"): dict(talker=27.5, cp=27.9, talker_outliers=21.3, cp_outliers=22.7),
    ("native", "int6"): dict(talker=21.2, cp=22.3, talker_outliers=17.9, cp_outliers=19.8),
    ("native", "int5"): dict(talker=14.8, cp=16.5, talker_outliers=11.8, cp_outliers=14.2),
    ("native", "int4"): dict(talker=9.5, cp=10.9, talker_outliers=6.2, cp_outliers=8.1),
    ("torch", "int8"): dict(talker=28.6),
    ("torch", "int4"): dict(talker=9.4),
}
FAITHFUL_DB = 20.0  # the floor of the default (talker and code-predictor logits, both checkpoints)
NATIVE_READ_EFFICIENCY = 1.0
REALTIME_MODEL_SHARE = 0.6
SPLIT_MIN_CORES = 8  # a separate code-predictor process pays off only with cores to spare
MAX_STAGE_THREADS = 8  # per-frame GEMMs are tiny (batch = streams); more threads only sync
# Memory usable for weights + KV when no free figure is given: the rest is the OS, activations,
# the shared-memory rings and allocator slack (CUDA context on a discrete GPU).
HOST_MEMORY_SHARE = 0.75
GPU_MEMORY_SHARE = 0.9
KV_HEADROOM = 0.9
# model_bytes / kv_bytes_per_token are priced at 2 bytes per element (bf16, the released dtype).
WEIGHT_SCALE = {"bf16": 1.0, "fp32": 2.0, "int8": 0.5, "mixed": 0.4, "int6": 0.41, "int5": 0.35,
                "int4": 0.28}
DTYPE_SCALE = {"bfloat16": 1.0, "float32": 2.0}
MiB = 1 << 20


def bf16_native(hw: HardwareProfile) -> bool:
    return bool(hw.isa & BF16_ISA)


def native_kernel_level(hw: HardwareProfile, cap: str | None = None) -> str:
    """The native runtime's kernel level on ``hw`` ('avx512' | 'avx2' | 'neon' | 'scalar':
    ``engine.cpu.isa.kernel_level`` of its ISA list and arch), lowered by ``cap``
    (``OMNI_STREAM_CPU_ISA``'s level) where that is one of ``hw``'s architecture's levels."""
    level = cpu_isa.kernel_level(hw.isa, hw.arch)
    if cap is not None and cap in cpu_isa.FAMILY_LEVELS[cpu_isa.family(hw.arch)]:
        level = cpu_isa.capped(level, cap, hw.arch)
    return level


def native_kernels(hw: HardwareProfile, cap: str | None = None) -> str:
    """What the native runtime built for ``hw`` would report (``oc_isa()``), e.g.
    'avx2+fma+f16c', 'neon+dotprod+i8mm': the prediction for a machine that is not this one."""
    return cpu_isa.kernel_name(native_kernel_level(hw, cap), hw.isa)


def native_engine_runs(hw: HardwareProfile, cap: str | None = None) -> bool:
    """Whether the profile picks the native engine on ``hw``'s CPU: every x86-64 with
    AVX2 + FMA + F16C and every ARM64 (NEON); torch's kernels elsewhere."""
    return cpu_isa.native_engine_runs(native_kernel_level(hw, cap))


def _ordered_cpus(hw: HardwareProfile) -> list[int]:
    return [c for ids, _ in hw.clusters for c in ids]  # big cluster first


def priced_weight_path(frame_bytes: Mapping[str, int], bandwidth_gbs: float) -> str:
    """The most faithful native weight path whose frame fits the real-time budget at this read
    bandwidth: a frame reads ``frame_bytes[path]`` (``engine.cpu.plans.frame_weight_bytes``)
    at ``NATIVE_READ_EFFICIENCY`` of the measured bandwidth and may take
    ``REALTIME_MODEL_SHARE`` of its 80 ms; the fastest path (int4) when none fits."""
    budget_s = REALTIME_MODEL_SHARE * FRAME_S
    for wp in NATIVE_PATHS_BY_FIDELITY:
        if wp in frame_bytes and frame_bytes[wp] / (bandwidth_gbs * 1e9 * NATIVE_READ_EFFICIENCY) <= budget_s:
            return wp
    return NATIVE_PATHS_BY_FIDELITY[-1]


def priced_frame_s(reads, dram_gbs: float, kernel_gbs: Mapping[str, float] | None = None,
                   reread_gbs: float | None = None) -> float:
    """Seconds a frame of ``reads`` (``engine.cpu.plans.FrameReads``) takes where each product
    goes at the lower of where its weights come from and its kernel's own rate: the talker's
    and the code predictor's first sub-step from memory (``dram_gbs`` x
    ``NATIVE_READ_EFFICIENCY``), the other sub-steps re-read the code predictor at
    ``reread_gbs`` (the read bandwidth measured over a buffer of its size: the cache's where it
    fits, memory's where not). ``kernel_gbs``: each weight kind's measured cache-resident rate
    (``engine.cpu.plans.kernel_read_gbs``); missing kinds and None are unbounded, and without
    ``reread_gbs`` a re-read costs what a first read does: then this is bytes over bandwidth,
    the pricing of a machine nothing was measured on."""
    mem = dram_gbs * 1e9 * NATIVE_READ_EFFICIENCY
    again = mem if not reread_gbs else max(reread_gbs * 1e9, mem)

    def cost(by_kind: Mapping[str, int], source: float) -> float:
        return sum(b / min(source, (kernel_gbs or {}).get(k, math.inf) * 1e9)
                   for k, b in by_kind.items())

    return (cost(reads.talker, mem) + cost(reads.cp, mem)
            + (reads.sub_steps - 1) * cost(reads.cp, again))


def derive_weight_path(hw: HardwareProfile, device: str, *, model_bytes: int,
                       fidelity_first: bool = False, dtype_user: str | None = None,
                       bandwidth_gbs: float | None = None,
                       frame_bytes: Mapping[str, int] | None = None,
                       native: bool = False) -> str:
    """Low-bit weights where their kernels run natively and the model is big enough to be bound
    by weight bytes; unless fidelity comes first (or the user asked for fp32 compute), in which
    case the exact weights of the compute dtype. ``native``: the native runtime runs the step,
    whose low-bit kernels run on every kernel set; with the machine's measured read bandwidth
    priced by bytes per frame (``priced_weight_path``: the most faithful path that is real time
    here). Without a measurement, and on the torch engine where bf16 is native (``LOWBIT_ISA``),
    int4 on small CPUs (<= SMALL_CPU_CORES cores, where speed is what is missing) and int8 on
    bigger ones."""
    bf16 = device == "cuda" or bf16_native(hw)
    exact = "bf16" if bf16 and dtype_user != "float32" else "fp32"
    if (device == "cpu" and not fidelity_first and dtype_user != "float32"
            and (native or hw.isa & LOWBIT_ISA) and model_bytes >= LOWBIT_MIN_MODEL_BYTES):
        if native and bandwidth_gbs and bandwidth_gbs > 0 and frame_bytes:
            return priced_weight_path(frame_bytes, bandwidth_gbs)
        return "int4" if hw.physical_cores <= SMALL_CPU_CORES else "int8"
    return exact


def derive_codec_dtype(device: str, dtype: str, *, fidelity_first: bool = False) -> str:
    """Code2Wav's dtype. fp32 on GPUs, where an exact decode costs little beside the language
    models (benchmarks/tts/results/code2wav_precision_cuda.json), and wherever fidelity comes
    first or the models run in fp32; elsewhere the models' dtype: a CPU's bf16 decode is about
    half the fp32 one's cost per frame, which a small machine cannot spare
    (code2wav_precision.json)."""
    if device == "cuda" or fidelity_first:
        return "float32"
    return dtype


def derive_threads(hw: HardwareProfile, device: str, placement: str) -> dict[str, int]:
    """Intra-op threads per stage from physical cores (see the constants for the evidence)."""
    cores = hw.physical_cores
    if device == "cuda" or cores <= SMALL_CPU_CORES:
        return {"talker_threads": 1, "codec_threads": 1, "cp_threads": 1}
    per_core = max(1, hw.logical_cpus // cores)
    codec = max(1, cores // 4)
    model = cores - codec  # talker (+ code predictor): ~90% of a frame's CPU time
    if len(hw.clusters) > 1:  # big.LITTLE: the model stages take the big cluster
        model = max(1, len(hw.big_cores) // per_core)
        codec = max(1, min(cores - model, codec))
    if placement == "split":
        talker = max(1, (model + 1) // 2)
        cp = max(1, model - talker)
    else:
        talker, cp = model, 1
    cap = MAX_STAGE_THREADS
    return {"talker_threads": min(talker, cap), "codec_threads": min(codec, cap),
            "cp_threads": min(cp, cap)}


def derive_cpu_sets(hw: HardwareProfile, threads: Mapping[str, int],
                    placement: str) -> dict[str, tuple[int, ...]]:
    """Disjoint CPU ids per stage, handed out big cluster first in the order talker, cp, codec
    (SMT siblings included: ``threads x logical/physical`` CPUs each). Empty when the stages do
    not fit side by side, i.e. no pinning rather than pinning two stages onto one CPU."""
    per_core = max(1, hw.logical_cpus // hw.physical_cores)
    stages = ("talker", "cp", "codec") if placement == "split" else ("talker", "codec")
    want = {s: threads[f"{s}_threads"] * per_core for s in stages}
    cpus = _ordered_cpus(hw)
    if sum(want.values()) > len(cpus):
        return {}
    out, i = {}, 0
    for s in stages:
        out[s] = tuple(cpus[i:i + want[s]])
        i += want[s]
    return out


def derive_memory(hw: HardwareProfile, *, device: str, weight_path: str, dtype: str,
                  model_bytes: int, kv_bytes_per_token: int, max_seq_len: int,
                  max_streams_cap: int, kv_budget_mb: float | None,
                  free_memory_bytes: int | None = None) -> dict[str, Any]:
    """KV budget (MiB) and max streams: memory minus the weights, times the headroom, capped at
    what ``max_streams_cap`` slots of ``max_seq_len`` positions can use; streams = the slots
    ``plan_slots`` fits (at least 1: admission still guards each stream's bytes)."""
    per_token = max(1, int(kv_bytes_per_token * DTYPE_SCALE[dtype]))
    if kv_budget_mb is not None:  # an explicit figure (user): taken as-is
        budget = KVBudget(total_bytes=int(kv_budget_mb * MiB), bytes_per_token=per_token,
                          headroom=1.0, source="setting")
    else:
        if free_memory_bytes is not None:
            mem = int(free_memory_bytes)
        elif device == "cuda" and hw.cuda is not None and not hw.cuda["unified_memory"]:
            mem = int(hw.cuda["total_memory_gb"] * GPU_MEMORY_SHARE * (1 << 30))
        else:  # CPU, or Jetson's unified memory shared with the OS
            mem = int(hw.ram_gb * HOST_MEMORY_SHARE * (1 << 30))
        weights = int(model_bytes * WEIGHT_SCALE[weight_path])
        budget = KVBudget(total_bytes=max(0, mem - weights), bytes_per_token=per_token,
                          headroom=KV_HEADROOM, source="free memory - weights")
    slots = plan_slots(budget, max_seq_len, max_slots=max_streams_cap)
    if kv_budget_mb is None:
        needed = max(1, slots) * per_token * max_seq_len
        kv_budget_mb = round(max(1.0, min(budget.usable_bytes, needed) / MiB), 1)
    return {"max_streams": max(1, slots), "kv_budget_mb": kv_budget_mb}
