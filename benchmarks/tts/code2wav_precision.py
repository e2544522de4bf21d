"""Where Code2Wav's bf16 error comes from: audio SNR against the fp32 decode of the same codes
when one part of the decoder runs in bf16 (the rest fp32), and when all but one part do.

Each part's parameters are cast to bf16 and its input cast to bf16 (its output back to fp32),
so the table shows which parts would have to stay fp32 for a mixed-precision decode to reach a
target SNR. One-pass decode of random codes (streamed output equals it, tested elsewhere).

A second table streams the same codes twice in one dtype with two different chunk plans (the
server's adaptive chunks and a client's are not the same): how close two decoders of equal
numerics but different chunking can be, the ceiling for any client decoder matching the server.
Prints the tables, writes JSON.

    python benchmarks/tts/code2wav_precision.py --model /tmp/ck-06b
"""

from __future__ import annotations

import argparse
import json
import sys
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


def _snr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _mixed(model_path: str, low: list[str]):
    from omni_stream.checkpoints.io import load_codec

    m = load_codec(model_path, dtype=torch.float32)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "code2wav_precision.json"))
    a = ap.parse_args()
    machine = machine_info()
    from omni_stream.checkpoints.io import load_codec

    torch.manual_seed(a.seed)
    ref_model = load_codec(a.model, dtype=torch.float32)
    cfg = ref_model.cfg
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, a.frames))
    rows = []
    with torch.inference_mode():
        ref = ref_model(codes)
        pure = float(_snr(load_codec(a.model, dtype=torch.bfloat16)(codes).float(), ref))
        rows.append({"bf16": "all (the model cast to bf16)", "snr_db": pure})
        for part in PARTS:
            rows.append({"bf16": f"only {part}", "snr_db": _snr(_mixed(a.model, [part])(codes), ref)})
        for part in PARTS:
            others = [p for p in PARTS if p != part]
            rows.append({"bf16": f"all but {part}", "snr_db": _snr(_mixed(a.model, others)(codes), ref)})
        chunking = []
        for dtype, packed in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            m = ref_model if dtype == torch.float32 else load_codec(a.model, dtype=dtype)
            name = str(dtype).removeprefix("torch.")
            if packed:  # what the codec stage runs on a CPU: packed weights, one-pass Snake
                from omni_stream.stages.codec_stage import _snake_kernel

                if not m.pack(snake=_snake_kernel(m)):
                    continue
                name += " (codec stage kernels)"
            x, y = _streamed(m, codes, PLAN_A), _streamed(m, codes, PLAN_B)
            chunking.append({"dtype": name, "plans": [PLAN_A, PLAN_B],
                             "snr_db_between_plans": _snr(y, x),
                             "snr_db_plan_a_vs_fp32": _snr(x, ref[0])})
    print_machine(machine)
    print(f"{'parts in bf16 (rest fp32)':<40} audio SNR vs fp32 dB")
    for r in rows:
        print(f"{r['bf16']:<40} {r['snr_db']:6.1f}")
    print(f"\n{'streamed, two chunk plans':<36} {'between plans dB':>16} {'plan A vs fp32 dB':>18}")
    for r in chunking:
        print(f"{r['dtype']:<36} {r['snr_db_between_plans']:>16.1f} {r['snr_db_plan_a_vs_fp32']:>18.1f}")
    doc = {"model": a.model, "frames": a.frames, "seed": a.seed, "rows": rows,
           "chunking": chunking, "machine": machine,
           "command": "python benchmarks/tts/code2wav_precision.py " + " ".join(sys.argv[1:])}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
