"""Build (once) and load the CPU runtime library, ``omni_cpu.cpp``, with the host compiler.

The library is plain C++ with a C ABI (no torch headers, so it compiles in seconds) and is
built for the machine it runs on (``-march=native``: AVX-512 VNNI where the CPU has it). The
shared object is cached under ``<cache>/cpu-engine/<key>/`` where the key hashes the source, the
compiler and the CPU's flags, so a second start loads it at once and another CPU gets its own
build. ``bash scripts/setup.sh`` builds it at install time; ``ensure_library()`` builds it on
first use otherwise.
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("omni_cpu.cpp")  # includes the oc_*.h beside it
HEADERS = sorted(Path(__file__).parent.glob("oc_*.h"))
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")


class BuildError(RuntimeError):
    """The CPU runtime could not be compiled; the message names what is missing."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise BuildError("no C++ compiler found (g++, c++ or clang++): install one (Debian: "
                         "apt-get install g++) or run with --engine torch")
    return cxx


def library_path(flags: tuple[str, ...] = FLAGS) -> Path:
    cxx = compiler()
    parts = [p.read_bytes() for p in (SOURCE, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*parts, cxx.encode(), " ".join(flags).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / "cpu-engine" / key / "libomni_cpu.so"


def build(out: Path | None = None, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile the library (if not cached) and return its path. ``flags`` other than the
    default build, e.g. for a CPU without AVX-512, the portable scalar path (tests)."""
    out = out or library_path(flags)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [compiler(), *flags, "-o", str(tmp), str(SOURCE), "-lpthread"]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
        tmp.replace(out)
        log.info("built the CPU runtime in %.1f s: %s", time.perf_counter() - t0, out)
    return out


@lru_cache(maxsize=1)
def ensure_library() -> ctypes.CDLL:
    """The loaded library (built on first use)."""
    return ctypes.CDLL(str(build()))


if __name__ == "__main__":  # python -m omni_stream.engine.cpu.build: the install-time build
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build()
    lib = ctypes.CDLL(str(path))
    print(f"{path} (AVX-512 VNNI kernels: {'yes' if lib.oc_has_vnni() else 'no, scalar fallback'}; "
          f"AMX tiles: {'yes' if lib.oc_has_amx() else 'no'})")
