"""The native runtime's kernel levels in Python (engine/cpu/isa.py): which level a CPU's features
give, the ``OMNI_STREAM_CPU_ISA`` cap, the machine ``OMNI_STREAM_HW_PROFILE`` emulates, the
compiler flags of each, what the profile predicts and prints, and the fallback to the torch
engine (with the fix named) where the runtime cannot be built. The kernel sets themselves are
checked bit for bit in tests/test_cpu_isa.py and tests/test_cpu_arm64.py."""

from __future__ import annotations

import ctypes as C
import json
import logging
from pathlib import Path

import pytest

from omni_stream.edge import derive
from omni_stream.edge.probe import ARM_ISA, ENV_VAR, X86_ISA, load_profile, probe
from omni_stream.engine.cpu import build, isa

HW = Path(__file__).parent / "data" / "hw"
AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
ZEN4 = AVX512 | {"avx512_bf16", "gfni"}  # this build machine
SPR = AVX512 | {"avx512_bf16", "avx512_fp16", "avx_vnni", "gfni", "amx_tile", "amx_int8", "amx_bf16"}
A76 = frozenset({"asimd", "neon", "asimddp", "asimdhp", "fphp"})  # Raspberry Pi 5
V1 = A76 | {"i8mm", "bf16", "sve"}  # Graviton 3


def _target(env: dict, host=ZEN4, machine="x86_64", system="Linux") -> isa.Target:
    return isa.runtime_target(env, host, machine, system)


def _flags(env: dict, **kw) -> tuple[str, ...]:
    return isa.arch_flags(_target(env, **kw))


# ---------------------------------------------------------------- levels and names


def test_levels_follow_kernels_isa_h():
    assert isa.kernel_level(ZEN4, "x86_64") == isa.kernel_level(SPR, "AMD64") == "avx512"
    assert isa.kernel_level(AVX512 - {"avx512_vnni"}, "x86_64") == "avx2"  # Skylake-X: no VNNI
    assert isa.kernel_level(AVX512 - {"avx512bw"}, "x86_64") == "avx2"
    assert isa.kernel_level(AVX2, "x86_64") == "avx2"  # Haswell .. Zen 3, laptops
    for lacking in ("avx2", "fma", "f16c"):
        assert isa.kernel_level(AVX2 - {lacking}, "x86_64") == "scalar", lacking
    assert isa.kernel_level(set(), "x86_64") == "scalar"
    # ARM64: Advanced SIMD is part of every AArch64 core; the features only add to it
    for flags in (V1, A76, {"asimd"}, set()):
        assert isa.kernel_level(flags, "aarch64") == "neon"
    assert isa.kernel_level(set(), "arm64") == "neon"  # macOS's name
    # x86 flags on ARM (and the reverse) mean nothing; other architectures have no set
    assert isa.kernel_level(ZEN4, "aarch64") == "neon" and isa.kernel_level(V1, "x86_64") == "scalar"
    assert isa.kernel_level(ZEN4, "riscv64") == isa.kernel_level(A76, "armv7l") == "scalar"
    assert [isa.LEVELS.index(x) for x in ("scalar", "avx2", "avx512", "neon")] == [0, 1, 2, 3]


def test_names_are_what_oc_isa_reports():
    assert isa.kernel_name("avx512", ZEN4) == "avx512+vnni+gfni"
    assert isa.kernel_name("avx512", SPR) == "avx512+vnni+gfni+amx"
    assert isa.kernel_name("avx512", AVX512 | {"amx_tile"}) == "avx512+vnni"  # tiles without int8
    assert isa.kernel_name("avx2", AVX2) == "avx2+fma+f16c"
    assert isa.kernel_name("avx2", AVX2 | {"avx_vnni"}) == "avx2+fma+f16c+avxvnni"
    assert isa.kernel_name("neon", V1) == "neon+dotprod+i8mm"
    assert isa.kernel_name("neon", A76) == "neon+dotprod"
    assert isa.kernel_name("neon", {"asimd"}) == "neon"
    assert isa.kernel_name("scalar", ZEN4) == "scalar"


def test_the_probe_keeps_every_feature_the_levels_read():
    """The probe drops cpuinfo flags it does not list: every one isa.py reads must be listed,
    and both modules name the override variable alike (the engine cannot import edge)."""
    read = isa.AVX512_NEEDS | isa.AMX_INT8 | {"avx_vnni", "gfni"}
    assert read <= X86_ISA
    assert {isa.ARM_DOTPROD, isa.ARM_I8MM} <= ARM_ISA
    assert {f for f, _ in isa.X86_OFF} <= X86_ISA
    assert isa.HW_PROFILE_ENV == ENV_VAR


def test_recorded_machines_predict_their_kernels():
    def name(machine, **kw):
        return derive.native_kernels(probe(str(HW / machine), **kw))

    assert name("local_xeon_2c") == "avx512+vnni+gfni+amx"  # Sapphire Rapids VM
    assert name("xeon_2s_spr") == "avx512+vnni+amx"
    assert name("desktop_rtx4090") == "avx512+vnni"  # Zen 4 (its recording lists no gfni)
    assert name("phone_biglittle") == "neon+dotprod+i8mm"  # Cortex-A715 / A510
    assert name("jetson_orin_nano") == "neon+dotprod"  # Cortex-A78AE
    hw = probe(str(HW / "local_xeon_2c"))
    assert derive.native_kernel_level(hw, "avx2") == "avx2"
    assert derive.native_kernels(hw, "avx2") == "avx2+fma+f16c+avxvnni"
    assert derive.native_kernel_level(hw, "neon") == "avx512"  # another family's cap: not its own
    assert not derive.native_engine_runs(hw, "scalar") and derive.native_engine_runs(hw)


# ---------------------------------------------------------------- the cap


def test_cap_values_and_errors():
    for v in isa.LEVELS:
        assert isa.parse_cap(v) == v
    assert isa.parse_cap(" AVX2 ") == "avx2"
    assert isa.parse_cap(None) is None and isa.parse_cap("") is None
    for bad in ("avx3", "sse4", "native", "AVX512_CORE"):
        with pytest.raises(ValueError, match="scalar, avx2, avx512, neon") as e:
            isa.parse_cap(bad)
        assert isa.CAP_ENV in str(e.value)


def test_cap_lowers_never_raises_and_must_be_this_architectures():
    assert isa.capped("avx512", "avx2", "x86_64") == "avx2"
    assert isa.capped("avx2", "avx512", "x86_64") == "avx2"  # above the CPU: no effect
    assert isa.capped("avx2", "scalar", "x86_64") == "scalar"
    assert isa.capped("neon", "scalar", "aarch64") == "scalar"
    assert isa.capped("neon", None, "aarch64") == "neon"
    with pytest.raises(ValueError, match="use one of scalar, avx2, avx512"):
        isa.capped("avx512", "neon", "x86_64")
    with pytest.raises(ValueError, match="use one of scalar, neon"):
        isa.capped("neon", "avx2", "aarch64")
    t = _target({isa.CAP_ENV: "avx512"}, host=AVX2)
    assert t.level == "avx2" and "this CPU's best is avx2" in t.why
    with pytest.raises(ValueError, match="not a kernel level"):
        _target({isa.CAP_ENV: "avx3"})


# ---------------------------------------------------------------- emulation


def test_emulated_isa_lists_set_the_level_as_far_as_this_cpu_has_it():
    emu = lambda flags, **more: {ENV_VAR: json.dumps({"isa": sorted(flags), **more})}  # noqa: E731
    t = _target(emu(AVX2))
    assert (t.level, t.name, t.features) == ("avx2", "avx2+fma+f16c", AVX2)
    assert _target(emu(AVX2 - {"f16c"})).level == "scalar"
    assert _target(emu(AVX512)).name == "avx512+vnni"  # no gfni listed: none used
    # an emulated machine above this CPU runs this CPU's level
    t = _target(emu(SPR), host=AVX2)
    assert t.level == "avx2" and "above this CPU's avx2" in t.why
    # the cap wins over the list (both ways)
    assert _target({**emu(AVX2), isa.CAP_ENV: "avx512"}).level == "avx512"
    assert _target({**emu(AVX512), isa.CAP_ENV: "scalar"}).level == "scalar"
    # another architecture: the scalar reference here (bit for bit every set's products)
    t = _target({ENV_VAR: json.dumps({"arch": "aarch64", "isa": sorted(V1)})})
    assert t.level == "scalar" and "aarch64" in t.why
    t = _target({ENV_VAR: json.dumps({"arch": "x86_64", "isa": sorted(AVX2)})}, host=V1,
                machine="aarch64")
    assert t.level == "scalar"
    # partial overrides without isa / arch, bad JSON and the same arch: this CPU as it is
    for env in ({ENV_VAR: '{"physical_cores": 8}'}, {ENV_VAR: "not json"}, {ENV_VAR: "[1]"},
                {ENV_VAR: '{"arch": "x86_64"}'}, {}):
        t = _target(env)
        assert (t.level, t.features, t.why) == ("avx512", ZEN4, "this CPU"), env
    # ARM on ARM: the emulated core's extensions
    t = _target({ENV_VAR: json.dumps({"isa": sorted(A76)})}, host=V1, machine="aarch64")
    assert (t.level, t.name) == ("neon", "neon+dotprod")


# ---------------------------------------------------------------- flags


def test_flags_per_level():
    base = tuple(f for f in build.FLAGS if f != "-march=native")
    native = _target({})
    assert isa.compile_flags(native, base) == build.FLAGS  # the install-time build, unchanged
    assert _flags({}) == ("-march=native",)
    # the AVX2 cap: no AVX-512; AMX off where the CPU has it
    assert _flags({isa.CAP_ENV: "avx2"}) == ("-march=native", "-mno-avx512f")
    assert _flags({isa.CAP_ENV: "avx2"}, host=SPR) == (
        "-march=native", "-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
    assert _flags({isa.CAP_ENV: "avx512"}, host=SPR) == ("-march=native",)
    # the scalar level: the reference on the family's baseline
    assert _flags({isa.CAP_ENV: "scalar"}) == ("-march=x86-64", "-DOC_FORCE_SCALAR")
    assert _flags({isa.CAP_ENV: "scalar"}, host=V1, machine="aarch64") == (
        "-march=armv8-a", "-DOC_FORCE_SCALAR")
    assert _flags({isa.CAP_ENV: "scalar"}, host=V1, machine="arm64", system="Darwin") == (
        "-DOC_FORCE_SCALAR",)
    assert _flags({}, host=set(), machine="riscv64") == ("-DOC_FORCE_SCALAR",)  # no -march
    # an emulated machine's missing features are off too
    emu = lambda flags: {ENV_VAR: json.dumps({"isa": sorted(flags)})}  # noqa: E731
    assert _flags(emu(AVX2)) == ("-march=native", "-mno-avx512f", "-mno-gfni")
    assert _flags(emu(AVX2), host=SPR) == (
        "-march=native", "-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16",
        "-mno-avxvnni", "-mno-gfni")
    assert _flags(emu(AVX2 | {"avx_vnni"}), host=SPR) == (  # Alder Lake: AVX-VNNI kept
        "-march=native", "-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16",
        "-mno-gfni")
    assert _flags(emu(AVX512 | {"gfni"}), host=SPR) == (  # Ice Lake: no AMX, no AVX-VNNI
        "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mno-avxvnni")
    assert _flags(emu(ZEN4)) == ("-march=native",)  # this machine, listed: the native build
    assert _flags(emu({"avx"})) == ("-march=x86-64", "-DOC_FORCE_SCALAR")
    # Skylake-X (AVX-512 without VNNI): the AVX2 set, in a build that has AVX-512 as it would
    skx = AVX512 - {"avx512_vnni"}
    assert _target(emu(skx)).name == "avx2+fma+f16c" and _flags(emu(skx)) == (
        "-march=native", "-mno-avx512vnni", "-mno-gfni")
    # ARM64: -mcpu=native (clang has no -march=native there); an emulated core's extensions
    arm = dict(host=V1, machine="aarch64")
    assert _flags({}, **arm) == ("-mcpu=native",)
    assert _flags(emu(V1), **arm) == ("-mcpu=native",)
    assert _flags(emu(A76), **arm) == ("-march=armv8.2-a+dotprod",)  # Raspberry Pi 5 on Graviton 3
    assert _flags(emu({"asimd"}), **arm) == ("-march=armv8-a",)  # Cortex-A53 / A72
    assert _flags(emu(A76), host=A76, machine="aarch64") == ("-mcpu=native",)


def test_macos_arm64_flags():
    """macOS arm64, on paper (no such machine here): -mcpu=native (build.py swaps in
    -mcpu=apple-m1 where the compiler refuses it), -dynamiclib for -shared."""
    t = _target({}, host=V1, machine="arm64", system="Darwin")
    base = tuple(f for f in build.FLAGS if f != "-march=native")
    flags = isa.compile_flags(t, base)
    assert flags[:2] == ("-O3", "-mcpu=native") and "-dynamiclib" in flags and "-shared" not in flags


def test_every_cap_gets_its_own_cached_build(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    paths = set()
    for cap in ("avx512", "avx2", "scalar"):
        monkeypatch.setenv(isa.CAP_ENV, cap)
        paths.add(build.library_path())
    assert len(paths) == 3
    monkeypatch.setenv(isa.CAP_ENV, "neon")
    if isa.family(isa.this_target({}).machine) == "x86":
        with pytest.raises(build.BuildError, match="use one of scalar, avx2, avx512"):
            build.library_path()


# ---------------------------------------------------------------- build failures name the fix


def test_a_missing_compiler_names_the_fix(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(build.BuildError, match="CXX=/nonexistent/g\\+\\+ is not a compiler.*--engine torch"):
        build.compiler()
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler found.*apt-get install g\\+\\+"):
        build.compiler()


def test_compile_errors_name_the_fix():
    assert "OMNI_STREAM_CPU_ISA=avx2" in build._fix("cc1plus: error: bad value 'znver9' for '-march=' switch")
    assert "OMNI_STREAM_CPU_ISA=avx2" in build._fix("error: unknown target CPU 'native'")
    assert "toolchain" in build._fix("fatal error: immintrin.h: No such file or directory")
    assert "--engine torch" in build._fix("internal compiler error")


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """CXX names no compiler; the loaded library is forgotten (and again after)."""
    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent")
    build.ensure_library.cache_clear()
    yield
    build.ensure_library.cache_clear()


def _serve_args(*argv):
    from omni_stream.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


AVX2_BOX = {"hardware_class": "x86_cpu", "arch": "x86_64", "isa": sorted(AVX2),
            "physical_cores": 2}


def test_serve_falls_back_to_torch_where_the_runtime_cannot_be_built(tiny_ckpt, no_compiler, caplog):
    from omni_stream.orchestrator.flags import pipeline_settings

    hw = load_profile(env={ENV_VAR: json.dumps(AVX2_BOX)}, use_torch=False)
    _, prof, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), hw)
    assert prof.engine == "native"  # the profile alone: an AVX2 machine runs the native engine
    with caplog.at_level(logging.WARNING, logger="omni_stream.cli"):
        s, prof, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), hw, build_native=True)
    assert (s.engine, prof.engine, src["engine"]) == ("torch", "torch", "derived")
    assert not prof.lend_cores
    assert "torch engine runs the decode step" in caplog.text
    assert "CXX=/nonexistent is not a compiler" in caplog.text and "--engine torch" in caplog.text
    # asked for by the user: an error naming the reason, not a silent switch
    with pytest.raises(ValueError, match="--engine native: the CPU runtime cannot run here: CXX="):
        pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--engine", "native"), hw,
                          build_native=True)
    with pytest.raises(ValueError, match="native CPU runtime only.*cannot run here: CXX="):
        pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--weight-path", "mixed"), hw,
                          build_native=True)


def test_profile_prints_the_kernels_and_why_they_are_missing(tiny_ckpt, capsys, monkeypatch, tmp_path):
    from omni_stream.cli import main

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    # another machine (a full description): the predicted kernels
    graviton = {"hardware_class": "arm64_cpu", "arch": "aarch64", "cpu_model": "Neoverse-V1",
                "physical_cores": 4, "logical_cpus": 4, "isa": sorted(V1),
                "clusters": [[[0, 1, 2, 3], 2600000]], "numa_nodes": 1, "ram_gb": 8.0,
                "cuda": None}
    monkeypatch.setenv(ENV_VAR, json.dumps(graviton))
    assert main(["profile", "--model", str(tiny_ckpt), "--json", "--no-measure"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["native_kernels"]["kernels"] == "neon+dotprod+i8mm"
    assert out["native_kernels"]["source"] == "predicted" and out["profile"]["engine"] == "native"
    assert main(["profile", "--model", str(tiny_ckpt), "--no-measure"]) == 0
    assert "native kernels: neon+dotprod+i8mm (predicted for the machine" in capsys.readouterr().out
    # this machine without a compiler: the reason, and the torch engine
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("CXX", "/nonexistent")
    build.ensure_library.cache_clear()
    try:
        assert main(["profile", "--model", str(tiny_ckpt), "--json", "--no-measure"]) == 0
    finally:
        build.ensure_library.cache_clear()
    out = json.loads(capsys.readouterr().out)
    assert out["native_kernels"]["kernels"] is None and out["profile"]["engine"] == "torch"
    assert "CXX=/nonexistent is not a compiler" in out["native_kernels"]["unavailable"]


# ---------------------------------------------------------------- the built library


@pytest.mark.compile
def test_a_failed_compile_falls_back_with_the_compilers_words(tiny_ckpt, monkeypatch, tmp_path, caplog):
    """A compiler that runs and fails (``false``): the build error carries the fix and the
    command; serve falls back to torch."""
    from omni_stream.orchestrator.flags import pipeline_settings

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    build.ensure_library.cache_clear()
    try:
        with pytest.raises(build.BuildError, match="compiling omni_cpu.cpp failed: .*--engine torch"):
            build.build()
        hw = load_profile(env={ENV_VAR: json.dumps(AVX2_BOX)}, use_torch=False)
        with caplog.at_level(logging.WARNING, logger="omni_stream.cli"):
            s, _, _ = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), hw, build_native=True)
    finally:
        build.ensure_library.cache_clear()
    assert s.engine == "torch" and "compiling omni_cpu.cpp failed" in caplog.text


@pytest.mark.compile
def test_the_emulated_machine_runs_end_to_end_on_its_kernels(tiny_ckpt, monkeypatch):
    """``OMNI_STREAM_HW_PROFILE``'s isa list (an AVX2 laptop) and ``OMNI_STREAM_CPU_ISA``
    (scalar) build the runtime the engine then runs: the library reports the level the isa
    module predicts, and the decode gives the native build's codes (every set, the same bits)."""
    from omni_stream.engine.cpu import abi
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.models.prompt import PromptRequest

    def codes():
        build.ensure_library.cache_clear()
        synth = Synthesizer.from_path(tiny_ckpt, weight_path="int4", engine="native", threads=1)
        got = synth.generate_codes(PromptRequest(text="Hello from an emulated laptop.",
                                                 language="english", speaker="ryan"),
                                   SamplingParams.greedy(), 0, 12)[0]
        return abi.library().oc_isa().decode(), got

    monkeypatch.delenv(isa.CAP_ENV, raising=False)
    monkeypatch.delenv(ENV_VAR, raising=False)
    try:
        here, want = codes()
        assert here == isa.this_target().name
        monkeypatch.setenv(ENV_VAR, json.dumps({"isa": sorted(AVX2)}))
        if isa.kernel_level(isa.host_flags(), isa.this_target().machine) in ("avx512", "avx2"):
            name, got = codes()
            assert name == "avx2+fma+f16c" and (got == want).all()
        monkeypatch.delenv(ENV_VAR)
        monkeypatch.setenv(isa.CAP_ENV, "scalar")
        name, got = codes()
        assert name == "scalar" and abi.library().oc_isa_level() == 0 and (got == want).all()
    finally:
        build.ensure_library.cache_clear()
    monkeypatch.delenv(isa.CAP_ENV)
    lib = abi.library()  # the default build again, with the test entry points declared
    assert lib.oc_isa_level() == isa.LEVELS.index(isa.this_target().level)
    assert lib.oc_linear_ref.argtypes[0] is C.POINTER(abi.OcLinear)


EMULATED = {"avx2 laptop": {"isa": sorted(AVX2)}, "skylake-x": {"isa": sorted(AVX512 - {"avx512_vnni"})},
            "cascade lake": {"isa": sorted(AVX512)}, "sandy bridge": {"isa": ["avx"]},
            "graviton": {"arch": "aarch64", "isa": sorted(V1)}}


@pytest.mark.compile
def test_each_emulated_build_reports_the_predicted_kernels(tmp_path):
    """The flags of each emulated machine, compiled: the library's own oc_isa() is the name
    the isa module predicts (the flags and kernels/isa.h agree)."""
    host = isa.host_flags()
    for name, override in EMULATED.items():
        target = isa.runtime_target({ENV_VAR: json.dumps(override)}, host)
        if isa.family(target.machine) != "x86" and name != "graviton":
            continue
        lib = build.load(build.build(tmp_path / name.replace(" ", "_") / "lib.so",
                                     build.default_flags(target)))
        assert build.kernels(lib) == target.name, (name, target)
