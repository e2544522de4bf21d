"""oneDNN's instruction-set level: what this CPU offers, what a process may use, and the level
the codec's packed bf16 products are pinned to.

oneDNN picks a kernel per call from the shape and the ISA. At ``AVX512_CORE_BF16`` its bf16
inner products (``brg_matmul:avx512_core_bf16``) compute every output row alike whatever the
row count, so a stream's streamed decode is the same bits at any chunk plan and batch
(``tests/test_code2wav.py``). Above that level (AMX tiles) and below it (AVX512_CORE(_VNNI)
emulate bf16 through other kernels, e.g. a GEMV for one row) the kernel, hence the rounding,
follows the row count: one stream's audio then depends on how its frames were chunked and
which streams shared its calls (AMX Xeon: fails; AVX512_CORE_VNNI here: 39.7 dB between two
chunk plans). Below ``AVX512_CORE`` (AVX2 without AVX-NE-CONVERT) oneDNN has no packed bf16
linear at all.

So the processes that run the bf16 streaming decode (the codec stage, a client's torch decoder)
cap oneDNN at ``AVX512_CORE_BF16`` before its first primitive (``pin_decode_isa``): the cap is
the environment variable ``ONEDNN_MAX_CPU_ISA``, which oneDNN reads once, at its first use in a
process. A cap the user set lower is kept (the ISA-emulation tests use that). Where the CPU
lacks AVX512-BF16 no level gives the guarantee; ``decode_invariant`` says so and the server
logs it (the profile never makes bf16 the codec's default there: no native bf16).

Plain Python, no torch import: the level is read from the CPU's flags and the environment.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN's x86 levels, lowest first (``dnnl::cpu_isa``); aliases map onto these names
LEVELS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
          "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
          "AVX10_2_512", "AVX10_2_512_AMX_2")
ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
           "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}
# CPU flags (/proc/cpuinfo) each level needs on top of the one below it
_NEEDS = {
    "SSE41": {"sse4_1"}, "AVX": {"avx"}, "AVX2": {"avx2", "fma"}, "AVX2_VNNI": {"avx_vnni"},
    "AVX2_VNNI_2": {"avx_vnni_int8", "avx_ne_convert"},
    "AVX512_CORE": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "AVX512_CORE_VNNI": {"avx512_vnni"}, "AVX512_CORE_BF16": {"avx512_bf16"},
    "AVX10_1_512": {"avx512_fp16"}, "AVX10_1_512_AMX": {"amx_tile", "amx_int8", "amx_bf16"},
    "AVX10_1_512_AMX_FP16": {"amx_fp16"}, "AVX10_2_512": {"avx10_2"},
    "AVX10_2_512_AMX_2": {"amx_fp8"},
}
# the level the bf16 streaming decode runs at: the one whose kernels treat rows alike
DECODE_LEVEL = "AVX512_CORE_BF16"
# the packed bf16 linear (mkldnn _reorder_linear_weight) needs AVX512BW/VL/DQ or AVX-NE-CONVERT
# the lowest level with a packed bf16 linear (``_reorder_linear_weight`` needs AVX512BW/VL/DQ or
# AVX-NE-CONVERT; below it the call raises)
_PACKING_LEVEL = "AVX2_VNNI_2"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags (empty where there is no /proc/cpuinfo, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported_levels(flags: frozenset[str] | set[str]) -> tuple[str, ...]:
    """The levels this CPU runs, lowest first: each needs its own flags and those of the levels
    below it (the AVX2_VNNI pair aside: the AVX-512 levels do not need the VEX VNNI forms)."""
    out: list[str] = []
    base = set()
    for lv in LEVELS:
        if lv in ("AVX2_VNNI", "AVX2_VNNI_2"):
            if out and out[-1] in ("AVX2", "AVX2_VNNI") and _NEEDS[lv] <= flags:
                out.append(lv)
            continue
        base |= _NEEDS[lv]
        if not base <= flags:
            break
        out.append(lv)
    return tuple(out)


def cpu_level(flags: frozenset[str] | set[str]) -> str | None:
    """The highest oneDNN level this CPU runs; None below SSE4.1 or off x86."""
    levels = supported_levels(flags)
    return levels[-1] if levels else None


def normalise(name: str | None) -> str | None:
    """A level name as oneDNN spells it (upper case, aliases resolved); None for unset,
    ``ALL``/``DEFAULT`` (no cap) and names oneDNN does not know (it ignores those too)."""
    if not name:
        return None
    n = ALIASES.get(name.strip().upper(), name.strip().upper())
    return n if n in LEVELS else None


def _rank(level: str | None) -> int:
    return len(LEVELS) if level is None else LEVELS.index(level)


def effective_level(cap: str | None, flags: frozenset[str] | set[str]) -> str | None:
    """The level oneDNN runs at: the highest the CPU runs that is not above ``cap``."""
    top = _rank(normalise(cap))
    ok = [lv for lv in supported_levels(flags) if _rank(lv) <= top]
    return ok[-1] if ok else None


def packing_available(level: str | None) -> bool:
    """oneDNN can pack a bf16 linear weight at this level (else ``_reorder_linear_weight``
    raises: AVX2 without AVX-NE-CONVERT)."""
    return level is not None and _rank(level) >= _rank(_PACKING_LEVEL)


def decode_invariant(level: str | None) -> bool:
    """The packed bf16 decode gives a stream the same bits at any chunk plan at this level."""
    return level == DECODE_LEVEL


def pin_decode_isa(environ: dict | None = None,
                   flags: frozenset[str] | set[str] | None = None) -> str | None:
    """Cap oneDNN at ``DECODE_LEVEL`` in this process (unless a lower cap is set already) and
    return the level it will run at. Call before the process's first oneDNN primitive: oneDNN
    reads the cap once (the codec stage calls it first thing; ``TorchDecoder`` before its bf16
    model is built). A process that ran oneDNN earlier keeps the level it started with; the
    codec stage's start-up check (``CodecStage.check_invariance``) measures what holds."""
    env = os.environ if environ is None else environ
    flags = cpu_flags() if flags is None else flags
    cur = normalise(env.get(ENV))
    if _rank(cur) > _rank(DECODE_LEVEL):
        env[ENV] = DECODE_LEVEL
    return effective_level(env.get(ENV), flags)


def current_level() -> str | None:
    """The level oneDNN runs at in this process, from the CPU and the cap set now."""
    return effective_level(os.environ.get(ENV), cpu_flags())


__all__ = ["DECODE_LEVEL", "ENV", "LEVELS", "cpu_flags", "cpu_level", "current_level",
           "decode_invariant", "effective_level", "normalise", "packing_available",
           "pin_decode_isa", "supported_levels"]
