"""Per-frame cost of omni-stream vs the official qwen-tts code, side by side, on this CPU.

For each (dtype, threads) it times, in a fresh process:
  omni-stream: talker step, code predictor (15 sub-steps), Code2Wav streaming (1 frame/call);
  official:    whole generate per frame (talker + nested code-predictor generate) and its
               one-pass codec decode per frame, on the SAME checkpoint in its isolated env.
Beside them: the memory-bandwidth floor = bytes of weights read per frame / copy bandwidth
(STREAM convention: bytes read + written per second by a large memcpy) measured in the same run.

    python benchmarks/tts/frame_bench.py --model /tmp/ck-06b [--frames 24] [--no-official]

Prints a table and writes benchmarks/tts/results/frame_bench.json. Medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "tts" / "results"
sys.path.insert(0, str(ROOT))

from benchmarks.tts.harness import median_ms  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."


def copy_bandwidth_gbs(threads: int, mib: int = 512) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    ms = median_ms(lambda: b.copy_(a), 7)
    return 2 * a.numel() * 4 / (ms / 1e3) / 1e9


def worker(args: argparse.Namespace) -> dict:
    """Run in a child process: time omni-stream's phases for one (dtype, threads)."""
    import torch

    from omni_stream.checkpoints.io import load_model
    from omni_stream.models.code2wav import Code2WavStream
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = load_model(args.model, dtype=dtype)
    synth = Synthesizer(model, max_seq_len=512)
    eng = synth.engine
    voice = sorted(model.config.talker.speakers)[0] if model.config.talker.speakers else None
    req = PromptRequest(text=TEXT, language="english", speaker=voice,
                        instructions="a calm voice" if model.config.variant == "voice_design" else None)
    t = model.weights.talker
    talker_bytes = sum(p.numel() * p.element_size() for n, p in t.named_parameters()
                       if n.startswith("model.layers") or n.startswith("model.norm") or n.startswith("codec_head"))
    cp = t.code_predictor
    cp_step_bytes = sum(p.numel() * p.element_size() for n, p in cp.named_parameters()
                        if n.startswith("model.layers") or n.startswith("model.norm")
                        or n.startswith("small_to_mtp"))
    head_bytes = cp.lm_head[0].weight.numel() * cp.lm_head[0].weight.element_size()
    g = model.config.talker.num_code_groups
    frame_bytes = talker_bytes + (g - 1) * (cp_step_bytes + head_bytes)
    with torch.inference_mode():
        p = synth.builder.build(req)
        eng.prefill(0, p.embeds, p.trailing, SamplingParams(), 0)
        for _ in range(2):
            eng.step(1)
        step_ms = median_ms(lambda: eng.step(1), args.frames)
        cp_ms = median_ms(lambda: eng.predict_residual(1), args.frames)
        stream = Code2WavStream(model.code2wav, max_slots=1)
        codes = torch.randint(0, 2048, (1, g, 1))
        for _ in range(2):
            stream.decode([0], codes)
        c2w_ms = median_ms(lambda: stream.decode([0], codes), args.frames)
    bw = copy_bandwidth_gbs(args.threads)
    return dict(dtype=args.dtype, threads=args.threads, talker_ms=step_ms - cp_ms, cp_ms=cp_ms,
                frame_ms=step_ms, code2wav_stream_ms=c2w_ms, total_ms=step_ms + c2w_ms,
                weight_bytes_per_frame=frame_bytes, copy_bw_gbs=bw,
                floor_ms=frame_bytes / (bw * 1e9) * 1e3)


def official(args: argparse.Namespace, dtype: str, threads: int) -> dict | None:
    """Time the official generate (and codec decode) in the reference environment."""
    sys.path.insert(0, str(ROOT))
    from tests.reference.refenv import ensure_reference_env

    py = ensure_reference_env()
    with tempfile.TemporaryDirectory() as td:
        reqs = [{"id": "b", "text": TEXT, "speaker": "ryan", "language": "english", "instruct": None,
                 "variant": "custom_voice", "max_new_tokens": args.frames + 1, "greedy": False,
                 "non_streaming_mode": True, "dtype": dtype}]
        rq = Path(td) / "req.json"
        rq.write_text(json.dumps(reqs))
        out = Path(td) / "out.npz"
        cmd = [str(py), str(ROOT / "tests" / "reference" / "official_runner.py"), "generate",
               "--model", str(args.model), "--requests", str(rq), "--out", str(out),
               "--threads", str(threads), "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[dtype],
               "--attn", "sdpa", "--decode"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-2000:], file=sys.stderr)
            return None
        import numpy as np

        z = np.load(out)
        res = dict(dtype=dtype, threads=threads, frame_ms=float(z["ms_per_frame_b"]),
                   frames=int(z["codes_b"].shape[0]))
        if "decode_ms_per_frame_b" in z:
            res["code2wav_onepass_ms"] = float(z["decode_ms_per_frame_b"])
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-official", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "frame_bench.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        print(json.dumps(worker(args)))
        return 0
    machine = machine_info()
    rows, off = [], []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for dt in args.dtypes.split(","):
        for th in (int(x) for x in args.threads.split(",")):
            r = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model,
                                "--dtype", dt, "--threads", str(th), "--frames", str(args.frames)],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            if not args.no_official:
                o = official(args, dt, th)
                if o is None:
                    print(f"official run failed for {dt}/{th}", file=sys.stderr)
                    return 1
                off.append(o)
    print_machine(machine)
    print(f"{'dtype':5} {'thr':>3} | {'talker':>8} {'cp(15)':>8} {'c2w/fr':>8} {'ours/fr':>8} "
          f"{'floor':>7} {'x floor':>7} | {'official/fr':>11} {'speedup':>7}")
    for i, r in enumerate(rows):
        o = off[i] if off else None
        sp = o["frame_ms"] / r["frame_ms"] if o else float("nan")
        r["speedup_vs_official"] = sp
        r["x_floor"] = r["frame_ms"] / r["floor_ms"]
        print(f"{r['dtype']:5} {r['threads']:>3} | {r['talker_ms']:8.1f} {r['cp_ms']:8.1f} "
              f"{r['code2wav_stream_ms']:8.1f} {r['frame_ms']:8.1f} {r['floor_ms']:7.1f} "
              f"{r['x_floor']:7.2f} | {(o['frame_ms'] if o else float('nan')):11.1f} {sp:7.2f}")
    best = {}
    for dt in args.dtypes.split(","):
        ours = min((r for r in rows if r["dtype"] == dt), key=lambda r: r["frame_ms"])
        entry = dict(ours_best_ms=ours["frame_ms"], ours_threads=ours["threads"],
                     x_floor=ours["x_floor"])
        if off:
            theirs = min((o for o in off if o["dtype"] == dt), key=lambda o: o["frame_ms"])
            entry.update(official_best_ms=theirs["frame_ms"], official_threads=theirs["threads"],
                         speedup=theirs["frame_ms"] / ours["frame_ms"])
        best[dt] = entry
    print("best per dtype (each side at its best thread count):", json.dumps(best))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=str(args.model), frames=args.frames, ours=rows,
                                   official=off, best=best, machine=machine,
                                   command=" ".join(["python", "benchmarks/tts/frame_bench.py"] + sys.argv[1:])),
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
