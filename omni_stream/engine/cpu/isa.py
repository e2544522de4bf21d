"""Which kernel set of the CPU runtime a machine runs, and the compiler flags that build it.

The one place in Python that knows the ISA conditions of ``kernels/isa.h``: the profile
(``edge.derive``) asks here for the kernel level of the probed (or emulated) hardware, and
``build.py`` for the flags of the level this process builds and runs at. Levels, as
``oc_isa_level()`` numbers them:

    scalar  0  the reference (kernels/scalar.h): any CPU, or ``-DOC_FORCE_SCALAR``
    avx2    1  x86-64 with AVX2 + FMA + F16C (+ AVX-VNNI's VPDPBUSD where the CPU has it)
    avx512  2  x86-64 with AVX-512 F/BW/VL + VNNI + F16C (+ GFNI, + AMX int8 tiles)
    neon    3  ARM64 (Advanced SIMD is part of every AArch64 core; + dotprod, + i8mm)

CPU features are named as /proc/cpuinfo names them (``avx512_vnni``, ``asimddp``, ...), which
is also how ``OMNI_STREAM_HW_PROFILE``'s ``isa`` list names them (``edge.probe``).

The level a process builds and runs at (``runtime_target``) is this CPU's, lowered by

- ``OMNI_STREAM_CPU_ISA=scalar|avx2|avx512|neon``: a cap, as ``ONEDNN_MAX_CPU_ISA`` is for
  oneDNN; a cap above what the CPU has does not raise it. It wins over the next point.
- ``OMNI_STREAM_HW_PROFILE`` with an ``isa`` list (and/or ``arch``): the emulated machine's
  level and features, as far as this CPU has them (e.g. ``["avx", "avx2", "fma", "f16c"]`` on
  an AVX-512 server: the AVX2 set, built without AVX-512, AVX-VNNI, GFNI and AMX). A machine of
  the other architecture (ARM64 described on an x86-64 host) runs the scalar reference, whose
  products every kernel set gives bit for bit (tests/test_cpu_isa.py, test_cpu_arm64.py).

Everything here but ``host_flags`` is a pure function of its arguments (tests).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping

LEVELS = ("scalar", "avx2", "avx512", "neon")  # index: oc_isa_level()
CAP_ENV = "OMNI_STREAM_CPU_ISA"
HW_PROFILE_ENV = "OMNI_STREAM_HW_PROFILE"  # edge.probe.ENV_VAR (the engine sits below edge)

X86_MACHINES = frozenset({"x86_64", "amd64", "x64"})
ARM64_MACHINES = frozenset({"aarch64", "arm64", "armv8", "armv8l"})
# the levels of each family, lowest first
FAMILY_LEVELS = {"x86": ("scalar", "avx2", "avx512"), "arm64": ("scalar", "neon"),
                 "other": ("scalar",)}

# the CPU features each level needs (kernels/isa.h's conditions, in cpuinfo names; AVX-512's
# include AVX2's: no CPU has one without the other, and the compiler implies them)
AVX2_NEEDS = frozenset({"avx2", "fma", "f16c"})
AVX512_NEEDS = AVX2_NEEDS | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
NEEDS = {"avx512": AVX512_NEEDS, "avx2": AVX2_NEEDS, "neon": frozenset(), "scalar": frozenset()}
AMX_INT8 = frozenset({"amx_tile", "amx_int8"})
ARM_DOTPROD = "asimddp"  # cpuinfo's name of the dot-product extension (SDOT/UDOT)
ARM_I8MM = "i8mm"

# x86 features the kernels use beyond their level's needs, and the flags that turn each off
# where -march=native would turn it on but the target lacks it (a cap or an emulated machine).
# -mno-avx512f turns off every AVX-512 subset with it (the three after it then go unsaid: an
# AVX-512 CPU without one of them runs the AVX2 set); AMX's three go together.
X86_OFF = (("avx512f", ("-mno-avx512f",)),
           ("avx512bw", ("-mno-avx512bw",)),
           ("avx512vl", ("-mno-avx512vl",)),
           ("avx512_vnni", ("-mno-avx512vnni",)),
           ("amx_tile", ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")),
           ("avx_vnni", ("-mno-avxvnni",)),
           ("gfni", ("-mno-gfni",)))
# the portable baseline of each family (the scalar level builds for it: no vector extension
# the CPU may lack is used, as on the machine that level stands for)
BASELINE = {"x86": ("-march=x86-64",), "arm64": ("-march=armv8-a",), "other": ()}


def family(machine: str) -> str:
    """'x86', 'arm64' or 'other' for a ``platform.machine()`` / probe ``arch`` string."""
    m = (machine or "").lower()
    return "x86" if m in X86_MACHINES else "arm64" if m in ARM64_MACHINES else "other"


def kernel_level(isa_flags: Iterable[str], machine: str) -> str:
    """The kernel set a CPU with these features runs at best: 'avx512' | 'avx2' | 'neon' |
    'scalar'. On ARM64 that is NEON always: Advanced SIMD is part of every AArch64 core the
    runtime can run on (Linux and macOS require it), and the features only add to it."""
    flags = set(isa_flags)
    fam = family(machine)
    if fam == "x86":
        if AVX512_NEEDS <= flags:
            return "avx512"
        if AVX2_NEEDS <= flags:
            return "avx2"
        return "scalar"
    if fam == "arm64":
        return "neon"
    return "scalar"


def kernel_name(level: str, isa_flags: Iterable[str] = ()) -> str:
    """What ``oc_isa()`` of a build at ``level`` for a CPU with these features reports, e.g.
    'avx512+vnni+gfni', 'avx2+fma+f16c+avxvnni', 'neon+dotprod+i8mm', 'scalar'."""
    flags = set(isa_flags)
    if level == "avx512":
        return "avx512+vnni" + ("+gfni" if "gfni" in flags else "") + (
            "+amx" if AMX_INT8 <= flags else "")
    if level == "avx2":
        return "avx2+fma+f16c" + ("+avxvnni" if "avx_vnni" in flags else "")
    if level == "neon":
        return "neon" + ("+dotprod" if ARM_DOTPROD in flags else "") + (
            "+i8mm" if ARM_I8MM in flags else "")
    return "scalar"


def native_engine_runs(level: str) -> bool:
    """Whether the native engine is the one to pick at this kernel level: the vector sets are;
    the scalar reference runs (``--engine native``) but is slower than torch's kernels."""
    return level != "scalar"


def parse_cap(value: str | None) -> str | None:
    """``OMNI_STREAM_CPU_ISA``'s value as a level, None when unset or empty."""
    v = (value or "").strip().lower()
    if not v:
        return None
    if v not in LEVELS:
        raise ValueError(f"{CAP_ENV}={value!r} is not a kernel level: use one of "
                         f"{', '.join(LEVELS)} (or leave it unset for the CPU's best)")
    return v


def capped(level: str, cap: str | None, machine: str) -> str:
    """``level`` lowered to ``cap`` (never raised); a cap of the other architecture's levels
    (neon on x86-64, avx2 on ARM64) is an error naming the valid ones."""
    if cap is None:
        return level
    order = FAMILY_LEVELS[family(machine)]
    if cap not in order:
        raise ValueError(f"{CAP_ENV}={cap} is not a level of this {machine} CPU: use one of "
                         f"{', '.join(order)}")
    return lower(level, cap, machine)


def lower(a: str, b: str, machine: str) -> str:
    """The lower of two levels of ``machine``'s family."""
    order = FAMILY_LEVELS[family(machine)]
    return order[min(order.index(a), order.index(b))]


def emulated(env: Mapping[str, str]) -> tuple[frozenset[str] | None, str | None] | None:
    """(isa list, arch) that ``OMNI_STREAM_HW_PROFILE`` describes, each None where not given;
    None without either (or where the value is not a JSON object: the probe reports that)."""
    text = (env.get(HW_PROFILE_ENV) or "").strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    isa, arch = data.get("isa"), data.get("arch")
    isa = frozenset(isa) if isinstance(isa, list) and all(isinstance(f, str) for f in isa) else None
    arch = arch if isinstance(arch, str) and arch else None
    if isa is None and arch is None:
        return None
    return isa, arch


@dataclass(frozen=True)
class Target:
    """What a build runs: its level, the CPU features its code may use (a subset of ``host``,
    this CPU's, which ``-march=native`` turns on) and the host's machine and system; ``why``:
    how the level was reached."""

    level: str
    features: frozenset[str]
    host: frozenset[str]
    machine: str
    system: str
    why: str

    @property
    def name(self) -> str:
        """The ``oc_isa()`` this target's build reports."""
        return kernel_name(self.level, self.features)


def runtime_target(env: Mapping[str, str] | None = None, host: Iterable[str] | None = None,
                   machine: str | None = None, system: str | None = None) -> Target:
    """The kernel set this process builds and runs at (see the module doc): this CPU's
    (``host`` features, ``machine``), lowered by ``OMNI_STREAM_CPU_ISA`` or else by the machine
    ``OMNI_STREAM_HW_PROFILE`` describes. Raises ValueError on an invalid cap."""
    env = os.environ if env is None else env
    machine = machine or platform.machine()
    system = system or platform.system()
    host = frozenset(host_flags() if host is None else host)
    best = kernel_level(host, machine)
    cap = parse_cap(env.get(CAP_ENV))
    if cap is not None:
        level = capped(best, cap, machine)
        why = (f"{CAP_ENV}={cap}" + ("" if level == cap else f" (this CPU's best is {best})"))
        # below AVX-512 the build has none of it (nor AMX): the code of a CPU without it
        features = host if level != "avx2" else frozenset(
            f for f in host if not f.startswith(("avx512", "amx")))
        return Target(level, features, host, machine, system, why)
    emu = emulated(env)
    if emu is not None:
        isa, arch = emu
        if arch is not None and family(arch) != family(machine):
            return Target("scalar", frozenset(), host, machine, system,
                          f"{HW_PROFILE_ENV} describes an {arch} machine on this {machine} one: "
                          "the scalar reference (every kernel set gives its products bit for bit)")
        if isa is not None:
            want = kernel_level(isa, arch or machine)
            level = lower(best, want, machine)
            return Target(level, host & isa, host, machine, system,
                          f"{HW_PROFILE_ENV}'s isa list" + ("" if level == want else
                                                            f" ({want}: above this CPU's {best})"))
    return Target(best, host, host, machine, system, "this CPU")


def arch_flags(target: Target) -> tuple[str, ...]:
    """The compiler's target flags for ``target``: ``-march=native`` (``-mcpu=native`` on
    ARM64, where clang has no -march=native), with what the target may not use turned off; the
    family's baseline and ``-DOC_FORCE_SCALAR`` at the scalar level. On macOS arm64
    ``build.py`` falls back to ``-mcpu=apple-m1`` where the compiler refuses ``-mcpu=native``."""
    fam = family(target.machine)
    if target.level == "scalar":
        base = () if target.system == "Darwin" else BASELINE[fam]
        return (*base, "-DOC_FORCE_SCALAR")
    if fam == "x86":
        allowed = target.features
        off: list[str] = []
        for feature, flags in X86_OFF:
            need = AMX_INT8 if feature == "amx_tile" else {feature}
            if feature.startswith("avx512") and "-mno-avx512f" in off:
                continue
            if feature in target.host and not need <= allowed:
                off.extend(flags)
        return ("-march=native", *off)
    if fam == "arm64":
        host = target.host
        want = {f for f in (ARM_DOTPROD, ARM_I8MM) if f in target.features}
        if want == {f for f in (ARM_DOTPROD, ARM_I8MM) if f in host}:
            return ("-mcpu=native",)
        # fewer extensions than this CPU's (an emulated core): an explicit architecture
        ext = ("+dotprod" if ARM_DOTPROD in want else "") + ("+i8mm" if ARM_I8MM in want else "")
        return (f"-march=armv8.2-a{ext}",) if ext else ("-march=armv8-a",)
    return ()


def compile_flags(target: Target, base: tuple[str, ...]) -> tuple[str, ...]:
    """``base`` (``build.FLAGS`` without its -march) with ``target``'s arch flags after -O3,
    and on macOS ``-dynamiclib`` for ``-shared``."""
    arch = arch_flags(target)
    rest = [f for f in base if f != "-O3"]
    if target.system == "Darwin":
        rest = ["-dynamiclib" if f == "-shared" else f for f in rest]
    return ("-O3", *arch, *rest)


# ---------------------------------------------------------------- this machine


# macOS: sysctl hw.optional.arm.FEAT_* -> the cpuinfo names used here
DARWIN_FEATURES = {"FEAT_DotProd": "asimddp", "FEAT_I8MM": "i8mm", "FEAT_BF16": "bf16",
                   "FEAT_FP16": "fphp"}


@lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """This CPU's features, cpuinfo-named: /proc/cpuinfo's ``flags`` (x86) or ``Features``
    (ARM) on Linux; on macOS (no /proc) sysctl's ``hw.optional.arm.FEAT_*`` (arm64, with
    NEON's 'asimd' implied) or ``machdep.cpu.features`` (x86, lower-cased). Untested here: no
    macOS machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-a"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        flags = set()
        if family(platform.machine()) == "arm64":
            flags |= {"asimd", "neon", "fp"}
            for line in out.splitlines():
                key, _, val = line.partition(":")
                feat = key.strip().rsplit(".", 1)[-1]
                if key.strip().startswith("hw.optional.arm.") and val.strip() == "1" \
                        and feat in DARWIN_FEATURES:
                    flags.add(DARWIN_FEATURES[feat])
        else:
            for line in out.splitlines():
                if line.startswith(("machdep.cpu.features", "machdep.cpu.leaf7_features")):
                    flags |= {f.lower().replace(".", "_") for f in line.split(":", 1)[1].split()}
        return frozenset(flags)
    return frozenset()


def this_target(env: Mapping[str, str] | None = None) -> Target:
    """``runtime_target`` of this process (its environment, this CPU)."""
    return runtime_target(env, host_flags())
