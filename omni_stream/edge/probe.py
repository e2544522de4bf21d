"""Hardware probe: what machine are we on, as one frozen, validated ``HardwareProfile``.

Everything is read from files under ``root`` (``/proc``, ``/sys``, ``/etc``) so tests can point
the probe at small recorded trees (``tests/data/hw/<machine>/``); CUDA facts come in as a plain
dict (``torch_cuda_info()`` on a real machine, a fake dict in tests) so the probe itself never
imports torch. ``OMNI_STREAM_HW_PROFILE=<json>`` replaces probed fields, which is how tests and
benchmarks emulate another hardware class on the machine at hand.

The profile only states facts; deciding dtype, threads or placement from them is
``edge.adapt``'s job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

ENV_VAR = "OMNI_STREAM_HW_PROFILE"
HARDWARE_CLASSES = ("x86_cpu", "arm64_cpu", "cuda_discrete", "jetson", "npu_phone")
SOURCES = ("probe", "override", "probe+override")
CUDA_CLASSES = ("cuda_discrete", "jetson")
CUDA_KEYS = ("name", "total_memory_gb", "unified_memory", "compute_capability")

# ISA flags that matter for inference kernels; everything else in /proc/cpuinfo is dropped.
X86_ISA = frozenset({
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
    "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "gfni",
})
ARM_ISA = frozenset({
    "neon", "asimd", "asimdhp", "asimddp", "fphp", "i8mm", "bf16", "sve", "sve2", "svei8mm",
    "svebf16", "sme",
})

# (CPU implementer, CPU part) -> core name, for ARM cpuinfo which has no 'model name'.
ARM_PARTS = {
    ("0x41", "0xd03"): "Cortex-A53", ("0x41", "0xd05"): "Cortex-A55",
    ("0x41", "0xd08"): "Cortex-A72", ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0c"): "Neoverse-N1", ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd41"): "Cortex-A78", ("0x41", "0xd42"): "Cortex-A78AE",
    ("0x41", "0xd44"): "Cortex-X1", ("0x41", "0xd46"): "Cortex-A510",
    ("0x41", "0xd47"): "Cortex-A710", ("0x41", "0xd48"): "Cortex-X2",
    ("0x41", "0xd49"): "Neoverse-N2", ("0x41", "0xd4d"): "Cortex-A715",
    ("0x41", "0xd4e"): "Cortex-X3", ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x41", "0xd80"): "Cortex-A520", ("0x41", "0xd81"): "Cortex-A720",
    ("0x41", "0xd82"): "Cortex-X4",
}

Cluster = tuple[tuple[int, ...], int]  # (cpu ids, max_freq_khz); 0 kHz = frequency unknown


@dataclass(frozen=True)
class HardwareProfile:
    """Facts about the machine. Lists given for ``isa``/``clusters`` are normalised here, so the
    JSON override and the probe share one constructor and one set of checks."""

    hardware_class: str
    arch: str
    cpu_model: str
    physical_cores: int
    logical_cpus: int
    isa: frozenset[str]
    clusters: tuple[Cluster, ...]  # biggest (fastest) cluster first
    numa_nodes: int
    ram_gb: float  # GiB, from MemTotal
    cuda: dict[str, Any] | None = field(default=None, hash=False)
    npu: str | None = None
    source: str = "probe"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are stored once, here
        if self.hardware_class not in HARDWARE_CLASSES:
            raise ValueError(f"unknown hardware_class {self.hardware_class!r}; "
                             f"valid: {', '.join(HARDWARE_CLASSES)}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}; valid: {', '.join(SOURCES)}")
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(f"arch must be a non-empty string, got {self.arch!r}")
        if not isinstance(self.cpu_model, str):
            raise ValueError(f"cpu_model must be a string, got {self.cpu_model!r}")
        for name in ("physical_cores", "logical_cpus", "numa_nodes"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.logical_cpus < self.physical_cores:
            raise ValueError(f"logical_cpus ({self.logical_cpus}) < physical_cores "
                             f"({self.physical_cores}); set both consistently")
        if isinstance(self.ram_gb, bool) or not isinstance(self.ram_gb, (int, float)) \
                or self.ram_gb <= 0:
            raise ValueError(f"ram_gb must be a number > 0, got {self.ram_gb!r}")
        set_(self, "ram_gb", float(self.ram_gb))
        if isinstance(self.isa, str) or not all(isinstance(f, str) for f in self.isa):
            raise ValueError(f"isa must be a list of flag strings, got {self.isa!r}")
        set_(self, "isa", frozenset(self.isa))
        set_(self, "clusters", _normalise_clusters(self.clusters))
        set_(self, "cuda", _normalise_cuda(self.cuda))
        if self.hardware_class in CUDA_CLASSES and self.cuda is None:
            raise ValueError(f"hardware_class {self.hardware_class!r} needs cuda info; add "
                             f"'cuda': {{{', '.join(CUDA_KEYS)}}} to the {ENV_VAR} override")
        if self.npu is not None and (not isinstance(self.npu, str) or not self.npu):
            raise ValueError(f"npu must be null or a non-empty string, got {self.npu!r}")

    @property
    def big_cores(self) -> tuple[int, ...]:
        """CPU ids of the fastest cluster (all CPUs on a uniform machine)."""
        return self.clusters[0][0]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _normalise_clusters(clusters: Any) -> tuple[Cluster, ...]:
    try:
        out = tuple((tuple(int(c) for c in ids), int(freq)) for ids, freq in clusters)
    except (TypeError, ValueError) as e:
        raise ValueError(f"clusters must be a list of [cpu_ids, max_freq_khz], got {clusters!r}") \
            from e
    if not out or any(not ids for ids, _ in out):
        raise ValueError(f"clusters must be non-empty lists of cpu ids, got {clusters!r}")
    seen = [c for ids, _ in out for c in ids]
    if len(seen) != len(set(seen)):
        raise ValueError(f"clusters share cpu ids: {clusters!r}")
    freqs = [f for _, f in out]
    if freqs != sorted(freqs, reverse=True) or min(freqs) < 0:
        raise ValueError(f"clusters must be ordered fastest first with freq >= 0: {clusters!r}")
    return out


def _normalise_cuda(cuda: Any) -> dict[str, Any] | None:
    if cuda is None:
        return None
    if not isinstance(cuda, Mapping):
        raise ValueError(f"cuda must be null or an object with {', '.join(CUDA_KEYS)}; "
                         f"got {cuda!r}")
    unknown = sorted(set(cuda) - set(CUDA_KEYS))
    missing = [k for k in CUDA_KEYS if k not in cuda]
    if unknown or missing:
        raise ValueError(f"cuda keys: unknown {unknown}, missing {missing}; "
                         f"valid: {', '.join(CUDA_KEYS)}")
    cc = tuple(cuda["compute_capability"])
    if len(cc) != 2 or not all(_is_int(x) for x in cc):
        raise ValueError(f"cuda.compute_capability must be [major, minor], got {cc!r}")
    if not isinstance(cuda["unified_memory"], bool):
        raise ValueError(f"cuda.unified_memory must be a bool, got {cuda['unified_memory']!r}")
    return {"name": str(cuda["name"]), "total_memory_gb": float(cuda["total_memory_gb"]),
            "unified_memory": cuda["unified_memory"], "compute_capability": cc}


# ---------------------------------------------------------------- probing


def torch_cuda_info() -> dict[str, Any] | None:
    """CUDA device 0 as a plain dict for ``probe``, or None without torch or without CUDA.

    torch is imported here, not at module import, so probing a CPU-only box stays cheap."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "total_memory_gb": round(props.total_memory / 2**30, 2),
            "compute_capability": (props.major, props.minor),
            "integrated": bool(getattr(props, "is_integrated", False))}


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(errors="replace")
    except OSError:
        return None


def _parse_cpuinfo(text: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Per-processor blocks, plus the trailing keys outside any block (ARM 'Hardware')."""
    blocks: list[dict[str, str]] = []
    extra: dict[str, str] = {}
    cur: dict[str, str] | None = None
    for line in text.splitlines():
        if ":" not in line:
            cur = None if not line.strip() else cur
            continue
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "processor":
            cur = {"processor": val}
            blocks.append(cur)
        elif cur is not None:
            cur[key] = val
        else:
            extra[key] = val
    return blocks, extra


def _arch(blocks: list[dict[str, str]], root: Path) -> str:
    first = blocks[0] if blocks else {}
    if "flags" in first:
        return "x86_64" if "lm" in first["flags"].split() else "i686"
    if "Features" in first:
        return "aarch64" if first.get("CPU architecture", "8") == "8" else "armv7l"
    return platform.machine() if str(root) == "/" else "unknown"


def _cpu_model(blocks: list[dict[str, str]], extra: dict[str, str]) -> str:
    if blocks and blocks[0].get("model name"):
        return blocks[0]["model name"]
    parts: list[str] = []
    for b in blocks:
        key = (b.get("CPU implementer", ""), b.get("CPU part", ""))
        if key != ("", ""):
            name = ARM_PARTS.get(key, f"{key[0]}:{key[1]}")
            if name not in parts:
                parts.append(name)
    cores = " + ".join(parts)
    hw = extra.get("Hardware") or (blocks[0].get("Hardware") if blocks else None)
    if hw:
        return f"{hw} ({cores})" if cores else hw
    return cores or "unknown"


def _isa(blocks: list[dict[str, str]], arch: str) -> frozenset[str]:
    first = blocks[0] if blocks else {}
    flags = set((first.get("flags") or first.get("Features") or "").split())
    if arch.startswith("x86") or arch == "i686":
        return frozenset(flags & X86_ISA)
    isa = flags & ARM_ISA
    if "asimd" in isa:
        isa.add("neon")  # AArch64 Advanced SIMD is NEON; adapt code asks for 'neon'
    return frozenset(isa)


def _int_file(root: Path, rel: str) -> int | None:
    text = _read(root, rel)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _physical_cores(root: Path, cpus: list[int], blocks: list[dict[str, str]]) -> int:
    cores = set()
    for c in cpus:
        base = f"sys/devices/system/cpu/cpu{c}/topology"
        core = _int_file(root, f"{base}/core_id")
        pkg = _int_file(root, f"{base}/physical_package_id")
        if core is None:
            break
        cores.add((pkg, core))
    else:
        if cores:
            return len(cores)
    # No sysfs topology: fall back to cpuinfo's physical id / core id (x86 only), then 1:1.
    pairs = {(b.get("physical id"), b.get("core id")) for b in blocks}
    if blocks and all(k != (None, None) for k in pairs):
        return len(pairs)
    return len(cpus)


def _clusters(root: Path, cpus: list[int]) -> tuple[Cluster, ...]:
    by_freq: dict[int, list[int]] = {}
    for c in cpus:
        f = _int_file(root, f"sys/devices/system/cpu/cpu{c}/cpufreq/cpuinfo_max_freq")
        by_freq.setdefault(f or 0, []).append(c)
    if 0 in by_freq and len(by_freq) > 1:  # partial cpufreq data: don't invent a cluster
        return ((tuple(cpus), 0),)
    return tuple((tuple(ids), f) for f, ids in sorted(by_freq.items(), reverse=True))


def _numa_nodes(root: Path) -> int:
    node_dir = root / "sys/devices/system/node"
    try:
        n = sum(1 for p in node_dir.iterdir() if re.fullmatch(r"node\d+", p.name))
    except OSError:
        n = 0
    return max(n, 1)


def _ram_gb(root: Path) -> float:
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read(root, "proc/meminfo") or "", re.M)
    if not m:
        raise RuntimeError(f"no MemTotal in {root / 'proc/meminfo'}; set ram_gb via {ENV_VAR}")
    return round(int(m.group(1)) / 2**20, 2)


def _is_tegra(root: Path, extra: dict[str, str]) -> bool:
    if (root / "etc/nv_tegra_release").exists():
        return True
    model = (_read(root, "proc/device-tree/model") or "").strip("\x00\n ").lower()
    return "jetson" in model or "tegra" in model or "tegra" in extra.get("Hardware", "").lower()


def probe(root: str = "/", torch_info: dict[str, Any] | None = None) -> HardwareProfile:
    """Read the machine under ``root``; ``torch_info`` is ``torch_cuda_info()`` or a fake."""
    r = Path(root)
    text = _read(r, "proc/cpuinfo")
    if text is None:
        raise RuntimeError(f"cannot read {r / 'proc/cpuinfo'}; "
                           f"set {ENV_VAR} to describe the machine")
    blocks, extra = _parse_cpuinfo(text)
    cpus = sorted(int(b["processor"]) for b in blocks) or [0]
    arch = _arch(blocks, r)
    tegra = _is_tegra(r, extra)
    cuda = None
    if torch_info is not None:
        cuda = {"name": torch_info["name"], "total_memory_gb": torch_info["total_memory_gb"],
                "compute_capability": tuple(torch_info["compute_capability"]),
                "unified_memory": bool(tegra or torch_info.get("integrated", False))}
    if cuda is not None:
        hw_class = "jetson" if tegra else "cuda_discrete"
    else:
        hw_class = "arm64_cpu" if arch == "aarch64" else "x86_cpu"
    return HardwareProfile(
        hardware_class=hw_class, arch=arch, cpu_model=_cpu_model(blocks, extra),
        physical_cores=_physical_cores(r, cpus, blocks), logical_cpus=len(cpus),
        isa=_isa(blocks, arch), clusters=_clusters(r, cpus), numa_nodes=_numa_nodes(r),
        ram_gb=_ram_gb(r), cuda=cuda, source="probe")


# ---------------------------------------------------------------- override and printing

FIELDS = tuple(f.name for f in dataclasses.fields(HardwareProfile))
OVERRIDABLE = tuple(n for n in FIELDS if n != "source")
_PROBED = tuple(n for n in OVERRIDABLE if n != "npu")  # with all of these given, skip the probe


def parse_override(text: str) -> dict[str, Any]:
    """The ``OMNI_STREAM_HW_PROFILE`` JSON as a dict of field -> value, keys checked."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_VAR} is not valid JSON: {e.msg} at line {e.lineno} column "
                         f"{e.colno} (char {e.pos})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{ENV_VAR} must be a JSON object of HardwareProfile fields, "
                         f"got {type(data).__name__}")
    bad = sorted(set(data) - set(OVERRIDABLE))
    if bad:
        raise ValueError(f"{ENV_VAR}: unknown key(s) {', '.join(map(repr, bad))}; "
                         f"valid: {', '.join(OVERRIDABLE)}")
    return data


def apply_override(base: HardwareProfile, override: Mapping[str, Any]) -> HardwareProfile:
    """Replace the given fields of ``base``. Core counts follow each other: overriding only
    ``physical_cores`` keeps the probed threads-per-core and resets ``clusters`` to one
    cluster of the new CPUs, so an emulated 8-core box on a 2-core runner stays consistent."""
    new = dict(override)
    if "physical_cores" in new and "logical_cpus" not in new and _is_int(new["physical_cores"]):
        threads_per_core = max(1, base.logical_cpus // base.physical_cores)
        new["logical_cpus"] = new["physical_cores"] * threads_per_core
    if "logical_cpus" in new and "clusters" not in new and _is_int(new["logical_cpus"]):
        new["clusters"] = ((tuple(range(new["logical_cpus"])), base.clusters[0][1]),)
    return dataclasses.replace(base, **new, source="probe+override" if new else base.source)


def load_profile(env: Mapping[str, str] | None = None, root: str = "/",
                 torch_info: dict[str, Any] | None = None, *,
                 use_torch: bool = True) -> HardwareProfile:
    """The effective profile: probe, then the ``OMNI_STREAM_HW_PROFILE`` override if set.

    An override naming every probed field is a full description of another machine: the probe
    is skipped (source 'override'). ``torch_info`` None with ``use_torch`` asks torch."""
    env = os.environ if env is None else env
    text = env.get(ENV_VAR, "").strip()
    override = parse_override(text) if text else {}
    if all(k in override for k in _PROBED):
        return HardwareProfile(**override, source="override")
    if torch_info is None and use_torch:
        torch_info = torch_cuda_info()
    base = probe(root, torch_info)
    if override:
        log.info("hardware profile override from %s: %s", ENV_VAR, sorted(override))
    return apply_override(base, override)


def profile_summary(p: HardwareProfile) -> dict[str, Any]:
    """JSON-able dict; also valid as an ``OMNI_STREAM_HW_PROFILE`` value (minus 'source')."""
    cuda = None
    if p.cuda is not None:
        cuda = {**p.cuda, "compute_capability": list(p.cuda["compute_capability"])}
    return {"hardware_class": p.hardware_class, "arch": p.arch, "cpu_model": p.cpu_model,
            "physical_cores": p.physical_cores, "logical_cpus": p.logical_cpus,
            "isa": sorted(p.isa), "clusters": [[list(ids), f] for ids, f in p.clusters],
            "numa_nodes": p.numa_nodes, "ram_gb": p.ram_gb, "cuda": cuda, "npu": p.npu,
            "source": p.source}
