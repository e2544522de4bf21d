"""Released-layout config dicts for random checkpoints: tiny (tests), 0.6B and 1.7B shapes.

The 0.6B/1.7B values are the released ones (see shared/reference/qwen3-tts.md); the tiny preset
keeps every id and vocabulary of the release (codec vocab 3072, text vocab 151936) and shrinks
only the widths and depths, so prompts and special ids behave exactly as on a real checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any

from omni_stream.config import VARIANTS, ConfigError

LANGUAGES = {
    "chinese": 2055, "english": 2050, "german": 2053, "spanish": 2054, "japanese": 2058,
    "french": 2061, "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071,
    "sichuan_dialect": 2062, "beijing_dialect": 2074,
}
SPEAKERS = {
    "vivian": 3065, "serena": 3066, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECT: dict[str, Any] = {name: False for name in SPEAKERS}
SPEAKER_DIALECT.update({"eric": "sichuan_dialect", "dylan": "beijing_dialect"})

PRESETS = ("tiny", "small", "0.6b", "1.7b")

_CODEC_IDS = {
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
    "codec_think_id": 2154, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}

_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(size="0b6", hidden=64, ffn=128, layers=2, heads=4, kv=2, head_dim=16,
                 text_hidden=32, cp_hidden=64, cp_ffn=128, cp_layers=2, cp_heads=4, cp_kv=2,
                 cp_head_dim=16, spk_dim=64,
                 codec=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                            latent_dim=32, codebook_dim=16, codebook_size=2048,
                            decoder_dim=64),
                 encoder=dict(num_filters=4, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                              head_dim=16, codebook_dim=16, vector_quantization_hidden_dimension=16,
                              upsample_groups=32, sliding_window=8)),
    # between tiny and 0.6B: real-time on a 2-core CPU with prefills that cost whole frames,
    # which is what the scheduling load tests need
    "small": dict(size="0b6", hidden=512, ffn=1536, layers=6, heads=8, kv=4, head_dim=64,
                  text_hidden=512, cp_hidden=512, cp_ffn=1536, cp_layers=1, cp_heads=8, cp_kv=4,
                  cp_head_dim=64, spk_dim=512,
                  codec=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                             latent_dim=64, codebook_dim=32, codebook_size=2048,
                             decoder_dim=128),
                  encoder=dict(num_filters=8, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=16, codebook_dim=32,
                               vector_quantization_hidden_dimension=32, upsample_groups=64,
                               sliding_window=16)),
    "0.6b": dict(size="0b6", hidden=1024, ffn=3072, layers=28, heads=16, kv=8, head_dim=128,
                 text_hidden=2048, cp_hidden=1024, cp_ffn=3072, cp_layers=5, cp_heads=16,
                 cp_kv=8, cp_head_dim=128, spk_dim=1024, codec={}),
    "1.7b": dict(size="1b7", hidden=2048, ffn=6144, layers=28, heads=16, kv=8, head_dim=128,
                 text_hidden=2048, cp_hidden=1024, cp_ffn=3072, cp_layers=5, cp_heads=16,
                 cp_kv=8, cp_head_dim=128, spk_dim=2048, codec={}),
}

_CODEC_RELEASED = dict(
    attention_bias=False, attention_dropout=0.0, latent_dim=1024, codebook_dim=512,
    codebook_size=2048, decoder_dim=1536, hidden_act="silu", hidden_size=512,
    intermediate_size=1024, layer_scale_initial_scale=0.01, max_position_embeddings=8000,
    head_dim=64, num_attention_heads=16, num_hidden_layers=8, num_key_value_heads=16,
    num_quantizers=16, num_semantic_quantizers=1, rms_norm_eps=1e-5, rope_theta=10000,
    semantic_codebook_size=4096, sliding_window=72, upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2], vector_quantization_hidden_dimension=512,
)

# The released Mimi-style encoder config (run by omni_stream.models.speech_encoder for ICL voice
# cloning; the official loader builds Qwen3TTSTokenizerV2Encoder from this block). tiny/small
# shrink widths and depths (their ``encoder`` overrides; the sliding window is small there so a
# parity test would notice if it were applied).
_ENCODER_CONFIG = dict(
    audio_channels=1, codebook_dim=256, codebook_size=2048, compress=2, dilation_growth_rate=2,
    frame_rate=12.5, head_dim=64, hidden_act="gelu", hidden_size=512, intermediate_size=2048,
    kernel_size=7, last_kernel_size=7, layer_scale_initial_scale=0.01,
    max_position_embeddings=8000, norm_eps=1e-5, num_attention_heads=8, num_filters=64,
    num_hidden_layers=8, num_key_value_heads=8, num_quantizers=32, num_residual_layers=1,
    num_semantic_quantizers=1, residual_kernel_size=3, rope_theta=10000.0, sampling_rate=24000,
    sliding_window=250, trim_right_ratio=1.0, upsample_groups=512,
    upsampling_ratios=[8, 6, 5, 4], use_causal_conv=True, use_conv_shortcut=False,
    vector_quantization_hidden_dimension=256,
)


def _lm_block(hidden: int, ffn: int, layers: int, heads: int, kv: int, head_dim: int,
              vocab: int) -> dict[str, Any]:
    return dict(
        hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab,
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000, max_position_embeddings=32768,
        attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
        sliding_window=None, initializer_range=0.02, tie_word_embeddings=False,
    )


def model_config_dict(preset: str, variant: str, *, talker_layers: int | None = None,
                      cp_layers: int | None = None) -> dict[str, Any]:
    """The main ``config.json`` of a checkpoint of this preset and variant."""
    if preset not in _SIZES:
        raise ConfigError(f"unknown preset '{preset}': expected one of {', '.join(PRESETS)}")
    if variant not in VARIANTS:
        raise ConfigError(f"unknown variant '{variant}': expected one of {', '.join(VARIANTS)}")
    s = _SIZES[preset]
    cp = _lm_block(s["cp_hidden"], s["cp_ffn"], cp_layers or s["cp_layers"], s["cp_heads"],
                   s["cp_kv"], s["cp_head_dim"], 2048)
    cp.update(model_type="qwen3_tts_talker_code_predictor", num_code_groups=16,
              rope_scaling=None, layer_types=["full_attention"] * cp["num_hidden_layers"],
              max_window_layers=cp["num_hidden_layers"])
    talker = _lm_block(s["hidden"], s["ffn"], talker_layers or s["layers"], s["heads"], s["kv"],
                       s["head_dim"], 3072)
    talker.update(
        model_type="qwen3_tts_talker", code_predictor_config=cp, num_code_groups=16,
        text_vocab_size=151936, text_hidden_size=s["text_hidden"],
        rope_scaling={"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default",
                      "type": "default"},
        position_id_per_seconds=13,
        codec_language_id=dict(LANGUAGES),
        spk_id=dict(SPEAKERS) if variant == "custom_voice" else {},
        spk_is_dialect=dict(SPEAKER_DIALECT) if variant == "custom_voice" else {},
        **_CODEC_IDS,
    )
    if preset in ("tiny", "small"):
        # keep mrope sections consistent with the tiny head_dim (sum = head_dim / 2)
        half = s["head_dim"] // 2
        talker["rope_scaling"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    cfg: dict[str, Any] = dict(
        architectures=["Qwen3TTSForConditionalGeneration"],
        model_type="qwen3_tts",
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=s["size"],
        tts_model_type=variant,
        im_start_token_id=151644, im_end_token_id=151645,
        tts_pad_token_id=151671, tts_bos_token_id=151672, tts_eos_token_id=151673,
        assistant_token_id=77091,
        talker_config=talker,
        torch_dtype="bfloat16",
        transformers_version="4.57.3",
    )
    if variant == "base":
        cfg["speaker_encoder_config"] = dict(
            mel_dim=128, enc_dim=s["spk_dim"],
            enc_channels=[512, 512, 512, 512, 1536] if preset not in ("tiny", "small") else [32, 32, 32, 32, 96],
            enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=128 if preset not in ("tiny", "small") else 16,
            enc_res2net_scale=8 if preset not in ("tiny", "small") else 4,
            enc_se_channels=128 if preset not in ("tiny", "small") else 16, sample_rate=24000)
    return cfg


def encoder_config_dict(preset: str) -> dict[str, Any]:
    """The ``encoder_config`` block of ``speech_tokenizer/config.json`` of this preset."""
    if preset not in _SIZES:
        raise ConfigError(f"unknown preset '{preset}': expected one of {', '.join(PRESETS)}")
    enc = copy.deepcopy(_ENCODER_CONFIG)
    enc.update(_SIZES[preset].get("encoder", {}))
    return enc


def codec_config_dict(preset: str) -> dict[str, Any]:
    """``speech_tokenizer/config.json`` of this preset."""
    if preset not in _SIZES:
        raise ConfigError(f"unknown preset '{preset}': expected one of {', '.join(PRESETS)}")
    dec = copy.deepcopy(_CODEC_RELEASED)
    dec.update(_SIZES[preset]["codec"])
    return dict(
        architectures=["Qwen3TTSTokenizerV2Model"],
        model_type="qwen3_tts_tokenizer_12hz",
        encoder_valid_num_quantizers=16,
        input_sample_rate=24000, output_sample_rate=24000,
        decode_upsample_rate=1920, encode_downsample_rate=1920,
        encoder_config=encoder_config_dict(preset),
        decoder_config=dec,
        transformers_version="4.57.3",
    )


GENERATION_CONFIG = dict(
    do_sample=True, repetition_penalty=1.05, temperature=0.9, top_p=1.0, top_k=50,
    subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_p=1.0, subtalker_top_k=50,
    max_new_tokens=8192,
)


def auxiliary_files() -> dict[str, dict[str, Any]]:
    """Processor / feature-extractor stubs the reference loader reads (relative path -> JSON)."""
    return {
        "preprocessor_config.json": {"processor_class": "Qwen3TTSProcessor"},
        "speech_tokenizer/preprocessor_config.json": {
            "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor",
            "feature_size": 1, "overlap": None, "padding_side": "right", "padding_value": 0.0,
            "return_attention_mask": True, "sampling_rate": 24000,
        },
    }
