"""One frame step of two source trees, or of this tree at several kernel levels, side by side.

Checks out ``--before`` (a git revision) in a temporary worktree and times ``FrameEngine.step``
(talker + code predictor, one frame) in that tree and in this one, alternating fresh processes
round by round so drift hits both alike: the same checkpoint, engine, weight path, threads,
batch 1, ``--frames`` steps after 5 warm-up steps per process. Prints the per-round medians and
the median of them per side with n, the machine's read bandwidth beside them, and writes JSON.

``--isa avx512,avx2`` runs this tree once per native kernel level instead (or beside
``--before``): each side capped by ``OMNI_STREAM_CPU_ISA`` with torch, oneDNN and MKL capped
alike (the AVX2 emulation of docs/configuration.md), so one machine measures what another kind
runs, on the same memory. Every side decodes greedily from one prompt; the greedy codes of all
its frames are compared with the first side's (the kernel sets give the scalar reference's
products bit for bit, so the codes should be equal).

    python benchmarks/tts/frame_ab.py --model CK --before facf099 [--engine native]
        [--weight-path mixed] [--threads 1] [--rounds 6] [--frames 40]
    python benchmarks/tts/frame_ab.py --model CK --isa avx512,avx2 --weight-path int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tts.harness import ISA_ENV  # noqa: E402

# run inside each tree (its omni_stream first on the path): one JSON line
WORKER = r"""
import json, statistics, sys, time
import torch
engine, weight_path, threads, frames, ck = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
import omni_stream
from omni_stream.config import SamplingParams
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.loading import attach_engine, load_for_engine
from omni_stream.models.prompt import PromptBuilder, PromptRequest
model = load_for_engine(ck, torch.float32, "cpu", weight_path, engine)
eng = FrameEngine(model.weights.talker, EngineShape(max_slots=1, max_seq_len=512))
attach_engine(eng, engine, weight_path, threads, model_path=ck)
p = PromptBuilder(model.config, model.weights.talker, model.tokenizer).build(
    PromptRequest(text="Hello world, this is a frame cost check.", language="english", speaker="ryan"))
ts, codes = [], []
with torch.inference_mode():
    eng.prefill(0, p.embeds, p.trailing, SamplingParams.greedy(), 0)
    for i in range(frames + 5):
        t0 = time.perf_counter(); c, _ = eng.step(1); dt = time.perf_counter() - t0
        codes.append(c[0].tolist())
        if i >= 5:
            ts.append(dt)
isa = None
if engine == "native":
    import ctypes
    from omni_stream.engine.cpu.abi import library
    lib = library()
    if hasattr(lib, "oc_isa"):
        lib.oc_isa.restype = ctypes.c_char_p
        isa = lib.oc_isa().decode()
print(json.dumps({"ms": statistics.median(ts) * 1e3, "n": len(ts), "src": omni_stream.__file__, "isa": isa,
                  "codes": codes}))
"""


def run_side(tree: Path, a: argparse.Namespace, isa: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), **ISA_ENV.get(isa or "", {}))
    out = subprocess.run([sys.executable, "-c", WORKER, a.engine, a.weight_path, str(a.threads),
                          str(a.frames), a.model], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not got["src"].startswith(str(tree)):
        raise RuntimeError(f"{tree}: imported omni_stream from {got['src']}")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--before", help="a git revision of this repository")
    ap.add_argument("--isa", default="", help="this tree at each of these native kernel levels "
                    f"({', '.join(ISA_ENV)}), comma-separated; default: as built here")
    ap.add_argument("--engine", default="native")
    ap.add_argument("--weight-path", default="mixed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/frame_ab.json"))
    a = ap.parse_args()
    from benchmarks.tts.machine import machine_info, print_machine

    machine = machine_info()
    print_machine(machine)
    isas = [x for x in a.isa.split(",") if x]
    if not a.before and not isas:
        ap.error("give --before REV, --isa LEVELS or both")
    if unknown := [x for x in isas if x not in ISA_ENV]:
        ap.error(f"--isa: unknown level(s) {', '.join(unknown)}; valid: {', '.join(ISA_ENV)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides: list[tuple[str, Path, str | None]] = []
        before = Path(tmp) / "before"
        if a.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(before),
                            a.before], check=True)
            sides.append(("before", before, None))
        sides += [(f"after[{x}]", ROOT, x) for x in isas] or [("after", ROOT, None)]
        try:
            for r in range(a.rounds):
                for side, tree, isa in sides:
                    got = run_side(tree, a, isa)
                    rows.append({"round": r + 1, "side": side, "ms": got["ms"], "n": got["n"],
                                 "native_kernels": got.get("isa"), "codes": got.get("codes")})
                    print(f"round {r + 1}  {side:14s} {got['ms']:7.2f} ms (n={got['n']}, "
                          f"kernels {got.get('isa')})")
        finally:
            if a.before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                               check=False)
    names = [s for s, _, _ in sides]
    med = {s: statistics.median(x["ms"] for x in rows if x["side"] == s) for s in names}
    base = names[0]
    print(f"\nmedian of {a.rounds} rounds ({a.engine} {a.weight_path}, {a.threads} thread(s), batch 1): "
          + ", ".join(f"{s} {med[s]:.2f} ms (x{med[s] / med[base]:.3f})" for s in names)
          + f"; {machine['label']}, 1 thread {machine['bandwidth_gbs_1_thread']} GB/s")
    # greedy decoding: every side's frames (warm-up included) should carry the same codes
    first = next((x["codes"] for x in rows if x.get("codes")), None)
    same = {s: all(x.get("codes") == first for x in rows if x["side"] == s) for s in names}
    print(f"greedy codes of {len(first or [])} frames x 16 equal to the first side's: "
          + ", ".join(f"{s} {'yes' if v else 'NO'}" for s, v in same.items()))
    for x in rows:
        x.pop("codes", None)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    Path(a.out).write_text(json.dumps({
        "before": a.before, "after": rev, "isa": isas, "engine": a.engine, "weight_path": a.weight_path,
        "threads": a.threads, "frames_per_round": a.frames, "rounds": rows,
        "median_ms": med, "ratio": {s: med[s] / med[base] for s in names}, "greedy_codes_equal": same,
        "greedy_frames": len(first or []), "machine": machine}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
