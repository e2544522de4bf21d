"""Code2Wav: the Qwen3-TTS 12 Hz speech-tokenizer decoder, one-pass and exactly streamed.

``codes [B, 16, T] -> wav [B, T * 1920]`` (24 kHz, clamped to [-1, 1]). The network is fully causal
(causal convs, transposed convs trimmed on the right, sliding-window attention over 72 frames), so
a prefix of the codes decodes to a prefix of the audio. ``Code2WavStream`` uses that to decode only
the new frames of each stream: per batch slot it keeps every causal conv's last input samples, each
block transposed conv's previous input column, and per transformer layer the rotated keys and the
values of the last ``sliding_window - 1`` frames plus the absolute frame position. Streamed output
equals the one-pass decode at any chunking, to float rounding. With the packed kernels
(``pack``) a stream's streamed output is moreover the same bits at any chunking and batch:
every streaming product treats a frame's rows alike whatever else the call holds (each query
attends its own window in a product of fixed shape, the quantizer projects row by row, the
Snake kernel has no scalar tail, a lone row is computed as one of two), so in bf16 and in fp32
a request does not sound different by timing. In bf16 that holds where oneDNN runs at
``AVX512_CORE_BF16`` (its AMX and its emulated-bf16 kernels round by row count): a process
pins that level first (``models.onednn.pin_decode_isa``). Unpacked (fp32 off CPU, or a torch
without oneDNN) the chunk plan moves samples by float rounding (~1e-6: 1 LSB of s16 in about
1% of the samples).

Parameter names equal the official ``Qwen3TTSTokenizerV2Decoder`` state_dict keys with the
``decoder.`` prefix stripped, so a checkpoint loads strictly (``load_state_dict(sd, strict=True)``).

Dtypes: the model runs in the dtype of its parameters (fp32 or bf16). The streaming state is kept
in that same dtype: the tails are exactly the activations a one-pass decode in that dtype would
feed to the same convs, so nothing is gained by holding them in fp32. RMSNorm statistics and the
rotary angles are computed in fp32 as in the official code; the rotary angles are recomputed per
call from integer positions, so casting the model never degrades them.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from omni_stream.config import Code2WavConfig
from omni_stream.models.code2wav_blocks import (CausalConv1d, CausalTransConv1d, ConvNeXtBlock,
                                              DecoderBlock, ResidualVQ, SnakeBeta, SplitResidualVQ)
from omni_stream.models.code2wav_gemm import (DEFAULT_GEMM_MIN_CHANNELS, onednn_packing_available,
                                            pack_onednn_linear)
from omni_stream.models.code2wav_state import Code2WavState, Step
from omni_stream.models.code2wav_transformer import DecoderTransformer
from omni_stream.models.layers import RMSNorm

__all__ = ["Code2Wav", "Code2WavState", "Code2WavStream", "random_code2wav_state_dict"]


# ---------------------------------------------------------------- model


class Code2Wav(nn.Module):
    """The speech-tokenizer decoder. ``forward`` decodes in one pass; ``step`` streams.

    ``gemm_min_channels``: streaming runs convs / transposed convs with at least this many input
    channels as plain GEMMs (see ``DEFAULT_GEMM_MIN_CHANNELS``); 0 = all, a huge value = none.
    """

    def __init__(self, cfg: Code2WavConfig,
                 gemm_min_channels: int = DEFAULT_GEMM_MIN_CHANNELS) -> None:
        super().__init__()
        if cfg.num_quantizers < 2:
            raise ValueError("Code2Wav needs num_quantizers >= 2 (1 semantic + acoustic codebooks)")
        self.cfg = cfg
        self.packed = False  # weights held in oneDNN's layout too (``pack``)
        self.quantizer = SplitResidualVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = DecoderTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv1d(cfg.latent_dim, cfg.latent_dim, r, r),
                           ConvNeXtBlock(cfg.latent_dim)]) for r in cfg.upsampling_ratios)
        out_dim = cfg.decoder_dim >> len(cfg.upsample_rates)
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))]
            + [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)])
        # Number the stateful modules (Code2WavState lists are indexed by these ids) and pick
        # each conv's streaming kernel.
        self._tail_shapes: list[tuple[int, int]] = []
        for m in self.modules():
            if isinstance(m, (CausalConv1d, CausalTransConv1d)):
                m.gemm = m.conv.in_channels >= gemm_min_channels and m.conv.groups == 1
                if m.context > 0:
                    m.state_id = len(self._tail_shapes)
                    self._tail_shapes.append((m.conv.in_channels, m.context))
        for i, layer in enumerate(self.pre_transformer.layers):
            layer.self_attn.layer_id = i

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    def pack(self, snake=None) -> bool:
        """Hold the weights of the wide streaming convs, of every transposed conv, of the
        quantizer's projections and of every linear layer in oneDNN's blocked layout as well
        (bf16 or fp32 on CPU; False and nothing done elsewhere). oneDNN then stops re-packing
        each weight on every call, which at streaming sizes costs as much as the product itself
        (a bf16 decode call is 10-15% faster at the released dims). The transposed convs then
        run as GEMMs, so the audio is the unpacked decode's within rounding
        (tests/test_code2wav.py), not bit for bit; and a stream's audio is the same bits at any
        chunk plan and batch (``models.onednn`` says where). In fp32 every conv that is not
        depthwise streams as a packed GEMM, the narrow ones too: oneDNN's fp32 conv rounds by
        the call's length, so a request's audio would follow its timing. Call it once the
        weights are loaded and cast: the packed copies do not follow later changes.
        ``snake``: a one-pass SnakeBeta kernel for streaming (``engine.cpu.abi.snake_kernel``:
        torch's five bf16 ops are a quarter of a decode call)."""
        w = self.pre_conv.conv.weight
        if not onednn_packing_available(w):
            return False
        for m in self.modules():
            if isinstance(m, CausalConv1d) and w.dtype == torch.float32 and m.conv.groups == 1:
                m.gemm = True
            if isinstance(m, (CausalConv1d, CausalTransConv1d, ResidualVQ)):
                m.pack()
            elif isinstance(m, nn.Linear):
                pack_onednn_linear(m)
            elif isinstance(m, SnakeBeta) and snake is not None:
                m.pack(snake)
        self.packed = True
        return True

    def check_codes(self, codes: Tensor) -> Tensor:
        """Validate ``codes [B, Q, T]`` and return them as int64. Reads min/max back to the host
        (one sync); the unchecked ``step`` is the path for callers that validated already."""
        q, size = self.cfg.num_quantizers, self.cfg.codebook_size
        if not isinstance(codes, Tensor) or codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor [batch, {q}, frames]")
        if codes.dim() != 3 or codes.shape[1] != q:
            raise ValueError(f"codes must have shape [batch, {q}, frames] ({q} codebooks), "
                             f"got {tuple(codes.shape)}")
        if codes.shape[0] < 1 or codes.shape[2] < 1:
            raise ValueError(f"codes must hold at least one row and one frame, got {tuple(codes.shape)}")
        lo, hi = torch.stack(torch.aminmax(codes)).tolist()
        if lo < 0 or hi >= size:
            raise ValueError(f"codes must lie in [0, {size}) (codebook_size), got values in [{lo}, {hi}]")
        return codes.long()

    def _run(self, codes: Tensor, step: Step | None, cos: Tensor | None = None,
             sin: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """[B, Q, T] -> [B, T*spf]. ``cos``/``sin``/``mask``: the transformer's rotary angles and
        mask when the caller computes them (``DecoderTransformer.forward``); else derived here."""
        h = self.quantizer.decode(codes, rows=step is not None)  # [B, codebook_dim, T]
        h = self.pre_conv(h, step).transpose(1, 2)  # [B, T, latent]
        h = self.pre_transformer(h, step, cos, sin, mask).transpose(1, 2)  # [B, latent, T]
        for blocks in self.upsample:
            for m in blocks:
                h = m(h, step)
        for m in self.decoder:
            h = m(h, step)
        return h.clamp(min=-1, max=1).squeeze(1)

    def forward(self, codes: Tensor) -> Tensor:
        """One-pass decode: ``codes [B, Q, T]`` int -> ``wav [B, T * samples_per_frame]``."""
        return self._run(self.check_codes(codes), None)

    def new_state(self, max_slots: int) -> Code2WavState:
        """Zeroed streaming state for ``max_slots`` slots, on the parameters' device and dtype."""
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        p = self.pre_conv.conv.weight
        kw = dict(device=p.device, dtype=p.dtype)
        cfg = self.cfg
        kv = (max_slots, cfg.num_key_value_heads, cfg.sliding_window - 1, cfg.head_dim)
        n = cfg.num_hidden_layers
        return Code2WavState(
            pos=torch.zeros(max_slots, dtype=torch.long, device=p.device),
            keys=[torch.zeros(kv, **kw) for _ in range(n)],
            values=[torch.zeros(kv, **kw) for _ in range(n)],
            tails=[torch.zeros(max_slots, c, L, **kw) for c, L in self._tail_shapes])

    @torch.no_grad()
    def step(self, state: Code2WavState, idx: Tensor, codes: Tensor) -> Tensor:
        """Hot path, unchecked: decode ``codes [s, Q, n]`` (int64) as the next frames of slots
        ``idx [s]`` (distinct, int64) and return exactly the new samples ``[s, n * spf]``."""
        return self._run(codes, Step(state, idx))


class Code2WavStream:
    """Exact streaming decoder over ``max_slots`` fixed batch slots (one stream per slot).

    ``decode(slots, codes)`` runs one batched pass over the listed slots; the other slots' state
    is untouched. Create and use it under the same grad mode: state allocated inside
    ``torch.inference_mode()`` cannot be updated outside it.
    """

    def __init__(self, model: Code2Wav, max_slots: int) -> None:
        self.model = model
        self.state = model.new_state(max_slots)

    @property
    def max_slots(self) -> int:
        return self.state.max_slots

    def decode(self, slots: Sequence[int] | Tensor, codes: Tensor) -> Tensor:
        """``codes [len(slots), Q, n]`` -> the ``[len(slots), n * samples_per_frame]`` samples
        that these frames add to each slot's stream."""
        idx = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        codes = self.model.check_codes(codes)
        if idx.numel() != codes.shape[0]:
            raise ValueError(f"got {idx.numel()} slots for {codes.shape[0]} rows of codes")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.max_slots):
            raise ValueError(f"slots must lie in [0, {self.max_slots}), got {idx.tolist()}")
        if idx.unique().numel() != idx.numel():
            raise ValueError(f"slots must be distinct within one call, got {idx.tolist()}")
        return self.model.step(self.state, idx.to(self.state.pos.device),
                               codes.to(self.state.pos.device))

    def reset(self, slot: int) -> None:
        """Start a new stream in ``slot``."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must lie in [0, {self.max_slots}), got {slot}")
        self.state.reset(slot)

    def snapshot(self, slot: int) -> list[Tensor]:
        """A copy of ``slot``'s stream state; :meth:`restore` continues it in any slot."""
        return self.state.snapshot(slot)

    def restore(self, slot: int, snap: list[Tensor]) -> None:
        self.state.restore(slot, snap)


# ---------------------------------------------------------------- random weights


def random_code2wav_state_dict(cfg: Code2WavConfig, seed: int = 0, *,
                               layer_scale: float | None = None,
                               convnext_gamma: float = 1e-6) -> dict[str, Tensor]:
    """Random weights (fp32, keys without the ``decoder.`` prefix) that make audible, non-silent,
    non-saturated audio: random codebooks (the official init is zeros, hence silence), weights
    ~ N(0, 1/fan_in), small random biases and Snake parameters. ``layer_scale`` defaults to the
    config's value and ``convnext_gamma`` to the official 1e-6; tests raise both so the
    attention window and the ConvNeXt convs visibly shape the output."""
    g = torch.Generator().manual_seed(seed)
    ls = cfg.layer_scale_initial_scale if layer_scale is None else layer_scale
    with torch.device("meta"):
        shapes = {k: (v.shape, m) for k, v, m in _params_with_owner(Code2Wav(cfg))}

    def randn(shape: torch.Size, std: float) -> Tensor:
        return torch.randn(shape, generator=g) * std

    out: dict[str, Tensor] = {}
    for name, (shape, owner) in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embedding_sum":
            t = randn(shape, 1.0)
        elif leaf == "cluster_usage":
            t = torch.ones(shape)
        elif leaf in ("alpha", "beta"):
            t = randn(shape, 0.1)
        elif leaf == "scale":
            t = torch.full(shape, ls)
        elif leaf == "gamma":
            t = torch.full(shape, convnext_gamma)
        elif isinstance(owner, (RMSNorm, nn.LayerNorm)) and leaf == "weight":
            t = 1.0 + randn(shape, 0.05)
        elif leaf == "bias":
            t = randn(shape, 0.02)
        elif isinstance(owner, nn.ConvTranspose1d):  # [Cin, Cout, k]: Cin * k/stride taps
            t = randn(shape, (shape[0] * (owner.kernel_size[0] // owner.stride[0])) ** -0.5)
        else:  # Linear [out, in] / Conv1d [out, in/groups, k]
            fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1)
            t = randn(shape, fan_in ** -0.5)
        out[name] = t
    # Residual branches scaled down so the stack does not compound; the output conv scaled so
    # the waveform RMS is ~0.2-0.3 (audible, rarely clipped) at tiny and released dims alike.
    last = f"decoder.{len(cfg.upsample_rates) + 2}.conv.weight"
    for name in out:
        if name.endswith(".conv2.conv.weight"):
            out[name] = out[name] * 0.3
    out[last] = out[last] * 0.1
    return out


def _params_with_owner(model: nn.Module):
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            yield (f"{mname}.{pname}" if mname else pname), p, m
