"""The streaming Code2Wav as one pure function: ``(codes, state) -> (wav, new state)``.

``Code2Wav.step`` updates a preallocated multi-slot ``Code2WavState`` in place, which is right
for the server (fixed batch slots, no allocation) but cannot be exported: an exported program
for a phone must take the stream's state as inputs and hand the next state back as outputs.
``DecoderStep`` runs the very same layers (so the math cannot drift from the server's decoder)
and gives them, instead of the slot tensors, stand-ins whose reads return the current state and
whose in-place writes are recorded as the new state. The result is a function of its inputs
only, which ``torch.export`` traces into a program with explicit state in and out.

State layout (one stream, leading dim 1), in the order of the program's inputs after ``codes``:
``pos [1]`` int64, then per transformer layer ``keys``, then per layer ``values``
``[1, H_kv, W-1, D]``, then every stateful conv's tail ``[1, C_in, L]`` in module order: exactly
``Code2Wav.new_state(1)`` flattened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omni_stream.models.code2wav import Code2Wav, Code2WavState

__all__ = ["DecoderStep", "StateSpec", "state_specs", "flatten_state", "initial_state"]


class _Slot:
    """Stands in for one state tensor of a single-slot stream. ``Code2Wav`` reads a slot with
    ``index_select(0, idx)`` and writes it with ``index_copy_(0, idx, new)``; here the read
    returns the input tensor and the write keeps ``new`` as the output."""

    def __init__(self, t: Tensor) -> None:
        self.t = t
        self.new: Tensor | None = None

    def index_select(self, dim: int, idx: object) -> Tensor:
        return self.t

    def index_copy_(self, dim: int, idx: object, src: Tensor) -> "_Slot":
        self.new = src
        return self


class _SlotState:
    """Duck-typed ``Code2WavState`` whose tensors are ``_Slot`` stand-ins."""

    def __init__(self, pos: Tensor, keys: list[Tensor], values: list[Tensor],
                 tails: list[Tensor]) -> None:
        self.pos = _Slot(pos)
        self.keys = [_Slot(t) for t in keys]
        self.values = [_Slot(t) for t in values]
        self.tails = [_Slot(t) for t in tails]

    def outputs(self) -> list[Tensor]:
        out = []
        for s in (self.pos, *self.keys, *self.values, *self.tails):
            assert s.new is not None, "a state tensor was not written by the step"
            out.append(s.new)
        return out


@dataclass
class _FunctionalStep:
    """What ``Code2Wav`` modules read from a streaming call (``state``, ``idx``)."""

    state: _SlotState
    idx: None = None


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix


def state_specs(model: Code2Wav) -> list[StateSpec]:
    """Name, shape and dtype of every state tensor, in program input order."""
    st = model.new_state(1)
    n = len(st.keys)
    names = (["pos"] + [f"attn{i}.keys" for i in range(n)] + [f"attn{i}.values" for i in range(n)]
             + [f"conv_tail{i}" for i in range(len(st.tails))])
    return [StateSpec(nm, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for nm, t in zip(names, flatten_state(st))]


def flatten_state(st: Code2WavState) -> list[Tensor]:
    return [st.pos, *st.keys, *st.values, *st.tails]


def initial_state(model: Code2Wav) -> list[Tensor]:
    """The state of a fresh stream (position 0, zero history) as the program's state inputs."""
    return flatten_state(model.new_state(1))


class DecoderStep(nn.Module):
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
        slots = _SlotState(state[0], list(state[1:1 + n]), list(state[1 + n:1 + 2 * n]),
                           list(state[1 + 2 * n:]))
        wav = self.model._run(codes, _FunctionalStep(slots))  # [1, n * spf]
        return (wav, *slots.outputs())


@torch.no_grad()
def run_steps(step: DecoderStep, codes: Tensor, chunks: list[int]) -> Tensor:
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
