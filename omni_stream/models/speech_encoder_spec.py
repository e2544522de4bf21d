"""What a Base checkpoint's speech-tokenizer encoder is: its config block and the tensors it stores.

- ``SpeechEncoderConfig``: the ``encoder_config`` block of ``speech_tokenizer/config.json``
  (MimiConfig field names), validated.
- ``expected_keys``: every ``encoder.*`` tensor of the released layout with its shape, in the
  official module order (the strict loader's key map).
- ``random_state_dict``: reproducible random weights under those names for test checkpoints.

The network that runs them is ``models/speech_encoder.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from omni_stream.config import ConfigError

__all__ = ["ACTIVATIONS", "SpeechEncoderConfig", "expected_keys", "random_state_dict", "unused_key"]

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class SpeechEncoderConfig:
    """The ``encoder_config`` block of ``speech_tokenizer/config.json`` (MimiConfig field names)
    plus the top-level ``encoder_valid_num_quantizers`` and ``encode_downsample_rate``."""

    # SEANet
    audio_channels: int = 1
    num_filters: int = 64
    kernel_size: int = 7
    last_kernel_size: int = 7
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    num_residual_layers: int = 1
    compress: int = 2
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    use_causal_conv: bool = True
    use_conv_shortcut: bool = False
    pad_mode: str = "constant"
    # transformer
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    sliding_window: int | None = 250  # parsed; not applied (see module docstring)
    use_cache: bool = False  # parsed; official encode runs full-causal with either value
    # quantizer
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    vector_quantization_hidden_dimension: int = 256
    # rates
    sampling_rate: int = 24000
    frame_rate: float = 12.5
    valid_num_quantizers: int = 16
    downsample_rate: int = 1920

    def __post_init__(self) -> None:
        where = "speech_tokenizer/config.json encoder_config"
        for name in ("audio_channels", "num_filters", "kernel_size", "last_kernel_size",
                     "residual_kernel_size", "dilation_growth_rate", "num_residual_layers",
                     "compress", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "codebook_size",
                     "codebook_dim", "num_quantizers", "num_semantic_quantizers",
                     "vector_quantization_hidden_dimension", "sampling_rate",
                     "valid_num_quantizers", "downsample_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                key = name if name not in ("valid_num_quantizers", "downsample_rate") else {
                    "valid_num_quantizers": "encoder_valid_num_quantizers",
                    "downsample_rate": "encode_downsample_rate"}[name]
                raise ConfigError(f"{where}: '{key}' must be a positive int, got {v!r}")
        if not self.upsampling_ratios or any(not isinstance(r, int) or r <= 0 for r in self.upsampling_ratios):
            raise ConfigError(f"{where}: 'upsampling_ratios' must be positive ints, got {self.upsampling_ratios!r}")
        if self.audio_channels != 1:
            raise ConfigError(f"{where}: 'audio_channels' must be 1 (mono), got {self.audio_channels}")
        if not self.use_causal_conv:
            raise ConfigError(f"{where}: 'use_causal_conv' false is not supported")
        if self.pad_mode != "constant":
            raise ConfigError(f"{where}: 'pad_mode' {self.pad_mode!r} is not supported (only 'constant')")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{where}: 'hidden_act' {self.hidden_act!r} is not supported "
                              f"(expected one of {', '.join(ACTIVATIONS)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: 'num_attention_heads' must be a multiple of 'num_key_value_heads'")
        if self.head_dim % 2:
            raise ConfigError(f"{where}: 'head_dim' must be even (rotary embeddings), got {self.head_dim}")
        if self.num_filters % self.compress:
            raise ConfigError(f"{where}: 'compress' {self.compress} must divide 'num_filters' {self.num_filters}")
        vq = self.vector_quantization_hidden_dimension
        if self.codebook_dim != vq:
            raise ConfigError(f"{where}: 'codebook_dim' ({self.codebook_dim}) must equal "
                              f"'vector_quantization_hidden_dimension' ({vq})")
        if not self.num_semantic_quantizers < self.num_quantizers:
            raise ConfigError(f"{where}: 'num_semantic_quantizers' must be below 'num_quantizers'")
        if not self.num_semantic_quantizers <= self.valid_num_quantizers <= self.num_quantizers:
            raise ConfigError(f"encoder_valid_num_quantizers {self.valid_num_quantizers} must be within "
                              f"[{self.num_semantic_quantizers}, num_quantizers {self.num_quantizers}]")
        hop = math.prod(self.upsampling_ratios)
        if self.sampling_rate % hop or not math.isclose(self.sampling_rate / hop, 2 * self.frame_rate):
            raise ConfigError(f"{where}: 'frame_rate' {self.frame_rate} must be half of sampling_rate / "
                              f"prod(upsampling_ratios) = {self.sampling_rate / hop} (the stride-2 downsample)")
        if self.downsample_rate != 2 * hop:
            raise ConfigError(f"encode_downsample_rate {self.downsample_rate} != 2 * prod(upsampling_ratios) = {2 * hop}")

    @classmethod
    def from_codec_dict(cls, codec: Mapping[str, Any]) -> "SpeechEncoderConfig":
        """From a parsed ``speech_tokenizer/config.json`` (ConfigError names a bad key)."""
        enc = codec.get("encoder_config")
        if not isinstance(enc, Mapping):
            raise ConfigError("speech_tokenizer/config.json: missing 'encoder_config'")
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in enc.items():
            if k in names and k not in ("valid_num_quantizers", "downsample_rate"):
                kw[k] = tuple(v) if isinstance(v, list) else v
        if "head_dim" not in enc and "hidden_size" in enc and "num_attention_heads" in enc:
            kw["head_dim"] = int(enc["hidden_size"]) // int(enc["num_attention_heads"])
        if enc.get("codebook_dim") is None and "hidden_size" in enc:
            kw["codebook_dim"] = enc["hidden_size"]
        if "num_key_value_heads" not in enc and "num_attention_heads" in enc:
            kw["num_key_value_heads"] = enc["num_attention_heads"]
        kw["valid_num_quantizers"] = codec.get("encoder_valid_num_quantizers", 16)
        kw["downsample_rate"] = codec.get("encode_downsample_rate", 1920)
        for k in ("norm_eps", "rope_theta", "layer_scale_initial_scale", "frame_rate"):
            if k in kw and not isinstance(kw[k], (int, float)):
                raise ConfigError(f"speech_tokenizer/config.json encoder_config: '{k}' must be a number, got {kw[k]!r}")
        return cls(**kw)


# ----------------------------------------------------------------------------------------------
# key map
# ----------------------------------------------------------------------------------------------

def _seanet_convs(cfg: SpeechEncoderConfig) -> list[tuple[str, int, int, int, int, int]]:
    """(name under encoder.layers, c_in, c_out, kernel, stride, dilation) of every SEANet conv, in
    the official ModuleList order (ELUs take the indices between them)."""
    convs = [("0", cfg.audio_channels, cfg.num_filters, cfg.kernel_size, 1, 1)]
    idx, width = 1, cfg.num_filters
    for ratio in reversed(cfg.upsampling_ratios):
        for j in range(cfg.num_residual_layers):
            hidden = width // cfg.compress
            convs.append((f"{idx}.block.1", width, hidden, cfg.residual_kernel_size, 1, cfg.dilation_growth_rate ** j))
            convs.append((f"{idx}.block.3", hidden, width, 1, 1, 1))
            if cfg.use_conv_shortcut:
                convs.append((f"{idx}.shortcut", width, width, 1, 1, 1))
            idx += 1
        idx += 1  # ELU
        convs.append((f"{idx}", width, 2 * width, 2 * ratio, ratio, 1))
        idx += 1
        width *= 2
    idx += 1  # ELU
    convs.append((f"{idx}", width, cfg.hidden_size, cfg.last_kernel_size, 1, 1))
    return convs


def expected_keys(cfg: SpeechEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the official checkpoint stores under ``encoder.`` (prefix stripped) -> shape."""
    keys: dict[str, tuple[int, ...]] = {}
    for name, cin, cout, k, _, _ in _seanet_convs(cfg):
        keys[f"encoder.layers.{name}.conv.weight"] = (cout, cin, k)
        keys[f"encoder.layers.{name}.conv.bias"] = (cout,)
    h, hd = cfg.hidden_size, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"encoder_transformer.layers.{i}."
        for proj, rows in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                           ("v", cfg.num_key_value_heads)):
            keys[f"{p}self_attn.{proj}_proj.weight"] = (rows * hd, h)
            if cfg.attention_bias:
                keys[f"{p}self_attn.{proj}_proj.bias"] = (rows * hd,)
        keys[f"{p}self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * hd)
        if cfg.attention_bias:
            keys[f"{p}self_attn.o_proj.bias"] = (h,)
        keys[f"{p}mlp.fc1.weight"] = (cfg.intermediate_size, h)
        keys[f"{p}mlp.fc2.weight"] = (h, cfg.intermediate_size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            keys[f"{p}{norm}.weight"] = (h,)
            keys[f"{p}{norm}.bias"] = (h,)
        keys[f"{p}self_attn_layer_scale.scale"] = (h,)
        keys[f"{p}mlp_layer_scale.scale"] = (h,)
    keys["downsample.conv.weight"] = (h, h, 4)
    vq = cfg.vector_quantization_hidden_dimension
    for part, n in (("semantic", cfg.num_semantic_quantizers),
                    ("acoustic", cfg.num_quantizers - cfg.num_semantic_quantizers)):
        p = f"quantizer.{part}_residual_vector_quantizer."
        if vq != h:
            keys[p + "input_proj.weight"] = (vq, h, 1)
            keys[p + "output_proj.weight"] = (h, vq, 1)
        for j in range(n):
            keys[f"{p}layers.{j}.codebook.initialized"] = (1,)
            keys[f"{p}layers.{j}.codebook.cluster_usage"] = (cfg.codebook_size,)
            keys[f"{p}layers.{j}.codebook.embed_sum"] = (cfg.codebook_size, cfg.codebook_dim)
    return keys


def random_state_dict(cfg: SpeechEncoderConfig, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Reproducible random weights under the official names, made so codes are informative: convs
    fan-in scaled, layer scales O(0.1), codebooks normal noise at the scale of the projected
    features (the official init's all-zero codebooks would map every frame to code 0) and
    positive ``cluster_usage``."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_keys(cfg).items():
        if name.endswith("codebook.initialized"):
            t = torch.ones(shape)
        elif name.endswith("cluster_usage"):
            t = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith("embed_sum"):
            # codewords = embed_sum / usage ~ N(0, 0.3^2) per dim, like the projected residuals
            t = 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".scale"):
            t = 0.1 + 0.05 * torch.rand(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        else:  # conv / linear weights: [out, in(, k)]
            fan_in = math.prod(shape[1:])
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        out[name] = t.to(dtype)
    # codewords must be scaled against the actual residuals: rescale embed_sum by usage so the
    # stored pair divides back to the N(0, 0.3^2) codewords above
    for name in list(out):
        if name.endswith("embed_sum"):
            usage = out[name[: -len("embed_sum")] + "cluster_usage"].float()
            out[name] = (out[name].float() * usage[:, None]).to(dtype)
    return out


def unused_key(cfg: SpeechEncoderConfig, key: str) -> bool:
    """Checkpoint keys the encode path never reads (kept out of the module)."""
    if key.endswith("codebook.initialized") or key.endswith("output_proj.weight"):
        return True
    prefix = "quantizer.acoustic_residual_vector_quantizer.layers."
    if key.startswith(prefix):
        return int(key[len(prefix):].split(".", 1)[0]) >= cfg.valid_num_quantizers - cfg.num_semantic_quantizers
    return False

