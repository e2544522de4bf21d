"""``omni-stream profile``: the effective profile with sources, on this machine and emulated."""

from __future__ import annotations

import json

import pytest

from omni_stream.cli import main


def test_profile_here_and_emulated(tiny_ckpt, capsys, monkeypatch):
    assert main(["profile", "--model", str(tiny_ckpt), "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert here["hardware"]["hardware_class"] in ("x86_cpu", "arm64_cpu")
    assert set(here["sources"]) == set(here["profile"])
    monkeypatch.setenv("OMNI_STREAM_HW_PROFILE", json.dumps(
        {"hardware_class": "cuda_discrete", "cuda": {"name": "H100", "total_memory_gb": 80.0,
                                                      "unified_memory": False,
                                                      "compute_capability": [9, 0]}}))
    assert main(["profile", "--model", str(tiny_ckpt), "--json", "--set", '{"max_seq_len": 1024}']) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["profile"]["device"] == "cuda" and gpu["profile"]["cuda_graphs"] is True
    assert gpu["profile"]["max_seq_len"] == 1024 and gpu["sources"]["max_seq_len"] == "user"
    monkeypatch.setenv("OMNI_STREAM_HW_PROFILE", '{"hardware_class": "quantum"}')
    assert main(["profile", "--model", str(tiny_ckpt)]) == 2
    assert "quantum" in capsys.readouterr().err


def _serve_args(*argv):
    from omni_stream.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_settings_follow_the_profile_and_flags(tiny_ckpt, monkeypatch):
    from omni_stream.cli import pipeline_settings
    from omni_stream.edge.probe import load_profile

    # an emulated 8-core big.LITTLE ARM board: split placement, 2 threads per stage, from the profile
    hw = load_profile(env={"OMNI_STREAM_HW_PROFILE": json.dumps(
        {"hardware_class": "arm64_cpu", "arch": "aarch64", "physical_cores": 8, "ram_gb": 8})},
        use_torch=False)
    s, prof, src = pipeline_settings(_serve_args("--model", str(tiny_ckpt)), hw)
    assert s.placement == prof.placement == "split" and src["placement"] == "derived"
    assert s.talker_threads == prof.talker_threads and s.max_streams == prof.max_streams
    assert s.max_seq_len == prof.max_seq_len == 1024 and src["max_seq_len"] == "class:arm64_cpu"
    # explicit flags win over the profile
    s2, _, src2 = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--placement", "together",
                                                "--max-streams", "3", "--dtype", "fp32"), hw)
    assert (s2.placement, s2.max_streams, s2.dtype) == ("together", 3, "float32")
    assert src2["placement"] == src2["max_streams"] == src2["dtype"] == "user"
    # --profile none: the fixed defaults
    s3, _, src3 = pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--profile", "none"), hw)
    assert (s3.placement, s3.max_streams, s3.dtype, s3.max_seq_len) == ("together", 4, "float32", 2048)
    assert set(src3.values()) == {"default"}
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        pipeline_settings(_serve_args("--model", str(tiny_ckpt), "--dtype", "fp8"), hw)
