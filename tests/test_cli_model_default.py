"""One CLI convention: every ``omni-stream`` command that takes ``--model`` takes ``default``
(the embedded model, ``checkpoints.default.resolve_model_path``), and defaults to it.

The embedded default model is the tiny seed-0 custom_voice checkpoint, so the session's copy of
it is put where ``resolve_model_path`` looks (a fresh cache dir): nothing is generated, and each
command below really runs on ``--model default`` (serve: its settings; export-decoder: up to the
exporter, which test_export_decoder.py runs for real).
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from omni_stream.checkpoints.default import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION
from omni_stream.cli import build_parser, main


@pytest.fixture
def default_model(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_STREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cache" / "models" / DEFAULT_MODEL_VERSION
    shutil.copytree(tiny_ckpt, path)
    (path / ".complete").write_text("ok\n")
    return path


def _synthesize(default_model, tmp_path, capsys, monkeypatch):
    wav = tmp_path / "a.wav"
    assert main(["synthesize", "--model", "default", "--text", "Hi.", "--voice", "ryan",
                 "--greedy", "--max-frames", "4", "--out", str(wav)]) == 0
    assert wav.stat().st_size > 44 and "frames" in capsys.readouterr().out


def _serve(default_model, tmp_path, capsys, monkeypatch):
    from omni_stream.cli import pipeline_settings

    settings, _, _ = pipeline_settings(build_parser().parse_args(
        ["serve", "--model", "default", "--profile", "none"]))
    assert settings.model_path == str(default_model) and settings.model_name == "qwen3-tts"


def _profile(default_model, tmp_path, capsys, monkeypatch):
    assert main(["profile", "--model", "default", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"]


def _export_decoder(default_model, tmp_path, capsys, monkeypatch):
    from omni_stream.export import torch_program
    from omni_stream.export.manifest import ExportError

    seen = []

    def export_program(model_dir, *a, **k):
        seen.append(model_dir)
        raise ExportError("stopped by the test")

    monkeypatch.setattr(torch_program, "export_program", export_program)
    assert main(["export-decoder", "--model", "default", "--format", "pt2", "--out",
                 str(tmp_path / "dec"), "--no-progress"]) == 2
    assert seen == [default_model] and "stopped by the test" in capsys.readouterr().err


def _export_step(default_model, tmp_path, capsys, monkeypatch):
    from omni_stream.export.manifest import Manifest

    out = tmp_path / "npu"
    assert main(["export-step", "--model", "default", "--part", "talker", "--context", "16",
                 "--layout", "ring", "--out", str(out)]) == 0
    m = Manifest.read(out / "talker-ring.json")
    assert m.source_checkpoint == str(default_model.resolve()) and m.step.context == 16


def _fidelity(default_model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "fidelity.json"
    assert main(["fidelity", "--model", "default", "--weight-path", "int8", "--frames", "2",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["weight_path"] for r in rows] == ["int8"]


RUNS = {"synthesize": _synthesize, "serve": _serve, "profile": _profile,
        "export-decoder": _export_decoder, "export-step": _export_step, "fidelity": _fidelity}


def _model_commands() -> dict[str, argparse.Action]:
    """command -> its --model option, for every subcommand that has one."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if "--model" in action.option_strings:
                out[name] = action
    return out


def test_every_model_command_defaults_to_the_embedded_model():
    opts = _model_commands()
    assert set(opts) == set(RUNS), "a command with --model needs its case in RUNS"
    for name, action in opts.items():
        assert action.default == DEFAULT_MODEL_NAME and not action.required, name
        assert "'default'" in action.help, name


@pytest.mark.parametrize("command", sorted(RUNS))
def test_model_default_resolves(command, default_model, tmp_path, capsys, monkeypatch):
    RUNS[command](default_model, tmp_path, capsys, monkeypatch)
