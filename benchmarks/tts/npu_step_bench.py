"""NPU decode-step bench: ORT CPU latency per step, roll vs ring, fp32 vs w8a16 vs w4a16, at the 0.6B shape.

For the talker (context 256 by default) and the code predictor (context 16) of a 0.6B-shaped
checkpoint: export both cache layouts, quantize each (calibrated on recorded greedy decodes),
then measure per graph
  * the median ONNX Runtime CPU latency of one step (session.run only) and of one runtime step
    (feeds, run, ring write / window take-back), at a half-full cache;
  * the bytes crossing the graph boundary per step (inputs + outputs, weights excluded);
  * fidelity over one greedy eager history: fp32 graph vs the eager engine, quantized graph vs
    the fp32 graph (logits SNR, top-1 and top-5 agreement).
Writes ``results/npu_step_bench.json`` and ``.md``; exports are cached in ``--work``.

The QDQ graphs' CPU latency is whatever ONNX Runtime's graph optimizer makes of them (it may
fold weight DequantizeLinear + MatMul into integer kernels, and runs the 16-bit activation
Q/DQ pairs as extra elementwise work): a CPU figure, not an NPU one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from omni_stream.export.onnx_export import build_step, export_module
from omni_stream.export.onnx_parity import compare_logits, record_eager, replay_code_predictor, replay_talker
from omni_stream.export.onnx_quantize import CALIBRATION_TEXTS, calibration_feeds, quantize_step
from omni_stream.export.manifest import Manifest, ManifestError
from omni_stream.export.runtime_onnx import OrtRunner, StepCache
from omni_stream.checkpoints.io import load_model
from omni_stream.models.prompt import PromptRequest
from omni_stream.scheduling.fingerprint import fingerprint_info

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.tts.machine
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

log = logging.getLogger("npu_step_bench")
RESULTS = Path(__file__).resolve().parent / "results"
REQ = PromptRequest(text="Hello world, this is a test of the phone decoder.", language="english", speaker="ryan")


def _cached(path: Path) -> bool:
    """A graph from an earlier run whose manifest this version reads and whose files match it."""
    try:
        Manifest.read(path.with_suffix(".json")).check_files()
        return True
    except ManifestError:
        return False


def _time_step(runner: OrtRunner, m: Manifest, reps: int, rng: np.random.Generator) -> tuple[float, float]:
    """Median ms of session.run and of a whole runtime step, cache half full (random content)."""
    cache = StepCache(m)
    for a in (*cache.keys, *cache.values):
        a[...] = rng.standard_normal(a.shape, dtype=np.float32) * 0.5
    ctx = m.step.context
    pos = ctx // 2 if m.part == "talker" else ctx - 2
    x = rng.standard_normal(cache.inputs["x"].shape[-1], dtype=np.float32) * 0.05
    head = 3 if m.step.multi_head else None
    cache.pos = pos
    feeds = cache.feeds(x, head)
    runner.run(feeds)  # warm-up
    run_ms, step_ms = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.run(feeds)
        run_ms.append((time.perf_counter() - t0) * 1e3)
        cache.pos = pos
        t0 = time.perf_counter()
        cache.step(runner, x, head)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(run_ms), statistics.median(step_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/ck-06b", help="0.6B-shaped checkpoint (made if missing)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/omni-npu-bench"), help="export cache folder")
    ap.add_argument("--talker-context", type=int, default=256)
    ap.add_argument("--cp-context", type=int, default=16)
    ap.add_argument("--frames", type=int, default=24, help="frames of the eager fidelity history")
    ap.add_argument("--calib-frames", type=int, default=6, help="frames per calibration utterance")
    ap.add_argument("--calib-steps", type=int, default=16, help="talker steps kept for calibration")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schemes", nargs="*", default=["w8a16", "w4a16"])
    ap.add_argument("--layouts", nargs="*", default=["roll", "ring"])
    ap.add_argument("--out", type=Path, default=RESULTS / "npu_step_bench.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("onnxscript", "onnx_ir", "torch.onnx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    machine = machine_info()
    torch.set_num_threads(args.threads)
    if not Path(args.model, "config.json").is_file():
        subprocess.run([sys.executable, "-m", "omni_stream.cli", "make-checkpoint", "--preset", "0.6b",
                        "--out", args.model], check=True)
    model = load_model(args.model, dtype=torch.float32)
    cfg = model.config.talker
    args.work.mkdir(parents=True, exist_ok=True)
    contexts = {"talker": args.talker_context, "code_predictor": args.cp_context}

    log.info("eager greedy history: %d frames", args.frames)
    hist = record_eager(model, REQ, args.frames)
    graphs: dict[tuple[str, str, str], Path] = {}
    for layout in args.layouts:
        for part, ctx in contexts.items():
            path = args.work / f"{part}-{layout}.onnx"
            if not _cached(path):
                log.info("export %s %s (context %d)", part, layout, ctx)
                export_module(build_step(model.weights.talker, part, layout, ctx), part, path)
            graphs[(part, layout, "fp32")] = path
        todo = [s for s in args.schemes for p in contexts if not _cached(args.work / f"{p}-{layout}.{s}.onnx")]
        feeds = None
        if todo:
            log.info("calibration decode (%s)", layout)
            feeds = calibration_feeds(model, layout, args.talker_context, args.cp_context,
                                      frames=args.calib_frames, texts=CALIBRATION_TEXTS[:1])
            t = feeds["talker"]
            feeds["talker"] = t[:: max(1, len(t) // args.calib_steps)][: args.calib_steps]
        for scheme in args.schemes:
            for part in contexts:
                q = args.work / f"{part}-{layout}.{scheme}.onnx"
                if not _cached(q):
                    log.info("quantize %s %s %s on %d feeds", part, layout, scheme, len(feeds[part]))
                    quantize_step(args.work / f"{part}-{layout}.onnx", q, feeds[part], scheme)
                graphs[(part, layout, scheme)] = q

    rng = np.random.default_rng(0)
    rows = []
    fp32_logits: dict[tuple[str, str], np.ndarray] = {}
    for (part, layout, variant), path in graphs.items():
        m = Manifest.read(path.with_suffix(".json"))
        runner = OrtRunner(path, threads=args.threads)
        run_ms, step_ms = _time_step(runner, m, args.reps, rng)
        replay = replay_talker if part == "talker" else replay_code_predictor
        logits = replay(runner, m, hist)
        if variant == "fp32":
            fp32_logits[(part, layout)] = logits
            ref, against = (hist.talker_logits if part == "talker" else hist.cp_logits), "eager"
        else:
            ref, against = fp32_logits[(part, layout)], "fp32 graph"
        fid = compare_logits(ref, logits)
        b = m.boundary_bytes()
        size = sum(f.bytes for f in m.files)
        rows.append(dict(part=part, layout=layout, variant=variant, context=m.step.context,
                         run_ms=round(run_ms, 2), step_ms=round(step_ms, 2), bytes_in=b["in"],
                         bytes_out=b["out"], bytes_total=b["total"], graph_mb=round(size / 2**20, 1),
                         fidelity_vs=against, fidelity_rows=fid["rows"], snr_db=round(fid["snr_db"], 1),
                         top1=round(fid["top1"], 4), top5=round(fid["top5"], 4)))
        log.info("%s", rows[-1])

    head = ("| part | layout | variant | ctx | ORT run ms | runtime step ms | KiB in | KiB out | "
            "graph MiB | fidelity vs | rows | SNR dB | top-1 | top-5 |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['part']} | {r['layout']} | {r['variant']} | {r['context']} | {r['run_ms']:.2f} | "
                     f"{r['step_ms']:.2f} | {r['bytes_in'] / 1024:.1f} | {r['bytes_out'] / 1024:.1f} | "
                     f"{r['graph_mb']:.0f} | {r['fidelity_vs']} | {r['fidelity_rows']} | {r['snr_db']:.1f} | "
                     f"{r['top1']:.3f} | {r['top5']:.3f} |")
    table = "\n".join(lines)
    print_machine(machine)
    print(table)
    info = fingerprint_info()
    result = dict(
        benchmark="npu_step_bench", command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        shape=dict(talker_layers=cfg.lm.num_hidden_layers, hidden=cfg.lm.hidden_size,
                   kv_heads=cfg.lm.num_key_value_heads, head_dim=cfg.lm.head_dim,
                   cp_layers=cfg.code_predictor.num_hidden_layers),
        threads=args.threads, reps=args.reps, onnxruntime=__import__("onnxruntime").__version__,
        torch=torch.__version__, cpu=info["cpu_model"], cpu_count=os.cpu_count(),
        loadavg=os.getloadavg(), history=dict(prompt=hist.prompt_len, frames=args.frames),
        machine=machine, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    md = args.out.with_suffix(".md")
    md.write_text(
        "# NPU decode step on ONNX Runtime CPU (0.6B shape, random weights)\n\n"
        f"`{result['command']}`: {info['cpu_model']}, {args.threads} thread(s), ORT {result['onnxruntime']}, "
        f"median of {args.reps}; load average at the end {tuple(round(x, 2) for x in result['loadavg'])}.\n\n"
        "* ORT run ms: `session.run` only; runtime step ms: feeds + run + cache write (ring slot) or take-back (roll).\n"
        "* KiB in/out: bytes crossing the graph boundary per step (fp32 I/O; weights excluded).\n"
        "* Fidelity: fp32 rows against the eager engine, quantized rows against the fp32 graph, over "
        f"one greedy history ({hist.prompt_len}-position prompt, {args.frames} frames; the code predictor has 15 rows per frame).\n"
        "* Quantized graphs are QDQ (int8/int4 per-channel weights, uint16 activations). Their latency is "
        "what ORT's CPU optimizer makes of the Q/DQ pairs (weight DQ + MatMul may become integer kernels; "
        "the roll layout also quantizes the whole window it hands back): a CPU figure, not an NPU one.\n"
        "* Random weights give near-uniform logits (tiny top-1 margins), so quantized top-1/top-5 agreement "
        "here is a pessimistic figure; see docs/npu_export.md for where the error comes from.\n\n" + table + "\n")
    log.info("wrote %s and %s", args.out, md)


if __name__ == "__main__":
    main()
