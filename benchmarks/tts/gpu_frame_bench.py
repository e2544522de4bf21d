"""Per-frame cost of the batched engine step vs the number of streams, CUDA graphs on and off.

For each mode (``graphs``: ``GraphedStep(engine)`` replaying one captured graph per padded batch
size; ``eager``: plain ``FrameEngine.step``, which syncs once per frame to attend only over the
live prefix) and each S in ``--streams`` it prefills S slots with the same prompt (seeds
differ), runs ``--warmup`` untimed steps, then times ``--frames`` steps of ``runner.step(S)``
one by one, each followed by reading the next codebook-0 ids on the host (what the talker
stage does every frame, so the GPU work is finished when the clock stops). Reported per S:
median / p90 ms per step (one 80 ms frame for all S streams), ms per stream-frame, how many
times faster than real time the step is (80 ms / step) and frames per second over all streams.

    python benchmarks/tts/gpu_frame_bench.py --model /tmp/ck-06b --device cuda --streams 1,8,32,128
    python benchmarks/tts/gpu_frame_bench.py --model /tmp/ck-tiny --device cpu --no-graphs \
        --streams 1,2 --frames 4        # CPU smoke test (no capture off-GPU)

Prints a table and writes benchmarks/tts/results/gpu_frame_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.harness import pct  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "tts" / "results"
FRAME_MS = 80.0
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."


def bench_mode(model, graphs: bool, streams: list[int], args: argparse.Namespace) -> list[dict]:
    """Time runner.step(S) for every S in ``streams`` with one engine of max(streams) slots."""
    import torch

    from omni_stream.engine.frame import EngineShape, FrameEngine
    from omni_stream.engine.graphs import GraphedStep
    from omni_stream.models.prompt import PromptBuilder, PromptRequest
    from omni_stream.engine.sampling import SamplingParams

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    engine = FrameEngine(model.weights.talker,
                         EngineShape(max_slots=max(streams), max_seq_len=args.max_seq_len), device=dev)
    t0 = time.perf_counter()
    runner = GraphedStep(engine, enabled=graphs)
    capture_s = time.perf_counter() - t0 if graphs else 0.0
    builder = PromptBuilder(model.config, model.weights.talker, model.tokenizer)
    speakers = sorted(model.config.talker.speakers)
    voice = ("ryan" if "ryan" in speakers else speakers[0]) if speakers else None
    instr = "a calm voice" if model.config.variant == "voice_design" else None
    prompt = builder.build(PromptRequest(text=TEXT, language="english", speaker=voice,
                                         instructions=instr))
    if prompt.length + args.warmup + args.frames + 1 > args.max_seq_len:
        raise SystemExit(f"prompt {prompt.length} + {args.warmup + args.frames} steps exceed "
                         f"--max-seq-len {args.max_seq_len}")
    params = SamplingParams.greedy() if args.greedy else SamplingParams()
    rows = []
    for s in streams:
        for slot in range(s):  # fresh streams at the same position for every S
            engine.prefill(slot, prompt.embeds, prompt.trailing, params, seed=slot)
        for slot in range(s, engine.shape.max_slots):
            engine.release(slot)
        if cuda:
            torch.cuda.synchronize()
        for _ in range(args.warmup):
            runner.step(s)[1].cpu()
        ts = []
        for _ in range(args.frames):
            t = time.perf_counter()
            _, code0 = runner.step(s)
            code0.cpu()  # the talker stage's one host read per frame (end-of-stream check)
            ts.append((time.perf_counter() - t) * 1e3)
        med = statistics.median(ts)
        rows.append(dict(mode="graphs" if graphs else "eager", streams=s,
                         bucket=runner.bucket(s) if graphs else s,
                         ms_per_step_p50=round(med, 3), ms_per_step_p90=round(pct(ts, 0.9), 3),
                         ms_per_step_mean=round(statistics.fmean(ts), 3),
                         ms_per_stream_frame=round(med / s, 4),
                         x_realtime=round(FRAME_MS / med, 2),
                         frames_per_s=round(1e3 * s / med, 1)))
        print(f"  {rows[-1]['mode']:6} S={s:<4} {med:8.2f} ms/step", flush=True)
    del runner, engine
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return [dict(r, capture_s=round(capture_s, 2)) for r in rows]


def table(rows: list[dict]) -> str:
    head = (f"{'mode':6} {'streams':>7} | {'ms/step p50':>11} {'p90':>8} | {'ms/stream-frame':>15} | "
            f"{'x realtime':>10} | {'frames/s':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mode']:6} {r['streams']:>7} | {r['ms_per_step_p50']:11.2f} "
                     f"{r['ms_per_step_p90']:8.2f} | {r['ms_per_stream_frame']:15.3f} | "
                     f"{r['x_realtime']:10.2f} | {r['frames_per_s']:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (released layout)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--streams", default="1,8,32,128")
    ap.add_argument("--frames", type=int, default=30, help="timed steps per S")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per S")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU runs)")
    ap.add_argument("--greedy", action="store_true", help="greedy instead of official sampling")
    ap.add_argument("--no-graphs", action="store_true", help="eager only (required off-GPU)")
    ap.add_argument("--no-eager", action="store_true", help="graphs only")
    ap.add_argument("--out", default=str(RESULTS / "gpu_frame_bench.json"))
    args = ap.parse_args(argv)
    import torch

    from omni_stream.checkpoints.io import load_model

    streams = sorted({int(x) for x in args.streams.split(",") if x.strip()})
    if not streams or streams[0] < 1 or args.frames < 1 or args.warmup < 0:
        ap.error("--streams: positive integers; --frames >= 1; --warmup >= 0")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch: run on a GPU machine, or pass "
                         "--device cpu --no-graphs for a smoke test")
    modes = [m for m, off in (("eager", args.no_eager), ("graphs", args.no_graphs)) if not off]
    if "graphs" in modes and dev.type != "cuda":
        raise SystemExit("CUDA graphs need --device cuda; pass --no-graphs on CPU")
    if not modes:
        ap.error("--no-graphs and --no-eager leave nothing to run")
    machine = machine_info()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=getattr(torch, dtype), device=dev)
    load_s = time.perf_counter() - t0
    rows, errors = [], {}
    with torch.inference_mode():
        for m in modes:
            print(f"{m}:", flush=True)
            try:  # keep the other mode's numbers if one fails (e.g. capture or out of memory)
                rows += bench_mode(model, m == "graphs", streams, args)
            except (RuntimeError, ValueError) as e:
                traceback.print_exc()
                errors[m] = f"{type(e).__name__}: {e}"
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    print_machine(machine)
    print(table(rows))
    speedup = {}
    if not errors and len(modes) == 2:
        by = {(r["mode"], r["streams"]): r for r in rows}
        speedup = {str(s): round(by["eager", s]["ms_per_step_p50"] / by["graphs", s]["ms_per_step_p50"], 2)
                   for s in streams}
        print("graphs speed-up (eager / graphs ms per step):", speedup)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(benchmark="gpu_frame_bench", model=str(args.model), device=str(dev),
               device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               dtype=dtype, torch=torch.__version__, max_seq_len=args.max_seq_len,
               frames=args.frames, warmup=args.warmup, sampling="greedy" if args.greedy else "official",
               threads=torch.get_num_threads(), load_s=round(load_s, 1), rows=rows,
               graphs_speedup=speedup, errors=errors, cpu_count=os.cpu_count(), machine=machine,
               command=shlex.join(["python", "benchmarks/tts/gpu_frame_bench.py",
                                  *(sys.argv[1:] if argv is None else argv)]))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    for m, e in errors.items():
        print(f"{m} failed: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
