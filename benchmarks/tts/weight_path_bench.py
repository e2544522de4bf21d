"""CPU weight paths side by side: speed per frame and fidelity against bf16, same inputs.

For each path (bf16 = exact reference, int8, int4; optionally compiled) in a fresh process:
talker step + code predictor (15 sub-steps) per frame at 1 stream, median over frames, and the
bytes of decoder weights a frame reads. Then, with the bf16 model and each low-bit model loaded
side by side, the teacher-forced fidelity (models.fidelity): codebook-0 top-1 agreement and
top-5 overlap, talker logits SNR, code-predictor agreement, and the audio SNR of each path's own
codes vs the reference codes through the same Code2Wav. A last block says what quantizing the
codec itself would cost (SNR of its waveform on the same codes), which is why it stays exact.

    python benchmarks/tts/weight_path_bench.py --model /tmp/ck-06b --threads 1,2 --frames 16

Prints a table, writes benchmarks/tts/results/weight_path_bench.json. Random-weight checkpoints
have flat logits (small argmax margins), so the agreement figures are pessimistic; the fp32 row
(the exact model in full precision against bf16) shows how far rounding alone moves them.
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
RESULTS = ROOT / "benchmarks" / "tts" / "results"
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
TEXT = "Hello world, this is a streaming speech benchmark sentence with a few more words in it."
FRAME_S = 0.08


def speed_worker(a: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from omni_stream.engine.loading import load_on_weight_path
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.quant import QUANTIZED, weight_bytes
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    wp = a.path if a.path in QUANTIZED else None
    m = load_on_weight_path(a.model, dtype=torch.bfloat16, weight_path=wp)
    load_s = time.perf_counter() - t0
    s = Synthesizer(m, max_seq_len=512)
    eng = s.engine
    compile_s = None
    if a.compile:
        from omni_stream.engine.compiled import compile_engine, warm_up

        compile_engine(eng)
        compile_s = warm_up(eng)
    t = m.weights.talker
    decoder = [t.model.layers, t.model.norm, t.codec_head]
    cp = t.code_predictor
    talker_b = sum(weight_bytes(x) for x in decoder)
    cp_b = weight_bytes(cp.model.layers) + weight_bytes(cp.small_to_mtp_projection)
    head_b = weight_bytes(cp.lm_head[0])
    g = m.config.talker.num_code_groups
    voice = sorted(m.config.talker.speakers)[0] if m.config.talker.speakers else None
    with torch.inference_mode():
        p = s.builder.build(PromptRequest(text=TEXT, language="english", speaker=voice))
        eng.prefill(0, p.embeds, p.trailing, SamplingParams(), 0)
        for _ in range(3):
            eng.step(1)
        ts = []
        for _ in range(a.frames):
            t1 = time.perf_counter()
            eng.step(1)
            ts.append((time.perf_counter() - t1) * 1e3)
        c2w = codec_ms_per_frame(m.code2wav, g) if a.codec else None
    return dict(path=a.path, threads=a.threads, compiled=bool(a.compile), frame_ms=statistics.median(ts),
                frame_ms_p90=sorted(ts)[int(0.9 * (len(ts) - 1))], load_s=load_s,
                compile_s=compile_s, code2wav_ms_per_frame_chunk4=c2w,
                weight_bytes_per_frame=talker_b + (g - 1) * (cp_b + head_b))


def codec_ms_per_frame(code2wav, groups: int, chunk: int = 4, reps: int = 5) -> float:
    """The streaming Code2Wav (the server's decoder) per frame: median over ``reps`` decodes of
    ``chunk`` new random frames each, state carried, after one warm-up chunk."""
    import torch

    from omni_stream.models.code2wav import Code2WavStream

    st = Code2WavStream(code2wav, max_slots=1)
    codes = torch.randint(0, 2048, (1, groups, chunk))
    with torch.inference_mode():
        st.decode([0], codes)
        cs = []
        for _ in range(reps):
            t1 = time.perf_counter()
            st.decode([0], codes)
            cs.append((time.perf_counter() - t1) * 1e3 / chunk)
    return statistics.median(cs)


def fidelity(model: str, paths: list[str], frames: int, threads: int) -> list[dict]:
    import torch

    sys.path.insert(0, str(ROOT))
    from omni_stream.engine.loading import load_on_weight_path
    from omni_stream.evaluation.fidelity import teacher_forced
    from omni_stream.evaluation.metrics import snr_db
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.quant import quantize_codec
    from omni_stream.engine.synthesis import Synthesizer

    torch.set_num_threads(threads)
    ref = Synthesizer(load_on_weight_path(model, dtype=torch.bfloat16), max_seq_len=512)
    voice = sorted(ref.model.config.talker.speakers)[0] if ref.model.config.talker.speakers else None
    req = PromptRequest(text=TEXT, language="english", speaker=voice)
    rows = []
    for wp in paths:
        # fp32: the exact model in full precision, a yardstick for how flat random logits are
        dt = torch.float32 if wp == "fp32" else torch.bfloat16
        test = Synthesizer(load_on_weight_path(model, dtype=dt, weight_path=None if wp == "fp32" else wp),
                           max_seq_len=512)
        f = teacher_forced(ref, test, req, frames)
        codes = torch.randint(0, 2048, (1, ref.model.config.talker.num_code_groups, 8),
                              generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            wav = ref.model.code2wav(codes).float()
            if wp != "fp32":
                quantize_codec(test.model.code2wav, wp)
            codec_snr = snr_db(wav, test.model.code2wav(codes).float())
        rows.append(dict(path=wp, **f.as_dict(), codec_quantized_snr_db=codec_snr))
        del test
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--paths", default="bf16,int8,int4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--fidelity-frames", type=int, default=24)
    ap.add_argument("--compile", action="store_true", help="also time each path compiled")
    ap.add_argument("--fidelity-only", action="store_true",
                    help="recompute the fidelity rows only, keeping the speed rows of --out")
    ap.add_argument("--out", default=str(RESULTS / "weight_path_bench.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--codec", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.threads = int(a.threads)
        print(json.dumps(speed_worker(a)))
        return 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    paths = a.paths.split(",")
    fid_paths = ["fp32"] + [p for p in paths if p != "bf16"]
    if a.fidelity_only:
        doc = json.loads(Path(a.out).read_text())
        doc["fidelity"] = fidelity(a.model, fid_paths, a.fidelity_frames,
                                   max(int(x) for x in a.threads.split(",")))
        doc["fidelity_command"] = " ".join(["python", "benchmarks/tts/weight_path_bench.py"] + sys.argv[1:])
        Path(a.out).write_text(json.dumps(doc, indent=2))
        for r in doc["fidelity"]:
            print(r)
        return 0
    machine = machine_info()
    speed = []
    for th in (int(x) for x in a.threads.split(",")):
        for comp in ([False, True] if a.compile else [False]):
            for wp in paths:
                cmd = [sys.executable, __file__, "--worker", "--model", a.model, "--path", wp,
                       "--threads", str(th), "--frames", str(a.frames)]
                cmd += ["--compile"] if comp else []
                cmd += ["--codec"] if wp == paths[0] and not comp else []
                r = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    print(r.stderr[-3000:], file=sys.stderr)
                    return 1
                row = json.loads(r.stdout.strip().splitlines()[-1])
                speed.append(row)
                print(f"  {wp:5} threads={th} compiled={comp}: {row['frame_ms']:.1f} ms/frame",
                      flush=True)
    codec_ms = {r["threads"]: r["code2wav_ms_per_frame_chunk4"] for r in speed
                if r["code2wav_ms_per_frame_chunk4"] is not None}
    for r in speed:
        base = next(b for b in speed if b["path"] == paths[0] and b["threads"] == r["threads"]
                    and not b["compiled"])
        r["speedup_vs_bf16"] = base["frame_ms"] / r["frame_ms"]
        r["est_rtf_serial"] = (r["frame_ms"] + codec_ms[r["threads"]]) / (FRAME_S * 1e3)
    fid = fidelity(a.model, fid_paths, a.fidelity_frames,
                   max(int(x) for x in a.threads.split(",")))
    print()
    print_machine(machine)
    print(f"{'path':5} {'thr':>3} {'comp':>4} | {'MB/frame':>8} {'ms/frame':>8} {'x bf16':>6} "
          f"{'est RTF':>7}")
    for r in speed:
        print(f"{r['path']:5} {r['threads']:>3} {'yes' if r['compiled'] else 'no':>4} | "
              f"{r['weight_bytes_per_frame'] / 1e6:8.0f} {r['frame_ms']:8.1f} "
              f"{r['speedup_vs_bf16']:6.2f} {r['est_rtf_serial']:7.2f}")
    print(f"(est RTF = (frame + codec at chunk 4: {codec_ms}) / 80 ms, one process)")

    def f(v, fmt):
        return "inf" if v is None else format(v, fmt)
    print(f"\n{'path':5} | {'code0 top1':>10} {'top5':>5} {'logit SNR':>9} {'cb1-15':>6} "
          f"{'audio SNR':>9} | {'codec-q SNR':>11}")
    for r in fid:
        print(f"{r['path']:5} | {r['code0_agreement']:10.3f} {r['code0_top5_overlap']:5.2f} "
              f"{f(r['logits_snr_db'], '9.1f')} {r['residual_agreement']:6.3f} "
              f"{f(r['audio_snr_db'], '9.1f')} | {f(r['codec_quantized_snr_db'], '11.1f')}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        model=a.model, frames=a.frames, fidelity_frames=a.fidelity_frames, speed=speed,
        fidelity=fid, codec_ms_per_frame_chunk4=codec_ms, machine=machine,
        command=" ".join(["python", "benchmarks/tts/weight_path_bench.py"] + sys.argv[1:])),
        indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
