"""The 12 Hz speech tokenizer's *encoder*: 24 kHz audio -> the 16-codebook codes ICL voice cloning
puts in the talker prompt.

The released speech tokenizer stores a Mimi-style encoder under ``encoder.*`` (the official
``Qwen3TTSTokenizerV2Encoder`` is transformers' ``MimiModel`` with its decoder half removed). This
is a native re-implementation of the path the official ``encode`` runs, numerically matched:

    wav [T] -> SEANet conv stack (causal convs, ELU, residual blocks)   25 Hz, hidden_size
            -> transformer (LayerNorm, RoPE, causal attention, layer scale, MLP)
            -> downsample conv (stride 2, replicate padding)             12.5 Hz
            -> split RVQ encode: 1 semantic + (valid - 1) acoustic codebooks, nearest codeword
               by euclidean distance (``torch.cdist`` as the official code) -> codes [frames, 16]

Facts the parity depends on (checked against transformers 4.57.3 / qwen-tts 0.1.1):
- Every conv pads ``kernel_eff - stride`` on the left and ``ceil(L/stride)*stride - L`` on the
  right (Mimi's extra padding for the last frame), so each conv maps L -> ceil(L/stride) and the
  whole encoder maps T samples -> ceil(T/1920) frames: the official trim is a no-op for one clip.
- The encoder transformer gets a plain causal mask from transformers: ``sliding_window`` is NOT
  applied (a clip longer than the window still sees its whole past). Checked on a window of 8
  frames against an 82-frame clip, with ``use_cache`` false and true: identical codes.
- Codebooks are stored as ``embed_sum`` / ``cluster_usage``; the codewords are
  ``embed_sum / cluster_usage.clamp(min=1e-5)``. ``initialized``, ``output_proj`` and codebooks past
  ``encoder_valid_num_quantizers`` are checkpoint keys the encode path never reads: loading checks
  them (strict key map) and drops them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["SpeechEncoder", "SpeechEncoderConfig", "expected_keys", "random_state_dict"]

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}
_CODEBOOK_EPS = 1e-5  # MimiEuclideanCodebook's clamp on cluster_usage


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
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"{where}: 'hidden_act' {self.hidden_act!r} is not supported "
                              f"(expected one of {', '.join(_ACTIVATIONS)})")
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


def _unused(cfg: SpeechEncoderConfig, key: str) -> bool:
    """Checkpoint keys the encode path never reads (kept out of the module)."""
    if key.endswith("codebook.initialized") or key.endswith("output_proj.weight"):
        return True
    prefix = "quantizer.acoustic_residual_vector_quantizer.layers."
    if key.startswith(prefix):
        return int(key[len(prefix):].split(".", 1)[0]) >= cfg.valid_num_quantizers - cfg.num_semantic_quantizers
    return False


# ----------------------------------------------------------------------------------------------
# modules (attribute names = checkpoint names)
# ----------------------------------------------------------------------------------------------

class _CausalConv(nn.Module):
    """Mimi's causal conv: left pad ``kernel_eff - stride``, right pad up to a whole last frame."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left = (kernel - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L] -> [B, C', ceil(L / stride)]
        length = x.shape[-1]
        extra = -(-length // self.stride) * self.stride - length
        x = F.pad(x, (self.left, extra), mode=self.pad_mode)
        return self.conv(x)


class _ResBlock(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, width: int, dilation: int) -> None:
        super().__init__()
        hidden = width // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), _CausalConv(width, hidden, cfg.residual_kernel_size, dilation=dilation),
            nn.ELU(), _CausalConv(hidden, width, 1)])
        self.shortcut = _CausalConv(width, width, 1) if cfg.use_conv_shortcut else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return self.shortcut(x) + y


class _SEANet(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [_CausalConv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size)]
        width = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            layers += [_ResBlock(cfg, width, cfg.dilation_growth_rate ** j) for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), _CausalConv(width, 2 * width, 2 * ratio, stride=ratio)]
            width *= 2
        layers += [nn.ELU(), _CausalConv(width, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, T] -> [B, hidden, ceil(T/hop)]
        for layer in self.layers:
            x = layer(x)
        return x


class _LayerScale(nn.Module):
    def __init__(self, width: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((width,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class _Attention(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        h, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=b)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=b)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=b)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=b)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # [B, T, hidden]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)  # [B, H, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.self_attn_layer_scale = _LayerScale(h, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = _LayerScale(h, cfg.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class _Transformer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, hidden]
        # RoPE tables are rebuilt per call (cheap next to the convs; nothing to fix up after a
        # meta-device build): inv_freq exactly as transformers' default rope init computes it
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=x.device).float() / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponent)
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class _Codebook(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.register_buffer("cluster_usage", torch.ones(cfg.codebook_size))
        self.register_buffer("embed_sum", torch.zeros(cfg.codebook_size, cfg.codebook_dim))

    def codewords(self) -> torch.Tensor:  # [codebook_size, dim]
        return self.embed_sum / self.cluster_usage.clamp(min=_CODEBOOK_EPS)[:, None]


class _VQLayer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.codebook = _Codebook(cfg)


class _RVQ(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, n: int) -> None:
        super().__init__()
        vq = cfg.vector_quantization_hidden_dimension
        self.input_proj = nn.Conv1d(cfg.hidden_size, vq, 1, bias=False) if vq != cfg.hidden_size else None
        self.layers = nn.ModuleList([_VQLayer(cfg) for _ in range(n)])

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [B, hidden, F] -> [n, B, F]
        if self.input_proj is not None:
            x = self.input_proj(x)
        residual = x.permute(0, 2, 1)  # [B, F, D]
        codes = []
        for layer in self.layers:
            embed = layer.codebook.codewords()
            flat = residual.reshape(-1, residual.shape[-1])
            idx = torch.cdist(flat[None].float(), embed[None].float(), p=2)[0].argmin(dim=-1)
            idx = idx.view(residual.shape[:-1])
            residual = residual - F.embedding(idx, embed)
            codes.append(idx)
        return torch.stack(codes)


class _SplitRVQ(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.semantic_residual_vector_quantizer = _RVQ(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = _RVQ(cfg, cfg.valid_num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [B, hidden, F] -> [K, B, F]
        codes = self.semantic_residual_vector_quantizer.encode(x)
        if len(self.acoustic_residual_vector_quantizer.layers):
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer.encode(x)], dim=0)
        return codes


class SpeechEncoder(nn.Module):
    """24 kHz mono audio -> codes ``[frames, valid_num_quantizers]`` (frames = ceil(T / 1920)).

    State-dict keys are the checkpoint's ``encoder.*`` keys (prefix stripped) minus the ones the
    encode path never reads; :meth:`load_weights` checks the full official key set.
    """

    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = _SEANet(cfg)
        self.encoder_transformer = _Transformer(cfg)
        self.downsample = _CausalConv(cfg.hidden_size, cfg.hidden_size, 4, stride=2, bias=False,
                                      pad_mode="replicate")
        self.quantizer = _SplitRVQ(cfg)

    @property
    def sample_rate(self) -> int:
        return self.cfg.sampling_rate

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` float audio -> codes ``[B, K, ceil(T / downsample_rate)]``."""
        param = self.downsample.conv.weight
        x = self.encoder(wav.to(device=param.device, dtype=param.dtype)[:, None, :])  # [B, hidden, T/960]
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        x = self.downsample(x)  # [B, hidden, F]
        return self.quantizer.encode(x).transpose(0, 1)

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """One mono clip ``[T]`` at 24 kHz -> LongTensor ``[frames, K]`` on the CPU."""
        wav = torch.as_tensor(wav)
        if not wav.is_floating_point():
            raise ValueError(f"encode expects float samples in [-1, 1], got {wav.dtype}: scale integer PCM first")
        if wav.dim() != 1:
            raise ValueError(f"encode expects one mono clip [samples] at {self.sample_rate} Hz, "
                             f"got shape {tuple(wav.shape)}: average the channels first")
        if wav.shape[0] < 1:
            raise ValueError("reference audio too short: 0 samples")
        if not bool(torch.isfinite(wav).all()):
            raise ValueError("reference audio contains NaN or infinite samples")
        codes = self.forward(wav[None].float())[0]  # [K, F]
        frames = -(-wav.shape[0] // self.cfg.downsample_rate)
        assert codes.shape[1] == frames, (codes.shape, frames)
        return codes.transpose(0, 1).to(device="cpu", dtype=torch.int64).contiguous()

    def load_weights(self, tensors: Mapping[str, torch.Tensor], prefix: str = "encoder.",
                     assign: bool = False) -> None:
        """Strictly load the ``prefix``-ed checkpoint tensors (others ignored): every official key
        must be present with its shape, nothing else under the prefix may appear."""
        want = expected_keys(self.cfg)
        got = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        missing = sorted(k for k in want if k not in got)
        unexpected = sorted(k for k in got if k not in want)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing tensors: {', '.join(prefix + k for k in missing[:6])}"
                             + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
            if unexpected:
                parts.append(f"unexpected tensors: {', '.join(prefix + k for k in unexpected[:6])}"
                             + (f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else ""))
            raise ValueError("speech encoder weights: " + "; ".join(parts))
        for k, shape in want.items():
            if tuple(got[k].shape) != shape:
                raise ValueError(f"speech encoder tensor {prefix}{k} has shape {tuple(got[k].shape)}, "
                                 f"the encoder_config implies {shape}")
        used = {k: v for k, v in got.items() if not _unused(self.cfg, k)}
        self.load_state_dict(used, strict=True, assign=assign)
