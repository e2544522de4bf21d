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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import msgspec

from omni_stream.config import LOW_BIT_WEIGHT_PATHS, NATIVE_ONLY_WEIGHT_PATHS, WEIGHT_PATHS, check_engine
from omni_stream.edge.derive import (FAITHFUL_DB, PATH_FIDELITY, SPLIT_MIN_CORES, bf16_native,
                                      derive_codec_dtype, derive_cpu_sets, derive_memory,
                                      derive_threads, derive_weight_path, native_kernel_level,
                                      priced_frame_s)
from omni_stream.edge.probe import CUDA_CLASSES, HardwareProfile
from omni_stream.engine.cpu import isa as cpu_isa

CLASS_DIR = Path(__file__).parent / "classes"
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("together", "split")
STAGES = ("talker", "cp", "codec")  # cpu_sets keys; 'cp' only with placement 'split'



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
            # the native runtime's kernels take fp32 activations; torch's low-bit ones bf16
            if self.dtype != "bfloat16" and self.engine != "native":
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




def derive(hw: HardwareProfile, inputs: Mapping[str, Any], *, model_bytes: int,
           kv_bytes_per_token: int, free_memory_bytes: int | None = None) -> dict[str, Any]:
    """The 'derived' layer. ``inputs`` are the other layers merged (user included), read for
    the knobs a derivation depends on; the caller applies calibration and user on top."""
    on_gpu = hw.hardware_class in CUDA_CLASSES and inputs.get("device_user") != "cpu"
    device = "cuda" if on_gpu else "cpu"
    bf16 = on_gpu or bf16_native(hw)
    # the native runtime where it has a vector kernel set (engine.cpu.isa: x86-64 with AVX2 +
    # FMA + F16C, ARM64) and could be built here (``native_unavailable``: why not)
    level = inputs.get("kernel_level") or native_kernel_level(hw)
    engine = ("native" if device == "cpu" and level != "scalar" and not inputs.get("compile")
              and not inputs.get("native_unavailable") else "torch")
    native = (inputs.get("engine_user") or engine) == "native"
    # vLLM runs the talker's weights as they are, in one process with its code predictor
    # on a CPU it is the reference path, fp32 unless asked (the native engine is the fast one):
    # its greedy codes are the torch engine's fp32 codes
    vllm = inputs.get("engine_user") == "vllm"
    dtype = "bfloat16" if bf16 and not (vllm and device == "cpu") else "float32"
    # a low-bit path the user names runs in bf16 on torch's kernels (models.quant); the native
    # runtime's take fp32 activations, so there the dtype stays the machine's (an AVX2 CPU
    # emulates bf16: its codec would be ~20x slower in bf16, code2wav_bench)
    if (device == "cpu" and not native and not vllm
            and inputs.get("weight_path_user") in LOW_BIT_WEIGHT_PATHS):
        dtype = "bfloat16"
    out: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "weight_path": ("bf16" if (inputs.get("dtype_user") or dtype) == "bfloat16" else "fp32")
        if vllm else derive_weight_path(hw, device, model_bytes=model_bytes,
                                        fidelity_first=bool(inputs.get("fidelity_first")),
                                        dtype_user=inputs.get("dtype_user"),
                                        bandwidth_gbs=inputs.get("bandwidth_gbs") if native else None,
                                        frame_bytes=inputs.get("frame_bytes"), native=native),
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
                  frame_bytes: Mapping[str, int] | None = None, kernel_level: str | None = None,
                  native_unavailable: str | None = None
                  ) -> tuple[DeployProfile, dict[str, str]]:
    """The effective profile and, per field, the layer its value came from.

    ``kernel_level``: the native runtime's kernel level here (default: ``hw``'s under
    ``OMNI_STREAM_CPU_ISA``, ``edge.derive.native_kernel_level``; 'scalar' derives the torch
    engine); ``native_unavailable``: why the native runtime cannot run here (its build failed),
    which derives the torch engine too.

    ``model_bytes`` (weights) and ``kv_bytes_per_token`` are priced at 2 bytes per element (bf16,
    as released); the profile scales them to its weight path and dtype. ``max_streams`` from
    the class file (or user) is a ceiling the KV budget may lower; a user ``max_streams`` is
    taken as-is. Unknown keys in ``user`` raise ValueError naming them."""
    if model_bytes < 0 or kv_bytes_per_token <= 0:
        raise ValueError("model_bytes must be >= 0 and kv_bytes_per_token > 0")
    user = dict(user or {})
    _check_keys(user, "user settings")
    if kernel_level is None:
        kernel_level = native_kernel_level(hw, cpu_isa.parse_cap(os.environ.get(cpu_isa.CAP_ENV)))
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
              "kernel_level": kernel_level, "native_unavailable": native_unavailable,
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
