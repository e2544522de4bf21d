"""Effective deployment profile: fixture machines (tests/data/hw/) and emulated classes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from omni_stream.edge.adapt import (CLASS_DIR, DEFAULTS, FIELDS, DeployProfile, build_profile,
                                    format_profile, load_class_file, profile_to_dict)
from omni_stream.edge.probe import ENV_VAR, HARDWARE_CLASSES, load_profile, probe
from omni_stream.scheduling.chunking import ChunkPolicy

HW = Path(__file__).parent / "data" / "hw"
ORIN_TORCH = {"name": "Orin", "total_memory_gb": 7.44, "compute_capability": (8, 7),
              "integrated": True}
RTX_TORCH = {"name": "NVIDIA GeForce RTX 4090", "total_memory_gb": 23.99,
             "compute_capability": (8, 9), "integrated": False}
MODEL_BYTES = 1_800_000_000  # ~0.9B parameters at bf16
KV_PER_TOKEN = 28 * 8 * 128 * 2 * 2  # 28 layers x 8 kv heads x 128 x K,V x bf16


def _build(hw, **kw):
    return build_profile(hw, model_bytes=MODEL_BYTES, kv_bytes_per_token=KV_PER_TOKEN, **kw)


def _machine(name: str, torch_info=None):
    return probe(str(HW / name), torch_info)


def _env(override: dict) -> dict[str, str]:
    return {ENV_VAR: json.dumps(override)}


def test_two_core_build_machine_one_thread_per_stage_together_bf16_int8():
    p, src = _build(_machine("local_xeon_2c"))
    assert (p.talker_threads, p.codec_threads, p.cp_threads) == (1, 1, 1)
    assert p.placement == "together" and p.device == "cpu" and not p.cuda_graphs
    # the ISA has avx512_bf16 (bf16 compute, low-bit kernels), the model is 0.9B and the CPU
    # small: int4
    assert (p.dtype, p.weight_path) == ("bfloat16", "int4")
    assert p.cpu_sets == {"talker": (0,), "codec": (1,)}
    for k in ("talker_threads", "codec_threads", "placement", "dtype", "weight_path",
              "cpu_sets", "max_streams", "kv_budget_mb", "device"):
        assert src[k] == "derived", k
    assert src["max_seq_len"] == "class:x86_cpu" and src["steady_chunk"] == "class:x86_cpu"
    assert set(src) == set(FIELDS)


def test_cpu_without_native_bf16_stays_fp32():
    hw = load_profile(_env({"isa": ["avx", "avx2", "fma"]}), root=str(HW / "local_xeon_2c"),
                      use_torch=False)
    p, src = _build(hw)
    assert (p.dtype, p.weight_path) == ("float32", "fp32") and src["dtype"] == "derived"


def test_phone_big_cluster_first_and_split_on_eight_cores():
    p, src = _build(_machine("phone_biglittle"))
    assert p.placement == "split"
    assert p.cpu_sets["talker"] == (4, 5) and p.cpu_sets["cp"] == (6, 7)
    assert set(p.cpu_sets["codec"]) <= {0, 1, 2, 3}
    ordered = [c for s in ("talker", "cp", "codec") for c in p.cpu_sets[s]]
    assert ordered[:4] == [4, 5, 6, 7] and len(ordered) == len(set(ordered))
    assert src["cpu_sets"] == "derived" and src["max_seq_len"] == "class:arm64_cpu"


def test_npu_phone_class_file_applies():
    hw = load_profile(_env({"hardware_class": "npu_phone", "npu": "qnn-htp"}),
                      root=str(HW / "phone_biglittle"), use_torch=False)
    p, src = _build(hw)
    assert p.device == "cpu" and p.max_streams == 1 and src["max_streams"] == "derived"
    assert p.steady_chunk == 4 and src["steady_chunk"] == "class:npu_phone"
    assert p.cpu_sets["talker"][0] in hw.big_cores


def test_gpu_box_cuda_graphs_bf16_together():
    p, src = _build(_machine("desktop_rtx4090", RTX_TORCH))
    assert p.device == "cuda" and p.cuda_graphs and src["cuda_graphs"] == "derived"
    assert p.dtype == "bfloat16" and p.placement == "together"
    assert p.compile and src["compile"] == "class:cuda_discrete"
    assert p.max_streams == 32  # 24 GB fits the class ceiling


def test_cuda_graphs_only_where_the_talker_can_graph_the_step():
    """Graphs need the code predictor inside the talker's step: a user's split placement on a
    GPU turns the derived value off, and an explicit cuda_graphs with split is refused."""
    p, src = _build(_machine("desktop_rtx4090", RTX_TORCH), user={"placement": "split"})
    assert p.device == "cuda" and p.placement == "split"
    assert not p.cuda_graphs and src["cuda_graphs"] == "derived"
    with pytest.raises(ValueError, match="placement 'together'"):
        _build(_machine("desktop_rtx4090", RTX_TORCH),
               user={"placement": "split", "cuda_graphs": True})
    with pytest.raises(ValueError, match="cuda_graphs"):
        DeployProfile(device="cuda", dtype="bfloat16", weight_path="bf16", placement="split",
                      cuda_graphs=True)


def test_jetson_unified_memory_limits_streams():
    p, src = _build(_machine("jetson_orin_nano", ORIN_TORCH), user={"max_streams": 64})
    assert p.device == "cuda" and p.cuda_graphs and not p.compile
    assert p.max_streams == 64 and src["max_streams"] == "user"
    q, _ = _build(_machine("jetson_orin_nano", ORIN_TORCH))
    assert q.max_streams == 4
    # the budget, not the ceiling, binds when memory is short
    r, rs = _build(_machine("jetson_orin_nano", ORIN_TORCH), free_memory_bytes=MODEL_BYTES
                   + 2 * KV_PER_TOKEN * 2048)
    assert r.max_streams == 1 and rs["max_streams"] == "derived"


def test_emulated_gpu_class_via_env():
    hw = load_profile(_env({"hardware_class": "cuda_discrete", "cuda": {
        "name": "H100", "total_memory_gb": 80.0, "unified_memory": False,
        "compute_capability": [9, 0]}}), root=str(HW / "local_xeon_2c"), use_torch=False)
    p, _ = _build(hw)
    assert p.device == "cuda" and p.cuda_graphs and p.max_seq_len == 4096


def test_emulated_sixteen_core_x86_splits_and_scales_threads():
    hw = load_profile(_env({"physical_cores": 16}), root=str(HW / "local_xeon_2c"),
                      use_torch=False)
    p, _ = _build(hw)
    assert p.placement == "split"
    assert p.codec_threads == 4 and p.talker_threads + p.cp_threads == 12
    assert sum(len(v) for v in p.cpu_sets.values()) == 16


def test_calibration_then_user_win_and_are_marked():
    hw = _machine("local_xeon_2c")
    p, src = _build(hw, calibration={"first_chunk": 2, "steady_chunk": 10})
    assert (p.first_chunk, p.steady_chunk) == (2, 10)
    assert src["first_chunk"] == src["steady_chunk"] == "calibration"
    p, src = _build(hw, calibration=ChunkPolicy(first=3, steady=6),
                    user={"steady_chunk": 12, "talker_threads": 2, "dtype": "bfloat16",
                          "weight_path": "int4", "queue_timeout_s": 2.5})
    assert (p.first_chunk, p.steady_chunk) == (3, 12)
    assert src["first_chunk"] == "calibration" and src["steady_chunk"] == "user"
    assert (p.talker_threads, p.dtype, p.weight_path) == (2, "bfloat16", "int4")
    for k in ("steady_chunk", "talker_threads", "dtype", "weight_path", "queue_timeout_s"):
        assert src[k] == "user"


def test_user_overrides_every_field():
    hw = _machine("desktop_rtx4090", RTX_TORCH)
    user = {"dtype": "float32", "codec_dtype": "bfloat16", "weight_path": "fp32", "device": "cpu",
            "max_streams": 3,
            "max_seq_len": 512, "kv_budget_mb": 100.0, "talker_threads": 1, "codec_threads": 1,
            "cp_threads": 1, "placement": "split", "cpu_sets": {"talker": [0], "cp": [1],
                                                                "codec": [2, 3]},
            "cuda_graphs": False, "compile": False, "first_chunk": 2, "steady_chunk": 4,
            "queue_timeout_s": 1.0, "fidelity_first": True, "engine": "torch",
            "lend_cores": False}
    assert set(user) == set(FIELDS)
    p, src = _build(hw, calibration={"first_chunk": 5, "steady_chunk": 9}, user=user)
    assert set(src.values()) == {"user"}
    assert profile_to_dict(p) == {**user, "cpu_sets": {"talker": [0], "cp": [1],
                                                       "codec": [2, 3]}}


def test_derived_values_follow_user_inputs():
    hw = _machine("local_xeon_2c")
    p, src = _build(hw, user={"placement": "split"})
    assert p.placement == "split" and p.cpu_sets == {}  # 3 stages do not fit on 2 CPUs
    two_streams_mb = 2 * KV_PER_TOKEN * 2048 / 2**20  # bf16 KV on this machine
    p, src = _build(hw, user={"kv_budget_mb": two_streams_mb})
    assert p.max_streams == 2 and src["max_streams"] == "derived"
    assert p.kv_budget_mb == two_streams_mb and src["kv_budget_mb"] == "user"
    p, _ = _build(hw, user={"kv_budget_mb": two_streams_mb, "max_seq_len": 4096})
    assert p.max_streams == 1
    p, _ = _build(hw, user={"kv_budget_mb": two_streams_mb, "dtype": "float32",
                            "weight_path": "fp32"})
    assert p.max_streams == 1  # fp32 KV costs twice as much


def test_codec_dtype_exact_on_gpus_and_with_fidelity_first_else_the_models_dtype():
    """Code2Wav decodes in fp32 where that is cheap (a GPU) or asked for (fidelity first, fp32
    models), in the models' bf16 on a bf16 CPU; a user value wins; a bad one is refused."""
    cpu = _machine("local_xeon_2c")
    p, src = _build(cpu)
    assert (p.dtype, p.codec_dtype) == ("bfloat16", "bfloat16") and src["codec_dtype"] == "derived"
    p, _ = _build(cpu, user={"fidelity_first": True})
    assert p.codec_dtype == "float32"
    p, _ = _build(cpu, user={"dtype": "float32", "weight_path": "fp32"})
    assert p.codec_dtype == "float32"
    p, src = _build(cpu, user={"codec_dtype": "float32"})
    assert (p.dtype, p.codec_dtype) == ("bfloat16", "float32") and src["codec_dtype"] == "user"
    gpu, _ = _build(_machine("desktop_rtx4090", RTX_TORCH))
    assert (gpu.device, gpu.dtype, gpu.codec_dtype) == ("cuda", "bfloat16", "float32")
    p, _ = _build(_machine("desktop_rtx4090", RTX_TORCH), user={"codec_dtype": "bfloat16"})
    assert p.codec_dtype == "bfloat16"
    nobf16 = load_profile(_env({"isa": ["avx", "avx2", "fma"]}), root=str(HW / "local_xeon_2c"),
                          use_torch=False)
    assert _build(nobf16)[0].codec_dtype == "float32"
    for bad in ("float16", "fp32", "", 32):
        with pytest.raises(ValueError, match="codec_dtype"):
            DeployProfile(codec_dtype=bad)


def test_unknown_keys_raise_naming_them():
    hw = _machine("local_xeon_2c")
    with pytest.raises(ValueError, match="'threads'.*'turbo'|'turbo'.*'threads'"):
        _build(hw, user={"threads": 4, "turbo": True})
    with pytest.raises(ValueError, match="'bogus'"):
        _build(hw, calibration={"bogus": 1})
    with pytest.raises(ValueError, match="placement"):
        _build(hw, user={"placement": "scattered"})


def test_class_files_are_complete_and_valid(tmp_path):
    for cls in HARDWARE_CLASSES:
        data = json.loads((CLASS_DIR / f"{cls}.json").read_text())
        assert data["comment"].strip()
        values = load_class_file(cls)
        assert set(values) <= set(FIELDS)
        DeployProfile(**{**DEFAULTS, **values})  # valid on their own
    (tmp_path / "x86_cpu.json").write_text(json.dumps({"comment": "", "values": {"speed": 1}}))
    with pytest.raises(ValueError, match="'speed'"):
        _build(_machine("local_xeon_2c"), class_dir=tmp_path)


def test_format_profile_table_has_every_field_and_source():
    p, src = _build(_machine("phone_biglittle"), user={"first_chunk": 2})
    text = format_profile(p, src)
    lines = [line for line in text.splitlines() if not line.startswith("note: ")]
    assert lines[0].split() == ["field", "value", "source"] and len(lines) == 2 + len(FIELDS)
    row = next(line for line in lines if line.startswith("first_chunk"))
    assert row.split() == ["first_chunk", "2", "user"]
    assert "talker=4,5" in text
    assert DeployProfile(**profile_to_dict(p)) == p
    json.dumps(profile_to_dict(p))


def test_profile_notes_say_what_bf16_decoding_and_each_weight_path_cost():
    """A CPU profile decoding in bf16 says how far Code2Wav's audio is from fp32; a low-bit
    weight path prints its measured fidelity, and one below the faithful floor (int4) says
    what that costs and the fix; exact settings carry no note."""
    from omni_stream.edge.derive import FAITHFUL_DB, PATH_FIDELITY

    bf16 = format_profile(DeployProfile(dtype="bfloat16", weight_path="int4"), {})
    assert "Code2Wav decodes in bf16" in bf16 and "weight_path int4" in bf16
    assert "code2wav_precision.json" in bf16 and "--codec-dtype fp32" in bf16
    assert "note:" not in format_profile(DeployProfile(), {})
    # an fp32 decode beside bf16 language models carries no Code2Wav note
    exact_codec = format_profile(DeployProfile(dtype="bfloat16", codec_dtype="float32"), {})
    assert "Code2Wav" not in exact_codec
    for (engine, wp), fid in PATH_FIDELITY.items():
        text = format_profile(DeployProfile(dtype="bfloat16", weight_path=wp, engine=engine), {})
        assert f"weight_path {wp} ({engine} engine)" in text and f"{fid['talker']:.0f}" in text
        assert ("Below" in text) == (min(v for v in fid.values() if v is not None) < FAITHFUL_DB)
        assert "omni-stream fidelity" in text
    assert "Below" in format_profile(DeployProfile(dtype="bfloat16", weight_path="int4",
                                                   engine="native"), {})


def test_profile_validation():
    with pytest.raises(ValueError, match="disjoint"):
        DeployProfile(cpu_sets={"talker": [0, 1], "codec": [1]})
    with pytest.raises(ValueError, match="steady_chunk"):
        DeployProfile(first_chunk=4, steady_chunk=2)
    with pytest.raises(ValueError, match="cuda_graphs"):
        DeployProfile(device="cpu", cuda_graphs=True)


def test_weight_path_derivation_speed_first_and_fidelity_first():
    hw = _machine("local_xeon_2c")  # avx512_bf16 + amx: the low-bit kernels run natively
    p, src = _build(hw)
    assert p.weight_path == "int4" and src["weight_path"] == "derived"  # 2 cores: speed first
    big = load_profile(_env({"physical_cores": 16}), root=str(HW / "local_xeon_2c"),
                       use_torch=False)  # the same ISA on 16 cores: int8 keeps more fidelity
    assert _build(big)[0].weight_path == "int8"
    p, src = _build(hw, user={"fidelity_first": True})
    assert (p.dtype, p.weight_path) == ("bfloat16", "bf16") and src["weight_path"] == "derived"
    small, _ = build_profile(hw, model_bytes=50_000_000, kv_bytes_per_token=KV_PER_TOKEN)
    assert small.weight_path == "bf16"  # small models are op-bound: exact weights
    p, _ = _build(hw, user={"dtype": "float32"})
    assert p.weight_path == "fp32"  # fp32 compute asked for: no bf16 low-bit kernels
    no_bf16 = load_profile(_env({"isa": ["avx", "avx2", "fma", "avx512_vnni"]}),
                           root=str(HW / "local_xeon_2c"), use_torch=False)
    assert _build(no_bf16)[0].weight_path == "fp32"  # no F16C: no native kernels, torch's fp32
    # the native runtime runs low-bit weights on every kernel set: an ARM64 phone (NEON) of 8
    # cores gets int8, a 2-core AVX2 machine int4 (in fp32: no native bf16 there)
    phone, src = _build(_machine("phone_biglittle"))
    assert (phone.engine, phone.weight_path) == ("native", "int8") and src["weight_path"] == "derived"
    avx2 = load_profile(_env({"isa": ["avx", "avx2", "fma", "f16c"]}),
                        root=str(HW / "local_xeon_2c"), use_torch=False)
    p, _ = _build(avx2)
    assert (p.engine, p.dtype, p.weight_path) == ("native", "float32", "int4")
    # priced there as on AVX-512: the most faithful path real time at the bandwidth
    frame = {"mixed": 10**8, "int4": 5 * 10**7}
    assert _build(avx2, bandwidth_gbs=20.0, frame_bytes=frame)[0].weight_path == "mixed"
    assert _build(avx2, bandwidth_gbs=1.0, frame_bytes=frame)[0].weight_path == "int4"
    # the torch engine's low-bit kernels still need native bf16
    p, _ = _build(avx2, user={"engine": "torch"})
    assert (p.engine, p.weight_path) == ("torch", "fp32")
    assert _build(_machine("phone_biglittle"), user={"engine": "torch"})[0].weight_path == "bf16"
    gpu, _ = _build(_machine("desktop_rtx4090", RTX_TORCH))
    assert gpu.weight_path == "bf16"
    p, src = _build(hw, user={"weight_path": "int8"})
    assert p.weight_path == "int8" and src["weight_path"] == "user"


def test_low_bit_weight_paths_need_bf16_on_cpu():
    with pytest.raises(ValueError, match="computes in bf16"):
        DeployProfile(dtype="float32", weight_path="int8")
    # the native runtime's low-bit kernels take fp32 activations: any dtype
    assert DeployProfile(dtype="float32", weight_path="mixed", engine="native").weight_path == "mixed"
    with pytest.raises(ValueError, match="CPU path"):
        DeployProfile(dtype="bfloat16", weight_path="int4", device="cuda")
    with pytest.raises(ValueError, match="fidelity_first must be true or false"):
        DeployProfile(fidelity_first="yes")


def test_engine_is_native_on_avx2_and_arm64_cpus_and_refused_where_it_cannot_run():
    """The native CPU runtime wherever it has a vector kernel set (engine.cpu.isa: x86-64 with
    AVX2 + FMA + F16C, every ARM64), torch elsewhere, on GPUs, when torch.compile is asked for,
    at the scalar level and where the runtime cannot be built; a user's engine that cannot run
    is refused."""
    vnni = _machine("local_xeon_2c")
    assert {"avx512_vnni", "avx512f", "avx512bw", "f16c"} <= set(vnni.isa)
    p, src = _build(vnni)
    assert p.engine == "native" and src["engine"] == "derived"
    p, _ = _build(vnni, user={"compile": True})
    assert p.engine == "torch"
    p, src = _build(vnni, user={"engine": "torch"})
    assert p.engine == "torch" and src["engine"] == "user"
    # AVX-512 without VNNI runs the AVX2 set; AVX2 without F16C (or no AVX2) has none
    no_vnni = dataclasses.replace(vnni, isa=frozenset(vnni.isa) - {"avx512_vnni"})
    assert _build(no_vnni)[0].engine == "native"
    avx2 = dataclasses.replace(vnni, isa=frozenset({"avx", "avx2", "fma", "f16c"}))
    assert _build(avx2)[0].engine == "native"
    for isa in ({"avx", "avx2", "fma"}, {"avx"}, set()):
        assert _build(dataclasses.replace(vnni, isa=frozenset(isa)))[0].engine == "torch", isa
    # every ARM64 core has NEON: the phone and a plain ARMv8.0 board (no dotprod) alike
    assert _build(_machine("phone_biglittle"))[0].engine == "native"
    a53 = load_profile(_env({"hardware_class": "arm64_cpu", "arch": "aarch64",
                             "isa": ["asimd", "neon"]}),
                       root=str(HW / "phone_biglittle"), use_torch=False)
    assert _build(a53)[0].engine == "native"
    # another architecture (no kernel set): torch
    assert _build(dataclasses.replace(vnni, arch="riscv64", isa=frozenset()))[0].engine == "torch"
    # the scalar level (OMNI_STREAM_CPU_ISA=scalar) and a runtime that cannot be built: torch
    assert _build(vnni, kernel_level="scalar")[0].engine == "torch"
    assert _build(vnni, kernel_level="avx2")[0].engine == "native"
    p, src = _build(vnni, native_unavailable="no C++ compiler found")
    assert p.engine == "torch" and src["engine"] == "derived" and not p.lend_cores
    assert _build(_machine("desktop_rtx4090", RTX_TORCH))[0].engine == "torch"
    with pytest.raises(ValueError, match="engine 'native' is the CPU runtime"):
        DeployProfile(device="cuda", dtype="bfloat16", weight_path="bf16", engine="native")
    with pytest.raises(ValueError, match="drop --compile"):
        DeployProfile(engine="native", compile=True)
    with pytest.raises(ValueError, match="engine must be one of"):
        DeployProfile(engine="onnx")


def test_codec_lends_its_cores_where_the_native_runtime_can_borrow_them():
    """Derived on with the native engine, the code predictor in the talker's process and both
    stages pinned; off (not refused) when a user's choice rules it out; refused by name when
    asked for where it cannot work."""
    vnni = _machine("local_xeon_2c")
    p, src = _build(vnni)
    assert p.lend_cores and src["lend_cores"] == "derived"
    assert p.cpu_sets["talker"] and p.cpu_sets["codec"]
    for user in ({"engine": "torch"}, {"compile": True}, {"placement": "split"}):
        assert not _build(vnni, user=user)[0].lend_cores, user
    assert not _build(_machine("desktop_rtx4090", RTX_TORCH))[0].lend_cores
    p, src = _build(vnni, user={"lend_cores": False})
    assert not p.lend_cores and src["lend_cores"] == "user"
    with pytest.raises(ValueError, match="lend_cores needs placement 'together'"):
        _build(vnni, user={"placement": "split", "lend_cores": True})
    with pytest.raises(ValueError, match="lend_cores needs engine 'native'"):
        _build(vnni, user={"engine": "torch", "lend_cores": True})
    with pytest.raises(ValueError, match="lend_cores needs cpu_sets"):
        DeployProfile(engine="native", dtype="bfloat16", weight_path="int4", lend_cores=True)
    with pytest.raises(ValueError, match="lend_cores must be true or false"):
        DeployProfile(lend_cores="yes")
