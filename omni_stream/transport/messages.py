"""Control messages between the server and the stage processes (msgspec, msgpack on the wire).

Control traffic is rare (a few messages per stream) and latency-tolerant, so it travels over a
plain ``multiprocessing`` Pipe wrapped in :class:`ControlChannel` (one duplex pipe per stage,
bytes only: no pickling of message bodies), while per-frame data goes through the rings. The
Connection pickles for 'spawn'/'forkserver' children like any multiprocessing Connection.

Large per-stream inputs (prompt embeddings, speaker x-vectors) do not belong here: they go as
ring payloads keyed by stream id; ``AddStream.prompt`` carries only small primitives.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Union

import msgspec

from omni_stream.config import SamplingParams

Primitive = Union[None, bool, int, float, str, list[Union[bool, int, float, str]]]


def _check_stream_id(stream_id: int) -> None:
    if stream_id < 0:
        raise ValueError(f"stream_id must be >= 0, got {stream_id}")


class AddStream(msgspec.Struct, tag="add_stream", tag_field="type", frozen=True):
    """Admit a stream. Sampling fields mirror ``models.sampling.SamplingParams``
    (``SamplingParams(**msg.sampling())``)."""

    stream_id: int
    prompt: dict[str, Primitive] = {}
    seed: int = 0
    max_frames: int = 4096
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    min_new_tokens: int = 2
    sub_do_sample: bool = True
    sub_temperature: float = 0.9
    sub_top_k: int = 50
    sub_top_p: float = 1.0

    def __post_init__(self) -> None:
        _check_stream_id(self.stream_id)
        if self.max_frames <= 0:
            raise ValueError(f"max_frames must be > 0, got {self.max_frames}")
        SamplingParams(**self.sampling())  # the same rules as the engine's (raises ValueError)

    def sampling(self) -> dict[str, float | int | bool]:
        return {f: getattr(self, f) for f in ("do_sample", "temperature", "top_k", "top_p",
                                               "repetition_penalty", "min_new_tokens",
                                               "sub_do_sample", "sub_temperature", "sub_top_k",
                                               "sub_top_p")}


class CancelStream(msgspec.Struct, tag="cancel_stream", tag_field="type", frozen=True):
    """Free the stream's slot now (client gone); no more output is wanted."""

    stream_id: int
    reason: str = ""

    def __post_init__(self) -> None:
        _check_stream_id(self.stream_id)


class StatsRequest(msgspec.Struct, tag="stats_request", tag_field="type", frozen=True):
    request_id: int = 0


class StatsReply(msgspec.Struct, tag="stats_reply", tag_field="type", frozen=True):
    stage: str
    pid: int
    request_id: int = 0
    stats: dict[str, Union[int, float]] = {}


class Shutdown(msgspec.Struct, tag="shutdown", tag_field="type", frozen=True):
    """Finish or drop running streams, close rings, exit."""

    reason: str = ""
    drain: bool = False


class StageError(msgspec.Struct, tag="stage_error", tag_field="type", frozen=True):
    """A stage failed for ``stream_ids`` (empty = all of its streams); ``fatal``: it is exiting."""

    stage: str
    message: str
    stream_ids: list[int] = []
    fatal: bool = False


ControlMessage = Union[AddStream, CancelStream, StatsRequest, StatsReply, Shutdown, StageError]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode(msg: ControlMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> ControlMessage:
    """Bytes -> message; raises msgspec.ValidationError (a ValueError) naming the bad field."""
    return _decoder.decode(data)


class ChannelClosed(ConnectionError):
    """The other end of a ControlChannel closed or died."""


class ControlChannel:
    """One end of a duplex control pipe carrying msgpack-encoded ControlMessages."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @classmethod
    def pair(cls, ctx=None) -> tuple["ControlChannel", "ControlChannel"]:
        """Two connected ends; pass one to the child process (Process args)."""
        import multiprocessing

        a, b = (ctx or multiprocessing).Pipe(duplex=True)
        return cls(a), cls(b)

    def send(self, msg: ControlMessage) -> None:
        try:
            self.conn.send_bytes(encode(msg))
        except (BrokenPipeError, ConnectionResetError, EOFError) as e:
            raise ChannelClosed(str(e)) from e

    def recv(self, timeout: float | None = None) -> ControlMessage | None:
        """Next message, None after ``timeout`` s (None = block); ChannelClosed if the peer left."""
        try:
            if not self.conn.poll(timeout):
                return None
            return decode(self.conn.recv_bytes())
        except (EOFError, ConnectionResetError, BrokenPipeError) as e:
            raise ChannelClosed(str(e) or "control channel closed") from e

    def fileno(self) -> int:
        """For select/asyncio ``add_reader``."""
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
