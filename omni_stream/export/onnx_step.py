"""One decode step as a static ONNX graph: talker, code predictor (``DecoderStep``) and Code2Wav
(``Code2WavOnnxStep``), each the model's own forward with every piece of state passed in and out.

The talker and code predictor step is ``DecoderStack.forward`` (``models/layers.py``), the one
step formulation the native engine runs too, at batch 1 and one token:

    inputs   x [1, 1, C_in]                 input embedding of the token
             rope_cos, rope_sin [1, 1, 1, D] rotary angles of its position (sin sign-folded, below)
             mask [1, 1, 1, N]               additive mask over the N keys [cache (N-1) ++ self]
             past_key_<i> [1, Hkv, D, N-1]   per layer: keys stored transposed (plain MatMul)
             past_value_<i> [1, Hkv, N-1, D] per layer
             head [1] int64                  code predictor only: which of the G-1 lm heads
    outputs  logits [1, V]; hidden [1, C] (talker only: it feeds the code predictor)
             roll: present_key_<i>, present_value_<i>  (the window shifted by one, same shapes)
             ring: new_key_<i> [1, Hkv, D, 1], new_value_<i> [1, Hkv, 1, D] (the runtime writes
                   them into ring slot ``pos % (N-1)``)

Why this shape of graph (NPU compilers want it): one cache tensor per layer and kind, never one
stacked ``[layers, ...]`` tensor that every layer slices (that slicing and its layout conversions
took ~70% of NPU cycles on real devices); grouped-query attention by reshaping the query
``[H, D] -> [Hkv, H/Hkv, D]`` so keys and values are never expanded; scores of the cached keys
and of the new key concatenated into ONE fused Softmax (explicit max/exp/sum/div forms broke
quantized compilation); static shapes; masks and rotary angles computed by the runtime.

Ring and roll give the same result on the same history: softmax over keys does not depend on
key order and every cached key carries its own rotary phase, so the ring is never reordered;
the mask hides slots not yet written.

Rotary: ``rope_sin`` carries the rotate-half sign, ``[-sin(a), sin(a)]``, so the graph computes
``x * cos + swap_halves(x) * sin`` with no Neg (identical floats: negation is exact).

The Code2Wav step is ``Code2Wav._run`` over one frame with an ``ExplicitState`` (the stand-in
the torch.export program uses too, ``code2wav_step.py``): inputs ``codes [1, Q, 1]`` int64,
the rotary angles, ``mask [1, 1, 1, W]`` over [W-1 cached frames ++ this frame], per layer K/V
as above and ``tail_<j> [1, C_j, L_j]`` per stateful conv; outputs ``audio [1, spf]``, the K/V
state of the layout and ``tail_out_<j>``. Its context must equal the codec's sliding window W:
a shorter one would change the output, a longer one would attend frames the model never sees.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_stream.models.layers import DecoderStack

LAYOUTS = ("roll", "ring")


class StepError(ValueError):
    """A model or setting the step export cannot handle; the message names the fix."""


def check_stack(stack: nn.Module, where: str) -> None:
    """Fail clearly when ``stack`` is not a Qwen3 decoder stack with the layers we export."""
    if not isinstance(stack, DecoderStack):
        raise StepError(f"{where}: expected a decoder stack (omni_stream.models.layers.DecoderStack), "
                        f"got {type(stack).__name__}; load the checkpoint with omni_stream.checkpoints.io.load_model")
    layers = getattr(stack, "layers", None)
    if layers is None or len(layers) == 0:
        raise StepError(f"{where}: the model has no decoder layers; check the checkpoint's num_hidden_layers")
    if len(layers) != stack.cfg.num_hidden_layers:
        raise StepError(f"{where}: {len(layers)} decoder layers but the config declares "
                        f"{stack.cfg.num_hidden_layers}; the checkpoint and config.json disagree")
    need = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        missing = [n for n in need if attn is None or not hasattr(attn, n)]
        for n in ("mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, n):
                missing.append(n)
        if missing:
            raise StepError(f"{where}: layer {i} lacks {', '.join(missing)}; only Qwen3 decoder "
                            "layers (q/k norm, GQA, SwiGLU) can be exported")


class _OnnxStep(nn.Module):
    """What every exported step shares: the cache layout, the context (N keys per step: N-1
    cached entries plus the new one), per-layer K/V names and shapes, the example inputs."""

    def __init__(self, layout: str, context: int, n_layers: int, n_kv: int, head_dim: int,
                 rope_theta: float) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise StepError(f"unknown cache layout '{layout}': expected one of {', '.join(LAYOUTS)}")
        if context < 2:
            raise StepError(f"context must be >= 2 (one cached entry plus the token), got {context}")
        self.layout, self.context, self.n_layers = layout, context, n_layers
        self.n_kv, self.head_dim, self.rope_theta = n_kv, head_dim, rope_theta

    @property
    def cache_len(self) -> int:
        return self.context - 1

    def cache_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(key, value) cache shapes of one layer."""
        n = self.cache_len
        return (1, self.n_kv, self.head_dim, n), (1, self.n_kv, n, self.head_dim)

    def step_inputs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Per-step inputs (name, shape, dtype), in graph order before the state."""
        raise NotImplementedError

    def state_inputs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Per-layer K/V (interleaved), then whatever else the step carries."""
        ks, vs = self.cache_shapes()
        out = []
        for i in range(self.n_layers):
            out += [(f"past_key_{i}", ks, torch.float32), (f"past_value_{i}", vs, torch.float32)]
        return out

    def input_names(self) -> list[str]:
        return [n for n, _, _ in self.step_inputs() + self.state_inputs()]

    def kv_output_names(self) -> list[str]:
        kind = "present" if self.layout == "roll" else "new"
        return [f"{kind}_{w}_{i}" for i in range(self.n_layers) for w in ("key", "value")]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ones(s, dtype=dt) if n == "rope_cos" else torch.zeros(s, dtype=dt)
                     for n, s, dt in self.step_inputs() + self.state_inputs())

    def _rope_and_mask(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        d = self.head_dim
        return [("rope_cos", (1, 1, 1, d), torch.float32), ("rope_sin", (1, 1, 1, d), torch.float32),
                ("mask", (1, 1, 1, self.context), torch.float32)]


class DecoderStep(_OnnxStep):
    """One-token step over a ``DecoderStack`` (weights shared with it, fp32).

    ``heads``: the lm heads ``[(V, C)]``; one head -> plain MatMul (talker), several -> the
    ``head`` input selects one by Gather (code predictor: one graph instead of G-1)."""

    def __init__(self, stack: DecoderStack, heads: list[torch.Tensor], layout: str, context: int,
                 in_proj: nn.Module | None = None, emit_hidden: bool = False,
                 where: str = "decoder") -> None:
        check_stack(stack, where)
        cfg = stack.cfg
        super().__init__(layout, context, cfg.num_hidden_layers, cfg.num_key_value_heads,
                         cfg.head_dim, cfg.rope_theta)
        self.stack = stack
        self.in_proj = in_proj if in_proj is not None else nn.Identity()
        self.emit_hidden = emit_hidden
        self.multi_head = len(heads) > 1
        # heads stored [n, C, V] so logits are a MatMul without a transposed weight
        w = torch.stack([h.detach().float().t() for h in heads])
        self.register_buffer("head_w", w.contiguous() if self.multi_head else w[0].contiguous(),
                             persistent=False)

    def step_inputs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        c_in = self.stack.layers[0].self_attn.q_proj.in_features
        if not isinstance(self.in_proj, nn.Identity):
            c_in = self.in_proj.in_features
        out = [("x", (1, 1, c_in), torch.float32)] + self._rope_and_mask()
        return out + ([("head", (1,), torch.int64)] if self.multi_head else [])

    def output_names(self) -> list[str]:
        return ["logits"] + (["hidden"] if self.emit_hidden else []) + self.kv_output_names()

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                mask: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stack's own decode step (``DecoderStack.forward``, the one formulation every
        backend runs) at batch 1, one token, keys stored transposed; the layout decides what
        state goes out: the new entries (ring) or the shifted window (roll)."""
        if self.multi_head:
            head, caches = rest[0], rest[1:]
        else:
            head, caches = None, rest
        h = self.in_proj(x)  # [1, 1, C]
        d = self.head_dim
        past = [(caches[2 * i], caches[2 * i + 1]) for i in range(self.n_layers)]
        hn, new = self.stack(h, rope_cos.reshape(1, 1, d), rope_sin.reshape(1, 1, d), mask, past,
                             keys_transposed=True)
        new_state: list[torch.Tensor] = []
        for (pk, pv), (k, v) in zip(past, new):
            k_t = k.reshape(1, self.n_kv, d, 1)  # [1, Hkv, D, 1] (T = 1: transposed by a reshape)
            if self.layout == "roll":
                new_state += [torch.cat((pk, k_t), dim=-1)[..., 1:], torch.cat((pv, v), dim=2)[:, :, 1:]]
            else:
                new_state += [k_t, v]
        if self.multi_head:
            w = torch.index_select(self.head_w, 0, head)  # [1, C, V]
            logits = torch.matmul(hn, w).reshape(1, -1)
        else:
            logits = torch.matmul(hn, self.head_w).reshape(1, -1)
        outs = [logits] + ([hn.reshape(1, -1)] if self.emit_hidden else [])
        return tuple(outs + new_state)


class Code2WavOnnxStep(_OnnxStep):
    """One frame of Code2Wav (``Code2Wav._run``, the model's own modules) over explicit state.

    Switches the model's streaming convs to the conv kernels (``native_conv_kernels``): NPU
    compilers take Conv ops, not the im2col GEMMs the server uses for wide layers."""

    def __init__(self, model: nn.Module, layout: str, context: int) -> None:
        from omni_stream.export.code2wav_step import native_conv_kernels
        from omni_stream.models.code2wav import Code2Wav

        if not isinstance(model, Code2Wav):
            raise StepError(f"code2wav: expected a Code2Wav module, got {type(model).__name__}; "
                            "load it with omni_stream.checkpoints.io.load_codec")
        cfg = model.cfg
        layers = model.pre_transformer.layers
        if len(layers) != cfg.num_hidden_layers or len(layers) == 0:
            raise StepError(f"code2wav: {len(layers)} transformer layers but the config declares "
                            f"{cfg.num_hidden_layers}; the codec checkpoint and its config disagree")
        if context != cfg.sliding_window:
            raise StepError(f"code2wav: context {context} differs from the codec's sliding window of "
                            f"{cfg.sliding_window} frames; use --context {cfg.sliding_window}")
        super().__init__(layout, context, cfg.num_hidden_layers, cfg.num_key_value_heads,
                         cfg.head_dim, cfg.rope_theta)
        native_conv_kernels(model)
        self.model = model
        self.tail_shapes = list(model._tail_shapes)

    def step_inputs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        codes = ("codes", (1, self.model.cfg.num_quantizers, 1), torch.int64)
        return [codes] + self._rope_and_mask()

    def state_inputs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return super().state_inputs() + [(f"tail_{j}", (1, c, n), torch.float32)
                                         for j, (c, n) in enumerate(self.tail_shapes)]

    def output_names(self) -> list[str]:
        return (["audio"] + self.kv_output_names()
                + [f"tail_out_{j}" for j in range(len(self.tail_shapes))])

    def forward(self, codes: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                mask: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from omni_stream.export.code2wav_step import ExplicitState

        n = self.n_layers
        st = ExplicitState(None, state[0:2 * n:2], state[1:2 * n:2], state[2 * n:],
                           keys_transposed=True, ring=self.layout == "ring")
        audio = self.model._run(codes, st, rope_cos, rope_sin, mask)  # [1, spf]
        kv = [t for pair in zip(st.new_keys, st.new_values) for t in pair]
        assert all(t is not None for t in kv + st.new_tails), "every state tensor must be written"
        return (audio, *kv, *st.new_tails)


def talker_step(talker: nn.Module, layout: str, context: int) -> DecoderStep:
    """The talker's step: input = summed frame embedding, outputs codec logits and hidden."""
    for name in ("model", "codec_head"):
        if not hasattr(talker, name):
            raise StepError(f"talker: the model lacks '{name}'; not a Qwen3-TTS talker")
    return DecoderStep(talker.model, [talker.codec_head.weight], layout, context,
                       emit_hidden=True, where="talker")


def code_predictor_step(talker: nn.Module, layout: str, context: int) -> DecoderStep:
    """The code predictor's step: input in the talker's width (projected in-graph), ``head``
    picks codebook j+1's lm head."""
    cp = getattr(talker, "code_predictor", None)
    if cp is None or not hasattr(cp, "model") or not hasattr(cp, "lm_head"):
        raise StepError("code_predictor: the model lacks talker.code_predictor (model, lm_head); "
                        "not a Qwen3-TTS checkpoint")
    groups = talker.cfg.num_code_groups
    if context < groups:
        raise StepError(f"code_predictor: context {context} is smaller than its per-frame sequence "
                        f"of {groups} positions (2 prefill + {groups - 2} sub-steps); use --context {groups}")
    proj = cp.small_to_mtp_projection
    return DecoderStep(cp.model, [h.weight for h in cp.lm_head], layout, context,
                       in_proj=None if isinstance(proj, nn.Identity) else proj, where="code_predictor")
