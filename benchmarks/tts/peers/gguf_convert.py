"""A released-layout Qwen3-TTS checkpoint -> the two GGUF files qwentts.cpp reads (talker, codec).

qwentts.cpp (the engine inside the ``realtimetts-qwen-native-cpu`` wheel) loads a talker GGUF
(arch ``qwen3-tts``: talker + code predictor + BPE vocab) and a codec GGUF (arch
``qwen3-tts-tokenizer``: the 12 Hz speech-tokenizer decoder). The tensor names and metadata keys
are those of upstream qwentts.cpp's ``convert.py`` (checked against the strings the bundled
``libqwen.so`` looks up); the quantization policy is that of its ``tools/quantize.cpp``:

- 1-D tensors, Snake alpha/beta, and the RVQ codebooks and projections (``tok_dec.vq_*``) stay F32;
- embeddings (``*.codec_embd*``, ``*.text_embd``) take the variant's embedding type
  (Q8_0 -> Q8_0, Q4_K_M -> Q6_K); every other >= 2-D tensor the base type (Q8_0, Q4_K, BF16);
- a tensor whose rows do not fill the type's blocks (conv kernels of width 7, 3, 1; tiny models)
  falls back to F16. quantize.cpp's Q4_K_M "bump" of v/down projections matches HF names
  (``layers.N``, ``v_proj``), which the GGUF names no longer carry, so it bumps nothing: plain Q4_K.

Q8_0 and BF16 are quantized with the ``gguf`` package; the K-quants (Q4_K, Q6_K) with ggml's own
``ggml_quantize_chunk`` from the peer's ``libggml-base`` (``GgmlQuantizer``), since ``gguf``
does not implement them.

    write_talker_gguf(ck, "talker-Q8_0.gguf", "Q8_0")
    write_codec_gguf(ck, "codec-Q8_0.gguf", "Q8_0")
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CODEC_ARCH",
    "QUANTS",
    "TALKER_ARCH",
    "GgmlQuantizer",
    "codec_metadata",
    "codec_tensor_name",
    "talker_metadata",
    "talker_tensor_name",
    "target_type",
    "write_codec_gguf",
    "write_talker_gguf",
]

TALKER_ARCH = "qwen3-tts"
CODEC_ARCH = "qwen3-tts-tokenizer"
QUANTS = ("F32", "BF16", "Q8_0", "Q4_K_M")
RVQ_EPS = 1e-5  # EuclideanCodebook: embedding = embedding_sum / clamp(cluster_usage, eps)

# HF suffix inside a decoder layer -> GGUF suffix (talker, code predictor, codec transformer)
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn_layer_scale.scale": "attn_scale",
    "mlp_layer_scale.scale": "ffn_scale",
}
_TALKER_TOP = {
    "talker.model.codec_embedding.weight": "talker.codec_embd.weight",
    "talker.model.text_embedding.weight": "talker.text_embd.weight",
    "talker.model.norm.weight": "talker.output_norm.weight",
    "talker.codec_head.weight": "talker.codec_head.weight",
    "talker.text_projection.linear_fc1.weight": "talker.text_proj.fc1.weight",
    "talker.text_projection.linear_fc1.bias": "talker.text_proj.fc1.bias",
    "talker.text_projection.linear_fc2.weight": "talker.text_proj.fc2.weight",
    "talker.text_projection.linear_fc2.bias": "talker.text_proj.fc2.bias",
    "talker.code_predictor.model.norm.weight": "code_pred.output_norm.weight",
    "talker.code_predictor.small_to_mtp_projection.weight": "code_pred.mtp_proj.weight",
    "talker.code_predictor.small_to_mtp_projection.bias": "code_pred.mtp_proj.bias",
}
_TALKER_RE = [
    (re.compile(r"talker\.model\.layers\.(\d+)\.(.+)"), "talker.blk.{0}.{L}"),
    (re.compile(r"talker\.code_predictor\.model\.layers\.(\d+)\.(.+)"), "code_pred.blk.{0}.{L}"),
    (re.compile(r"talker\.code_predictor\.model\.codec_embedding\.(\d+)\.weight"), "code_pred.codec_embd.{0}.weight"),
    (re.compile(r"talker\.code_predictor\.lm_head\.(\d+)\.weight"), "code_pred.lm_head.{0}.weight"),
]
# codec decoder: HF name -> GGUF name (codebooks are fused separately, input_proj dropped)
_CODEC_RE = [
    (re.compile(r"decoder\.pre_conv\.conv\.(weight|bias)"), "tok_dec.pre_conv.{0}"),
    (re.compile(r"decoder\.pre_transformer\.(input_proj|output_proj)\.(weight|bias)"), "tok_dec.pre_tfm.{0}.{1}"),
    (re.compile(r"decoder\.pre_transformer\.norm\.weight"), "tok_dec.pre_tfm.norm.weight"),
    (re.compile(r"decoder\.pre_transformer\.layers\.(\d+)\.(.+)"), "tok_dec.pre_tfm.blk.{0}.{L}"),
    (re.compile(r"decoder\.upsample\.(\d+)\.0\.conv\.(weight|bias)"), "tok_dec.upsample.{0}.conv.{1}"),
    (re.compile(r"decoder\.upsample\.(\d+)\.1\.dwconv\.conv\.(weight|bias)"), "tok_dec.upsample.{0}.dwconv.{1}"),
    (re.compile(r"decoder\.upsample\.(\d+)\.1\.(norm|pwconv1|pwconv2)\.(weight|bias)"), "tok_dec.upsample.{0}.{1}.{2}"),
    (re.compile(r"decoder\.upsample\.(\d+)\.1\.gamma"), "tok_dec.upsample.{0}.gamma"),
    (re.compile(r"decoder\.decoder\.0\.conv\.(weight|bias)"), "tok_dec.dec.0.conv.{0}"),
    (re.compile(r"decoder\.decoder\.5\.(alpha|beta)"), "tok_dec.dec.5.snake.{0}"),
    (re.compile(r"decoder\.decoder\.6\.conv\.(weight|bias)"), "tok_dec.dec.6.conv.{0}"),
    (re.compile(r"decoder\.decoder\.([1-4])\.block\.0\.(alpha|beta)"), "tok_dec.dec.{0}.snake.{1}"),
    (re.compile(r"decoder\.decoder\.([1-4])\.block\.1\.conv\.(weight|bias)"), "tok_dec.dec.{0}.conv_t.{1}"),
    (re.compile(r"decoder\.decoder\.([1-4])\.block\.([2-4])\.(act1|act2)\.(alpha|beta)"), "tok_dec.dec.{0}.res.{R}.{2}.{3}"),
    (re.compile(r"decoder\.decoder\.([1-4])\.block\.([2-4])\.(conv1|conv2)\.conv\.(weight|bias)"), "tok_dec.dec.{0}.res.{R}.{2}.{3}"),
    (re.compile(r"decoder\.quantizer\.rvq_(first|rest)\.output_proj\.weight"), "tok_dec.vq_{0}.output_proj.weight"),
]
_CODEC_DROPPED = re.compile(r"decoder\.quantizer\.rvq_(first|rest)\.input_proj\.weight|encoder\..*")
_CODEBOOK = re.compile(r"decoder\.quantizer\.rvq_(first|rest)\.vq\.layers\.(\d+)\._codebook\.(embedding_sum|cluster_usage)")
_KEEP_F32 = re.compile(r"\.(snake|act1|act2)\.(alpha|beta)$|^tok_(enc|dec)\.vq_|^spk_enc\.fc\.weight$")
_EMBED = re.compile(r"\.codec_embd|\.text_embd")


def _apply(rules: list, name: str) -> str | None:
    for pat, fmt in rules:
        m = pat.fullmatch(name)
        if not m:
            continue
        g = m.groups()
        extra: dict[str, Any] = {}
        if "{L}" in fmt:
            if g[-1] not in _LAYER:
                raise KeyError(f"{name}: no GGUF name for layer tensor '{g[-1]}'")
            extra["L"] = _LAYER[g[-1]]
        if "{R}" in fmt:
            extra["R"] = int(g[1]) - 2  # residual units are blocks 2..4
        return fmt.format(*g, **extra)
    return None


def talker_tensor_name(hf: str) -> str:
    """A main-checkpoint tensor -> its talker-GGUF name; KeyError naming the tensor if unmapped."""
    if hf in _TALKER_TOP:
        return _TALKER_TOP[hf]
    out = _apply(_TALKER_RE, hf)
    if out is None:
        raise KeyError(f"{hf}: no qwentts.cpp talker name (speaker encoder / Base models are not converted)")
    return out


def codec_tensor_name(hf: str) -> str | None:
    """A speech-tokenizer tensor -> its codec-GGUF name; None for tensors the decoder does not read
    (the encoder, the decoder quantizer's input_proj, codebook halves fused by the writer)."""
    if _CODEC_DROPPED.fullmatch(hf) or _CODEBOOK.fullmatch(hf):
        return None
    out = _apply(_CODEC_RE, hf)
    if out is None:
        raise KeyError(f"{hf}: no qwentts.cpp codec name")
    return out


def target_type(name: str, shape: tuple[int, ...], quant: str) -> str:
    """The GGUF type of one tensor in a variant (quantize.cpp's policy, see the module doc)."""
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: expected one of {', '.join(QUANTS)}")
    if quant == "F32" or len(shape) < 2 or _KEEP_F32.search(name):
        return "F32"
    t = {"BF16": "BF16", "Q8_0": "Q8_0", "Q4_K_M": "Q4_K"}[quant]
    if _EMBED.search(name):
        t = {"Q4_K": "Q6_K"}.get(t, t)
    block = {"BF16": 1, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}[t]
    return t if shape[-1] % block == 0 else "F16"


# --------------------------------------------------------------------------- metadata
def _u32(v: Any) -> tuple[str, Any]:
    return ("u32", int(v))


def _f32(v: Any) -> tuple[str, Any]:
    return ("f32", float(v))


def talker_metadata(cfg: dict, gen: dict) -> dict[str, tuple[str, Any]]:
    """The talker GGUF's key/values (typed: u32, f32, str, bool, arr) from config.json and
    generation_config.json."""
    t, cp = cfg["talker_config"], cfg["talker_config"]["code_predictor_config"]
    a = TALKER_ARCH
    kv: dict[str, tuple[str, Any]] = {
        "general.name": ("str", f"Qwen3-TTS-12Hz-{cfg['tts_model_size']}-{cfg['tts_model_type']}"),
        f"{a}.tokenizer_type": ("str", cfg["tokenizer_type"]),
        f"{a}.model_size": ("str", cfg["tts_model_size"]),
        f"{a}.model_type": ("str", cfg["tts_model_type"]),
        f"{a}.num_code_groups": _u32(t["num_code_groups"]),
    }
    for side, c in (("talker", t), ("code_pred", cp)):
        kv.update({
            f"{a}.{side}.embedding_length": _u32(c["hidden_size"]),
            f"{a}.{side}.feed_forward_length": _u32(c["intermediate_size"]),
            f"{a}.{side}.block_count": _u32(c["num_hidden_layers"]),
            f"{a}.{side}.attention.head_count": _u32(c["num_attention_heads"]),
            f"{a}.{side}.attention.head_count_kv": _u32(c["num_key_value_heads"]),
            f"{a}.{side}.attention.key_length": _u32(c["head_dim"]),
            f"{a}.{side}.vocab_size": _u32(c["vocab_size"]),
            f"{a}.{side}.context_length": _u32(c["max_position_embeddings"]),
            f"{a}.{side}.rope.freq_base": _f32(c["rope_theta"]),
            f"{a}.{side}.attention.layer_norm_rms_epsilon": _f32(c["rms_norm_eps"]),
        })
    kv[f"{a}.talker.text_vocab_size"] = _u32(t["text_vocab_size"])
    kv[f"{a}.talker.text_hidden_size"] = _u32(t["text_hidden_size"])
    kv[f"{a}.talker.position_id_per_seconds"] = _u32(t.get("position_id_per_seconds", 13))
    rs = t.get("rope_scaling") or {}
    if "mrope_section" in rs:
        kv[f"{a}.talker.rope.mrope_section"] = ("arr", [int(x) for x in rs["mrope_section"]])
        kv[f"{a}.talker.rope.mrope_interleaved"] = ("bool", bool(rs.get("interleaved", False)))
    for key, src in (("pad_id", "codec_pad_id"), ("bos_id", "codec_bos_id"), ("eos_id", "codec_eos_token_id"),
                     ("think_id", "codec_think_id"), ("nothink_id", "codec_nothink_id"),
                     ("think_bos_id", "codec_think_bos_id"), ("think_eos_id", "codec_think_eos_id")):
        kv[f"{a}.codec.{key}"] = _u32(t[src])
    langs = t.get("codec_language_id") or {}
    kv[f"{a}.codec.language_names"] = ("arr", list(langs))
    kv[f"{a}.codec.language_ids"] = ("arr", [int(v) for v in langs.values()])
    spk = t.get("spk_id") or {}
    if spk:
        dial = t.get("spk_is_dialect") or {}
        kv[f"{a}.codec.speaker_names"] = ("arr", list(spk))
        kv[f"{a}.codec.speaker_ids"] = ("arr", [int(v) for v in spk.values()])
        kv[f"{a}.codec.speaker_dialects"] = ("arr", [d if isinstance(d := dial.get(k), str) else "" for k in spk])
    for key, src in (("im_start_id", "im_start_token_id"), ("im_end_id", "im_end_token_id"),
                     ("tts_pad_id", "tts_pad_token_id"), ("tts_bos_id", "tts_bos_token_id"),
                     ("tts_eos_id", "tts_eos_token_id")):
        kv[f"{a}.text.{key}"] = _u32(cfg[src])
    for key, src, kind in (("do_sample", "do_sample", "bool"), ("top_k", "top_k", "u32"),
                           ("top_p", "top_p", "f32"), ("temperature", "temperature", "f32"),
                           ("repetition_penalty", "repetition_penalty", "f32"),
                           ("subtalker_do_sample", "subtalker_dosample", "bool"),
                           ("subtalker_top_k", "subtalker_top_k", "u32"),
                           ("subtalker_top_p", "subtalker_top_p", "f32"),
                           ("subtalker_temperature", "subtalker_temperature", "f32"),
                           ("max_new_tokens", "max_new_tokens", "u32")):
        if src in gen:
            kv[f"generation.{key}"] = (kind, {"bool": bool, "u32": int, "f32": float}[kind](gen[src]))
    return kv


def codec_metadata(cfg: dict, codebook_dim_internal: int) -> dict[str, tuple[str, Any]]:
    """The codec GGUF's key/values from speech_tokenizer/config.json; ``codebook_dim_internal``
    is the width of the RVQ codebook vectors (the fused table's columns)."""
    d, e, a = cfg["decoder_config"], cfg.get("encoder_config") or {}, CODEC_ARCH
    kv: dict[str, tuple[str, Any]] = {"general.name": ("str", "Qwen3-TTS-Tokenizer-12Hz")}
    for key in ("input_sample_rate", "output_sample_rate", "decode_upsample_rate",
                "encode_downsample_rate", "encoder_valid_num_quantizers"):
        if key in cfg:
            kv[f"{a}.{key}"] = _u32(cfg[key])
    for key in ("latent_dim", "codebook_dim", "codebook_size", "decoder_dim", "hidden_size",
                "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "num_quantizers", "num_semantic_quantizers", "sliding_window"):
        kv[f"{a}.decoder.{key}"] = _u32(d[key])
    kv[f"{a}.decoder.rms_norm_eps"] = _f32(d["rms_norm_eps"])
    kv[f"{a}.decoder.rope_theta"] = _f32(d["rope_theta"])
    kv[f"{a}.decoder.layer_scale_initial_scale"] = _f32(d["layer_scale_initial_scale"])
    kv[f"{a}.decoder.upsample_rates"] = ("arr", [int(x) for x in d["upsample_rates"]])
    kv[f"{a}.decoder.upsampling_ratios"] = ("arr", [int(x) for x in d["upsampling_ratios"]])
    kv[f"{a}.decoder.vector_quantization_hidden_dim"] = _u32(d["vector_quantization_hidden_dimension"])
    kv[f"{a}.decoder.codebook_dim_internal"] = _u32(codebook_dim_internal)
    for key in ("num_filters", "kernel_size", "last_kernel_size", "residual_kernel_size",
                "num_residual_layers", "dilation_growth_rate", "compress", "hidden_size",
                "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "codebook_dim", "codebook_size", "num_quantizers",
                "num_semantic_quantizers"):
        if key in e:
            kv[f"{a}.encoder.{key}"] = _u32(e[key])
    for key in ("norm_eps", "rope_theta", "layer_scale_initial_scale"):
        if key in e:
            kv[f"{a}.encoder.{key}"] = _f32(e[key])
    if "upsampling_ratios" in e:
        kv[f"{a}.encoder.upsampling_ratios"] = ("arr", [int(x) for x in e["upsampling_ratios"]])
    if "vector_quantization_hidden_dimension" in e:
        kv[f"{a}.encoder.vector_quantization_hidden_dim"] = _u32(e["vector_quantization_hidden_dimension"])
    return kv


# --------------------------------------------------------------------------- quantization
class GgmlQuantizer:
    """ggml's reference quantizers (``ggml_quantize_chunk``) from a ``libggml-base`` shared
    library: the K-quants the ``gguf`` package cannot write."""

    def __init__(self, lib_path: str | Path):
        self.lib = ctypes.CDLL(str(lib_path))
        f = self.lib.ggml_quantize_chunk
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def __call__(self, w: np.ndarray, qtype: Any) -> np.ndarray:
        """w: [..., n] float -> uint8 [rows, bytes per row] in ggml's block layout."""
        import gguf

        src = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, w.shape[-1])
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert src.shape[1] % block == 0, (src.shape, qtype)
        dst = np.empty((src.shape[0], src.shape[1] // block * size), dtype=np.uint8)
        n = self.lib.ggml_quantize_chunk(int(qtype), src.ctypes.data, dst.ctypes.data, 0,
                                         src.shape[0], src.shape[1], None)
        assert n == dst.nbytes, (n, dst.nbytes)
        return dst


def _encode(arr: np.ndarray, t: str, quantizer: Callable | None) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype or None) for GGUFWriter.add_tensor."""
    import gguf

    q = gguf.GGMLQuantizationType
    if t == "F32":
        return np.ascontiguousarray(arr, dtype=np.float32), None
    if t == "F16":
        return np.ascontiguousarray(arr, dtype=np.float16), None
    qt = q[t]
    if t in ("Q4_K", "Q6_K"):
        if quantizer is None:
            raise RuntimeError(f"{t} needs ggml's quantizer: pass quantizer=GgmlQuantizer(<peer venv>/"
                               "qwentts_cpp_cpu/lib/libggml-base.so.0)")
        data = quantizer(arr, qt)
    else:
        data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qt)
    return data.reshape(*arr.shape[:-1], -1), qt


def _add_kv(w, kv: dict[str, tuple[str, Any]]) -> None:
    for key, (kind, v) in kv.items():
        {"u32": w.add_uint32, "f32": w.add_float32, "str": w.add_string, "bool": w.add_bool,
         "arr": w.add_array}[kind](key, v)


def _tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for k in sorted(f.keys()):
            yield k, f.get_tensor(k).float().numpy()


def _bpe(ck: Path) -> tuple[list[str], list[int], list[str]]:
    """Qwen2 BPE vocab as GGUF arrays: tokens by id (added tokens user-defined, type 4; gaps
    unused, type 5) and the merges."""
    vocab = json.loads((ck / "vocab.json").read_text(encoding="utf-8"))
    added = json.loads((ck / "tokenizer_config.json").read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    n = max([*vocab.values(), *(int(i) for i in added)]) + 1
    tokens: list[str | None] = [None] * n
    types = [1] * n
    for tok, i in vocab.items():
        tokens[i] = tok
    for i, info in added.items():
        tokens[int(i)], types[int(i)] = info["content"], 4
    for i, tok in enumerate(tokens):
        if tok is None:
            tokens[i], types[i] = f"<|unused-{i}|>", 5
    merges = [ln for ln in (ck / "merges.txt").read_text(encoding="utf-8").splitlines()
              if ln and not ln.startswith("#")]
    return tokens, types, merges  # type: ignore[return-value]


def write_talker_gguf(ck: str | Path, out: str | Path, quant: str,
                      quantizer: Callable | None = None) -> dict[str, str]:
    """Write the talker GGUF of checkpoint folder ``ck`` in variant ``quant``; returns
    {gguf name: type}. Every checkpoint tensor must map (KeyError naming it otherwise)."""
    import gguf

    ck = Path(ck)
    cfg = json.loads((ck / "config.json").read_text())
    gp = ck / "generation_config.json"
    w = gguf.GGUFWriter(str(out), TALKER_ARCH)
    _add_kv(w, talker_metadata(cfg, json.loads(gp.read_text()) if gp.exists() else {}))
    tokens, types, merges = _bpe(ck)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", 151643)
    plan: dict[str, str] = {}
    for hf, arr in _tensors(ck / "model.safetensors"):
        name = talker_tensor_name(hf)
        t = target_type(name, arr.shape, quant)
        data, raw = _encode(arr, t, quantizer)
        w.add_tensor(name, data, raw_dtype=raw)
        plan[name] = t
    _finish(w)
    return plan


def write_codec_gguf(ck: str | Path, out: str | Path, quant: str,
                     quantizer: Callable | None = None) -> dict[str, str]:
    """Write the codec GGUF (the speech-tokenizer decoder) of checkpoint folder ``ck``."""
    import gguf

    st = Path(ck) / "speech_tokenizer"
    cfg = json.loads((st / "config.json").read_text())
    books: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    tensors: list[tuple[str, np.ndarray]] = []
    for hf, arr in _tensors(st / "model.safetensors"):
        m = _CODEBOOK.fullmatch(hf)
        if m:
            books.setdefault((m[1], int(m[2])), {})[m[3]] = arr
            continue
        name = codec_tensor_name(hf)
        if name is not None:
            tensors.append((name, arr))
    for (side, i), b in sorted(books.items()):
        if set(b) != {"embedding_sum", "cluster_usage"}:
            raise KeyError(f"codebook rvq_{side}.{i}: has {sorted(b)}, needs embedding_sum and cluster_usage")
        emb = b["embedding_sum"] / np.clip(b["cluster_usage"], RVQ_EPS, None)[:, None]
        tensors.append((f"tok_dec.vq_{side}.{i}.codebook", emb.astype(np.float32)))
    dim = next(a.shape[1] for n, a in tensors if n.endswith(".codebook"))
    w = gguf.GGUFWriter(str(out), CODEC_ARCH)
    _add_kv(w, codec_metadata(cfg, dim))
    plan: dict[str, str] = {}
    for name, arr in tensors:
        t = target_type(name, arr.shape, quant)
        data, raw = _encode(arr, t, quantizer)
        w.add_tensor(name, data, raw_dtype=raw)
        plan[name] = t
    _finish(w)
    return plan


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
