"""Build (once) and load the CPU runtime library, ``omni_cpu.cpp``, with the host compiler.

The library is plain C++ with a C ABI (no torch headers, so it compiles in seconds) and is
built for the machine it runs on (``-march=native``: the kernel set of ``kernels/isa.h`` the CPU
has, AVX-512 VNNI, AVX2 or NEON; the scalar reference elsewhere). ``OMNI_STREAM_CPU_ISA`` caps
the level, and an ``OMNI_STREAM_HW_PROFILE`` ``isa`` list builds the emulated machine's set
(``engine.cpu.isa``: the levels and their flags). The shared object is cached under
``<cache>/cpu-engine/<key>/`` where the key hashes the source, the compiler, the flags and the
CPU's features, so a second start loads it at once and another CPU or cap gets its own build.
``bash scripts/setup.sh`` builds it at install time; ``ensure_library()`` builds it on first
use otherwise. A failed build raises ``BuildError`` with the fix in its message; the server then
runs the torch engine (``orchestrator.flags.pipeline_settings``).

macOS arm64 (Apple clang) is handled here but untested (no such machine in CI): clang has no
``-march=native`` there, so the build uses ``-mcpu=native`` where the compiler accepts it and
``-mcpu=apple-m1`` otherwise, links with ``-dynamiclib`` into ``libomni_cpu.dylib`` and needs
no ``-lpthread`` (libSystem has the threads).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from omni_stream.checkpoints.default import cache_dir
from omni_stream.engine.cpu import isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("omni_cpu.cpp")  # includes the oc_*.h beside it
HEADERS = sorted([*Path(__file__).parent.glob("oc_*.h"), *Path(__file__).parent.glob("kernels/*.h")])
# the native build on Linux (no cap, no emulation): what ``default_flags()`` gives on most machines
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")
DARWIN = platform.system() == "Darwin"
LIB_NAME = "libomni_cpu.dylib" if DARWIN else "libomni_cpu.so"


class BuildError(RuntimeError):
    """The CPU runtime could not be compiled; the message names what is missing."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return " ".join(sorted(isa.host_flags())) or platform.processor()


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else g++, c++ or clang++ on the PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        found = shutil.which(cxx)
        if not found:
            raise BuildError(f"CXX={cxx} is not a compiler on this machine: set CXX to an "
                             "installed C++ compiler (g++ or clang++), or unset it, or run with "
                             "--engine torch")
        return found
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        fix = ("xcode-select --install" if DARWIN else
               "Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; "
               "Alpine: apk add g++")
        raise BuildError(f"no C++ compiler found (g++, c++ or clang++): install one ({fix}) "
                         "or run with --engine torch")
    return cxx


@lru_cache(maxsize=None)
def _accepts(cxx: str, flag: str) -> bool:
    """Whether ``cxx`` compiles an empty file with ``flag`` (macOS: -mcpu=native)."""
    try:
        r = subprocess.run([cxx, flag, "-x", "c++", "-fsyntax-only", "-"], input="",
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def default_flags(target: isa.Target | None = None) -> tuple[str, ...]:
    """The flags of the library this process runs: ``FLAGS`` with the target's architecture
    flags (``isa.this_target()``: this CPU under ``OMNI_STREAM_CPU_ISA`` / an emulated
    machine's ``isa`` list). Raises ValueError on an invalid ``OMNI_STREAM_CPU_ISA``."""
    target = target or isa.this_target()
    flags = isa.compile_flags(target, tuple(f for f in FLAGS if f != "-march=native"))
    if target.system == "Darwin" and "-mcpu=native" in flags and not _accepts(compiler(), "-mcpu=native"):
        flags = tuple("-mcpu=apple-m1" if f == "-mcpu=native" else f for f in flags)
    return flags


def _checked_flags() -> tuple[str, ...]:
    try:
        return default_flags()
    except ValueError as e:  # an OMNI_STREAM_CPU_ISA that is no level of this CPU
        raise BuildError(str(e)) from None


def library_path(flags: tuple[str, ...] | None = None) -> Path:
    """Where the build with ``flags`` (default: ``default_flags()``) is cached."""
    flags = _checked_flags() if flags is None else flags
    cxx = compiler()
    parts = [p.read_bytes() for p in (SOURCE, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*parts, cxx.encode(), " ".join(flags).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / "cpu-engine" / key / LIB_NAME


def _fix(stderr: str) -> str:
    """What to do about a failed compile, from the compiler's words."""
    low = stderr.lower()
    if "march=" in low or "mcpu=" in low or "unknown target cpu" in low or "bad value" in low:
        return (f"this compiler does not know this CPU: update it, or set {isa.CAP_ENV}=avx2 "
                f"(x86-64) or {isa.CAP_ENV}=scalar to build a lower kernel level, or run with "
                "--engine torch")
    if "immintrin" in low or "arm_neon" in low or "no such file" in low:
        return "the compiler's headers are missing: install the full C++ toolchain, or run with --engine torch"
    return (f"update the compiler (GCC >= 10 or clang >= 12), or set {isa.CAP_ENV}=scalar for "
            "the portable kernels, or run with --engine torch")


def build(out: Path | None = None, flags: tuple[str, ...] | None = None) -> Path:
    """Compile the library (if not cached) and return its path. ``flags`` other than
    ``default_flags()`` build e.g. another kernel set (tests). Raises ``BuildError`` (no
    compiler, a failed compile: the message names the fix)."""
    flags = _checked_flags() if flags is None else flags
    out = out or library_path(flags)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [compiler(), *flags, "-o", str(tmp), str(SOURCE), *(() if DARWIN else ("-lpthread",))]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise BuildError(f"running the compiler {cmd[0]} failed ({e}): set CXX to a working "
                             "C++ compiler, or run with --engine torch") from None
        if r.returncode != 0:
            raise BuildError(f"compiling {SOURCE.name} failed: {_fix(r.stderr)}. The command was "
                             f"{' '.join(cmd)}:\n{r.stderr[-3000:]}")
        tmp.replace(out)
        log.info("built the CPU runtime in %.1f s: %s", time.perf_counter() - t0, out)
    return out


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path``; a file that does not load raises ``BuildError``."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"the built CPU runtime {path} does not load ({e}): delete "
                         f"{path.parent} to rebuild it, or run with --engine torch") from None


@lru_cache(maxsize=1)
def ensure_library() -> ctypes.CDLL:
    """The loaded library (built on first use)."""
    return load(build())


def kernels(lib: ctypes.CDLL) -> str:
    """What ``lib`` runs, as it reports it (``oc_isa()``), e.g. 'avx2+fma+f16c'."""
    lib.oc_isa.restype = ctypes.c_char_p
    return lib.oc_isa().decode()


if __name__ == "__main__":  # python -m omni_stream.engine.cpu.build: the install-time build
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        target = isa.this_target()
        path = build()
        lib = load(path)
    except (BuildError, ValueError) as e:
        print(f"the CPU runtime was not built: {e}", file=sys.stderr)
        sys.exit(1)
    print(path)
    print(f"native kernels: {kernels(lib)} ({target.why})")
