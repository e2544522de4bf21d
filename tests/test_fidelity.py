"""Teacher-forced fidelity of the code predictor (evaluation.fidelity) and ``omni-stream fidelity``.

- the teacher-forced logits are the decode's own: fed an engine's greedy codes, their argmax is
  what ``predict_residual`` drew, on the torch engine and on the CPU runtime, and torch and
  the runtime's exact (f32) weights agree to > 60 dB on the same inputs;
- a path against itself is inf dB and agreement 1 per codebook; int8 is finite and closer to
  fp32 than int4;
- the command prints a row per path, writes the JSON with the new keys, notes an outlier
  checkpoint, and refuses an unknown weight path by name.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from omni_stream.cli import main
from omni_stream.engine.frame import EngineShape, FrameEngine
from omni_stream.engine.sampling import SamplingParams
from omni_stream.engine.synthesis import Synthesizer
from omni_stream.evaluation.fidelity import OUTLIERS_FILE, load_path, requests_for, teacher_forced
from omni_stream.evaluation.metrics import snr_db
from omni_stream.models.prompt import PromptBuilder


def _frames(model, kind: str | None, frames: int = 6):
    """(engine, [(hidden, code0, residual codes, teacher-forced logits)] per frame) of a greedy
    decode whose every frame is checked against its teacher-forced logits."""
    eng = FrameEngine(model.weights.talker, EngineShape(max_slots=2, max_seq_len=256))
    if kind:
        pytest.importorskip("omni_stream.engine.cpu.native")
        eng.use_native(kind, kind, threads=2)
    req = requests_for(model.config)[0]
    p = PromptBuilder(model.config, model.weights.talker, model.tokenizer).build(req)
    out = []
    with torch.inference_mode():
        eng.prefill(0, p.embeds, p.trailing, SamplingParams.greedy(), 0)
        for _ in range(frames):
            res = eng.predict_residual(1)
            h, c0 = eng.last_hidden[:1].clone(), int(eng.last_code0[0])
            logits = eng.cp_logits_teacher_forced(h, c0, res[0])
            assert logits.shape == (15, eng.codebook_size) and logits.dtype == torch.float32
            assert torch.equal(logits.argmax(-1), res[0]), (kind, len(out))
            out.append((h, c0, res[0], logits))
            with eng.residual_given(res):
                eng.step(1)
    return eng, out


@pytest.mark.parametrize("kind", [None, "f32", "q8", "q4"],
                         ids=["torch", "native-f32", "native-q8", "native-q4"])
def test_teacher_forced_argmax_is_the_decodes_greedy_codes(tiny_model, kind):
    _frames(tiny_model, kind)  # fp32 model: the runtime's low-bit kinds reproduce their draws too


def test_torch_and_native_exact_weights_agree_on_the_same_inputs(tiny_model):
    _, frames = _frames(tiny_model, None)
    native_eng, _ = _frames(tiny_model, "f32")
    got = torch.stack([native_eng.cp_logits_teacher_forced(h, c0, r) for h, c0, r, _ in frames])
    want = torch.stack([lg for *_, lg in frames])
    assert snr_db(want, got) > 60


def test_a_path_against_itself_is_exact_per_codebook(tiny_model):
    ref, same = Synthesizer(tiny_model, max_seq_len=256), Synthesizer(tiny_model, max_seq_len=256)
    f = teacher_forced(ref, same, requests_for(tiny_model.config), 4, codec=False)
    assert f.frames > 0
    assert f.cp_logits_snr_db == math.inf
    assert f.cp_logits_snr_db_per_codebook == [math.inf] * 15
    assert f.cp_agreement_per_codebook == [1.0] * 15 and f.cp_agreement == 1.0
    d = f.as_dict()  # JSON: an infinite SNR is null, as for the talker's
    assert d["cp_logits_snr_db"] is None and d["cp_logits_snr_db_per_codebook"] == [None] * 15


def test_int8_code_predictor_is_closer_to_fp32_than_int4(tiny_ckpt, tiny_model):
    ref = Synthesizer(tiny_model, max_seq_len=256)
    reqs = requests_for(tiny_model.config)
    f8, f4 = (teacher_forced(ref, load_path(tiny_ckpt, wp, max_seq_len=256), reqs, 4, codec=False)
              for wp in ("int8", "int4"))
    for f in (f8, f4):
        assert math.isfinite(f.cp_logits_snr_db) and len(f.cp_logits_snr_db_per_codebook) == 15
        assert all(math.isfinite(x) for x in f.cp_logits_snr_db_per_codebook)
        assert all(0.0 <= a <= 1.0 for a in f.cp_agreement_per_codebook)
    assert f8.cp_logits_snr_db > f4.cp_logits_snr_db
    assert f8.cp_logits_snr_db > 25 and f8.cp_agreement > 0.8, f8


def test_cli_writes_the_rows_and_notes_outliers(tiny_ckpt, tmp_path, capsys):
    ck = tmp_path / "ck"  # the shared checkpoint, plus an outlier record of its own
    ck.mkdir()
    for f in tiny_ckpt.iterdir():
        (ck / f.name).symlink_to(f)
    (ck / OUTLIERS_FILE).write_text(json.dumps({"outliers": True, "channels": {"layer.0": [[3, 40.0]]}}))
    out = tmp_path / "fid.json"
    assert main(["fidelity", "--model", str(ck), "--weight-path", "int8", "--frames", "4",
                 "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "outlier channels" in printed and "int8" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["weight_path"] for r in rows] == ["int8"]
    r = rows[0]
    assert r["frames"] > 0 and r["cp_logits_snr_db"] > 0
    assert len(r["cp_logits_snr_db_per_codebook"]) == 15 and len(r["cp_agreement_per_codebook"]) == 15
    assert 1 <= r["cp_worst_codebook"] <= 15 and r["cp_worst_agreement"] <= r["cp_agreement"]
    for key in ("logits_snr_db", "code0_agreement", "code0_top5_overlap", "audio_snr_db"):
        assert key in r


def test_cli_refuses_an_unknown_weight_path_by_name(tiny_ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fidelity", "--model", str(tiny_ckpt), "--weight-path", "int3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "int3" in err and all(wp in err for wp in ("bf16", "fp32", "int8", "int4"))
