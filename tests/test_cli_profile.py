"""``omni-stream profile``: the effective profile with sources, on this machine and emulated."""

from __future__ import annotations

import json

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
