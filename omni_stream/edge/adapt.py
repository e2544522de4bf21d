"""The effective deployment profile: what to run with on this machine, and why.

Five layers, later ones win, and every field remembers which layer set it:

    default        model defaults (``DEFAULTS``: the ``omni-stream serve`` defaults)
    class:<name>   ``edge/classes/<hardware_class>.json`` (per-class baseline, with a comment)
    derived        computed from the probe's facts (dtype, threads, placement, KV, streams ...)
    calibration    the cached chunk policy (first / steady chunk) that ``scheduling.calibrate``
                   measured for this deployment (``omni-stream serve`` / ``profile`` load it)
    user           explicit flags

Derived values that depend on other knobs (max streams on ``max_seq_len`` and the KV budget,
threads and CPU sets on the placement) are computed from the *final* values of those knobs, so
``--placement split`` from the user still gets split-aware threads and CPU sets.

The probe (``edge.probe``) only states facts; every decision lives here, as pure functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import msgspec

from omni_stream.config import LOW_BIT_WEIGHT_PATHS, NATIVE_ONLY_WEIGHT_PATHS, WEIGHT_PATHS, check_engine
from omni_stream.edge.probe import CUDA_CLASSES, HardwareProfile
from omni_stream.scheduling.kv_budget import KVBudget, plan_slots

CLASS_DIR = Path(__file__).parent / "classes"
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("together", "split")
STAGES = ("talker", "cp", "codec")  # cpu_sets keys; 'cp' only with placement 'split'

# Native bf16 matmul: x86 AVX512-BF16 / AMX, Arm BF16 (BFMMLA). Without it bf16 is emulated
# (slower than fp32) so the fidelity-first choice is fp32.
BF16_ISA = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# Up to this many physical cores, one intra-op thread per stage: on the 2-core build machine
# 1/1 had the best TTFA and no underruns, the naive 2/2 the worst (oversubscription):
# benchmarks/tts/results/cpu_thread_sweep.json.
SMALL_CPU_CORES = 4
# Low-bit weights (models.quant): torch's int8/int4 CPU kernels take bf16 activations, so they
# pay off where bf16 is native (x86 AVX512-BF16/AMX). 0.6B talker + code predictor per frame on
# the 2-core build machine (benchmarks/tts/results/weight_path_bench.json), 1 / 2 threads:
# bf16 493 / 347 ms, int8 468 / 263 ms, int4 215 / 131 ms. Up to SMALL_CPU_CORES cores even
# int4 is short of real time, so speed comes first there (int4); bigger CPUs get int8, which
# keeps more fidelity (teacher-forced logits SNR vs bf16 28 dB vs 10 dB on random weights).
# Models smaller than LOWBIT_MIN_MODEL_BYTES are bound by per-op overhead, not weight bytes.
LOWBIT_ISA = frozenset({"avx512_bf16", "amx_bf16"})
# the native CPU runtime's fast kernels (engine/cpu): AVX-512 with VNNI dot products and F16C
NATIVE_ISA = frozenset({"avx512f", "avx512bw", "avx512_vnni", "f16c"})
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
FRAME_S = 0.08
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


@dataclass(frozen=True)
class DeployProfile:
    """Everything ``omni-stream serve`` needs to run well here. ``kv_budget_mb`` None means
    'size the KV cache from free memory at start-up'; ``cpu_sets`` empty means 'no pinning'."""

    dtype: str = "float32"
    # Code2Wav's dtype; None: the same as ``dtype``. Apart from the language models' because its
    # precision is what the listener hears and what client-side decoders must match: fp32 is
    # exact, bf16 ~28-30 dB from it (benchmarks/tts/results/code2wav_precision*.json)
    codec_dtype: str | None = None
    weight_path: str = "fp32"
    fidelity_first: bool = False  # keep exact (bf16/fp32) weights even where int8 is faster
    device: str = "cpu"
    max_streams: int = 4
    max_seq_len: int = 2048
    kv_budget_mb: float | None = None
    talker_threads: int = 1
    codec_threads: int = 1
    cp_threads: int = 1
    placement: str = "together"
    cpu_sets: dict[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    cuda_graphs: bool = False
    compile: bool = False
    engine: str = "torch"  # what runs the decode step: torch ops or the native CPU runtime
    # the codec stage lends its cores to the talker's native runtime while it is not decoding
    lend_cores: bool = False
    first_chunk: int = 1
    steady_chunk: int = 8
    queue_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_engine(self.engine, self.device, self.compile)
        for name, valid in (("dtype", DTYPES), ("weight_path", WEIGHT_PATHS),
                            ("device", DEVICES), ("placement", PLACEMENTS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {', '.join(valid)}; "
                                 f"got {getattr(self, name)!r}")
        for name in ("max_streams", "max_seq_len", "talker_threads", "codec_threads",
                     "cp_threads", "first_chunk", "steady_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.codec_dtype is not None and self.codec_dtype not in DTYPES:
            raise ValueError(f"codec_dtype must be null or one of {', '.join(DTYPES)}; "
                             f"got {self.codec_dtype!r}")
        if self.steady_chunk < self.first_chunk:
            raise ValueError(f"steady_chunk ({self.steady_chunk}) must be >= first_chunk "
                             f"({self.first_chunk})")
        for name in ("cuda_graphs", "compile", "fidelity_first", "lend_cores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError("cuda_graphs needs device 'cuda'; set cuda_graphs false on CPU")
        if self.cuda_graphs and self.placement != "together":
            raise ValueError("cuda_graphs needs placement 'together' (the split code predictor "
                             "runs outside the graph); set cuda_graphs false")
        if self.device == "cpu" and self.dtype == "float32" and self.weight_path == "bf16":
            raise ValueError("weight_path 'bf16' needs dtype 'bfloat16'; use weight_path 'fp32'")
        if self.weight_path in LOW_BIT_WEIGHT_PATHS:
            if self.device != "cpu":
                raise ValueError(f"weight_path {self.weight_path!r} is a CPU path; on "
                                 f"{self.device} use weight_path 'bf16'")
            if self.dtype != "bfloat16":
                raise ValueError(f"weight_path {self.weight_path!r} computes in bf16: set dtype "
                                 "'bfloat16' (or weight_path 'fp32')")
        if self.engine == "vllm" and self.weight_path not in (None, "fp32", "bf16"):
            raise ValueError(f"weight_path {self.weight_path!r} is not a vLLM path: engine "
                             "'vllm' runs the weights as they are (weight_path 'fp32' or 'bf16')")
        if self.weight_path in NATIVE_ONLY_WEIGHT_PATHS and self.engine != "native":
            raise ValueError(f"weight_path {self.weight_path!r} runs on the native CPU runtime "
                             "only: set engine 'native' (or weight_path 'int8' / 'int4')")
        if not _is_number(self.queue_timeout_s) or self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s!r}")
        if self.kv_budget_mb is not None and (not _is_number(self.kv_budget_mb)
                                              or self.kv_budget_mb <= 0):
            raise ValueError(f"kv_budget_mb must be null or > 0, got {self.kv_budget_mb!r}")
        object.__setattr__(self, "cpu_sets", _normalise_cpu_sets(self.cpu_sets, self.placement))
        if self.lend_cores:
            why = lend_cores_blocker(self.engine, self.placement, self.cpu_sets)
            if why:
                raise ValueError(f"lend_cores {why}; set lend_cores false")


FIELDS = tuple(f.name for f in dataclasses.fields(DeployProfile))
DEFAULTS: dict[str, Any] = {f.name: (f.default_factory() if f.default_factory
                                     is not dataclasses.MISSING else f.default)
                            for f in dataclasses.fields(DeployProfile)}
# Calibration may only set the chunk policy; ChunkPolicy's own names are accepted too.
CALIBRATION_KEYS = {"first_chunk": "first_chunk", "steady_chunk": "steady_chunk",
                    "first": "first_chunk", "steady": "steady_chunk"}
CHUNK_POLICY_ONLY = frozenset({"growth", "min_slack_s", "audio_frame_s", "hold_s",
                               "first_requested"})  # not profile fields


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def lend_cores_blocker(engine: str, placement: str, cpu_sets: Mapping[str, Any]) -> str | None:
    """Why the codec stage cannot lend its cores to the talker here (None: it can). Lending
    needs the native runtime (its pool runs the borrowed threads), the code predictor in the
    talker's process, and the two stages pinned to their own CPUs (the lent threads are
    pinned to the codec's)."""
    if engine != "native":
        return "needs engine 'native' (its thread pool borrows the codec's cores)"
    if placement != "together":
        return "needs placement 'together'"
    if not cpu_sets.get("talker") or not cpu_sets.get("codec"):
        return "needs cpu_sets for the talker and the codec stages"
    return None


def _normalise_cpu_sets(sets: Any, placement: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(sets, Mapping):
        raise ValueError(f"cpu_sets must map stage -> list of cpu ids, got {sets!r}")
    bad = sorted(set(sets) - set(STAGES))
    if bad:
        raise ValueError(f"cpu_sets: unknown stage(s) {bad}; valid: {', '.join(STAGES)}")
    if "cp" in sets and placement != "split":
        raise ValueError("cpu_sets['cp'] needs placement 'split' (the code predictor runs in "
                         "the talker process otherwise)")
    out: dict[str, tuple[int, ...]] = {}
    for stage in STAGES:
        if stage in sets:
            try:
                ids = tuple(int(c) for c in sets[stage])
            except (TypeError, ValueError) as e:
                raise ValueError(f"cpu_sets[{stage!r}] must be a list of cpu ids") from e
            if not ids or min(ids) < 0:
                raise ValueError(f"cpu_sets[{stage!r}] must be non-empty cpu ids >= 0: {ids}")
            out[stage] = ids
    seen = [c for ids in out.values() for c in ids]
    if len(seen) != len(set(seen)):
        raise ValueError(f"cpu_sets must be disjoint across stages, got {out}")
    return out


# ---------------------------------------------------------------- layers


def load_class_file(hardware_class: str, class_dir: str | Path | None = None) -> dict[str, Any]:
    """``<class_dir>/<hardware_class>.json``'s ``values``, keys checked against the profile."""
    path = Path(class_dir or CLASS_DIR) / f"{hardware_class}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"no class file for {hardware_class!r}: add {path}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from e
    if not isinstance(data, dict) or not isinstance(data.get("values"), dict):
        raise ValueError(f"{path} must be an object with 'comment' and 'values'")
    _check_keys(data["values"], f"class file {path}")
    return dict(data["values"])


def _check_keys(values: Mapping[str, Any], what: str) -> None:
    bad = sorted(set(values) - set(FIELDS))
    if bad:
        raise ValueError(f"{what}: unknown key(s) {', '.join(map(repr, bad))}; "
                         f"valid: {', '.join(FIELDS)}")


def calibration_values(calibration: Any) -> dict[str, Any]:
    """The calibration layer: ``first_chunk`` / ``steady_chunk`` of a ChunkPolicy (or a dict
    with those keys or ChunkPolicy's names); the policy's other fields are not profile fields."""
    if calibration is None:
        return {}
    if isinstance(calibration, msgspec.Struct):  # a scheduling.ChunkPolicy
        calibration = msgspec.structs.asdict(calibration)
    if not isinstance(calibration, Mapping):
        raise ValueError(f"calibration must be a dict or a ChunkPolicy, got {calibration!r}")
    bad = sorted(set(calibration) - set(CALIBRATION_KEYS) - CHUNK_POLICY_ONLY)
    if bad:
        raise ValueError(f"calibration: unknown key(s) {', '.join(map(repr, bad))}; "
                         f"valid: {', '.join(CALIBRATION_KEYS)}")
    return {CALIBRATION_KEYS[k]: v for k, v in calibration.items() if k in CALIBRATION_KEYS}


def _bf16_native(hw: HardwareProfile) -> bool:
    return bool(hw.isa & BF16_ISA)


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
                       frame_bytes: Mapping[str, int] | None = None) -> str:
    """Low-bit weights where their kernels run natively and the model is big enough to be bound
    by weight bytes; unless fidelity comes first (or the user asked for fp32 compute), in which
    case the exact weights of the compute dtype. With the native runtime's kernels and the
    machine's measured read bandwidth, priced by bytes per frame (``priced_weight_path``: the
    most faithful path that is real time here); without a measurement, int4 on small CPUs
    (<= SMALL_CPU_CORES cores, where speed is what is missing) and int8 on bigger ones."""
    bf16 = device == "cuda" or _bf16_native(hw)
    exact = "bf16" if bf16 and dtype_user != "float32" else "fp32"
    if (device == "cpu" and not fidelity_first and dtype_user != "float32"
            and hw.isa & LOWBIT_ISA and model_bytes >= LOWBIT_MIN_MODEL_BYTES):
        if NATIVE_ISA <= hw.isa and bandwidth_gbs and bandwidth_gbs > 0 and frame_bytes:
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


def derive(hw: HardwareProfile, inputs: Mapping[str, Any], *, model_bytes: int,
           kv_bytes_per_token: int, free_memory_bytes: int | None = None) -> dict[str, Any]:
    """The 'derived' layer. ``inputs`` are the other layers merged (user included), read for
    the knobs a derivation depends on; the caller applies calibration and user on top."""
    on_gpu = hw.hardware_class in CUDA_CLASSES and inputs.get("device_user") != "cpu"
    device = "cuda" if on_gpu else "cpu"
    bf16 = on_gpu or _bf16_native(hw)
    engine = ("native" if device == "cpu" and NATIVE_ISA <= hw.isa
              and not inputs.get("compile") else "torch")
    native = (inputs.get("engine_user") or engine) == "native"
    # vLLM runs the talker's weights as they are, in one process with its code predictor
    # on a CPU it is the reference path, fp32 unless asked (the native engine is the fast one):
    # its greedy codes are the torch engine's fp32 codes
    vllm = inputs.get("engine_user") == "vllm"
    dtype = "bfloat16" if bf16 and not (vllm and device == "cpu") else "float32"
    out: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "weight_path": ("bf16" if (inputs.get("dtype_user") or dtype) == "bfloat16" else "fp32")
        if vllm else derive_weight_path(hw, device, model_bytes=model_bytes,
                                        fidelity_first=bool(inputs.get("fidelity_first")),
                                        dtype_user=inputs.get("dtype_user"),
                                        bandwidth_gbs=inputs.get("bandwidth_gbs") if native else None,
                                        frame_bytes=inputs.get("frame_bytes")),
        "codec_dtype": derive_codec_dtype(device, inputs.get("dtype_user") or dtype,
                                          fidelity_first=bool(inputs.get("fidelity_first"))),
        "placement": "split" if device == "cpu" and hw.physical_cores >= SPLIT_MIN_CORES
        and not vllm else "together",
        "engine": engine,
    }
    placement = inputs.get("placement_user") or out["placement"]
    # the talker stage graphs the step (vLLM's step runs eagerly)
    out["cuda_graphs"] = on_gpu and placement == "together" and not vllm
    threads = derive_threads(hw, device, placement)
    out.update(threads)
    out["cpu_sets"] = derive_cpu_sets(hw, {**threads, **inputs.get("threads_user", {})},
                                      placement)
    # The language models are bound by one core's memory bandwidth, Code2Wav by compute: the
    # codec's cores run the talker runtime's extra threads whenever Code2Wav is idle. Measured
    # on a 2-core EPYC, alternating runs (benchmarks/tts/results/core_lending.json).
    out["lend_cores"] = lend_cores_blocker(
        inputs.get("engine_user") or out["engine"], placement,
        inputs.get("cpu_sets_user") or out["cpu_sets"]) is None
    out.update(derive_memory(
        hw, device=inputs.get("device_user") or device,
        weight_path=inputs.get("weight_path_user") or out["weight_path"],
        dtype=inputs.get("dtype_user") or dtype, model_bytes=model_bytes,
        kv_bytes_per_token=kv_bytes_per_token, max_seq_len=int(inputs["max_seq_len"]),
        max_streams_cap=int(inputs["max_streams"]), kv_budget_mb=inputs.get("kv_budget_mb_user"),
        free_memory_bytes=free_memory_bytes))
    return out


def build_profile(hw: HardwareProfile, *, model_bytes: int, kv_bytes_per_token: int,
                  calibration: Mapping[str, Any] | Any | None = None,
                  user: Mapping[str, Any] | None = None, class_dir: str | Path | None = None,
                  free_memory_bytes: int | None = None, bandwidth_gbs: float | None = None,
                  frame_bytes: Mapping[str, int] | None = None
                  ) -> tuple[DeployProfile, dict[str, str]]:
    """The effective profile and, per field, the layer its value came from.

    ``model_bytes`` (weights) and ``kv_bytes_per_token`` are priced at 2 bytes per element (bf16,
    as released); the profile scales them to its weight path and dtype. ``max_streams`` from
    the class file (or user) is a ceiling the KV budget may lower; a user ``max_streams`` is
    taken as-is. Unknown keys in ``user`` raise ValueError naming them."""
    if model_bytes < 0 or kv_bytes_per_token <= 0:
        raise ValueError("model_bytes must be >= 0 and kv_bytes_per_token > 0")
    user = dict(user or {})
    _check_keys(user, "user settings")
    values: dict[str, Any] = dict(DEFAULTS)
    sources = {k: "default" for k in FIELDS}
    layers: list[tuple[str, Mapping[str, Any]]] = [
        (f"class:{hw.hardware_class}", load_class_file(hw.hardware_class, class_dir))]
    pre = {**values, **layers[0][1], **user}
    inputs = {"max_seq_len": pre["max_seq_len"], "max_streams": pre["max_streams"],
              "placement_user": user.get("placement"), "device_user": user.get("device"),
              "dtype_user": user.get("dtype"), "weight_path_user": user.get("weight_path"),
              "fidelity_first": pre.get("fidelity_first", False), "compile": pre.get("compile"),
              "engine_user": user.get("engine"), "cpu_sets_user": user.get("cpu_sets"),
              "kv_budget_mb_user": user.get("kv_budget_mb"),
              "bandwidth_gbs": bandwidth_gbs, "frame_bytes": frame_bytes,
              "threads_user": {k: v for k, v in user.items() if k.endswith("_threads")}}
    layers.append(("derived", derive(hw, inputs, model_bytes=model_bytes,
                                     kv_bytes_per_token=kv_bytes_per_token,
                                     free_memory_bytes=free_memory_bytes)))
    layers.append(("calibration", calibration_values(calibration)))
    layers.append(("user", user))
    for name, layer in layers:
        for k, v in layer.items():
            values[k] = v
            sources[k] = name
    return DeployProfile(**values), sources


# ---------------------------------------------------------------- printing


def profile_to_dict(profile: DeployProfile) -> dict[str, Any]:
    """JSON-able dict (cpu_sets as lists); ``DeployProfile(**d)`` round-trips it."""
    d = dataclasses.asdict(profile)
    d["cpu_sets"] = {k: list(v) for k, v in profile.cpu_sets.items()}
    return d


def format_profile(profile: DeployProfile, sources: Mapping[str, str]) -> str:
    """A three-column table: field, value, source (the layer that set it)."""
    d = profile_to_dict(profile)
    rows = [("field", "value", "source")]
    for k in FIELDS:
        v = d[k]
        if k == "cpu_sets":
            v = " ".join(f"{s}={','.join(map(str, ids))}" for s, ids in v.items()) or "(none)"
        rows.append((k, "-" if v is None else str(v).lower() if isinstance(v, bool) else str(v),
                     sources.get(k, "?")))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    lines.insert(1, f"{'-' * w0}  {'-' * w1}  {'-' * max(len(r[2]) for r in rows)}")
    return "\n".join(lines + [f"note: {n}" for n in profile_notes(profile)])


def profile_notes(profile: DeployProfile) -> list[str]:
    """What a choice costs, where the profile trades fidelity for speed."""
    notes = []
    if (profile.codec_dtype or profile.dtype) == "bfloat16" and profile.device == "cpu":
        notes.append("Code2Wav decodes in bf16: its audio is ~28-30 dB from the fp32 decode of "
                     "the same codes (the same bits at any chunk plan where oneDNN runs its "
                     "AVX512-BF16 kernels: the codec stage pins that level and checks it at "
                     "start-up); mixed fp32/bf16 splits reach 35-39 dB at most of bf16's cost (benchmarks/tts/results/"
                     "code2wav_precision.json). An fp32 decode costs about twice bf16's per frame "
                     "on a CPU core. --codec-dtype fp32 for the exact decode (what client-side "
                     "decoders match) at that cost.")
    fid = PATH_FIDELITY.get((profile.engine, profile.weight_path))
    if fid is not None:
        def figs(tag: str) -> str:
            cp = fid.get("cp" + tag)
            return f"{fid['talker' + tag]:.0f}" + ("" if cp is None else f" / {cp:.0f}")

        outliers = f"; {figs('_outliers')} dB with outlier channels" if "talker_outliers" in fid else ""
        low = min(v for v in fid.values() if v is not None) < FAITHFUL_DB
        notes.append(
            f"weight_path {profile.weight_path} ({profile.engine} engine): talker"
            + (" / code-predictor" if fid.get("cp") is not None else "")
            + f" logits {figs('')} dB from fp32{outliers} (teacher-forced, random 0.6B weights: "
            "benchmarks/tts/results/cpu_engine_bench.md). "
            + (f"Below {FAITHFUL_DB:.0f} dB the codes part from the model's (words and voice "
               "change): the fastest path, the one picked where no more faithful one is real "
               "time at the machine's read bandwidth; --weight-path mixed (or int8) for "
               "fidelity at lower speed, --fidelity-first for exact weights. "
               if low else "")
            + "omni-stream fidelity --model DIR measures your checkpoint.")
    return notes


__all__ = [
    "CLASS_DIR", "DEFAULTS", "FIELDS", "DeployProfile", "build_profile", "derive",
    "calibration_values", "derive_cpu_sets", "derive_memory", "derive_threads",
    "derive_codec_dtype", "derive_weight_path", "priced_frame_s", "format_profile", "load_class_file", "profile_to_dict",
]
