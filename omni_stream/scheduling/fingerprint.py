"""Hardware fingerprint: the key under which calibrated scheduling parameters are cached.

It covers what changes the speed of a frame and nothing that does not: CPU model, core counts,
the ISA extensions the kernels dispatch on (AVX2 / AVX-512 / AMX / NEON / SVE...), RAM rounded
to whole GiB (exact figures drift with kernel reservations), the torch version and the GPU
model. Hostname, load, clock speed and free memory are left out on purpose: they change
without the hardware changing.

Nothing here imports torch or initialises CUDA (a CUDA context in the server process would cost
GPU memory): the torch version comes from package metadata and the GPU name from the driver's
/proc entries or ``nvidia-smi``, or from torch only if this process already initialised CUDA.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from typing import Any, Mapping

log = logging.getLogger(__name__)

SCHEMA = 1  # bump when the fields change: every cached calibration becomes stale

# ISA flags that matter for inference kernels (x86 /proc/cpuinfo "flags", arm "Features")
RELEVANT_FLAGS = frozenset({
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "neon", "asimd", "asimdhp", "asimddp", "fphp", "sve", "sve2", "bf16", "i8mm", "sme", "sme2",
})


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _cpuinfo() -> tuple[str, list[str]]:
    """(model name, relevant ISA flags) from /proc/cpuinfo, or platform fallbacks."""
    text = _read("/proc/cpuinfo")
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if not model and key in ("model name", "hardware", "processor") and not value.strip().isdigit():
            model = value.strip()
        elif key == "cpu part" and not model:
            model = f"arm part {value.strip()}"
        elif key in ("flags", "features"):
            flags.update(value.split())
    if not model:
        model = platform.processor() or platform.machine() or "unknown"
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        flags.add("neon")  # mandatory on AArch64 (reported as "asimd" on Linux)
    return model, sorted(flags & RELEVANT_FLAGS)


def _ram_gib() -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) * 1024 / (1 << 30))
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))
    except (ValueError, OSError, AttributeError):
        return None


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_names() -> list[str]:
    names = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        for line in _read(info).splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    if names:
        return names
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=False)
            names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("nvidia-smi failed: %s", e)
    if names:
        return names
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except (RuntimeError, AttributeError) as e:
            log.debug("torch GPU query failed: %s", e)
    return []


def fingerprint_info(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fields the fingerprint hashes. ``overrides`` replaces fields (tests, emulating
    another machine)."""
    model, flags = _cpuinfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    info: dict[str, Any] = dict(
        schema=SCHEMA,
        machine=platform.machine().lower(),
        system=platform.system().lower(),
        cpu_model=model,
        cpu_count=os.cpu_count() or 1,
        cpu_usable=usable,
        isa=flags,
        ram_gib=_ram_gib(),
        torch=_torch_version(),
        gpus=_gpu_names(),
    )
    if overrides:
        info.update(overrides)
    return info


def hardware_fingerprint(info: Mapping[str, Any] | None = None) -> str:
    """Stable 16-hex-digit hash of ``info`` (default: this machine's ``fingerprint_info()``)."""
    info = fingerprint_info() if info is None else info
    blob = json.dumps(dict(info), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


__all__ = ["fingerprint_info", "hardware_fingerprint", "RELEVANT_FLAGS", "SCHEMA"]
