"""Cloned-voice synthesis vs the official qwen-tts 0.1.1 code on the same random Base weights.

The official ``generate_voice_clone`` (greedy, fp32) runs in the reference environment
(tests/reference/refenv.py) on a reference clip made here; omni-stream computes the voice from
the same clip with its own encoders (``VoiceEncoder``) and must produce identical codes for
>= 100 frames, in ICL mode (the official default, text streamed) and x-vector mode, on 0.6B-
and 1.7B-shaped configs (talker and code-predictor depth cut for CI time; the speaker encoder
and the tokenizer's encoder keep their released size).

Set OMNI_STREAM_SKIP_REFERENCE=1 to skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omni_stream.checkpoints.io import load_model
from omni_stream.engine.sampling import SamplingParams
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.models.prompt import PromptRequest
from omni_stream.voices.synthetic import voiced_clip

pytestmark = [pytest.mark.reference, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("OMNI_STREAM_SKIP_REFERENCE") == "1",
                                 reason="OMNI_STREAM_SKIP_REFERENCE=1")]

ROOT = Path(__file__).resolve().parents[1]
FRAMES = 100
TEXT = "Good morning! This sentence is spoken in a cloned voice, word by word."
REF_TEXT = "This is how I sound when I read a short passage out loud."

SHAPES = {
    # name: (preset, make_checkpoint overrides, [(request id, clip sample rate, x_vector_only,
    #        non_streaming_mode)])
    "0.6b": ("0.6b", dict(talker_layers=2, cp_layers=2),
             [("icl", 24000, False, False), ("xvec", 16000, True, False),
              ("icl-nonstream", 24000, False, True)]),
    "1.7b": ("1.7b", dict(talker_layers=2, cp_layers=1),
             [("icl", 44100, False, False), ("xvec", 24000, True, False)]),
}


@pytest.fixture(scope="module")
def refpy() -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.reference.refenv import ensure_reference_env

    return ensure_reference_env()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cloned_voice_greedy_codes_identical(shape, ckpt_factory, refpy, tmp_path):
    from omni_stream.voices.encode import VoiceEncoder

    preset, overrides, cases = SHAPES[shape]
    ck = ckpt_factory(preset, "base", 5, **overrides)
    requests = []
    for i, (rid, sr, xvec, nonstream) in enumerate(cases):
        clip = tmp_path / f"{rid}.wav"
        sf.write(clip, voiced_clip(3.37 + i, sr, seed=i), sr, subtype="PCM_16")  # not whole frames
        requests.append(dict(id=rid, ref_audio=str(clip), ref_text=None if xvec else REF_TEXT,
                             x_vector_only=xvec, text=TEXT, language="english",
                             non_streaming_mode=nonstream, max_new_tokens=FRAMES + 1))
    rq = tmp_path / "requests.json"
    rq.write_text(json.dumps(requests))
    out = tmp_path / "official.npz"
    r = subprocess.run([str(refpy), str(ROOT / "tests" / "reference" / "official_runner.py"),
                        "clone", "--model", str(ck), "--requests", str(rq), "--out", str(out),
                        "--threads", "2"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    official = dict(np.load(out))

    model = load_model(ck, dtype=torch.float32)
    synth = Synthesizer(model, max_seq_len=1024)
    enc = VoiceEncoder(ck)
    for req in requests:
        rid = req["id"]
        wav, sr = sf.read(req["ref_audio"], dtype="float32")
        clone = enc.encode(wav, sr, ref_text=req["ref_text"], x_vector_only=req["x_vector_only"])
        err = float(np.abs(clone.x_vector - official[f"{rid}.x_vector"]).max())
        assert err <= 1e-4, f"{shape}/{rid}: x-vector max abs diff {err:.2e}"
        if req["x_vector_only"]:
            assert clone.ref_codes is None
        else:
            assert np.array_equal(clone.ref_codes, official[f"{rid}.ref_codes"]), rid
        theirs = official[f"{rid}.codes"]
        assert theirs.shape[0] >= FRAMES, f"official stopped early ({theirs.shape[0]} frames)"
        pr = PromptRequest(text=TEXT, language="english", clone=clone,
                           stream_text=not req["non_streaming_mode"])
        ours, _, _ = synth.generate_codes(pr, SamplingParams.greedy(), 0, FRAMES)
        mism = np.argwhere(ours != theirs[:len(ours)])
        assert len(ours) == FRAMES and mism.size == 0, (
            f"{shape}/{rid}: first mismatch at frame/codebook {mism[:1].tolist()}")
