"""oneDNN's ISA level (models/onednn.py): read from CPU flags, lowered by a cap, and pinned
for the bf16 streaming decode. Pure functions over flag sets of machines this project meets."""

from __future__ import annotations

import pytest

from omni_stream.models import onednn as isa

AVX2 = {"sse4_1", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
EPYC_ZEN4 = AVX512 | {"avx512_vnni", "avx512_bf16"}
XEON_AMX = EPYC_ZEN4 | {"avx_vnni", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}
CASCADE_LAKE = AVX512 | {"avx512_vnni"}
ALDER_LAKE = AVX2 | {"avx_vnni"}  # no AVX-512
ARROW_LAKE = ALDER_LAKE | {"avx_vnni_int8", "avx_ne_convert"}


@pytest.mark.parametrize("flags, top", [
    (set(), None), ({"sse4_1"}, "SSE41"), (AVX2, "AVX2"), (AVX512, "AVX512_CORE"),
    (CASCADE_LAKE, "AVX512_CORE_VNNI"), (EPYC_ZEN4, "AVX512_CORE_BF16"),
    (XEON_AMX, "AVX10_1_512_AMX"), (ALDER_LAKE, "AVX2_VNNI"), (ARROW_LAKE, "AVX2_VNNI_2"),
    (AVX512 - {"avx512dq"}, "AVX2"),  # a level needs every flag of the ones below it
    ({"avx512_bf16", "amx_bf16"}, None),  # flags without the base levels count for nothing
])
def test_cpu_level_is_the_highest_level_whose_flags_all_hold(flags, top):
    assert isa.cpu_level(frozenset(flags)) == top


def test_effective_level_is_the_highest_supported_level_under_the_cap():
    assert isa.effective_level(None, XEON_AMX) == "AVX10_1_512_AMX"
    assert isa.effective_level("ALL", XEON_AMX) == "AVX10_1_512_AMX"  # unknown name: no cap
    assert isa.effective_level("avx512_core_amx", EPYC_ZEN4) == "AVX512_CORE_BF16"  # alias
    assert isa.effective_level("AVX512_CORE_VNNI", XEON_AMX) == "AVX512_CORE_VNNI"
    # a cap on a level the CPU lacks runs the highest one below it that it has
    assert isa.effective_level("AVX2_VNNI_2", EPYC_ZEN4) == "AVX2"
    assert isa.effective_level("SSE41", set()) is None


def test_pin_lowers_a_higher_or_missing_cap_and_keeps_a_lower_one():
    env: dict[str, str] = {}
    assert isa.pin_decode_isa(env, XEON_AMX) == "AVX512_CORE_BF16"
    assert env[isa.ENV] == "AVX512_CORE_BF16"
    env = {isa.ENV: "AVX10_1_512_AMX"}
    assert isa.pin_decode_isa(env, XEON_AMX) == "AVX512_CORE_BF16"
    env = {isa.ENV: "DEFAULT"}
    assert isa.pin_decode_isa(env, XEON_AMX) == "AVX512_CORE_BF16"
    env = {isa.ENV: "AVX512_CORE_VNNI"}  # an emulated lower level stays (the ISA tests)
    assert isa.pin_decode_isa(env, XEON_AMX) == "AVX512_CORE_VNNI"
    assert env[isa.ENV] == "AVX512_CORE_VNNI"
    assert isa.pin_decode_isa({}, CASCADE_LAKE) == "AVX512_CORE_VNNI"  # the CPU's own is lower


def test_the_guarantee_and_packing_follow_the_level():
    assert isa.decode_invariant("AVX512_CORE_BF16")
    for lv in ("AVX512_CORE_VNNI", "AVX512_CORE", "AVX2", "AVX10_1_512_AMX", None):
        assert not isa.decode_invariant(lv)
    assert isa.packing_available("AVX512_CORE") and isa.packing_available("AVX2_VNNI_2")
    assert not isa.packing_available("AVX2") and not isa.packing_available("AVX2_VNNI")
    assert not isa.packing_available(None)


def test_cpu_flags_reads_the_first_processor(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert isa.cpu_flags(f) == frozenset({"fpu", "avx2", "fma"})
    assert isa.cpu_flags(tmp_path / "missing") == frozenset()
