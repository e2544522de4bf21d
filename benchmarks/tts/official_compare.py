"""Whole utterances through the official qwen-tts and through omni-stream, side by side.

The same fixed texts (the first ``--texts`` of ``harness.TEXTS``), the same
checkpoint, dtype, thread count and ``max_new_tokens``, sampling on with the official defaults
(temperature 0.9, top-k 50, repetition penalty 1.05, for the talker and the code predictor), in
ONE run, one side after the other (never overlapping):

  official  ``tests/reference/official_runner.py generate --decode`` in the reference env:
            ``generate`` wall time (talker + nested code-predictor generate, prefill included)
            and its one-pass speech-tokenizer decode of the whole utterance;
  ours      ``Synthesizer.generate_codes`` wall time (prefill + frame steps) and the codec two
            ways: one pass over the whole utterance (``Synthesizer.decode_audio``) and the
            exact streaming decoder ``Code2WavStream`` fed ``--chunk`` frames per call.

Both sides get one untimed warm-up request first (the runner also warms its generate), so
neither the first generate nor the first codec call pays a cold start. Frame counts can differ
(sampling, EOS); per-frame figures are wall time / frames on each side. Ratios are
official / ours (> 1: omni-stream is faster).

    python benchmarks/tts/official_compare.py --model /tmp/ck-06b --dtype bf16 --threads 2 --frames 48

Prints a table and writes benchmarks/tts/results/official_compare.json (key
``speedup_vs_official_per_frame``: median over texts of official ms/frame / ours ms/frame).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402
from benchmarks.tts.harness import TEXTS  # noqa: E402
from omni_stream.scheduling.fingerprint import fingerprint_info  # noqa: E402

RESULTS = ROOT / "benchmarks" / "tts" / "results"
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
LANGUAGE = "english"
WARM_ID = "warmup"
WARM_FRAMES = 4




def _voice(model_dir: Path) -> tuple[str, str | None, str | None]:
    """(variant, speaker, instruct) for the checkpoint: ryan if it has that speaker."""
    from omni_stream.checkpoints.io import read_config

    cfg = read_config(model_dir)
    speakers = sorted(cfg.talker.speakers)
    if cfg.variant == "custom_voice":
        return cfg.variant, ("ryan" if "ryan" in speakers else speakers[0]), None
    if cfg.variant == "voice_design":
        return cfg.variant, None, "a calm, clear voice"
    raise SystemExit(f"{model_dir}: variant {cfg.variant} needs a reference voice; use a "
                     "custom_voice or voice_design checkpoint")


def run_official(model: Path, texts: list[str], frames: int, dtype: str, threads: int,
                 log_path: Path) -> dict[str, dict]:
    """Per text id: frames, generate_s, ms_per_frame, decode_ms_per_frame (official runner)."""
    from tests.reference.refenv import ensure_reference_env

    py = ensure_reference_env()
    variant, speaker, instruct = _voice(model)
    base = dict(speaker=speaker, language=LANGUAGE, instruct=instruct, variant=variant,
                greedy=False, non_streaming_mode=True)
    reqs = [dict(base, id=WARM_ID, text=texts[0], max_new_tokens=WARM_FRAMES, seed=1000)]
    reqs += [dict(base, id=f"t{i}", text=t, max_new_tokens=frames, seed=i)
             for i, t in enumerate(texts)]
    with tempfile.TemporaryDirectory() as td:
        rq, out = Path(td) / "req.json", Path(td) / "out.npz"
        rq.write_text(json.dumps(reqs))
        cmd = [str(py), str(ROOT / "tests" / "reference" / "official_runner.py"), "generate",
               "--model", str(model), "--requests", str(rq), "--out", str(out),
               "--threads", str(threads), "--dtype", dtype, "--attn", "sdpa", "--decode"]
        with open(log_path, "w") as log:
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            tail = log_path.read_text()[-3000:]
            raise SystemExit(f"official runner failed ({r.returncode}); log {log_path}:\n{tail}")
        import numpy as np

        z = np.load(out)
        res = {}
        for i in range(len(texts)):
            rid = f"t{i}"
            n = int(z[f"codes_{rid}"].shape[0])
            if n == 0:
                raise SystemExit(f"official run produced no frames for text {i}")
            res[rid] = dict(frames=n, generate_s=float(z[f"generate_s_{rid}"]),
                            ms_per_frame=float(z[f"ms_per_frame_{rid}"]),
                            decode_ms_per_frame=float(z[f"decode_ms_per_frame_{rid}"]))
        return res


def run_ours(model: Path, texts: list[str], frames: int, dtype: str, threads: int,
             chunk: int, engine: str = "torch", weight_path: str | None = None) -> dict[str, dict]:
    """Per text id: frames, generate_s, ms_per_frame, decode (one pass, streaming) per frame."""
    import torch

    from omni_stream.models.code2wav import Code2WavStream
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer

    torch.set_num_threads(threads)
    from omni_stream.engine.loading import attach_engine, load_for_engine

    m = load_for_engine(model, getattr(torch, dtype), "cpu", weight_path, engine)
    variant, speaker, instruct = _voice(model)
    reqs = [PromptRequest(text=t, language=LANGUAGE, speaker=speaker, instructions=instruct)
            for t in texts]
    probe = Synthesizer(m, max_seq_len=8)
    longest = max(probe.builder.build(r).length for r in reqs)
    synth = Synthesizer(m, max_seq_len=longest + frames + 1)
    attach_engine(synth.engine, engine, weight_path, threads)  # no-op for the torch engine
    del probe
    params = SamplingParams()  # the official sampling defaults

    def stream_decode(codes_t: torch.Tensor, dec: Code2WavStream) -> None:  # codes_t [1, 16, F]
        dec.reset(0)
        for k in range(0, codes_t.shape[-1], chunk):
            dec.decode([0], codes_t[:, :, k:k + chunk])

    res = {}
    with torch.inference_mode():
        dec = Code2WavStream(m.code2wav, max_slots=1)
        warm, _, _ = synth.generate_codes(reqs[0], params, 1000, WARM_FRAMES)
        if len(warm):
            synth.decode_audio(warm)
            stream_decode(torch.as_tensor(warm).T.unsqueeze(0), dec)
        for i, req in enumerate(reqs):
            t0 = time.perf_counter()
            codes, _, _ = synth.generate_codes(req, params, i, frames)
            gen_s = time.perf_counter() - t0
            n = len(codes)
            if n == 0:
                raise SystemExit(f"omni-stream produced no frames for text {i}")
            t0 = time.perf_counter()
            synth.decode_audio(codes)
            onepass_s = time.perf_counter() - t0
            codes_t = torch.as_tensor(codes).T.unsqueeze(0)  # [1, 16, F]
            t0 = time.perf_counter()
            stream_decode(codes_t, dec)
            stream_s = time.perf_counter() - t0
            res[f"t{i}"] = dict(frames=n, generate_s=gen_s, ms_per_frame=1e3 * gen_s / n,
                                decode_onepass_ms_per_frame=1e3 * onepass_s / n,
                                decode_stream_ms_per_frame=1e3 * stream_s / n)
    return res


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def compare(texts: list[str], off: dict[str, dict], ours: dict[str, dict]) -> list[dict]:
    rows = []
    for i, text in enumerate(texts):
        o, u = off[f"t{i}"], ours[f"t{i}"]
        o_total = o["generate_s"] + o["decode_ms_per_frame"] * o["frames"] / 1e3
        u_total = u["generate_s"] + u["decode_onepass_ms_per_frame"] * u["frames"] / 1e3
        rows.append(dict(
            text=text, official=dict(o, total_s=o_total), ours=dict(u, total_s=u_total),
            ratio_ms_per_frame=_ratio(o["ms_per_frame"], u["ms_per_frame"]),
            ratio_generate_s=_ratio(o["generate_s"], u["generate_s"]),
            ratio_total_s=_ratio(o_total, u_total),
            ratio_decode_vs_stream=_ratio(o["decode_ms_per_frame"], u["decode_stream_ms_per_frame"]),
            ratio_decode_vs_onepass=_ratio(o["decode_ms_per_frame"], u["decode_onepass_ms_per_frame"]),
            same_frames=o["frames"] == u["frames"]))
    return rows


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def table(rows: list[dict], chunk: int) -> str:
    head = (f"{'text':>4} | {'frames':>9} | {'generate s':>13} | {'ms/frame':>15} {'ratio':>5} | "
            f"{'codec ms/frame: official':>24} {'ours c' + str(chunk):>8} {'1-pass':>7} | "
            f"{'x stream':>8} {'x 1-pass':>8}")
    lines = [f"{'':4} | {'off / ours':>9} | {'off / ours':>13} | {'off / ours':>15} {'':5} |", head,
             "-" * len(head)]
    for i, r in enumerate(rows):
        o, u = r["official"], r["ours"]
        lines.append(
            f"{i:>4} | {o['frames']:>4}/{u['frames']:<4} | {o['generate_s']:6.2f}/{u['generate_s']:<6.2f} | "
            f"{o['ms_per_frame']:7.1f}/{u['ms_per_frame']:<7.1f} {r['ratio_ms_per_frame']:5.2f} | "
            f"{o['decode_ms_per_frame']:24.1f} {u['decode_stream_ms_per_frame']:8.1f} "
            f"{u['decode_onepass_ms_per_frame']:7.1f} | {r['ratio_decode_vs_stream']:8.2f} "
            f"{r['ratio_decode_vs_onepass']:8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (released layout)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, default=48, help="max_new_tokens on both sides")
    ap.add_argument("--texts", type=int, default=3, help="how many of harness.TEXTS")
    ap.add_argument("--chunk", type=int, default=4, help="frames per Code2WavStream call")
    ap.add_argument("--engine", default="torch", choices=("torch", "native"),
                    help="omni-stream's decode-step engine (native: the CPU runtime)")
    ap.add_argument("--weight-path", default=None, choices=("bf16", "fp32", "int8", "int4"),
                    help="omni-stream's talker / code-predictor weights (the official side "
                         "always runs --dtype)")
    ap.add_argument("--out", default=str(RESULTS / "official_compare.json"))
    args = ap.parse_args(argv)
    if not 1 <= args.texts <= len(TEXTS):
        ap.error(f"--texts must be in [1, {len(TEXTS)}]")
    if args.frames < 1 or args.chunk < 1 or args.threads < 1:
        ap.error("--frames, --chunk and --threads must be >= 1")
    model = Path(args.model)
    dtype = DTYPES[args.dtype]
    texts = TEXTS[:args.texts]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t0 = time.perf_counter()
    off = run_official(model, texts, args.frames, dtype, args.threads, out.with_suffix(".official.log"))
    ours = run_ours(model, texts, args.frames, dtype, args.threads, args.chunk, args.engine,
                    args.weight_path)
    rows = compare(texts, off, ours)
    print_machine(machine)
    print(table(rows, args.chunk))
    summary = dict(
        speedup_vs_official_per_frame=_median([r["ratio_ms_per_frame"] for r in rows]),
        generate_s_ratio_median=_median([r["ratio_generate_s"] for r in rows]),
        total_s_ratio_median=_median([r["ratio_total_s"] for r in rows]),
        decode_ratio_vs_stream_median=_median([r["ratio_decode_vs_stream"] for r in rows]),
        decode_ratio_vs_onepass_median=_median([r["ratio_decode_vs_onepass"] for r in rows]))
    print("medians over texts (official / ours):",
          ", ".join(f"{k} {v:.2f}" for k, v in summary.items() if v is not None))
    doc = dict(
        benchmark="official_compare", model=str(model), dtype=dtype, threads=args.threads,
        engine=args.engine, weight_path=args.weight_path,
        max_new_tokens=args.frames, chunk=args.chunk, language=LANGUAGE, sampling="official defaults",
        **summary, rows=rows,
        notes=["ms_per_frame = generate wall time (prefill + frames, no codec) / frames, both sides",
               "official decode: one pass over the utterance (runner --decode); ours: "
               f"Code2WavStream at {args.chunk} frames per call and one pass",
               "total_s = generate_s + one-pass decode on each side",
               "the sides run one after the other in this process / its child, never at once"],
        torch=__import__("torch").__version__, cpu=fingerprint_info()["cpu_model"], cpu_count=os.cpu_count(),
        load_avg_at_end=list(os.getloadavg()), wall_s=round(time.perf_counter() - t0, 1),
        machine=machine,
        command=shlex.join(["python", "benchmarks/tts/official_compare.py",
                                  *(sys.argv[1:] if argv is None else argv)]))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
