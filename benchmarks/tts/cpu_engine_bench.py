"""CPU decode-step runtimes side by side: speed of the talker step and the code predictor, and
fidelity against the fp32 reference, on the same checkpoint and machine, in one run.

Candidates (each in a fresh process, so threads and caches do not leak between them):
  torch-bf16   the exact torch step in bf16 (eager)
  torch-int8   torch's packed int8 weights, bf16 activations (engine.quant)
  torch-int4   torch's packed 4-bit weights, bf16 activations (engine.quant)
  native-q4    the CPU runtime (engine/cpu): 4-bit weights, int8 activations, VNNI
  native-q8    the CPU runtime: 8-bit weights, int8 activations
  native-f32   the CPU runtime with exact fp32 weights
For each: the talker step (28 layers + head + draw, the code predictor's answer fixed) and the
code predictor's whole frame (15 sub-steps with their draws), at batch 1 and 4 and at 1 and 2
threads, medians over ``--frames``; the weight bytes a frame reads and the effective GB/s.
Fidelity (teacher-forced over ``--fidelity-frames``, evaluation.fidelity): talker logits SNR,
codebook-0 agreement and top-5 overlap, code-predictor agreement, against fp32 torch; the
fp32-vs-bf16 row is the yardstick of rounding alone.

    python benchmarks/tts/cpu_engine_bench.py --model /tmp/ck-06b

Writes benchmarks/tts/results/cpu_engine_bench.{json,md}. Random weights have flat logits, so
agreement figures are pessimistic next to a trained model's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.frame_bench import median_ms  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
RESULTS = ROOT / "benchmarks" / "tts" / "results"
TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."
PATHS = {  # name: (engine, weight path, dtype)
    "torch-bf16": ("torch", None, "bf16"), "torch-int8": ("torch", "int8", "bf16"),
    "torch-int4": ("torch", "int4", "bf16"), "native-q4": ("native", "int4", "bf16"),
    "native-q8": ("native", "int8", "bf16"), "native-f32": ("native", "fp32", "bf16"),
}


def _synth(model: str, name: str, threads: int, slots: int):
    import torch

    from omni_stream.engine.frame import EngineShape, FrameEngine
    from omni_stream.engine.loading import attach_engine, load_for_engine
    from omni_stream.engine.synthesis import Synthesizer

    engine, wp, dt = PATHS[name]
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    m = load_for_engine(model, dtype, "cpu", wp, engine)
    s = Synthesizer(m, max_seq_len=512)
    s.engine = FrameEngine(m.weights.talker, EngineShape(max_slots=slots, max_seq_len=512))
    attach_engine(s.engine, engine, wp, threads)
    return s


def speed_worker(a: argparse.Namespace) -> dict:
    import torch

    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.models.prompt import PromptRequest

    torch.set_num_threads(a.threads)
    out = {"path": a.path, "threads": a.threads}
    for batch in (1, 4):
        s = _synth(a.model, a.path, a.threads, batch)
        eng = s.engine
        p = s.builder.build(PromptRequest(text=TEXT, language="english", speaker="ryan"))
        with torch.inference_mode():
            for slot in range(batch):
                eng.prefill(slot, p.embeds, p.trailing, SamplingParams(), slot)
            for _ in range(2):
                eng.step(batch)
            cp_ms = median_ms(lambda: eng._predict_residual(batch), a.frames)
            res = eng._predict_residual(batch)
            eng.residual_fn = lambda _p, r=res: r  # the talker step alone
            talker_ms = median_ms(lambda: eng.step(batch), a.frames)
        out[f"talker_ms_b{batch}"] = talker_ms
        out[f"cp_frame_ms_b{batch}"] = cp_ms
        out[f"cp_substep_ms_b{batch}"] = cp_ms / 15
        out[f"frame_ms_b{batch}"] = talker_ms + cp_ms
        out["weight_bytes_per_frame"] = _frame_bytes(eng)
        s = eng = None  # free this batch size's engine before the next
    out["gbs_b1"] = out["weight_bytes_per_frame"] / (out["frame_ms_b1"] / 1e3) / 1e9
    return out


def _frame_bytes(eng) -> int:
    """Weight bytes one frame reads: the talker's layers and head once, the code predictor's
    layers 15 times and one of its heads per sub-step."""
    if eng.native is not None:
        n = eng.native
        size = lambda pk: sum(t.numel() * t.element_size() for t in pk.tensors)  # noqa: E731
        talker = sum(size(x) for layer in n.talker.layers for x in layer) + size(n.head)
        cp = sum(size(x) for layer in n.cp.layers for x in layer)
        return talker + 15 * (cp + size(n.cp_heads[0]))
    t = eng.talker
    size = lambda mod: sum(b.numel() * b.element_size() for b in [*mod.parameters(), *mod.buffers()])  # noqa: E731
    cp = t.code_predictor
    return size(t.model.layers) + size(t.codec_head) + 15 * (size(cp.model.layers) + size(cp.lm_head[0]))


def fidelity(model: str, names: list[str], frames: int, threads: int) -> list[dict]:
    import torch

    from omni_stream.checkpoints.io import load_model
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.evaluation.fidelity import teacher_forced
    from omni_stream.models.prompt import PromptRequest

    torch.set_num_threads(threads)
    req = PromptRequest(text=TEXT, language="english", speaker="ryan")
    ref = Synthesizer(load_model(model, dtype=torch.float32), max_seq_len=512)
    rows = []
    for name in ["torch-bf16 (rounding yardstick)"] + names:
        key = name.split(" ")[0]
        test = _synth(model, key, threads, 1)
        t0 = time.perf_counter()
        f = teacher_forced(ref, test, req, frames)
        rows.append({"path": name, **f.as_dict(), "seconds": time.perf_counter() - t0})
        print(f"fidelity {name}: logits SNR {f.logits_snr_db:.1f} dB, code-0 {f.code0_agreement:.2f}, "
              f"code predictor {f.residual_agreement:.2f}, audio {f.audio_snr_db}", flush=True)
        del test
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--fidelity-frames", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "cpu_engine_bench.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads-one", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.threads = a.threads_one
        print(json.dumps(speed_worker(a)))
        return 0
    machine = machine_info()
    print_machine(machine)
    names = a.paths.split(",")
    speed = []
    for name in names:
        for th in (int(t) for t in a.threads.split(",")):
            r = subprocess.run([sys.executable, __file__, "--worker", "--model", a.model, "--path", name,
                                "--threads-one", str(th), "--frames", str(a.frames)],
                               capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            row = json.loads(r.stdout.strip().splitlines()[-1])
            speed.append(row)
            print(f"{name:11} {th} thr: talker {row['talker_ms_b1']:6.1f} ms, cp frame "
                  f"{row['cp_frame_ms_b1']:6.1f} ms (sub-step {row['cp_substep_ms_b1']:.2f}), frame "
                  f"{row['frame_ms_b1']:6.1f} ms, {row['gbs_b1']:.1f} GB/s; batch 4 frame "
                  f"{row['frame_ms_b4']:6.1f} ms", flush=True)
    fid = fidelity(a.model, [n for n in names if n != "torch-bf16"], a.fidelity_frames,
                   max(int(t) for t in a.threads.split(",")))
    import platform

    res = dict(model=a.model, cpu=platform.processor() or _cpu_model(), frames=a.frames,
               fidelity_frames=a.fidelity_frames, speed=speed, fidelity=fid, machine=machine,
               command="python benchmarks/tts/cpu_engine_bench.py " + " ".join(sys.argv[1:]))
    Path(a.out).write_text(json.dumps(res, indent=1))
    Path(a.out).with_suffix(".md").write_text(markdown(res))
    print(f"wrote {a.out} and .md")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _fmt(v) -> str:
    return "" if v is None else f"{v:.3f}"


def markdown(res: dict) -> str:
    fid = {r["path"].split(" ")[0]: r for r in res["fidelity"]}
    lines = [f"# CPU decode-step runtimes ({res['cpu']})", "",
             f"Model `{res['model']}`; medians over {res['frames']} frames; fidelity teacher-forced "
             f"over {res['fidelity_frames']} frames against fp32 torch (the torch-bf16 row is "
             "rounding alone). Command: `" + res["command"] + "`", "",
             f"Machine: {(res.get('machine') or {}).get('label', 'not recorded')}", "",
             "| path | threads | talker b1 ms | CP sub-step b1 ms | frame b1 ms | GB/s b1 | "
             "frame b4 ms | logits SNR dB | code-0 agree | CP agree |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["speed"]:
        f = fid.get(r["path"], {})
        snr = f.get("logits_snr_db")
        lines.append(f"| {r['path']} | {r['threads']} | {r['talker_ms_b1']:.1f} | "
                     f"{r['cp_substep_ms_b1']:.2f} | {r['frame_ms_b1']:.1f} | {r['gbs_b1']:.1f} | "
                     f"{r['frame_ms_b4']:.1f} | {'' if snr is None else f'{snr:.1f}'} | "
                     f"{_fmt(f.get('code0_agreement'))} | {_fmt(f.get('residual_agreement'))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
