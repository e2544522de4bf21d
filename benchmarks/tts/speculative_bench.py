"""Speculative code prediction (``omni_stream.engine.speculative``) against the plain code
predictor, on the native CPU runtime (a weight path, e.g. the default ``mixed``) or the torch
engine: ms per code-predictor frame (the 15 codes of one frame, timed
around the engine's residual source alone), verification passes per frame and the share of
drafts accepted, for each draft depth and lookahead, greedy and sampled (the default
sub-sampling), on each checkpoint given (e.g. the plain and the outliers 0.6B).

Same work on both sides: one stream, the same prompt and seed, the same frames (the codes are
the plain path's by construction; the table says how many frames matched bit for bit: in bf16
a batched pass can round a near-tie unlike single steps). Medians over ``--frames`` frames
after ``--warmup``.

    python benchmarks/tts/speculative_bench.py --model /tmp/ck-06b --model /tmp/ck-06b-out
    python benchmarks/tts/speculative_bench.py --engine torch --model /tmp/ck-06b

Prints a table (and Markdown) and writes results/speculative_bench.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.tts.machine
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TEXT = "Speculative code prediction reads the predictor's weights once for several codes."


def run(model, path, a, params, spec=None) -> dict:
    from omni_stream.engine import speculative
    from omni_stream.engine.frame import EngineShape, FrameEngine
    from omni_stream.engine.loading import attach_engine
    from omni_stream.models.prompt import PromptBuilder, PromptRequest

    frames, warmup = a.frames, a.warmup
    talker = model.weights.talker
    eng = FrameEngine(talker, EngineShape(max_slots=1, max_seq_len=512))
    attach_engine(eng, a.engine, a.weight_path, a.threads, model_path=path)
    stats = speculative.enable(eng, *spec).stats if spec else None
    inner, times = eng.residual_source, []

    def timed(p: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(p)
        times.append(time.perf_counter() - t0)
        return out

    eng.use_residual(timed)
    prompt = PromptBuilder(model.config, talker, model.tokenizer).build(
        PromptRequest(text=TEXT, language="english", speaker="ryan"))
    codes = []
    with torch.inference_mode():
        eng.prefill(0, prompt.embeds, prompt.trailing, params, 7)
        for _ in range(warmup + frames):
            c, _ = eng.step(1)
            codes.append(c[0].clone())
    row = {"ms_per_frame": round(1e3 * statistics.median(times[warmup:]), 2),
           "codes": torch.stack(codes[warmup:]).numpy()}
    if stats is not None:
        # the warm-up frames' passes are in the totals too: rates per frame are unaffected
        row.update(acceptance=round(stats.acceptance, 3),
                   passes_per_frame=round(stats.passes_per_frame, 2))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="checkpoint folder (repeatable)")
    ap.add_argument("--engine", default="native", choices=("native", "torch"))
    ap.add_argument("--weight-path", default="mixed", help="the native engine's (default: mixed)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--drafts", default="1,2,3,4", help="draft depths (layers)")
    ap.add_argument("--lookahead", default="2,4", help="codes drafted per round")
    ap.add_argument("--out", default=str(RESULTS / "speculative_bench.json"))
    a = ap.parse_args()
    from omni_stream.engine.loading import load_for_engine
    from omni_stream.engine.sampling import SamplingParams

    machine = machine_info()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    configs = [None] + [(d, k) for d in map(int, a.drafts.split(",")) for k in map(int, a.lookahead.split(","))]
    rows = []
    for path in a.model:
        model = load_for_engine(path, dtype, "cpu", a.weight_path if a.engine == "native" else None,
                                a.engine)
        outliers = (Path(path) / "omni_stream_outliers.json").exists()
        for mode, params in (("greedy", SamplingParams.greedy()), ("sampled", SamplingParams())):
            base = None
            for spec in configs:
                r = run(model, path, a, params, spec)
                codes = r.pop("codes")
                if spec is None:
                    base, base_ms = codes, r["ms_per_frame"]
                row = {"model": path, "outliers": outliers, "mode": mode,
                       "draft_layers": spec[0] if spec else None, "lookahead": spec[1] if spec else None,
                       **r, "speedup": round(base_ms / r["ms_per_frame"], 3),
                       "frames_equal_to_plain": int((codes == base).all(axis=1).sum()),
                       "frames": len(codes)}
                rows.append(row)
                print(f"  {row}", flush=True)
        del model
    print_machine(machine)
    head = ("| checkpoint | mode | draft layers | lookahead | CP ms/frame | speedup | acceptance "
            "| passes/frame | frames equal to plain |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        name = Path(r["model"]).name + (" (outliers)" if r["outliers"] else "")
        lines.append(f"| {name} | {r['mode']} | {r['draft_layers'] or 'plain'} | {r['lookahead'] or '-'} "
                     f"| {r['ms_per_frame']} | {r['speedup']} | {r.get('acceptance', '-')} "
                     f"| {r.get('passes_per_frame', 15)} | {r['frames_equal_to_plain']}/{r['frames']} |")
    table = "\n".join(lines)
    print(table)
    where = f"{a.engine} engine" + (f", weight path {a.weight_path}" if a.engine == "native" else "")
    doc = {"benchmark": "speculative_code_prediction", "engine": a.engine,
           "weight_path": a.weight_path if a.engine == "native" else None, "dtype": a.dtype,
           "threads": a.threads,
           "frames": a.frames, "warmup": a.warmup, "rows": rows, "machine": machine,
           "command": "python benchmarks/tts/speculative_bench.py " + " ".join(sys.argv[1:])}
    Path(a.out).write_text(json.dumps(doc, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))
    md = (f"# Speculative code prediction ({where}, {a.dtype}, {a.threads} thread(s))\n\n"
          f"Machine: {machine.get('label')}; 1 thread {machine.get('bandwidth_gbs_1_thread')} GB/s.\n\n"
          f"Command: `{doc['command']}`\n\n{table}\n")
    Path(a.out).with_suffix(".md").write_text(md)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
