"""--engine vllm (omni_stream/engine/vllm): the talker decoder on vLLM, checked against the torch
engine. vLLM lives in an environment of its own (``omni_stream.engine.vllm.env``, built by
setup.sh), so the engine-level checks run there (tests/vllm_checks.py, JSON back) and the
server is started through the CLI, which moves itself into that environment.

- The same scripted multi-stream schedule on both engines (a whole and a chunked prefill with
  frame steps between its pieces, a stream held while the others step, a stream cancelled and
  its slot taken by a new one, a stream whose inputs go NaN): fp32 greedy codes identical per
  stream, on tiny (its head size 16 runs padded in vLLM's CPU attention) and on the 0.6B shape
  cut to 2 talker layers; the NaN stream alone fails; no request, KV block or slot is left.
- bf16: teacher-forced against fp32, vLLM's kernels are as close as torch's bf16.
- ``serve --engine vllm`` vs ``--engine torch --dtype fp32``: three concurrent greedy
  utterances, the same codec frames (the vllm engine's CPU default dtype is fp32).
- Refusals by name: low-bit weight paths, compile, split placement, no vLLM environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.speech_checks import greedy_frames

ROOT = Path(__file__).resolve().parents[1]
OMNI = str(Path(sys.executable).with_name("omni-stream"))


@pytest.fixture(scope="session")
def vllm_py() -> str:
    from omni_stream.engine.vllm.env import ensure_env

    return str(ensure_env(quiet=True))


def _check(py: str, *args: str, timeout: float = 900) -> dict:
    proc = subprocess.run([py, "-m", "tests.vllm_checks", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _assert_same_streams(res: dict) -> None:
    t, v = res["torch"], res["vllm"]
    assert t["ended"] == v["ended"]
    for k, codes in t["codes"].items():
        assert len(codes) > 0 or t["ended"][k] != "length", k
        a, b = np.array(codes), np.array(v["codes"][k])
        assert a.shape == b.shape, (k, a.shape, b.shape)
        diff = np.nonzero((a != b).any(axis=1))[0] if len(a) else []
        assert len(diff) == 0, f"stream {k}: codes part at frame {diff[0]}"
    assert res["vllm_left"] == {"requests": 0, "scheduler": 0, "kv_usage": 0.0}


def test_schedule_parity_fp32_tiny_with_a_poisoned_stream(vllm_py, tiny_ckpt):
    res = _check(vllm_py, "scenario", str(tiny_ckpt), "float32", "2", "40")
    _assert_same_streams(res)
    assert res["vllm"]["ended"] == {"0": "cancelled", "1": "length", "2": "invalid", "3": "length"}
    assert len(res["vllm"]["codes"]["1"]) == 40  # the held stream still spoke its frames


@pytest.mark.slow
def test_schedule_parity_fp32_06b_shape_depth_cut(vllm_py, ckpt_factory):
    ck = ckpt_factory("0.6b", "custom_voice", 3, talker_layers=2, cp_layers=1)
    res = _check(vllm_py, "scenario", str(ck), "float32", "-", "16")
    _assert_same_streams(res)
    assert set(res["vllm"]["ended"]) == {"0", "1", "2", "3"}  # stream 3 took a freed slot


def test_bf16_as_close_to_fp32_as_torch_bf16(vllm_py, tiny_ckpt):
    rows = _check(vllm_py, "fidelity", str(tiny_ckpt), "16")
    t, v = rows["torch"], rows["vllm"]
    assert v["frames"] == t["frames"] > 0
    assert v["logits_snr_db"] > t["logits_snr_db"] - 3.0, (v["logits_snr_db"], t["logits_snr_db"])
    assert v["logits_snr_db"] > 35.0
    assert v["code0_agreement"] >= t["code0_agreement"] - 0.1


def test_plugin_registers_the_talker_and_keys_are_strict(vllm_py, tiny_ckpt, tmp_path):
    res = _check(vllm_py, "plugin", str(tiny_ckpt), str(tmp_path / "cut"))
    assert res["registered"] is True
    assert "talker.model.layers.1.mlp.down_proj.weight" in res["missing_error"]


# ---------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: "
                                 f"{proc.stderr.read()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(1)
    raise AssertionError("server did not come up")


@pytest.fixture(scope="module")
def vllm_server(vllm_py, tiny_ckpt):
    """``omni-stream serve --engine vllm`` started from omni-stream's own environment: the CLI
    moves itself into the vLLM environment."""
    port = _free_port()
    proc = subprocess.Popen([OMNI, "serve", "--model", str(tiny_ckpt), "--engine", "vllm",
                             "--max-streams", "3", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        health = _wait_health(url, proc)
        yield url, health
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


TEXTS = ["Hello there, this is the vLLM engine speaking.",
         "A second voice at the same time, somewhat longer than the first one.",
         "Short."]


def test_serve_vllm_same_frames_as_torch_fp32(vllm_server, tiny_ckpt):
    from omni_stream.orchestrator import PipelineBackend, PipelineSettings
    from omni_stream.server.app import start_server
    from omni_stream.server.settings import ServerSettings
    from omni_stream.server.testing import serving_in_thread

    url, health = vllm_server
    assert health["status"] == "ok" and health["slots"] == 3

    async def three(u):
        return await asyncio.gather(*[greedy_frames(u, t, "vivian") for t in TEXTS])

    got = asyncio.run(three(url))
    settings = PipelineSettings(model_path=str(tiny_ckpt), engine="torch", dtype="float32",
                                max_streams=3)
    with serving_in_thread(lambda: start_server(PipelineBackend(settings), "127.0.0.1", 0,
                                                ServerSettings()), timeout=120) as turl:
        want = asyncio.run(three(turl))
    for t, g, w in zip(TEXTS, got, want):
        assert len(w) > 0 and g.shape == w.shape, (t, g.shape, w.shape)
        assert (g == w).all(), f"{t!r}: frames part at {np.nonzero((g != w).any(1))[0][0]}"


@pytest.mark.parametrize("flags, words", [
    (["--weight-path", "int4"], "not a vLLM path"),
    (["--compile"], "drop --compile"),
    (["--placement", "split"], "placement 'split'"),
])
def test_serve_vllm_refuses_what_it_cannot_run(vllm_py, tiny_ckpt, flags, words):
    proc = subprocess.run([OMNI, "serve", "--model", str(tiny_ckpt), "--engine", "vllm",
                           "--profile", "none", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr, proc.stderr[-2000:]


def test_engine_vllm_without_its_environment_names_the_fix(tiny_ckpt, tmp_path):
    env = dict(os.environ, OMNI_STREAM_VLLM_ENV=str(tmp_path / "none"))
    proc = subprocess.run([OMNI, "serve", "--model", str(tiny_ckpt), "--engine", "vllm"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "python -m omni_stream.engine.vllm.env" in proc.stderr
    assert not (tmp_path / "none").exists()  # refused, not built behind the user's back


def test_engine_vllm_with_ray_is_refused(tiny_ckpt):
    proc = subprocess.run([OMNI, "serve", "--model", str(tiny_ckpt), "--engine", "vllm",
                           "--ray", "local"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "drop --ray" in proc.stderr, proc.stderr[-2000:]
