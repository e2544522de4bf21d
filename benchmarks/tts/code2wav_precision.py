"""Code2Wav's precision frontier: audio SNR against the fp32 decode of the same codes, the SNR
between two chunk plans of one stream, and the streaming cost per frame, for each precision plan.

1. Sensitivity: one part of the decoder in bf16 (the rest fp32), and all but one part. Each
   part's parameters are cast to bf16 and its input cast to bf16 (its output back to fp32), so
   the table shows which parts would have to stay fp32 for a mixed-precision decode to reach a
   target SNR. One-pass decode of random codes (streamed output equals it, tested elsewhere).
2. The frontier: fp32, bf16, the codec stage's bf16 kernels (CPU) and mixed plans (the parts
   the sensitivity table ranks cheapest to round in bf16, the rest fp32). Per plan: SNR vs the
   fp32 one-pass decode, SNR between the same codes streamed with two chunk plans (the server's
   adaptive chunks depend on timing: how differently one seeded request can sound; also the
   ceiling for any client decoder matching the server), and ms per frame per stream of
   streaming calls of ``--chunk`` frames at each ``--batch`` (median of ``--calls``).

Prints the tables, writes JSON.

    python benchmarks/tts/code2wav_precision.py --model /tmp/ck-06b
    python benchmarks/tts/code2wav_precision.py --model /tmp/ck-06b --device cuda --batch 1,32,128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.tts.machine
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = {
    "quantizer+pre_conv": ["quantizer", "pre_conv"],
    "transformer": ["pre_transformer"],
    "upsample": ["upsample.0.0", "upsample.0.1", "upsample.1.0", "upsample.1.1"],
    "decoder.0 conv": ["decoder.0"],
    "block 1": ["decoder.1"], "block 2": ["decoder.2"], "block 3": ["decoder.3"],
    "block 4": ["decoder.4"], "output snake+conv": ["decoder.5", "decoder.6"],
}


MIXED_PLANS = {  # bf16 parts, the rest fp32: the parts that cost most and lose least first
    "mixed: bf16 blocks 3-4": ["block 3", "block 4", "output snake+conv"],
    "mixed: bf16 blocks 2-4": ["block 2", "block 3", "block 4", "output snake+conv"],
    "mixed: fp32 quantizer, pre_conv, transformer": [
        "upsample", "decoder.0 conv", "block 1", "block 2", "block 3", "block 4", "output snake+conv"],
}


def _snr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.float().pow(2).sum() / (x.float() - ref.float()).pow(2).sum()))


def _mixed(model_path: str, low: list[str], device: str = "cpu"):
    from omni_stream.checkpoints.io import load_codec

    m = load_codec(model_path, dtype=torch.float32, device=device)
    for part in low:
        for name in PARTS[part]:
            mod = m.get_submodule(name).to(torch.bfloat16)
            inner = mod.forward

            def fwd(x, *a, _f=inner, **kw):
                a = tuple(t.bfloat16() if torch.is_tensor(t) and t.is_floating_point() else t
                          for t in a)
                y = _f(x.bfloat16() if x.is_floating_point() else x, *a, **kw)
                return y.float()

            mod.forward = fwd
    return m


PLAN_A = [1, 2, 4, 8, 8, 8, 8, 8, 8, 9]  # a first-chunk ramp, then the steady size
PLAN_B = [2, 2, 6, 8, 8, 8, 8, 8, 8, 6]


def _streamed(model, codes: torch.Tensor, plan: list[int]) -> torch.Tensor:
    from omni_stream.models.code2wav import Code2WavStream

    assert sum(plan) == codes.shape[2], "the chunk plans must cover --frames (64)"
    s, out, t = Code2WavStream(model, 1), [], 0
    for n in plan:
        out.append(s.decode([0], codes[:, :, t:t + n])[0].float())
        t += n
    return torch.cat(out)


def _ms_per_frame(model, cfg, device: str, batch: int, chunk: int, calls: int) -> float:
    """Median wall ms of one streaming call of ``chunk`` frames for ``batch`` slots, per frame
    per stream (the device synchronised after each call)."""
    from omni_stream.models.code2wav import Code2WavStream

    s = Code2WavStream(model, batch)
    slots = list(range(batch))
    codes = torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, chunk), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(calls + 2):  # two warm-up calls
        t0 = time.perf_counter()
        s.decode(slots, codes)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) / (chunk * batch)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (the codec stage's)")
    ap.add_argument("--chunk", type=int, default=4, help="frames per timed streaming call")
    ap.add_argument("--batch", default="1", help="comma-separated slots per timed call")
    ap.add_argument("--calls", type=int, default=7, help="timed calls per cell (median)")
    ap.add_argument("--no-sensitivity", action="store_true", help="the frontier table only")
    ap.add_argument("--out", default=None, help="default: results/code2wav_precision[_cuda].json")
    a = ap.parse_args()
    out_path = a.out or str(RESULTS / f"code2wav_precision{'_cuda' if a.device == 'cuda' else ''}.json")
    batches = [int(x) for x in a.batch.split(",")]
    machine = machine_info()
    from omni_stream.checkpoints.io import load_codec

    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(a.seed)
    ref_model = load_codec(a.model, dtype=torch.float32, device=a.device)
    cfg = ref_model.cfg
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, a.frames)).to(a.device)
    rows = []
    with torch.inference_mode():
        ref = ref_model(codes)
        if not a.no_sensitivity:
            for part in PARTS:
                rows.append({"bf16": f"only {part}",
                             "snr_db": _snr(_mixed(a.model, [part], a.device)(codes), ref)})
            for part in PARTS:
                others = [p for p in PARTS if p != part]
                rows.append({"bf16": f"all but {part}",
                             "snr_db": _snr(_mixed(a.model, others, a.device)(codes), ref)})
        frontier = []
        plans = [("fp32", lambda: ref_model), ("bf16", lambda: load_codec(a.model, torch.bfloat16, a.device))]
        if a.device == "cpu":
            plans.append(("bf16 (codec stage kernels)", lambda: _stage_kernels(a.model)))
        plans += [(name, lambda low=low: _mixed(a.model, low, a.device)) for name, low in MIXED_PLANS.items()]
        for name, make in plans:
            m = make()
            if m is None:
                continue
            x, y = _streamed(m, codes, PLAN_A), _streamed(m, codes, PLAN_B)
            row = {"plan": name, "snr_db_vs_fp32": _snr(m(codes)[0], ref[0]),
                   "snr_db_plan_a_vs_fp32": _snr(x, ref[0]), "snr_db_between_plans": _snr(y, x),
                   "chunk": a.chunk}
            for b in batches:
                row[f"ms_per_frame_b{b}"] = round(_ms_per_frame(m, cfg, a.device, b, a.chunk, a.calls), 3)
            frontier.append(row)
            print(f"  {name}: {row}", flush=True)
    print_machine(machine)
    if rows:
        print(f"{'parts in bf16 (rest fp32)':<40} audio SNR vs fp32 dB")
        for r in rows:
            print(f"{r['bf16']:<40} {r['snr_db']:6.1f}")
    where = f"{a.device}" + (f", {a.threads} thread(s)" if a.device == "cpu" else "")
    print(f"\nfrontier ({where}; streamed with plans {PLAN_A} and {PLAN_B}; timed at chunk {a.chunk})")
    head = f"{'plan':<46} {'vs fp32 dB':>10} {'plan A vs fp32':>14} {'A vs B dB':>10}"
    print(head + "".join(f" {'ms/frame b' + str(b):>14}" for b in batches))
    for r in frontier:
        print(f"{r['plan']:<46} {r['snr_db_vs_fp32']:>10.1f} {r['snr_db_plan_a_vs_fp32']:>14.1f} "
              f"{r['snr_db_between_plans']:>10.1f}"
              + "".join(f" {r[f'ms_per_frame_b{b}']:>14.2f}" for b in batches))
    doc = {"model": a.model, "frames": a.frames, "seed": a.seed, "device": a.device,
           "threads": a.threads if a.device == "cpu" else None, "rows": rows,
           "frontier": frontier, "plans": [PLAN_A, PLAN_B], "machine": machine,
           "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
           "torch": torch.__version__,
           "command": "python benchmarks/tts/code2wav_precision.py " + " ".join(sys.argv[1:])}
    Path(out_path).write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_path}")
    return 0


def _stage_kernels(model_path: str):
    """What the codec stage runs on a CPU: bf16, packed weights, the one-pass Snake (None where
    oneDNN's packing is unavailable)."""
    from omni_stream.checkpoints.io import load_codec
    from omni_stream.models.code2wav_gemm import onednn_packing_available
    from omni_stream.stages.codec_kernels import stage_kernels

    m = load_codec(model_path, dtype=torch.bfloat16)
    return stage_kernels(m) if onednn_packing_available(m.pre_conv.conv.weight) else None


if __name__ == "__main__":
    sys.exit(main())
