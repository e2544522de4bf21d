"""Code2Wav's streaming state: what each slot carries between calls (``Code2WavState``) and
what one streaming call threads through the modules (``Step``: the state and the slots it
touches). The modules reach the state only through ``Step``'s three methods."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Code2WavState:
    """Per-slot streaming state, preallocated for ``max_slots`` slots (leading dim of every tensor).

    pos:    [S] int64: frames decoded so far = absolute rotary position of the slot's next frame.
    keys:   per transformer layer [S, H_kv, W-1, D]: rotated keys of the last W-1 frames, oldest
            first. Entries from before the stream start are masked out using ``pos``.
    values: per transformer layer [S, H_kv, W-1, D], aligned with ``keys``.
    tails:  per stateful conv (in module order) [S, C_in, L]: the last L inputs of that conv
            (L = (kernel-1)*dilation for causal convs, 1 for the block transposed convs). Zeros
            are exactly the causal left padding of a fresh stream.
    """

    pos: Tensor
    keys: list[Tensor]
    values: list[Tensor]
    tails: list[Tensor]

    @property
    def max_slots(self) -> int:
        return self.pos.shape[0]

    def reset(self, slot: int) -> None:
        """Make ``slot`` a fresh stream (position 0, zero history)."""
        self.pos[slot] = 0
        for t in (*self.keys, *self.values, *self.tails):
            t[slot].zero_()

    def snapshot(self, slot: int) -> list[Tensor]:
        """A copy of ``slot``'s state (for :meth:`restore` into any slot)."""
        return [t[slot].clone() for t in (self.pos, *self.keys, *self.values, *self.tails)]

    def restore(self, slot: int, snap: list[Tensor]) -> None:
        """Make ``slot`` continue the stream ``snap`` was taken from."""
        for t, s in zip((self.pos, *self.keys, *self.values, *self.tails), snap, strict=True):
            t[slot].copy_(s)

@dataclass
class Step:
    """What a streaming call threads through the modules: the state and the slots it touches.

    The modules reach the state only through the three methods below, so an exporter can stand
    in a subclass that takes the state as explicit inputs and returns the update as outputs
    (``omni_stream/export/code2wav_step.py``) and run these very modules."""

    state: Code2WavState
    idx: Tensor  # [s] int64 slot index per batch row
    keys_transposed = False  # past keys as [s, H_kv, D, W-1] (NPU graphs) instead of [.., W-1, D]
    # each query attends its own window of W keys in a product of fixed shape
    # (``windowed_attend``): a query's output is then the same whatever the chunk it came in
    windowed = True

    def advance(self, t: int) -> Tensor:
        """The selected slots' positions [s] before this call's ``t`` frames; moves them on."""
        p = self.state.pos.index_select(0, self.idx)
        self.state.pos.index_copy_(0, self.idx, p + t)
        return p

    def tail(self, state_id: int, x: Tensor, keep: int) -> Tensor:
        """Return ``tail ++ x`` for the selected slots and store its last ``keep`` columns back."""
        buf = self.state.tails[state_id]
        # a part running in another dtype than the state (a mixed-precision decode) reads and
        # writes its tail in its own dtype: bf16 values are exact in an fp32 state
        xx = torch.cat([buf.index_select(0, self.idx).to(x.dtype), x], dim=-1)
        buf.index_copy_(0, self.idx, xx[..., xx.shape[-1] - keep:].to(buf.dtype))
        return xx

    def kv(self, layer_id: int, k: Tensor, v: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer_id``'s past keys/values of the selected slots (for attention over
        ``[past ++ new]``); stores the last ``keep`` entries of ``[past ++ new]`` back.
        k, v [s, H_kv, T, D] are the new frames' rotated keys and values."""
        kb, vb = self.state.keys[layer_id], self.state.values[layer_id]
        past_k = kb.index_select(0, self.idx).to(k.dtype)  # a part in its own dtype (see tail)
        past_v = vb.index_select(0, self.idx).to(v.dtype)
        kk, vv = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        kb.index_copy_(0, self.idx, kk[:, :, kk.shape[2] - keep:].to(kb.dtype))
        vb.index_copy_(0, self.idx, vv[:, :, vv.shape[2] - keep:].to(vb.dtype))
        return past_k, past_v
