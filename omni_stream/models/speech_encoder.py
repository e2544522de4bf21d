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

import logging
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omni_stream.models.speech_encoder_spec import (ACTIVATIONS, SpeechEncoderConfig,
                                                    expected_keys, random_state_dict, unused_key)

log = logging.getLogger(__name__)

__all__ = ["SpeechEncoder", "SpeechEncoderConfig", "expected_keys", "random_state_dict"]

_CODEBOOK_EPS = 1e-5  # MimiEuclideanCodebook's clamp on cluster_usage


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
        self.act = ACTIVATIONS[cfg.hidden_act]

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
        used = {k: v for k, v in got.items() if not unused_key(self.cfg, k)}
        self.load_state_dict(used, strict=True, assign=assign)
