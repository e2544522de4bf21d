"""One ring record: a fixed 128-byte typed header followed by a raw tensor payload.

Header (little-endian, 88 bytes used): record length u32, kind u16 (0xFFFF = PAD marker: skip to
the ring start), flags u16, dtype code u8, ndim u8, 6 reserved bytes, stream id i64, sequence
number i64, shape 3 x i64, payload bytes u64, enqueue ns i64, put ns i64, aux i64 (free for the
stage: frame index, slot...). Times are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for
all processes): enqueue = when the producer made the item, put = entry of ``Ring.put``, and the
receiver adds get = return of ``Ring.get``, giving the enqueue->put->get attribution.

Payloads are numpy arrays or torch tensors (CUDA tensors are copied to host first, which syncs)
of up to 3 dims with a dtype in ``DTYPES``; bfloat16 travels as raw 16-bit words and comes back
as such from ``Message.as_tensor()``. Nothing is pickled.
"""

from __future__ import annotations

import struct
import sys
from enum import IntEnum, IntFlag
from typing import Any

import numpy as np

HEADER_SIZE = 128
MAX_DIMS = 3
PAD_KIND = 0xFFFF

# reclen, kind, flags, dtype, ndim, -, -, stream_id, seq, shape[3], nbytes, enqueue_ns, put_ns, aux
_HDR = struct.Struct("<IHHBBHIqq3qQqqq")
_PAD = struct.Struct("<IH")
assert _HDR.size <= HEADER_SIZE


class MsgKind(IntEnum):
    """Common message kinds; any value in [0, 0xFFFE] is allowed."""

    DATA = 0
    CODES = 1     # [n_frames, 16] int64 codec frames
    PCM = 2       # [samples] float32 (or int16) audio
    HIDDEN = 3    # talker hidden states
    EVENT = 4     # header-only event (payload None)


class Flags(IntFlag):
    NONE = 0
    END = 1       # last message of the stream
    ERROR = 2     # the stream failed upstream; payload may be empty
    FIRST = 4     # first message of the stream
    LENGTH = 8    # with END: the stream stopped at its frame cap, not at the model's end
    WAIT = 16     # EVENT: a continuous stream ran out of text and waits (aux: frames so far)
    RESUME = 32   # EVENT: its text arrived and it goes on (aux: milliseconds waited)


class FailReason(IntEnum):
    """``aux`` of an ERROR event: why the stream failed (for metrics; the payload says it in
    words)."""

    OTHER = 0
    INVALID_CODE = 1  # a code failed the check where it was produced or where it arrived


DTYPES: tuple[str | None, ...] = (None, "bool", "uint8", "int8", "int16", "int32", "int64",
                                  "float16", "float32", "float64", "bfloat16", "uint16",
                                  "uint32", "uint64")
_BF16 = DTYPES.index("bfloat16")
_NP_OF_CODE = [None if d is None else np.dtype("uint16" if d == "bfloat16" else d) for d in DTYPES]
_CODE_OF_NP = {d: i for i, d in enumerate(_NP_OF_CODE) if d is not None and i != _BF16}


def as_array(payload: Any) -> tuple[np.ndarray | None, int]:
    """Payload -> (C-contiguous native-endian ndarray or None, dtype code)."""
    if payload is None:
        return None, 0
    if isinstance(payload, np.ndarray):
        arr = payload
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        code = _CODE_OF_NP.get(arr.dtype)
        if code is None:
            raise TypeError(f"payload dtype {arr.dtype} is not carried; use one of {DTYPES[1:]}")
        return (arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)), code
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(payload, torch.Tensor):
        t = payload.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), _BF16
        return as_array(t.numpy())
    raise TypeError(f"payload must be a numpy array, a torch tensor or None, not {type(payload)!r}")


class Message:
    """One received message. ``payload`` is a numpy array (None for header-only messages)."""

    __slots__ = ("kind", "flags", "stream_id", "seq", "aux", "payload", "dtype_code",
                 "enqueue_ns", "put_ns", "get_ns", "_release")

    def __init__(self, kind: int, flags: int, stream_id: int, seq: int, aux: int,
                 payload: np.ndarray | None, dtype_code: int, enqueue_ns: int, put_ns: int,
                 get_ns: int, release: tuple[Any, int] | None = None) -> None:
        self.kind, self.flags, self.stream_id, self.seq, self.aux = kind, flags, stream_id, seq, aux
        self.payload, self.dtype_code = payload, dtype_code
        self.enqueue_ns, self.put_ns, self.get_ns = enqueue_ns, put_ns, get_ns
        self._release = release

    @property
    def end(self) -> bool:
        return bool(self.flags & Flags.END)

    @property
    def error(self) -> bool:
        return bool(self.flags & Flags.ERROR)

    @property
    def borrowed(self) -> bool:
        """True while ``payload`` is a view into the ring (``get(copy=False)``, not released)."""
        return self._release is not None and self._release[0]._borrow == self._release[1]

    def as_tensor(self):
        """Payload as a torch tensor sharing its memory (bfloat16 restored); None if no payload."""
        if self.payload is None:
            return None
        import torch

        if self.dtype_code == _BF16:
            return torch.from_numpy(self.payload.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(self.payload)

    def release(self) -> None:
        """Give a borrowed payload's ring space back (no-op for copies or if already released)."""
        rel, self._release = self._release, None
        if rel is not None:
            rel[0]._release(rel[1])

    def __repr__(self) -> str:
        p = None if self.payload is None else f"{self.payload.dtype}{list(self.payload.shape)}"
        return (f"Message(kind={self.kind}, stream_id={self.stream_id}, seq={self.seq}, "
                f"flags={Flags(self.flags).name or self.flags}, aux={self.aux}, payload={p})")
