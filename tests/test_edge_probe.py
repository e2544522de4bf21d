"""Hardware probe over recorded /proc + /sys trees (tests/data/hw/<machine>/), and the JSON override."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from omni_stream.edge.probe import (
    ENV_VAR, HARDWARE_CLASSES, HardwareProfile, load_profile, probe, profile_summary,
)

HW = Path(__file__).parent / "data" / "hw"

SPR_ISA = frozenset({"avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                     "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"})
ORIN_TORCH = {"name": "Orin", "total_memory_gb": 7.44, "compute_capability": (8, 7),
              "integrated": True}
RTX_TORCH = {"name": "NVIDIA GeForce RTX 4090", "total_memory_gb": 23.99,
             "compute_capability": (8, 9), "integrated": False}


def _root(machine: str) -> str:
    return str(HW / machine)


# ---------------------------------------------------------------- snapshots, one per machine


def test_local_xeon_2c_recorded_from_the_build_machine():
    # Real files of the 2-vCPU Sapphire Rapids VM these tests were written on: no cpufreq in
    # the VM, so one cluster of unknown (0 kHz) frequency.
    assert probe(_root("local_xeon_2c")) == HardwareProfile(
        hardware_class="x86_cpu", arch="x86_64", cpu_model="Intel(R) Xeon(R) Processor",
        physical_cores=2, logical_cpus=2, isa=SPR_ISA | {"gfni"}, clusters=(((0, 1), 0),), numa_nodes=1,
        ram_gb=23.54, cuda=None, npu=None, source="probe")


def test_two_socket_xeon_counts_cores_per_package_and_numa_nodes():
    # 2 sockets x 2 cores x 2 threads; core_id repeats across sockets, so only
    # (package, core_id) pairs give 4 physical cores.
    assert probe(_root("xeon_2s_spr")) == HardwareProfile(
        hardware_class="x86_cpu", arch="x86_64", cpu_model="Intel(R) Xeon(R) Platinum 8480+",
        physical_cores=4, logical_cpus=8, isa=SPR_ISA,
        clusters=(((0, 1, 2, 3, 4, 5, 6, 7), 3800000),), numa_nodes=2, ram_gb=503.5)


def test_arm_big_little_phone_orders_clusters_fastest_first():
    p = probe(_root("phone_biglittle"))
    assert p == HardwareProfile(
        hardware_class="arm64_cpu", arch="aarch64", cpu_model="MT6985 (Cortex-A510 + Cortex-A715)",
        physical_cores=8, logical_cpus=8,
        isa=frozenset({"neon", "asimd", "asimdhp", "asimddp", "fphp", "i8mm", "bf16"}),
        clusters=(((4, 5, 6, 7), 2850000), ((0, 1, 2, 3), 2000000)), numa_nodes=1, ram_gb=11.18)
    assert p.big_cores == (4, 5, 6, 7)


def test_jetson_orin_is_tegra_with_unified_memory():
    # Cores are split over two packages (4 + 2) with core_id restarting: still 6 cores.
    assert probe(_root("jetson_orin_nano"), torch_info=ORIN_TORCH) == HardwareProfile(
        hardware_class="jetson", arch="aarch64", cpu_model="Cortex-A78AE",
        physical_cores=6, logical_cpus=6, isa=frozenset({"neon", "asimd", "asimdhp", "asimddp", "fphp"}),
        clusters=(((0, 1, 2, 3, 4, 5), 1510400),), numa_nodes=1, ram_gb=7.44,
        cuda={"name": "Orin", "total_memory_gb": 7.44, "unified_memory": True,
              "compute_capability": (8, 7)})


def test_jetson_without_cuda_falls_back_to_arm64_cpu():
    assert probe(_root("jetson_orin_nano")).hardware_class == "arm64_cpu"


def test_x86_with_discrete_gpu():
    assert probe(_root("desktop_rtx4090"), torch_info=RTX_TORCH) == HardwareProfile(
        hardware_class="cuda_discrete", arch="x86_64",
        cpu_model="AMD Ryzen 9 7950X 16-Core Processor", physical_cores=2, logical_cpus=4,
        isa=frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                       "avx512_bf16", "avx512_vnni"}),
        clusters=(((0, 1, 2, 3), 5881000),), numa_nodes=1, ram_gb=62.5,
        cuda={"name": "NVIDIA GeForce RTX 4090", "total_memory_gb": 23.99,
              "unified_memory": False, "compute_capability": (8, 9)})


def test_real_machine_probe_matches_platform():
    p = load_profile(env={}, use_torch=False)
    machine = platform.machine()
    expected = {"x86_64": "x86_cpu", "AMD64": "x86_cpu", "aarch64": "arm64_cpu", "arm64": "arm64_cpu"}
    if machine in expected:
        assert p.hardware_class == expected[machine]
    assert p.arch == machine or (p.arch, machine) == ("aarch64", "arm64")
    assert 1 <= p.physical_cores <= p.logical_cpus and p.ram_gb > 0 and p.source == "probe"
    json.dumps(profile_summary(p))


# ---------------------------------------------------------------- override


def _env(override: dict | str) -> dict[str, str]:
    return {ENV_VAR: override if isinstance(override, str) else json.dumps(override)}


def test_override_replaces_given_fields_only():
    p = load_profile(_env({"hardware_class": "arm64_cpu", "arch": "aarch64", "physical_cores": 4,
                           "ram_gb": 8, "isa": ["neon", "asimddp"], "npu": "hexagon-v73"}),
                     root=_root("xeon_2s_spr"), use_torch=False)
    assert (p.hardware_class, p.arch, p.physical_cores, p.ram_gb) == ("arm64_cpu", "aarch64", 4, 8.0)
    assert p.isa == frozenset({"neon", "asimddp"}) and p.npu == "hexagon-v73"
    # Core counts follow each other: 2 threads per core kept, clusters reset to the new CPUs.
    assert p.logical_cpus == 8 and p.clusters == ((tuple(range(8)), 3800000),)
    assert p.cpu_model == "Intel(R) Xeon(R) Platinum 8480+" and p.numa_nodes == 2
    assert p.source == "probe+override"


def test_override_emulates_npu_phone_and_cuda_classes():
    phone = load_profile(_env({"hardware_class": "npu_phone", "npu": "qnn-htp"}),
                         root=_root("phone_biglittle"), use_torch=False)
    assert phone.hardware_class == "npu_phone" and phone.clusters[0][1] == 2850000
    gpu = load_profile(_env({"hardware_class": "cuda_discrete", "cuda": {
        "name": "fake", "total_memory_gb": 16, "unified_memory": False,
        "compute_capability": [8, 6]}}), root=_root("local_xeon_2c"), use_torch=False)
    assert gpu.cuda["compute_capability"] == (8, 6) and gpu.cuda["total_memory_gb"] == 16.0


def test_cuda_class_without_cuda_names_the_fix():
    with pytest.raises(ValueError, match="needs cuda info"):
        load_profile(_env({"hardware_class": "jetson"}), root=_root("local_xeon_2c"),
                     use_torch=False)


def test_full_override_skips_the_probe_and_round_trips_the_summary():
    p = probe(_root("desktop_rtx4090"), torch_info=RTX_TORCH)
    summary = profile_summary(p)
    summary.pop("source")
    q = load_profile(_env(summary), root="/nonexistent", use_torch=False)
    assert q == HardwareProfile(**{**p.__dict__, "source": "override"})


def test_unknown_key_is_named_with_valid_keys():
    with pytest.raises(ValueError, match=r"'cores'.*valid: hardware_class, arch"):
        load_profile(_env({"cores": 4}), root=_root("local_xeon_2c"), use_torch=False)


def test_unknown_class_lists_valid_classes():
    with pytest.raises(ValueError, match="unknown hardware_class 'tpu'") as e:
        load_profile(_env({"hardware_class": "tpu"}), root=_root("local_xeon_2c"), use_torch=False)
    assert all(c in str(e.value) for c in HARDWARE_CLASSES)


def test_bad_json_reports_position():
    with pytest.raises(ValueError, match=r"not valid JSON: .* line 1 column 20 \(char 19\)"):
        load_profile(_env('{"hardware_class": x86_cpu}'), root=_root("local_xeon_2c"),
                     use_torch=False)
    with pytest.raises(ValueError, match="JSON object"):
        load_profile(_env("[1, 2]"), root=_root("local_xeon_2c"), use_torch=False)


def test_override_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"physical_cores": 1}))
    p = load_profile(root=_root("local_xeon_2c"), use_torch=False)
    assert (p.physical_cores, p.logical_cpus) == (1, 1)
    monkeypatch.delenv(ENV_VAR)
    assert load_profile(root=_root("local_xeon_2c"), use_torch=False).physical_cores == 2


@pytest.mark.parametrize("bad, match", [
    ({"physical_cores": 0}, "physical_cores must be an integer >= 1"),
    ({"physical_cores": 4, "logical_cpus": 2}, "logical_cpus"),
    ({"ram_gb": -1}, "ram_gb"),
    ({"clusters": [[[0], 100], [[1], 200]]}, "fastest first"),
    ({"cuda": {"name": "x"}}, "missing"),
])
def test_invalid_field_values_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        load_profile(_env(bad), root=_root("local_xeon_2c"), use_torch=False)


def test_profile_is_hashable_and_summary_is_json():
    p = probe(_root("jetson_orin_nano"), torch_info=ORIN_TORCH)
    hash(p)
    assert json.loads(json.dumps(profile_summary(p)))["cuda"]["compute_capability"] == [8, 7]
