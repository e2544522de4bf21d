"""Checkpoint layout, strict loading and clear errors on bad folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_stream.config import ModelConfig
from omni_stream.checkpoints.io import CheckpointError, load_model, read_config
from omni_stream.models.text_tokenizer import TextTokenizer


def _copy(src, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def test_layout_and_config(tiny_ckpt):
    for rel in ["config.json", "generation_config.json", "model.safetensors", "vocab.json",
                "merges.txt", "tokenizer_config.json", "speech_tokenizer/config.json",
                "speech_tokenizer/model.safetensors"]:
        assert (tiny_ckpt / rel).is_file(), rel
    cfg = read_config(tiny_ckpt)
    assert isinstance(cfg, ModelConfig)
    assert cfg.variant == "custom_voice"
    assert cfg.code2wav.samples_per_frame == 1920
    assert cfg.talker.speakers["ryan"] == 3061 and cfg.talker.languages["english"] == 2050
    assert cfg.talker.special.codec_eos == 2150


def test_tokenizer_special_ids_and_roles(tiny_ckpt):
    tok = TextTokenizer.from_dir(tiny_ckpt)
    ids = tok.encode("<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 151644 and ids[-3] == 151644
    assert len(ids[:3]) == 3 and ids[2] == ids[-1]  # role is exactly 3 tokens
    assert ids[-5] == 151645
    assert tok.token_to_id("<tts_pad>") == 151671
    assert tok.decode(ids).startswith("<|im_start|>assistant\nHi there.")


def test_load_is_strict_and_complete(tiny_model):
    names = {k for k, _ in tiny_model.weights.named_parameters()}
    assert "talker.code_predictor.lm_head.14.weight" in names
    assert "talker.model.text_embedding.weight" in names
    assert not any(p.is_meta for p in tiny_model.weights.parameters())
    assert not any(p.is_meta for p in tiny_model.code2wav.parameters())


def test_missing_file_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    (ck / "speech_tokenizer" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="speech_tokenizer/config.json"):
        load_model(ck)


def test_missing_weights_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    (ck / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ck)


def test_missing_tokenizer_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    (ck / "merges.txt").unlink()
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        load_model(ck)


def _rewrite(path, fn):
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def test_wrong_shape_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    key = "talker.model.layers.1.mlp.up_proj.weight"
    _rewrite(ck / "model.safetensors", lambda s: s.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_model(ck)


def test_missing_and_unexpected_tensor_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    key = "talker.codec_head.weight"
    _rewrite(ck / "model.safetensors", lambda s: s.pop(key))
    with pytest.raises(CheckpointError, match="missing tensors: talker.codec_head.weight"):
        load_model(ck)
    ck2 = _copy(tiny_ckpt, tmp_path / "b")
    _rewrite(ck2 / "speech_tokenizer" / "model.safetensors",
             lambda s: s.__setitem__("decoder.bogus.weight", torch.zeros(1)))
    with pytest.raises(CheckpointError, match="bogus"):
        load_model(ck2)


def test_unknown_variant_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["tts_model_type"] = "karaoke"
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown tts_model_type 'karaoke'"):
        load_model(ck)


def test_not_a_folder():
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model("/nonexistent/model")


@pytest.mark.parametrize("variant", ["voice_design", "base"])
def test_other_variants_write_and_load(ckpt_factory, variant):
    ck = ckpt_factory("tiny", variant, 3)
    m = load_model(ck)
    assert m.config.variant == variant
    assert (m.config.talker.speakers == {}) 
    if variant == "base":
        assert hasattr(m.weights, "speaker_encoder")


def test_seed_determinism(ckpt_factory):
    a = load_file(str(ckpt_factory("tiny", "custom_voice", 5) / "model.safetensors"))
    b = load_file(str(ckpt_factory("tiny", "voice_design", 5) / "model.safetensors"))
    assert torch.equal(a["talker.codec_head.weight"], b["talker.codec_head.weight"])


def test_codec_not_silent(tiny_model):
    codes = torch.randint(0, 2048, (1, 16, 6))
    with torch.inference_mode():
        wav = tiny_model.code2wav(codes)
    assert wav.shape[-1] == 6 * 1920
    assert float(wav.float().pow(2).mean().sqrt()) > 1e-3
