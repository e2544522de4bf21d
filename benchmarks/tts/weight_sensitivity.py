"""Where a low-bit weight path's error comes from: one tensor class (or one third of the layers)
of the talker or the code predictor at a time on ``--kind`` weights (the runtime's own
quantizer, ``engine.cpu.packing.pack_weight``), everything else exact, teacher-forced against
the exact model (``evaluation.fidelity``): talker and code-predictor logits SNR per group. The
errors of separate groups add up (as powers), so the groups with the lowest SNR per weight are
where bits pay; ``engine.loading.NATIVE_PLANS["mixed"]`` is built from this table.

    python benchmarks/tts/weight_sensitivity.py --model /tmp/ck-06b

Writes benchmarks/tts/results/weight_sensitivity.{json,md}. Weights only (activations exact),
torch fp32, so the figure is the weights' own share of a path's error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "tts" / "results"
CLASSES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
           "down": ("mlp.down_proj",)}


def groups(talker) -> list[tuple[str, list]]:
    """(name, [linear modules]) of every group measured."""
    out = []
    for stack_name, stack in (("talker", talker.model), ("cp", talker.code_predictor.model)):
        layers = list(stack.layers)
        for cls, names in CLASSES.items():
            out.append((f"{stack_name}.{cls}",
                        [layer.get_submodule(n) for layer in layers for n in names]))
        n = len(layers)
        for third in range(3):
            sel = [layer for i, layer in enumerate(layers) if i * 3 // n == third]
            out.append((f"{stack_name}.layers_third_{third}",
                        [layer.get_submodule(x) for layer in sel for names in CLASSES.values()
                         for x in names]))
    out.append(("talker.head", [talker.codec_head]))
    out.append(("cp.heads", list(talker.code_predictor.lm_head)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kind", default="q4", help="weight kind of the group under test")
    ap.add_argument("--frames", type=int, default=8, help="per prompt (2 prompts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "weight_sensitivity.json"))
    a = ap.parse_args()
    import torch

    from omni_stream.engine.cpu.packing import pack_weight
    from omni_stream.evaluation.fidelity import load_path, reference, teacher_forced

    machine = machine_info()
    print_machine(machine)
    torch.set_num_threads(a.threads)
    ref, reqs, seq = reference(a.model, a.frames)
    test = load_path(a.model, "fp32", "torch", a.threads, max_seq_len=seq)
    talker = test.model.weights.talker
    rows = []
    for name, mods in groups(talker):
        saved = [m.weight.detach().clone() for m in mods]
        t0 = time.perf_counter()
        with torch.no_grad():
            for m in mods:
                m.weight.copy_(pack_weight(m.weight, None, a.kind).dequantized())
        f = teacher_forced(ref, test, reqs, a.frames, codec=False)
        with torch.no_grad():
            for m, w in zip(mods, saved):
                m.weight.copy_(w)
        params = sum(w.numel() for w in saved)
        finite = lambda v: None if v == float("inf") else v  # noqa: E731 - JSON has no inf
        rows.append(dict(group=name, params=params, talker_logits_snr_db=finite(f.logits_snr_db),
                         cp_logits_snr_db=finite(f.cp_logits_snr_db),
                         seconds=round(time.perf_counter() - t0, 1)))
        print(f"{name:24s} {params / 1e6:7.1f} M  talker {f.logits_snr_db:6.1f} dB  "
              f"cp {f.cp_logits_snr_db:6.1f} dB", flush=True)
    res = dict(model=a.model, kind=a.kind, frames=a.frames, rows=rows, machine=machine,
               command="python benchmarks/tts/weight_sensitivity.py " + " ".join(sys.argv[1:]))
    Path(a.out).write_text(json.dumps(res, indent=1))
    lines = [f"# Weight sensitivity ({a.kind} on one group at a time, the rest exact)", "",
             f"Model `{a.model}`; teacher-forced over 2 prompts x {a.frames} frames against fp32. "
             f"Command: `{res['command']}`", "",
             "| group | params (M) | talker logits SNR dB | CP logits SNR dB |", "|---|---|---|---|"]
    for r in rows:
        fmt = lambda v: "inf" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"| {r['group']} | {r['params'] / 1e6:.1f} | {fmt(r['talker_logits_snr_db'])} | "
                     f"{fmt(r['cp_logits_snr_db'])} |")
    Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
