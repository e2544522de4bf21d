"""Cloned-voice greedy parity with the official qwen-tts code at FULL 0.6B depth (28 talker
layers, 5 code-predictor layers), on the same random Base weights, fp32.

The test suite (tests/test_voice_clone_parity.py) checks at reduced depth; this runs once at the
released depth: the official ``generate_voice_clone`` in its isolated environment and
omni-stream's own encoders (``VoiceEncoder``) and engine, on the same reference clip, in ICL mode
(the official default, text streamed) and x-vector mode. Prints a table and writes JSON:
x-vector max abs difference, reference codes equal, frames compared, identical or the first
mismatch.

    python benchmarks/tts/clone_parity_full_depth.py --checkpoint /tmp/ck-06b-base --frames 100
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
import soundfile as sf  # noqa: E402
import torch  # noqa: E402

from benchmarks.tts.machine import machine_info, print_machine  # noqa: E402

TEXT = "Good morning! This sentence is spoken in a cloned voice at the full depth of the model."
REF_TEXT = "This is how I sound when I read a short passage out loud."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default="", help="a 0.6b base checkpoint (else one is written)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/tts/results/clone_parity_full_depth.json"))
    a = ap.parse_args()
    machine = machine_info()
    from omni_stream.checkpoints.io import load_model, read_config, write_random_checkpoint
    from omni_stream.engine.sampling import SamplingParams
    from omni_stream.engine.synthesis import Synthesizer
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.voices.encode import VoiceEncoder
    from omni_stream.voices.synthetic import voiced_clip
    from tests.reference.refenv import ensure_reference_env

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="clone-parity-"))
    ck = Path(a.checkpoint) if a.checkpoint else write_random_checkpoint(tmp / "ck", "0.6b", "base",
                                                                         seed=1)
    cfg = read_config(ck)
    depth = (cfg.talker.lm.num_hidden_layers, cfg.talker.code_predictor.num_hidden_layers)
    print(f"checkpoint {ck}: talker {depth[0]} layers, code predictor {depth[1]} layers", flush=True)
    clip = tmp / "ref.wav"
    sf.write(clip, voiced_clip(6.3, 24000), 24000, subtype="PCM_16")
    reqs = [dict(id=rid, ref_audio=str(clip), ref_text=None if xvec else REF_TEXT,
                 x_vector_only=xvec, text=TEXT, language="english", non_streaming_mode=False,
                 max_new_tokens=a.frames + 1) for rid, xvec in (("icl", False), ("xvec", True))]
    (tmp / "requests.json").write_text(json.dumps(reqs))
    refpy = ensure_reference_env()
    t0 = time.perf_counter()
    r = subprocess.run([str(refpy), str(ROOT / "tests/reference/official_runner.py"), "clone",
                        "--model", str(ck), "--requests", str(tmp / "requests.json"),
                        "--out", str(tmp / "official.npz"), "--threads", str(a.threads)],
                       capture_output=True, text=True)
    official_s = time.perf_counter() - t0
    if r.returncode:
        print(r.stderr[-4000:], file=sys.stderr)
        return 1
    off = dict(np.load(tmp / "official.npz"))
    model = load_model(ck, dtype=torch.float32)
    synth = Synthesizer(model, max_seq_len=1024)
    enc = VoiceEncoder(ck)
    wav, sr = sf.read(clip, dtype="float32")
    rows = []
    t1 = time.perf_counter()
    for q in reqs:
        rid = q["id"]
        clone = enc.encode(wav, sr, ref_text=q["ref_text"], x_vector_only=q["x_vector_only"])
        xdiff = float(np.abs(clone.x_vector - off[f"{rid}.x_vector"]).max())
        codes_equal = (clone.ref_codes is None) if q["x_vector_only"] else \
            bool(np.array_equal(clone.ref_codes, off[f"{rid}.ref_codes"]))
        ours, _, _ = synth.generate_codes(
            PromptRequest(text=TEXT, language="english", clone=clone, stream_text=True),
            SamplingParams.greedy(), 0, a.frames)
        theirs = off[f"{rid}.codes"]
        n = min(len(ours), len(theirs))
        mism = np.argwhere(ours[:n] != theirs[:n])
        rows.append(dict(id=rid, mode="x_vector" if q["x_vector_only"] else "icl",
                         x_vector_max_abs_diff=xdiff, ref_codes_identical=codes_equal,
                         ref_frames=0 if clone.ref_codes is None else len(clone.ref_codes),
                         frames_ours=len(ours), frames_official=len(theirs), frames_compared=n,
                         identical=bool(mism.size == 0 and len(ours) == len(theirs[:a.frames])),
                         first_mismatch=mism[0].tolist() if mism.size else None))
    ours_s = time.perf_counter() - t1
    out = dict(checkpoint=str(ck), talker_layers=depth[0], cp_layers=depth[1], frames=a.frames,
               official_seconds=round(official_s, 1), omni_stream_seconds=round(ours_s, 1),
               requests=rows, all_identical=all(r["identical"] and r["ref_codes_identical"]
                                                and r["x_vector_max_abs_diff"] <= 1e-4
                                                for r in rows), machine=machine)
    print_machine(machine)
    print(f"{'mode':<9} {'x-vec diff':>10} {'ref codes':>9} {'frames':>7} {'identical':>9}")
    for r in rows:
        print(f"{r['mode']:<9} {r['x_vector_max_abs_diff']:>10.1e} "
              f"{str(r['ref_codes_identical']):>9} {r['frames_compared']:>7} "
              f"{str(r['identical']):>9}")
    print(f"official {official_s:.0f} s, omni-stream {ours_s:.0f} s; all identical: "
          f"{out['all_identical']}")
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")
    return 0 if out["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
