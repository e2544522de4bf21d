"""The peers' converters (benchmarks/tts/peers) on the tiny checkpoint: the GGUF files qwentts.cpp
reads (names, shapes, types, metadata, read back with gguf.GGUFReader) and vox's build command.
Nothing here installs a peer or runs one (peer_bench.py does, outside the suite)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

gguf = pytest.importorskip("gguf")

from benchmarks.tts.peers import gguf_convert as gc
from benchmarks.tts.peers.setup import PEERS, Peer
from benchmarks.tts.peers.vox_build import vox_build_command


def _kv(reader: gguf.GGUFReader) -> dict:
    out = {}
    for name, field in reader.fields.items():
        out[name] = field.contents()
    return out


def _tensors(reader: gguf.GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_ckpt, tmp_path_factory):
    """{(file, variant): GGUFReader}. Reading 151k vocabulary strings back is most of the cost,
    so the Q8_0 talker is written with a short vocabulary (the F32 one checks the real one)."""
    out = tmp_path_factory.mktemp("gguf")
    readers = {}
    for q in ("F32", "Q8_0"):
        talker, codec = out / f"talker-{q}.gguf", out / f"codec-{q}.gguf"
        with pytest.MonkeyPatch.context() as mp:
            if q != "F32":
                mp.setattr(gc, "_bpe", lambda ck: (["a", "b"], [1, 1], ["a b"]))
            gc.write_talker_gguf(tiny_ckpt, talker, q)
        gc.write_codec_gguf(tiny_ckpt, codec, q)
        readers[("talker", q)], readers[("codec", q)] = gguf.GGUFReader(talker), gguf.GGUFReader(codec)
    return readers


def test_talker_gguf_names_shapes_and_metadata(tiny_ckpt, tiny_gguf):
    r = tiny_gguf[("talker", "F32")]
    kv, ts = _kv(r), _tensors(r)
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    t = cfg["talker_config"]
    assert kv["general.architecture"] == "qwen3-tts"
    assert kv["qwen3-tts.talker.block_count"] == t["num_hidden_layers"]
    assert kv["qwen3-tts.talker.embedding_length"] == t["hidden_size"]
    assert kv["qwen3-tts.code_pred.block_count"] == t["code_predictor_config"]["num_hidden_layers"]
    assert kv["qwen3-tts.talker.rope.mrope_section"] == t["rope_scaling"]["mrope_section"]
    assert kv["qwen3-tts.talker.rope.mrope_interleaved"] is True
    assert kv["qwen3-tts.codec.eos_id"] == t["codec_eos_token_id"]
    assert kv["qwen3-tts.codec.speaker_names"] == list(t["spk_id"])
    assert kv["qwen3-tts.codec.speaker_dialects"][list(t["spk_id"]).index("dylan")] == "beijing_dialect"
    assert kv["qwen3-tts.text.tts_pad_id"] == cfg["tts_pad_token_id"]
    assert kv["tokenizer.ggml.tokens"][cfg["im_start_token_id"]] == "<|im_start|>"
    # every checkpoint tensor, renamed, same values; GGUF lists dims innermost first
    with safe_open(str(tiny_ckpt / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert len(ts) == len(keys)
        for k in ("talker.model.layers.1.self_attn.k_proj.weight", "talker.code_predictor.lm_head.14.weight",
                  "talker.model.text_embedding.weight", "talker.text_projection.linear_fc2.bias"):
            g = ts[gc.talker_tensor_name(k)]
            want = f.get_tensor(k).float().numpy()
            assert list(g.shape) == list(reversed(want.shape))
            np.testing.assert_array_equal(np.asarray(g.data).reshape(want.shape), want)
    for name in ("talker.blk.0.attn_q_norm.weight", "talker.blk.1.ffn_down.weight", "talker.codec_embd.weight",
                 "talker.output_norm.weight", "code_pred.codec_embd.14.weight", "code_pred.blk.1.attn_output.weight",
                 "code_pred.output_norm.weight", "talker.text_proj.fc1.weight"):
        assert name in ts, name


def test_codec_gguf_names_codebooks_and_metadata(tiny_ckpt, tiny_gguf):
    r = tiny_gguf[("codec", "F32")]
    kv, ts = _kv(r), _tensors(r)
    d = json.loads((tiny_ckpt / "speech_tokenizer" / "config.json").read_text())["decoder_config"]
    assert kv["general.architecture"] == "qwen3-tts-tokenizer"
    assert kv["qwen3-tts-tokenizer.decoder.num_hidden_layers"] == d["num_hidden_layers"]
    assert kv["qwen3-tts-tokenizer.decoder.sliding_window"] == d["sliding_window"]
    assert kv["qwen3-tts-tokenizer.decoder.upsample_rates"] == d["upsample_rates"]
    assert kv["qwen3-tts-tokenizer.decoder.codebook_dim_internal"] == d["codebook_dim"] // 2
    with safe_open(str(tiny_ckpt / "speech_tokenizer" / "model.safetensors"), framework="pt") as f:
        base = "decoder.quantizer.rvq_rest.vq.layers.3._codebook."
        emb = f.get_tensor(base + "embedding_sum").float().numpy()
        use = f.get_tensor(base + "cluster_usage").float().numpy()
        conv = f.get_tensor("decoder.decoder.2.block.3.conv1.conv.weight").float().numpy()
    book = ts["tok_dec.vq_rest.3.codebook"]
    np.testing.assert_allclose(np.asarray(book.data).reshape(emb.shape),
                               emb / np.clip(use, gc.RVQ_EPS, None)[:, None], rtol=1e-6)
    c = ts["tok_dec.dec.2.res.1.conv1.weight"]  # block 3 = residual unit 1
    np.testing.assert_array_equal(np.asarray(c.data).reshape(conv.shape), conv)
    for name in ("tok_dec.pre_conv.weight", "tok_dec.pre_tfm.blk.1.attn_scale", "tok_dec.pre_tfm.input_proj.bias",
                 "tok_dec.upsample.1.pwconv2.weight", "tok_dec.upsample.0.gamma", "tok_dec.dec.0.conv.weight",
                 "tok_dec.dec.4.conv_t.weight", "tok_dec.dec.4.snake.alpha", "tok_dec.dec.5.snake.beta",
                 "tok_dec.dec.6.conv.bias", "tok_dec.vq_first.0.codebook", "tok_dec.vq_first.output_proj.weight"):
        assert name in ts, name
    assert not any("input_proj.weight" in n and "vq_" in n for n in ts)  # unused at decode time


def test_quantized_variant_follows_the_policy(tiny_gguf):
    types = {t.name: t.tensor_type.name for t in tiny_gguf[("talker", "Q8_0")].tensors}
    assert types["talker.blk.0.attn_q.weight"] == "Q8_0"
    assert types["talker.codec_embd.weight"] == "Q8_0"
    assert types["talker.blk.0.attn_norm.weight"] == "F32"  # 1-D stays F32
    ctypes_ = {t.name: t.tensor_type.name for t in tiny_gguf[("codec", "Q8_0")].tensors}
    assert ctypes_["tok_dec.vq_rest.0.codebook"] == "F32"  # RVQ tables never quantized
    assert ctypes_["tok_dec.dec.1.snake.alpha"] == "F32"
    assert ctypes_["tok_dec.dec.0.conv.weight"] == "F16"  # kernel 7 fills no Q8_0 block


def test_target_type_policy():
    assert gc.target_type("talker.blk.0.ffn_up.weight", (3072, 1024), "Q4_K_M") == "Q4_K"
    assert gc.target_type("talker.text_embd.weight", (151936, 2048), "Q4_K_M") == "Q6_K"
    assert gc.target_type("talker.blk.0.ffn_up.weight", (128, 64), "Q4_K_M") == "F16"  # 64 % 256
    assert gc.target_type("code_pred.lm_head.3.weight", (2048, 1024), "BF16") == "BF16"
    assert gc.target_type("tok_dec.vq_first.output_proj.weight", (512, 256, 1), "Q8_0") == "F32"
    assert gc.target_type("anything", (4, 4), "F32") == "F32"
    with pytest.raises(ValueError, match="Q4_K_M"):
        gc.target_type("x", (32, 32), "Q5")
    with pytest.raises(KeyError, match="speaker_encoder"):
        gc.talker_tensor_name("speaker_encoder.fc.weight")
    with pytest.raises(RuntimeError, match="GgmlQuantizer"):
        gc._encode(np.zeros((2, 256), np.float32), "Q4_K", None)


def test_vox_build_command(tmp_path):
    py = tmp_path / "bin" / "python"
    cmd = vox_build_command(py, "/ck", tmp_path / "m.tmod", "8-bit")
    assert cmd == [str(py), "-m", "vox", "build", "--model", "/ck", "--dtype", "bf16", "--quant", "q8",
                   "--no-hash", "-o", str(tmp_path / "m.tmod")]
    assert "--quant" not in vox_build_command(py, "/ck", "o", "fp32")
    assert vox_build_command(py, "/ck", "o", "fp32")[7] == "f32"
    assert vox_build_command(py, "/ck", "o", "4-bit")[9] == "q4full"
    with pytest.raises(ValueError, match="8-bit"):
        vox_build_command(py, "/ck", "o", "int3")


def test_peers_are_pinned():
    assert PEERS["vox"].requirement == "vox-tts==0.19.5"
    assert PEERS["qwentts"].requirement == "realtimetts-qwen-native-cpu==0.4.2"
    with pytest.raises(ValueError, match="exact version"):
        Peer("x", "x", ">=1", "x")
