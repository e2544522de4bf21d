"""The weight paths' fidelity/speed frontier: every path of the CPU decode step side by side,
speed and fidelity against the fp32 reference, on the same machine in one run.

Candidates (each timed in a fresh process, so threads and caches do not leak between them):
  native-int4 / -int5 / -int6 / -int8   the CPU runtime (engine/cpu), 4- to 8-bit weights on
                int8 activations, norm outliers folded into the weights (engine.cpu.native)
  native-mixed  a kind per tensor class (engine.loading.NATIVE_PLANS): 8 bits where the error
                comes from (attention, the first third of the layers, the heads), 5 elsewhere
  native-f32    the CPU runtime with exact fp32 weights
  torch-bf16    the exact torch step in bf16 (the yardstick of rounding alone)
  torch-int8 / torch-int4   torch's packed kernels (engine.quant), on request (--paths)
Speed: the talker step (28 layers + head + draw, the code predictor's answer fixed) and the
code predictor's whole frame (15 sub-steps with their draws), at batch 1 and 4 and at 1 and 2
threads, medians over ``--frames``; the weight bytes a frame reads and the effective GB/s
beside the machine's measured read bandwidth at the same thread count. Fidelity
(teacher-forced, ``evaluation.fidelity``, the prompts of ``omni-stream fidelity``) on
``--model`` and, with ``--outliers-model``, on a ``make-checkpoint --outliers`` checkpoint of
the same shape: talker logits SNR, code-0 agreement and top-5, code-predictor logits SNR and
agreement per codebook, audio SNR.

    python benchmarks/tts/cpu_engine_bench.py --model /tmp/ck-06b --outliers-model /tmp/ck-06b-out

Writes benchmarks/tts/results/cpu_engine_bench.{json,md}. Random weights have flat logits, so
agreement figures are pessimistic next to a trained model's; the SNRs are the figures to read.
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

from benchmarks.tts.harness import markdown_table, median_ms  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
RESULTS = ROOT / "benchmarks" / "tts" / "results"
TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."
PATHS = {  # name: (engine, weight path, dtype)
    "native-int4": ("native", "int4", "bf16"), "native-int5": ("native", "int5", "bf16"),
    "native-int6": ("native", "int6", "bf16"), "native-mixed": ("native", "mixed", "bf16"),
    "native-int8": ("native", "int8", "bf16"), "native-f32": ("native", "fp32", "bf16"),
    "torch-bf16": ("torch", None, "bf16"), "torch-int8": ("torch", "int8", "bf16"),
    "torch-int4": ("torch", "int4", "bf16"),
}
DEFAULT_PATHS = ("native-int4", "native-int5", "native-int6", "native-mixed", "native-int8",
                 "native-f32")


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
    batches = tuple(int(b) for b in str(getattr(a, "batches", "1,4")).split(","))
    for batch in batches:
        s = _synth(a.model, a.path, a.threads, batch)
        if batch == 1 and getattr(a, "codec_chunk", 0):
            from benchmarks.tts.weight_path_bench import codec_ms_per_frame

            # as the codec stage runs it: the server's codec dtype here (bf16 where bf16 is
            # native, else fp32: an AVX2 CPU emulates bf16), its packed weights and Snake
            import copy

            from omni_stream.edge.derive import bf16_native
            from omni_stream.edge.probe import load_profile
            from omni_stream.stages.codec_kernels import stage_kernels

            cdt = torch.bfloat16 if bf16_native(load_profile()) else torch.float32
            c2w = stage_kernels(copy.deepcopy(s.model.code2wav).to(cdt))
            out["codec_ms_per_frame"] = codec_ms_per_frame(c2w, 16, a.codec_chunk)
            out["codec_dtype"] = str(cdt).replace("torch.", "")
            del c2w
        eng = s.engine
        p = s.builder.build(PromptRequest(text=TEXT, language="english", speaker="ryan"))
        with torch.inference_mode():
            for slot in range(batch):
                eng.prefill(slot, p.embeds, p.trailing, SamplingParams(), slot)
            for _ in range(2):
                eng.step(batch)
            cp_ms = median_ms(lambda: eng.predict_residual(batch), a.frames)
            with eng.residual_given(eng.predict_residual(batch)):  # the talker step alone
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
    layers 15 times and one of its heads per sub-step (the native runner's: its plan's bytes,
    ``engine.cpu.plans.frame_weight_bytes``, equal to what it packed)."""
    plan = getattr(eng.runtime, "plan", None)  # a weight plan: the CPU runtime's
    if plan is not None:
        from omni_stream.engine.cpu.plans import frame_weight_bytes

        return frame_weight_bytes(eng.cfg, plan)
    t = eng.talker
    size = lambda mod: sum(b.numel() * b.element_size() for b in [*mod.parameters(), *mod.buffers()])  # noqa: E731
    cp = t.code_predictor
    return size(t.model.layers) + size(t.codec_head) + 15 * (size(cp.model.layers) + size(cp.lm_head[0]))


def fidelity(model: str, names: list[str], frames: int, threads: int) -> list[dict]:
    """Teacher-forced fidelity of each path (and the bf16 yardstick) against fp32 torch."""
    import torch

    from omni_stream.evaluation.fidelity import load_path, reference, report_row, teacher_forced

    torch.set_num_threads(threads)
    ref, reqs, seq = reference(model, frames)
    rows = []
    for name in ["torch-bf16"] + [n for n in names if n != "torch-bf16"]:
        engine, wp, _ = PATHS[name]
        test = load_path(model, wp or "bf16", engine, threads, max_seq_len=seq)
        t0 = time.perf_counter()
        f = teacher_forced(ref, test, reqs, frames)
        rows.append({"path": name, **report_row(wp or "bf16", engine, f),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"fidelity {name} ({Path(model).name}): talker {f.logits_snr_db:.1f} dB, code-0 "
              f"{f.code0_agreement:.2f}, CP {f.cp_logits_snr_db:.1f} dB (agree "
              f"{f.cp_agreement:.2f}), audio {f.audio_snr_db}", flush=True)
        del test
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    ap.add_argument("--outliers-model", default=None,
                    help="a make-checkpoint --outliers checkpoint of the same shape: fidelity on it too")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--fidelity-frames", type=int, default=24, help="per prompt (2 prompts)")
    ap.add_argument("--out", default=str(RESULTS / "cpu_engine_bench.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads-one", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="1,4", help=argparse.SUPPRESS)
    ap.add_argument("--codec-chunk", type=int, default=0, help=argparse.SUPPRESS)
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
    threads = max(int(t) for t in a.threads.split(","))
    bw = {str(th): machine.get("bandwidth_gbs_1_thread") if th == 1 else machine.get("bandwidth_gbs")
          for th in (int(t) for t in a.threads.split(","))}
    fid = fidelity(a.model, names, a.fidelity_frames, threads)
    fid_out = (fidelity(a.outliers_model, names, a.fidelity_frames, threads)
               if a.outliers_model else [])
    import platform

    res = dict(model=a.model, outliers_model=a.outliers_model,
               cpu=platform.processor() or _cpu_model(), frames=a.frames,
               fidelity_frames=a.fidelity_frames, speed=speed, fidelity=fid,
               fidelity_outliers=fid_out, bandwidth_gbs_by_threads=bw, machine=machine,
               frontier=frontier(speed, fid, fid_out),
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


def frontier(speed: list[dict], fid: list[dict], fid_out: list[dict]) -> list[dict]:
    """One row per path: bytes per frame, frame ms at each thread count (batch 1 and 4), and
    the fidelity figures on both checkpoints, most faithful first."""
    by = lambda rows: {r["path"]: r for r in rows}  # noqa: E731
    f, fo = by(fid), by(fid_out)
    rows = []
    for name in dict.fromkeys(r["path"] for r in speed):
        sp = [r for r in speed if r["path"] == name]
        row = {"path": name, "weight_bytes_per_frame": sp[0]["weight_bytes_per_frame"]}
        for r in sp:
            t = r["threads"]
            row[f"frame_ms_b1_t{t}"] = r["frame_ms_b1"]
            row[f"frame_ms_b4_t{t}"] = r["frame_ms_b4"]
            row[f"gbs_b1_t{t}"] = r["gbs_b1"]
        for tag, src in (("", f), ("_outliers", fo)):
            x = src.get(name)
            if x:
                row[f"talker_logits_snr_db{tag}"] = x["logits_snr_db"]
                row[f"cp_logits_snr_db{tag}"] = x["cp_logits_snr_db"]
                row[f"code0_agreement{tag}"] = x["code0_agreement"]
                row[f"cp_agreement{tag}"] = x["cp_agreement"]
                row[f"cp_agreement_per_codebook{tag}"] = x["cp_agreement_per_codebook"]
                row[f"audio_snr_db{tag}"] = x["audio_snr_db"]
        rows.append(row)
    return sorted(rows, key=lambda r: -r["weight_bytes_per_frame"])


def _db(v) -> str:
    return "inf" if v is None else f"{v:.1f}"


def markdown(res: dict) -> str:
    bw = res.get("bandwidth_gbs_by_threads") or {}
    lines = [f"# Weight paths: fidelity against speed ({res['cpu']})", "",
             f"Model `{res['model']}`" + (f", outliers model `{res['outliers_model']}`"
                                           if res.get("outliers_model") else "")
             + f"; speed medians over {res['frames']} frames; fidelity teacher-forced over 2 "
             f"prompts x {res['fidelity_frames']} frames against fp32 torch. Command: `"
             + res["command"] + "`", "",
             f"Machine: {(res.get('machine') or {}).get('label', 'not recorded')}; read bandwidth "
             + ", ".join(f"{v} GB/s at {t} thread{'s' if t != '1' else ''}" for t, v in bw.items()),
             "", "MB: weight bytes one frame reads (talker once, code predictor 15 times). SNRs "
             "in dB vs fp32 (plain / outliers checkpoint); agree: code-predictor codes, mean over "
             "the 15 codebooks, and the worst codebook.", ""]
    threads = sorted({r["threads"] for r in res["speed"]})
    head = (["path", "MB/frame"] + [f"frame ms b1 {t}t (GB/s)" for t in threads]
            + [f"frame ms b4 {t}t" for t in threads]
            + ["talker SNR", "CP SNR", "code-0", "CP agree (worst)", "audio SNR"])
    rows = []
    for r in res["frontier"]:
        def pair(key, fmt=_db):
            a, b = r.get(key), r.get(key + "_outliers")
            return fmt(a) + (f" / {fmt(b)}" if key + "_outliers" in r else "")

        def agree(tag=""):
            per = r.get(f"cp_agreement_per_codebook{tag}") or []
            return f"{r[f'cp_agreement{tag}']:.2f} ({min(per):.2f})" if per else ""

        cells = [r["path"], f"{r['weight_bytes_per_frame'] / 1e6:.0f}"]
        cells += [f"{r[f'frame_ms_b1_t{t}']:.1f} ({r[f'gbs_b1_t{t}']:.1f})" for t in threads]
        cells += [f"{r[f'frame_ms_b4_t{t}']:.1f}" for t in threads]
        if "talker_logits_snr_db" in r:
            cells += [pair("talker_logits_snr_db"), pair("cp_logits_snr_db"),
                      pair("code0_agreement", lambda v: f"{v:.2f}"),
                      agree() + (f" / {agree('_outliers')}" if "cp_agreement_outliers" in r else ""),
                      pair("audio_snr_db")]
        else:
            cells += [""] * 5
        rows.append(cells)
    lines.append(markdown_table(head, rows))
    yard = next((r for r in res["fidelity"] if r["path"] == "torch-bf16"), None)
    if yard:
        lines += ["", f"Yardstick (torch bf16, rounding alone): talker {_db(yard['logits_snr_db'])} dB, "
                  f"CP {_db(yard['cp_logits_snr_db'])} dB, code-0 {yard['code0_agreement']:.2f}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
