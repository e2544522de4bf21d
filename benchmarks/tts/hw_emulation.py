"""``omni-stream profile`` on this machine and on emulated hardware classes, as one table, and
the native engine's frame priced on each CPU class from its published memory bandwidth.

Each emulated machine is a full ``OMNI_STREAM_HW_PROFILE`` description (the probe is skipped),
run through the real command in a fresh process, so the table is exactly what ``serve --profile
auto`` would start with there. The CPU classes also get ``OMNI_STREAM_BANDWIDTH_GBS`` set to
their published bandwidth (see BANDWIDTH: the figure, and where it comes from), so the weight
path is the one the profile prices at that figure, and the frame of that path is priced here the
same way (``edge.derive.priced_frame_s`` of ``engine.cpu.plans.frame_reads``: the bytes a frame
reads over the bandwidth). Those frame times are priced, not measured: nothing ran on those
machines, the figures are the chips' theoretical peaks (what a few cores of them reach is
lower), and the kernel level is the one the profile predicts from the ISA list.

Writes docs/profiles.md and benchmarks/tts/results/hw_emulation.md (the same text) and
benchmarks/tts/results/hw_emulation.json.

    python benchmarks/tts/hw_emulation.py --model /tmp/ck-06b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

ARM_ISA = ["neon", "asimd", "asimdhp", "asimddp", "fphp"]  # ARMv8.2 with dotprod and fp16
AVX2_ISA = ["avx", "avx2", "fma", "f16c"]
AVX512_ISA = AVX2_ISA + ["avx512f", "avx512bw", "avx512vl", "avx512_vnni"]


def _cpu(model: str, arch: str, isa: list[str], clusters: list, ram_gb: float,
         hardware_class: str = "arm64_cpu", threads_per_core: int = 1, **more) -> dict:
    """A full HardwareProfile description of a CPU machine; ``clusters``: [(cores, kHz), ...],
    fastest first (CPU ids numbered in that order)."""
    out, first = [], 0
    for n, khz in clusters:
        out.append([list(range(first, first + n * threads_per_core)), khz])
        first += n * threads_per_core
    cores = sum(n for n, _ in clusters)
    return {"hardware_class": hardware_class, "arch": arch, "cpu_model": model,
            "physical_cores": cores, "logical_cpus": cores * threads_per_core, "isa": isa,
            "clusters": out, "numa_nodes": 1, "ram_gb": ram_gb, "cuda": None, **more}


# short label -> (description, OMNI_STREAM_HW_PROFILE or None for this machine)
MACHINES: dict[str, tuple[str, dict | None]] = {
    "this machine": ("this machine (probed)", None),
    "Graviton3 16c": ("arm64_cpu: Graviton3-class server, 16 cores", _cpu(
        "Neoverse-V1", "aarch64", ARM_ISA + ["i8mm", "bf16", "sve", "svebf16", "svei8mm"],
        [(16, 2600000)], 32.0)),
    "H100 box": ("cuda_discrete: H100 80 GB box, 32 cores", {
        "hardware_class": "cuda_discrete", "arch": "x86_64", "cpu_model": "AMD EPYC 9454",
        "physical_cores": 32, "logical_cpus": 64, "isa": AVX512_ISA + ["avx512_bf16"],
        "clusters": [[list(range(64)), 3800000]], "numa_nodes": 1, "ram_gb": 256.0,
        "cuda": {"name": "NVIDIA H100 80GB HBM3", "total_memory_gb": 79.1,
                 "unified_memory": False, "compute_capability": [9, 0]}}),
    # Cortex-A78AE is ARMv8.2: dotprod, no i8mm (tests/data/hw/jetson_orin_nano's cpuinfo)
    "Orin Nano (GPU)": ("jetson: Orin Nano 8 GB", {
        **_cpu("Cortex-A78AE", "aarch64", ARM_ISA, [(6, 1510000)], 7.4),
        "hardware_class": "jetson", "cuda": {"name": "Orin", "total_memory_gb": 7.4,
                                            "unified_memory": True, "compute_capability": [8, 7]}}),
    "X4 phone (NPU class)": ("npu_phone: 1+3+4 big.LITTLE phone SoC (Cortex-X4), 12 GB", _cpu(
        "Cortex-X4", "aarch64", ARM_ISA + ["i8mm", "bf16", "sve2"],
        [(1, 3300000), (3, 3150000), (4, 2270000)], 11.2, hardware_class="npu_phone",
        npu="hexagon-v75")),
    "Zen 3 laptop": ("x86_cpu: AVX2 laptop, AMD Ryzen 7 5800U (Zen 3), 8 cores", _cpu(
        "AMD Ryzen 7 5800U", "x86_64", AVX2_ISA, [(8, 4400000)], 16.0,
        hardware_class="x86_cpu", threads_per_core=2)),
    "Apple M2": ("arm64_cpu: Apple M2, 4 P + 4 E cores, 16 GB", _cpu(
        "Apple M2", "arm64", ARM_ISA + ["i8mm", "bf16"], [(4, 3490000), (4, 2420000)], 16.0)),
    "Graviton3 4 vCPU": ("arm64_cpu: Graviton3 (c7g.xlarge), 4 vCPU", _cpu(
        "Neoverse-V1", "aarch64", ARM_ISA + ["i8mm", "bf16", "sve", "svebf16", "svei8mm"],
        [(4, 2600000)], 8.0)),
    "Pi 5": ("arm64_cpu: Raspberry Pi 5 (Cortex-A76), 4 cores, 8 GB", _cpu(
        "Cortex-A76", "aarch64", ARM_ISA, [(4, 2400000)], 8.0)),
    "Orin Nano CPU": ("arm64_cpu: Jetson Orin Nano 8 GB, CPU side (6 Cortex-A78AE)", _cpu(
        "Cortex-A78AE", "aarch64", ARM_ISA, [(6, 1510000)], 7.4)),
    "X3 phone": ("arm64_cpu: phone SoC, 1 Cortex-X3 + 3 A715 + 4 A510 (Dimensity 9200 class)",
                 _cpu("Cortex-X3", "aarch64", ARM_ISA + ["i8mm", "bf16", "sve2"],
                      [(1, 3050000), (3, 2850000), (4, 1800000)], 12.0)),
}
# short label -> (GB/s the profile prices with, what that figure is). Published theoretical
# peaks of the memory interface (transfer rate x bus width) unless said otherwise; a few cores
# of a chip reach less than its peak, so every frame priced from these is a lower bound.
BANDWIDTH: dict[str, tuple[float, str]] = {
    "Graviton3 16c": (76.8, "16/64 share of Graviton3's 307.2 GB/s socket peak (DDR5-4800 x 8 "
                            "channels, AWS)"),
    "X4 phone (NPU class)": (76.8, "LPDDR5X-9600, 64-bit (Snapdragon 8 Gen 3 class), peak"),
    "Zen 3 laptop": (51.2, "DDR4-3200 dual channel (AMD's spec for the 5800U), peak"),
    "Apple M2": (100.0, "Apple's published 100 GB/s unified memory bandwidth (LPDDR5-6400, "
                        "128-bit)"),
    "Graviton3 4 vCPU": (19.2, "4/64 share of Graviton3's 307.2 GB/s socket peak (DDR5-4800 x "
                               "8 channels, AWS); an instance may draw more while its neighbours "
                               "idle"),
    "Pi 5": (17.1, "LPDDR4X-4267, 32-bit (Raspberry Pi's spec), peak; no measured STREAM "
                   "figure is cited here"),
    "Orin Nano CPU": (68.0, "NVIDIA's published 68 GB/s (LPDDR5, 128-bit), shared with the GPU"),
    "X3 phone": (68.3, "LPDDR5X-8533, 64-bit (MediaTek's spec for the Dimensity 9200), peak"),
}
COLUMNS = ["device", "engine", "dtype", "weight_path", "max_streams", "max_seq_len",
           "kv_budget_mb", "placement", "talker_threads", "cp_threads", "codec_threads",
           "cpu_sets", "lend_cores", "cuda_graphs", "compile", "first_chunk", "steady_chunk",
           "queue_timeout_s"]
PRICED_PATHS = ("mixed", "int6", "int5", "int4")


def run(model: str, override: dict | None, bandwidth: float | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("OMNI_STREAM_HW_PROFILE", "OMNI_STREAM_BANDWIDTH_GBS", "OMNI_STREAM_CPU_ISA"):
        env.pop(k, None)
    if override is not None:
        env["OMNI_STREAM_HW_PROFILE"] = json.dumps(override)
    if bandwidth is not None:
        env["OMNI_STREAM_BANDWIDTH_GBS"] = str(bandwidth)
    r = subprocess.run([sys.executable, "-m", "omni_stream.cli", "profile", "--model", model,
                        "--json"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"omni-stream profile failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def priced_ms(model: str, bandwidth: float) -> dict[str, float]:
    """Each low-bit native path's frame (ms) at ``bandwidth`` GB/s: its weight bytes over the
    bandwidth (``priced_frame_s`` without kernel rates: the pricing of an unmeasured machine)."""
    from omni_stream.checkpoints.default import resolve_model_path
    from omni_stream.checkpoints.io import read_config
    from omni_stream.edge.derive import priced_frame_s
    from omni_stream.engine.cpu.plans import frame_reads
    from omni_stream.engine.loading import NATIVE_PLANS

    cfg = read_config(resolve_model_path(model))
    return {wp: round(priced_frame_s(frame_reads(cfg.talker, plan), bandwidth) * 1e3, 1)
            for wp, plan in NATIVE_PLANS.items() if wp in ("int8",) + PRICED_PATHS}


def cell(v) -> str:
    if isinstance(v, dict):
        return " ".join(f"{k}={','.join(map(str, ids))}" for k, ids in v.items()) or "-"
    if isinstance(v, bool):
        return "on" if v else "off"
    return "-" if v is None else str(v)


def main() -> int:
    from omni_stream.edge.derive import FRAME_S, REALTIME_MODEL_SHARE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "profiles.md"))
    ap.add_argument("--md", default=str(ROOT / "benchmarks/tts/results/hw_emulation.md"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/hw_emulation.json"))
    a = ap.parse_args()
    machine = machine_info()
    results = {}
    for short, (name, override) in MACHINES.items():
        bw = BANDWIDTH.get(short, (None, None))[0]
        results[short] = dict(name=name, **run(a.model, override, bw))
        p = results[short]["profile"]
        if override is None:  # this machine: priced from the bandwidth measured here
            bw, basis = machine["bandwidth_gbs"], (f"measured here on {machine['bandwidth_threads']} "
                                                   "threads (machine_info)")
        else:
            basis = BANDWIDTH.get(short, (None, None))[1]
        if p["device"] == "cpu" and p["engine"] == "native" and bw:
            ms = priced_ms(a.model, bw)
            results[short]["priced"] = dict(
                bandwidth_gbs=bw, basis=basis, frame_ms=ms,
                weight_path_ms=ms.get(p["weight_path"]),
                budget_ms=round(REALTIME_MODEL_SHARE * FRAME_S * 1e3, 1),
                note="priced, not measured: the frame's weight bytes over the bandwidth "
                     "(edge.derive.priced_frame_s); the kernels' own rates and the cache are "
                     "not counted")
    names = list(results)
    budget = REALTIME_MODEL_SHARE * FRAME_S * 1e3
    lines = ["# Effective profiles by hardware class", "",
             "What `omni-stream serve --profile auto` starts with on this build machine and on "
             f"{len(names) - 1}", "emulated machines (`OMNI_STREAM_HW_PROFILE`), for the model "
             f"`{Path(a.model).name}`. Generated by",
             f"`python benchmarks/tts/hw_emulation.py --model {a.model}`; the sources of each",
             "value (default, class file, derived, calibration, user) are listed per machine below.",
             "", "| field | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    lines.append("| native kernels | " + " | ".join(
        (results[n]["native_kernels"]["kernels"] or "none") for n in names) + " |")
    for col in COLUMNS:
        lines.append(f"| {col} | " + " | ".join(cell(results[n]["profile"][col]) for n in names)
                     + " |")
    lines += ["", "## The native engine's frame on each CPU class: priced, not measured", "",
              "Where the profile runs the native engine on the CPU, the frame of its weight path "
              "priced from the", "bandwidth: the bytes a frame reads (talker once, the code "
              "predictor's 15 sub-steps) over the", "figure (`edge.derive.priced_frame_s`, as "
              "`serve` prices an unmeasured machine; `OMNI_STREAM_BANDWIDTH_GBS`", "was set to it, "
              "so the weight path is the one the profile prices there). Real time on paper: the",
              f"frame within {budget:.0f} ms ({REALTIME_MODEL_SHARE:.0%} of the 80 ms frame; the "
              "rest is the codec's share, scheduling and margin).", "",
              "Nothing ran on those machines: the figures are published theoretical peaks (a few "
              "cores of a chip", "reach less, so each frame here is a lower bound), the kernel "
              "level is the one predicted from the ISA", "list, and the kernels' own rates and "
              "caches are not counted. Only \"this machine\" was measured (its", "bandwidth; "
              "its frame is still priced by bytes here).", "",
              "| machine | kernels | threads (talker/cp/codec) | dtype | weight path | GB/s | "
              "frame ms (that path) | mixed / int4 ms | real time on paper | bandwidth basis |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        pr = results[n].get("priced")
        if not pr:
            continue
        p = results[n]["profile"]
        wms = pr["weight_path_ms"]
        lines.append(
            f"| {n} | {results[n]['native_kernels']['kernels']} | {p['talker_threads']}/"
            f"{p['cp_threads']}/{p['codec_threads']} | {p['dtype']} | {p['weight_path']} | "
            f"{pr['bandwidth_gbs']:g} | {wms} | {pr['frame_ms']['mixed']} / {pr['frame_ms']['int4']} | "
            f"{'yes' if wms is not None and wms <= budget else 'no'} | {pr['basis']} |")
    lines += ["", "## Machines", ""]
    for n in names:
        hw = results[n]["hardware"]
        nk = results[n]["native_kernels"]
        lines.append(f"- **{n}** ({results[n]['name']}): {hw['hardware_class']}, {hw['arch']}, "
                     f"{hw['cpu_model']}, {hw['physical_cores']} cores, {hw['ram_gb']} GiB, "
                     f"ISA {' '.join(hw['isa'])}"
                     + (f", GPU {hw['cuda']['name']} ({'unified' if hw['cuda']['unified_memory'] else 'discrete'}"
                        f" {hw['cuda']['total_memory_gb']} GB)" if hw.get("cuda") else "")
                     + (f", NPU {hw['npu']}" if hw.get("npu") else "") + ". Native kernels: "
                     f"{nk['kernels'] or 'none'} ({nk['note'] or 'its library reports it'}).")
        src = results[n]["sources"]
        by = {}
        for k, s in src.items():
            by.setdefault(s, []).append(k)
        lines.append("  Sources: " + "; ".join(f"{s}: {', '.join(ks)}" for s, ks in sorted(by.items())))
    text = "\n".join(lines) + "\n"
    Path(a.doc).write_text(text)
    Path(a.md).write_text(text)
    Path(a.out).write_text(json.dumps(dict(model=a.model, machines=results, machine=machine,
                                           bandwidth=BANDWIDTH,
                                           command=" ".join(["python", "benchmarks/tts/hw_emulation.py"] + sys.argv[1:])),
                                      indent=2))
    print_machine(machine)
    print(text)
    print(f"wrote {a.doc}, {a.md} and {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
