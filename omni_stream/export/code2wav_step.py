"""The streaming Code2Wav as one pure function: ``(codes, state) -> (wav, new state)``.

``Code2Wav.step`` updates a preallocated multi-slot ``Code2WavState`` in place, which is right
for the server (fixed batch slots, no allocation) but cannot be exported: an exported program
for a phone must take the stream's state as inputs and hand the next state back as outputs.
``Code2WavStep`` runs the very same layers (so the math cannot drift from the server's decoder)
with an ``ExplicitState`` in place of the slot state: the modules reach their state only through
``Step.advance/tail/kv``, which here read the given tensors and keep the updates as the new
state. The result is a function of its inputs only, which ``torch.export`` traces into a
program with explicit state in and out. The one-frame ONNX step for NPUs
(``onnx_step.Code2WavOnnxStep``) runs the same modules over the same ``ExplicitState``, with
keys transposed, the roll or ring cache layout and the rotary angles and mask as graph inputs.

State layout (one stream, leading dim 1), in the order of the program's inputs after ``codes``:
``pos [1]`` int64, then per transformer layer ``keys``, then per layer ``values``
``[1, H_kv, W-1, D]``, then every stateful conv's tail ``[1, C_in, L]`` in module order: exactly
``Code2Wav.new_state(1)`` flattened.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from omni_stream.export.manifest import TensorSpec
from omni_stream.models.code2wav import Code2Wav, Code2WavState
from omni_stream.models.code2wav_state import Step

__all__ = ["Code2WavStep", "ExplicitState", "flatten_state", "initial_state",
           "native_conv_kernels", "state_specs"]


class ExplicitState(Step):
    """One stream's Code2Wav state as explicit tensors, for the modules' ``Step`` calls: reads
    return the given tensors, writes are kept as the next state (``new_*``). Nothing is written
    in place, so a step over it is a pure function of its inputs that an exporter can trace.

    ``keys_transposed``: past keys come (and go) as ``[1, H_kv, D, W-1]``, the layout NPU graphs
    want. ``ring``: the next key/value state is only this call's entries (the runtime writes
    them into their ring slot) instead of the window shifted by them; one frame per call."""

    windowed = False  # the exported graphs keep ``attend`` (their runtimes' kernels, fp32)

    def __init__(self, pos: Tensor | None, keys: list[Tensor], values: list[Tensor],
                 tails: list[Tensor], keys_transposed: bool = False, ring: bool = False) -> None:
        self.pos, self.keys, self.values, self.tails = pos, list(keys), list(values), list(tails)
        self.keys_transposed, self.ring = keys_transposed, ring
        self.new_pos: Tensor | None = None
        self.new_keys: list[Tensor | None] = [None] * len(self.keys)
        self.new_values: list[Tensor | None] = [None] * len(self.values)
        self.new_tails: list[Tensor | None] = [None] * len(self.tails)

    def advance(self, t: int) -> Tensor:
        assert self.pos is not None, "no position state: pass the rotary angles and the mask"
        self.new_pos = self.pos + t
        return self.pos

    def tail(self, state_id: int, x: Tensor, keep: int) -> Tensor:
        xx = torch.cat([self.tails[state_id], x], dim=-1)
        self.new_tails[state_id] = xx[..., xx.shape[-1] - keep:]
        return xx

    def kv(self, layer_id: int, k: Tensor, v: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        past_k, past_v = self.keys[layer_id], self.values[layer_id]
        kd = 3 if self.keys_transposed else 2  # the keys' position dim
        k = k.transpose(2, 3) if self.keys_transposed else k
        if self.ring:
            self.new_keys[layer_id], self.new_values[layer_id] = k, v
        else:
            kk, vv = torch.cat([past_k, k], dim=kd), torch.cat([past_v, v], dim=2)
            self.new_keys[layer_id] = kk.narrow(kd, kk.shape[kd] - keep, keep)
            self.new_values[layer_id] = vv[:, :, vv.shape[2] - keep:]
        return past_k, past_v

    def outputs(self) -> list[Tensor]:
        out = [self.new_pos, *self.new_keys, *self.new_values, *self.new_tails]
        assert all(t is not None for t in out), "a state tensor was not written by the step"
        return out


def state_specs(model: Code2Wav) -> list[TensorSpec]:
    """Name, shape and dtype of every state tensor, in program input order."""
    st = model.new_state(1)
    n = len(st.keys)
    names = (["pos"] + [f"attn{i}.keys" for i in range(n)] + [f"attn{i}.values" for i in range(n)]
             + [f"conv_tail{i}" for i in range(len(st.tails))])
    return [TensorSpec(nm, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for nm, t in zip(names, flatten_state(st))]


def flatten_state(st: Code2WavState) -> list[Tensor]:
    return [st.pos, *st.keys, *st.values, *st.tails]


def initial_state(model: Code2Wav) -> list[Tensor]:
    """The state of a fresh stream (position 0, zero history) as the program's state inputs."""
    return flatten_state(model.new_state(1))


class Code2WavStep(nn.Module):
    """``forward(codes [1, Q, n] int64, *state) -> (wav [1, n * spf], *new_state)``.

    Decoding frames in any number of calls, feeding each call's new state into the next, gives
    the same samples as ``Code2WavStream`` (and so as the one-pass decode) to float rounding."""

    def __init__(self, model: Code2Wav) -> None:
        super().__init__()
        self.model = model
        self.num_layers = model.cfg.num_hidden_layers
        self.num_tails = len(model.new_state(1).tails)

    def forward(self, codes: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        n, t = self.num_layers, self.num_tails
        assert len(state) == 1 + 2 * n + t, f"expected {1 + 2 * n + t} state tensors"
        st = ExplicitState(state[0], state[1:1 + n], state[1 + n:1 + 2 * n], state[1 + 2 * n:])
        wav = self.model._run(codes, st)  # [1, n * spf]
        return (wav, *st.outputs())


def native_conv_kernels(model: Code2Wav) -> None:
    """Stream the wide convs with the conv kernels instead of Code2Wav's im2col + GEMM path, for
    export backends whose compilers want Conv ops (ExecuTorch, ONNX for NPUs). XNNPACK delegates
    convolutions but not those GEMMs (their weights are reshaped in the graph), which left the
    four widest layers of the 0.6B codec to ExecuTorch's portable mm: ~50x slower per frame
    (benchmarks/tts/decoder_export_bench.py). Same math, different rounding."""
    for m in model.modules():
        if hasattr(m, "gemm"):
            m.gemm = False


@torch.no_grad()
def run_steps(step: Code2WavStep, codes: Tensor, chunks: list[int]) -> Tensor:
    """Decode ``codes [1, Q, T]`` in chunks of the given sizes from a fresh state (for tests and
    the exporter's self-check)."""
    state = initial_state(step.model)
    out, at = [], 0
    for c in chunks:
        wav, *state = step(codes[:, :, at:at + c], *state)
        out.append(wav)
        at += c
    assert at == codes.shape[2], "chunks must cover the codes"
    return torch.cat(out, dim=-1)
