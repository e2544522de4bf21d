"""What folding norm outliers into the weights is worth: the native runtime's low-bit paths with
smoothing (``engine.cpu.packing.smoothing``, the default) and without, teacher-forced against the
fp32 reference (``evaluation.fidelity``), on a checkpoint made with ``make-checkpoint
--outliers`` (and, for contrast, a plain one, where it must cost nothing).

    python benchmarks/tts/smoothing_bench.py --model /tmp/ck-06b-out --model /tmp/ck-06b

Writes benchmarks/tts/results/smoothing_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "tts" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--paths", default="int6,int8")
    ap.add_argument("--frames", type=int, default=12, help="per prompt (2 prompts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "smoothing_bench.json"))
    a = ap.parse_args()
    import torch

    from omni_stream.engine.frame import EngineShape, FrameEngine
    from omni_stream.engine.loading import NATIVE_PLANS
    from omni_stream.evaluation.fidelity import load_path, outliers_note, reference, teacher_forced

    machine = machine_info()
    print_machine(machine)
    torch.set_num_threads(a.threads)
    rows = []
    for model in a.model:
        ref, reqs, seq = reference(model, a.frames)
        test = load_path(model, "bf16", "torch", a.threads, max_seq_len=seq)
        for wp in a.paths.split(","):
            for smooth in (True, False):
                test.engine = FrameEngine(test.model.weights.talker, EngineShape(max_slots=1, max_seq_len=seq))
                test.engine.use_native(plan=dataclasses.replace(NATIVE_PLANS[wp], smooth=smooth),
                                       threads=a.threads)
                f = teacher_forced(ref, test, reqs, a.frames, codec=False)
                rows.append(dict(model=model, outliers=outliers_note(model) is not None,
                                 weight_path=wp, smoothing=smooth,
                                 talker_logits_snr_db=f.logits_snr_db,
                                 cp_logits_snr_db=f.cp_logits_snr_db,
                                 code0_agreement=f.code0_agreement, cp_agreement=f.cp_agreement))
                print(f"{Path(model).name:12s} {wp:6s} smoothing {'on ' if smooth else 'off'}: talker "
                      f"{f.logits_snr_db:5.1f} dB, CP {f.cp_logits_snr_db:5.1f} dB", flush=True)
        del ref, test
    res = dict(rows=rows, frames=a.frames, machine=machine,
               command="python benchmarks/tts/smoothing_bench.py " + " ".join(sys.argv[1:]))
    Path(a.out).write_text(json.dumps(res, indent=1))
    lines = ["# Smoothing norm outliers into the weights: on and off", "",
             f"Teacher-forced over 2 prompts x {a.frames} frames against fp32. Command: "
             f"`{res['command']}`", "",
             "| model | outliers | path | smoothing | talker SNR dB | CP SNR dB | code-0 | CP agree |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {Path(r['model']).name} | {'yes' if r['outliers'] else 'no'} | "
                     f"{r['weight_path']} | {'on' if r['smoothing'] else 'off'} | "
                     f"{r['talker_logits_snr_db']:.1f} | {r['cp_logits_snr_db']:.1f} | "
                     f"{r['code0_agreement']:.2f} | {r['cp_agreement']:.2f} |")
    Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
