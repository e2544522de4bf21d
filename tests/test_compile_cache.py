"""torch.compile of the decoder steps: same codes as eager, and a second start compiles nothing.

Each start is a fresh ``omni-stream synthesize --compile`` process sharing one cache folder
(``OMNI_STREAM_CACHE_DIR``), which is what a server restart looks like. The first start on the
2-core CI machine compiles for ~40-70 s; the second loads every graph from the cache.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def _run(ckpt, tmp_path, name: str, cache, compile_: bool) -> tuple[np.ndarray, dict | None]:
    codes = tmp_path / f"{name}.npy"
    env = dict(os.environ, OMNI_STREAM_CACHE_DIR=str(cache))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "omni_stream.cli", "synthesize", "--model", str(ckpt),
           "--text", "Compiled steps, cached.", "--greedy", "--max-frames", "6",
           "--weight-path", "int8", "--threads", "1", "--codes-out", str(codes)]
    if compile_:
        cmd.append("--compile")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"graphs_compiled': (\d+), 'graphs_from_cache': (\d+)", r.stdout)
    stats = {"compiled": int(m.group(1)), "cached": int(m.group(2))} if m else None
    return np.load(codes), stats


def test_compiled_steps_match_eager_and_warm_start_skips_compilation(tiny_ckpt, tmp_path,
                                                                     monkeypatch):
    cache = tmp_path / "cache"
    eager, none = _run(tiny_ckpt, tmp_path, "eager", cache, False)
    assert none is None
    cold_codes, cold = _run(tiny_ckpt, tmp_path, "cold", cache, True)
    assert cold is not None and cold["compiled"] > 0
    assert any((cache / "compile").iterdir())
    warm_codes, warm = _run(tiny_ckpt, tmp_path, "warm", cache, True)
    assert warm == {"compiled": 0, "cached": cold["compiled"] + cold["cached"]}
    assert np.array_equal(cold_codes, warm_codes)  # the same kernels, from the cache
    assert cold_codes.shape == eager.shape

    # compiled vs eager: fused kernels round bf16 differently, and on random weights a near-tie
    # can flip one greedy code and everything after it, so compare teacher-forced (same history
    # each frame): a wrong compiled step would show ~0 dB and chance agreement
    import torch

    from omni_stream.engine.loading import load_on_weight_path
    from omni_stream.engine.compiled import compile_engine
    from omni_stream.evaluation.fidelity import teacher_forced
    from omni_stream.models.prompt import PromptRequest
    from omni_stream.engine.synthesis import Synthesizer

    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(next((cache / "compile").iterdir())))
    ref, comp = (Synthesizer(load_on_weight_path(tiny_ckpt, dtype=torch.bfloat16, weight_path="int8"),
                             max_seq_len=256) for _ in range(2))
    compile_engine(comp.engine)
    req = PromptRequest(text="Compiled steps, cached.", language="auto", speaker="ryan")
    f = teacher_forced(ref, comp, req, 8, codec=False)
    assert f.frames == 8
    assert f.logits_snr_db > 30 and f.code0_agreement >= 0.75, f
