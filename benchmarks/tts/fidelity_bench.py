"""Codebook agreement of the fast paths with the fp32 run, over the same prompts (greedy).

Greedy decoding is autoregressive, so one flipped argmax changes every later frame: we report
the frame of the first difference, and the per-codebook agreement over all frames of the
free-running decode (a pessimistic figure), for each fast path against fp32.

    python benchmarks/tts/fidelity_bench.py --model /tmp/ck-06b --frames 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from omni_stream.checkpoints.io import load_model  # noqa: E402
from omni_stream.models.prompt import PromptRequest  # noqa: E402
from omni_stream.engine.sampling import SamplingParams  # noqa: E402
from omni_stream.engine.synthesis import Synthesizer  # noqa: E402
from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

PROMPTS = ["Hello world, this is a fidelity check of the fast paths.",
           "Good morning! Numbers like 42 are spoken digit by digit."]


def run(model_path: str, dtype: torch.dtype, frames: int) -> list[np.ndarray]:
    m = load_model(model_path, dtype=dtype)
    s = Synthesizer(m, max_seq_len=512)
    voice = sorted(m.config.talker.speakers)[0] if m.config.talker.speakers else None
    out = []
    for text in PROMPTS:
        codes, _, _ = s.generate_codes(PromptRequest(text=text, language="english", speaker=voice),
                                       SamplingParams.greedy(), 0, frames)
        out.append(codes)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/fidelity_bench.json"))
    a = ap.parse_args()
    machine = machine_info()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    ref = run(a.model, torch.float32, a.frames)
    rows = []
    for name, dt in [("bf16", torch.bfloat16)]:
        got = run(a.model, dt, a.frames)
        for i, (r, g) in enumerate(zip(ref, got)):
            n = min(len(r), len(g))
            eq = r[:n] == g[:n]
            diff = np.argwhere(~eq.all(axis=1))
            rows.append(dict(path=name, prompt=i, frames=n,
                             first_diff_frame=int(diff[0, 0]) if diff.size else None,
                             agreement_per_codebook=[round(float(x), 3) for x in eq.mean(axis=0)],
                             agreement_codebook0=round(float(eq[:, 0].mean()), 3),
                             agreement_all=round(float(eq.mean()), 3)))
    print_machine(machine)
    print(f"{'path':6} {'prompt':>6} {'frames':>6} {'1st diff':>8} {'cb0 agr':>8} {'all agr':>8}")
    for r in rows:
        print(f"{r['path']:6} {r['prompt']:>6} {r['frames']:>6} {str(r['first_diff_frame']):>8} "
              f"{r['agreement_codebook0']:8.3f} {r['agreement_all']:8.3f}")
    Path(a.out).write_text(json.dumps(dict(model=a.model, rows=rows, seconds=time.perf_counter() - t0, machine=machine,
                                           command="python " + " ".join(sys.argv)), indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
