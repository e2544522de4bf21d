"""The talker's engines side by side: vLLM (``--engine vllm``), the native CPU runtime and torch, on
the same machine in one run, each candidate in a fresh process, the list run twice in turn
(ABC ABC) so drift hits every engine alike; each figure is the median of the two rounds.

Per candidate (engine, weight path, dtype), on one checkpoint (default: a random 0.6B):
  start_s        load + engine attach (vLLM's engine start, the runtime's packing) + first step
  frame_ms@b     the decode step alone (talker + code predictor + draws) with b streams in the
                 batch, b = 1..4, median of --steps steps
  ttfa_ms        prefill of the prompt + the first frame step + Code2Wav of the first frame
                 (the engine's share of time to first audio, no server), p50/p95 of --ttfa
                 fresh streams (each a new vLLM request)
  rtf            (frame_ms@1 + Code2Wav ms per frame) / 80 ms
  rt_streams     the most streams b <= 4 with frame_ms@b + b x Code2Wav ms per frame <= 80 ms
                 x 0.85 (both stages on the same cores, as on a 2-core machine)
  same_codes     greedy frames identical to torch fp32's (the first --frames frames), and the
                 first frame where they part
  fidelity       exact (fp32), rounding (bf16), or the weight path's measured teacher-forced
                 talker logits SNR (benchmarks/tts/results/cpu_engine_bench.md)

Runs under the vLLM environment's python (it has torch, omni-stream and vLLM):

    ~/.cache/omni-stream/vllm-env-v1/bin/python benchmarks/tts/vllm_bench.py --model /tmp/ck-06b

Writes benchmarks/tts/results/vllm_bench_<tag>.{json,md}. With a CUDA device, --device cuda
adds the GPU rows (torch and vllm; benchmarks/tts/gpu_run.sh runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.harness import pct  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "tts" / "results"
TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."
CPU = {  # name: (engine, weight path, dtype)
    "torch-fp32": ("torch", None, "float32"), "vllm-fp32": ("vllm", None, "float32"),
    "native-fp32": ("native", "fp32", "float32"),
    "torch-bf16": ("torch", None, "bfloat16"), "vllm-bf16": ("vllm", None, "bfloat16"),
    "native-mixed": ("native", "mixed", "bfloat16"),
}
CUDA = {"torch-bf16-cuda": ("torch", None, "bfloat16"), "vllm-bf16-cuda": ("vllm", None, "bfloat16")}
BATCH = (1, 2, 3, 4)


def candidate(model: str, engine: str, weight_path: str | None, dtype: str, device: str,
              steps: int, ttfa_n: int, frames: int, threads: int) -> dict:
    """One candidate, in this (fresh) process."""
    import torch

    from omni_stream.config import SamplingParams
    from omni_stream.engine.frame import EngineShape, FrameEngine
    from omni_stream.engine.loading import attach_engine, load_for_engine
    from omni_stream.models.prompt import PromptBuilder, PromptRequest

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model_obj = load_for_engine(model, getattr(torch, dtype), device, weight_path, engine)
    eng = FrameEngine(model_obj.weights.talker, EngineShape(max_slots=max(BATCH), max_seq_len=512),
                      device=device)
    attach_engine(eng, engine, weight_path, threads, model_path=model)
    builder = PromptBuilder(model_obj.config, model_obj.weights.talker, model_obj.tokenizer)
    speakers = sorted(model_obj.config.talker.speakers)
    prompt = builder.build(PromptRequest(text=TEXT, speaker=speakers[0] if speakers else None))
    greedy = SamplingParams.greedy()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        eng.prefill(0, prompt.embeds, prompt.trailing, greedy, 0)
        eng.step(1)
        sync()
        start_s = time.perf_counter() - t0
        # greedy codes of one stream (slot 0, fresh)
        eng.release(0)
        eng.prefill(0, prompt.embeds, prompt.trailing, greedy, 0)
        codes = []
        for _ in range(frames):
            c, _ = eng.step(1)
            codes.append(c[0].tolist())
        # the step alone at each batch size
        frame_ms = {}
        for b in BATCH:
            for s in range(max(BATCH)):
                eng.release(s)
            for s in range(b):
                eng.prefill(s, prompt.embeds, prompt.trailing, greedy, s)
            for _ in range(3):
                eng.step(b)
            ts = []
            for _ in range(steps):
                sync()
                t = time.perf_counter()
                eng.step(b)
                sync()
                ts.append((time.perf_counter() - t) * 1e3)
            frame_ms[b] = statistics.median(ts)
        for s in range(max(BATCH)):
            eng.release(s)
        # Code2Wav per frame (first chunk of 1 frame, and a steady chunk of 4)
        c2w = model_obj.code2wav
        one = torch.as_tensor([codes[0]], dtype=torch.long, device=device).T.unsqueeze(0)
        four = torch.as_tensor(codes[:4], dtype=torch.long, device=device).T.unsqueeze(0)
        for x in (one, four):
            c2w(x)

        def c2w_ms(x, n=10):
            ts = []
            for _ in range(n):
                sync()
                t = time.perf_counter()
                c2w(x)
                sync()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        c2w_first, c2w_steady = c2w_ms(one), c2w_ms(four) / 4
        # time to first audio, engine side: fresh stream -> prefill -> first frame -> decode
        ttfa = []
        for i in range(ttfa_n):
            sync()
            t = time.perf_counter()
            eng.prefill(0, prompt.embeds, prompt.trailing, greedy, i)
            c, _ = eng.step(1)
            c2w(c[:1].T.unsqueeze(0))
            sync()
            ttfa.append((time.perf_counter() - t) * 1e3)
            eng.release(0)
    budget = 80.0 * 0.85
    rt = max([b for b in BATCH if frame_ms[b] + b * c2w_steady <= budget], default=0)
    return {"start_s": start_s, "frame_ms": frame_ms, "codec_ms_per_frame": c2w_steady,
            "codec_first_ms": c2w_first, "ttfa_ms_p50": pct(ttfa, 0.5),
            "ttfa_ms_p95": pct(ttfa, 0.95), "ttfa_n": len(ttfa),
            "rtf": (frame_ms[1] + c2w_steady) / 80.0, "rt_streams": rt, "codes": codes,
            "prompt_len": int(prompt.length), "threads": threads}


def _run_candidate(name, spec, a) -> dict:
    engine, wp, dtype = spec
    cmd = [sys.executable, __file__, "--one", json.dumps(
        dict(model=a.model, engine=engine, weight_path=wp, dtype=dtype, device=a.device,
             steps=a.steps, ttfa_n=a.ttfa, frames=a.frames, threads=a.threads))]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"error": p.stderr[-3000:]}
    return json.loads(lines[-1][7:])


def _fidelity(name: str, spec) -> str:
    engine, wp, dtype = spec
    if wp in (None, "fp32", "bf16"):
        return "exact" if dtype == "float32" else "bf16 rounding"
    try:
        rows = json.loads((RESULTS / "cpu_engine_bench.json").read_text())["paths"]
        row = next(r for r in rows if r.get("path") == f"{engine}-{wp}")
        return f"talker logits {row['fidelity']['logits_snr_db']:.1f} dB (cpu_engine_bench)"
    except (OSError, KeyError, StopIteration, ValueError, TypeError):
        from omni_stream.edge.derive import PATH_FIDELITY

        fid = PATH_FIDELITY.get((engine, wp))
        return f"talker logits {fid['talker']:.1f} dB (edge.adapt table)" if fid else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: a random 0.6B in /tmp)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default=None, help="comma-separated candidates")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ttfa", type=int, default=20)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        res = candidate(**json.loads(a.one))
        print("RESULT " + json.dumps(res))
        return 0
    machine = machine_info()
    if a.model is None:
        from omni_stream.checkpoints.io import write_random_checkpoint

        a.model = "/tmp/ck-06b-vllm-bench"
        if not Path(a.model, "model.safetensors").is_file():
            write_random_checkpoint(a.model, "0.6b", "custom_voice", seed=0)
    table = CUDA if a.device == "cuda" else CPU
    names = a.only.split(",") if a.only else list(table)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            print(f"round {r + 1}: {n} ...", file=sys.stderr, flush=True)
            runs[n].append(_run_candidate(n, table[n], a))
    ref = next((x[0].get("codes") for n, x in runs.items() if n.startswith("torch-fp32")), None)
    rows = []
    for n in names:
        ok = [x for x in runs[n] if "error" not in x]
        if not ok:
            rows.append({"name": n, "error": runs[n][0]["error"]})
            continue
        med = lambda f: statistics.median(f(x) for x in ok)  # noqa: E731
        codes = ok[0]["codes"]
        part = next((i for i, (x, y) in enumerate(zip(codes, ref or [])) if x != y), None)
        engine, wp, dtype = table[n]
        rows.append({
            "name": n, "engine": engine, "weight_path": wp, "dtype": dtype,
            "start_s": med(lambda x: x["start_s"]),
            "frame_ms": {str(b): med(lambda x: x["frame_ms"][str(b)]) for b in BATCH},
            "ttfa_ms_p50": med(lambda x: x["ttfa_ms_p50"]),
            "ttfa_ms_p95": med(lambda x: x["ttfa_ms_p95"]), "ttfa_n": ok[0]["ttfa_n"],
            "codec_ms_per_frame": med(lambda x: x["codec_ms_per_frame"]),
            "rtf": med(lambda x: x["rtf"]), "rt_streams": min(x["rt_streams"] for x in ok),
            "same_codes_as_torch_fp32": None if ref is None else part is None,
            "codes_part_at_frame": part, "frames_compared": len(codes),
            "fidelity": _fidelity(n, table[n]), "rounds": len(ok)})
    hdr = ("| candidate | start s | ms/frame b=1 | b=4 | TTFA p50 / p95 ms (n) | RTF | real-time "
           "streams | greedy codes vs torch fp32 | fidelity |")
    lines = [hdr, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'].strip().splitlines()[-1][:80]} "
                         "| | | | | | | |")
            continue
        same = ("-" if r["same_codes_as_torch_fp32"] is None else
                "identical" if r["same_codes_as_torch_fp32"] else
                f"part at frame {r['codes_part_at_frame']}") + f" ({r['frames_compared']})"
        lines.append(f"| {r['name']} | {r['start_s']:.1f} | {r['frame_ms']['1']:.1f} | "
                     f"{r['frame_ms']['4']:.1f} | {r['ttfa_ms_p50']:.0f} / {r['ttfa_ms_p95']:.0f}"
                     f" ({r['ttfa_n']}) | {r['rtf']:.2f} | {r['rt_streams']} | {same} | "
                     f"{r['fidelity']} |")
    print_machine(machine)
    print("\n".join(lines))
    tag = a.tag or f"{Path(a.model).name}_{a.device}"
    doc = {"machine": machine, "model": a.model, "device": a.device, "steps": a.steps,
           "threads": a.threads, "rows": rows,
           "note": "decode-step figures exclude prefill on every side; TTFA includes the "
                   "prefill, the first step and Code2Wav of one frame on every side"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"vllm_bench_{tag}.json").write_text(json.dumps(doc, indent=1))
    (RESULTS / f"vllm_bench_{tag}.md").write_text(
        f"# Talker engines: vllm vs native vs torch ({a.device})\n\n"
        f"Machine: {machine.get('label', '')}\n\nModel: {a.model}; {a.threads} threads; "
        f"medians of {a.rounds} rounds, each a fresh process; step medians of {a.steps} "
        f"steps.\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
