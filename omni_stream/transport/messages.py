"""Control messages between the server and the stage processes (msgspec, msgpack on the wire).

Control traffic is rare (a few messages per stream) and latency-tolerant, so it travels over a
plain ``multiprocessing`` Pipe wrapped in :class:`ControlChannel` (one duplex pipe per stage,
bytes only: no pickling of message bodies), while per-frame data goes through the rings. The
Connection pickles for 'spawn'/'forkserver' children like any multiprocessing Connection.

Every message is a typed struct: ``AddStream`` nests the prompt (:class:`PromptSpec`), the
sampling settings (``config.SamplingParams``, the engine's own type) and the chunk policy
(``scheduling.chunking.ChunkPolicy``, the codec stage's own type), so decoding a message checks
every field (a wrong type or value is a ``msgspec.ValidationError`` naming it). The one message
that rides a ring instead of the pipe, the talker's first event of a stream to the codec stage,
is :class:`StreamStart`: msgpack bytes as a uint8 payload.

``PromptSpec`` carries the text, a few names and, for a cloned voice, its :class:`CloneSpec`
(an x-vector of a few KB and at most a few hundred reference frames: small enough for the pipe,
sent once per stream). Prompt embeddings are built in the talker stage, never sent.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Union

import msgspec
import numpy as np

from omni_stream.config import SamplingParams
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.scheduling.limits import FrameCap


def _check_stream_id(stream_id: int) -> None:
    if stream_id < 0:
        raise ValueError(f"stream_id must be >= 0, got {stream_id}")


class CloneSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A cloned voice on the wire: ``x_vector`` float32 and ``ref_codes`` int64 [frames, G]
    as little-endian bytes (``ref_codes`` empty: x-vector-only mode)."""

    x_vector: bytes
    ref_codes: bytes = b""
    codebooks: int = 16
    ref_text: str | None = None

    @classmethod
    def of(cls, clone) -> "CloneSpec":
        """The wire form of a ``models.voice_clone.VoiceClone``."""
        codes = b"" if clone.ref_codes is None else clone.ref_codes.astype("<i8").tobytes()
        g = 16 if clone.ref_codes is None else int(clone.ref_codes.shape[1])
        return cls(clone.x_vector.astype("<f4").tobytes(), codes, g, clone.ref_text)

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(x-vector float32 [C], reference codes int64 [frames, G] or None); ValueError if the
        bytes do not make them."""
        if len(self.x_vector) % 4 or self.codebooks < 1 or len(self.ref_codes) % (8 * self.codebooks):
            raise ValueError("a CloneSpec's byte lengths do not match its element types")
        xv = np.frombuffer(self.x_vector, dtype="<f4")
        codes = (np.frombuffer(self.ref_codes, dtype="<i8").reshape(-1, self.codebooks)
                 if self.ref_codes else None)
        return xv, codes


class PromptSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the talker stage builds the prompt from (``models.prompt.PromptRequest``'s fields)."""

    text: str = ""
    language: str = "auto"
    speaker: str | None = None
    instructions: str | None = None
    stream_text: bool = False  # feed the text token by token alongside the codec frames
    clone: CloneSpec | None = None  # a cloned voice (Base models)
    # the prompt's token ids, tokenized once by the server (``models.prompt.tokenize_prompt``);
    # the stage tokenizes only what is None. Continuous text (text arrives while the stream
    # runs): ``text_ids`` is the text so far (the server keeps back the tail whose tokens could
    # still change); AppendText brings the rest and closes it. Implies stream_text.
    text_ids: list[int] | None = None
    continuous: bool = False
    role_ids: list[int] | None = None
    instruct_ids: list[int] | None = None
    ref_ids: list[int] | None = None


class AddStream(msgspec.Struct, tag="add_stream", tag_field="type", frozen=True,
                forbid_unknown_fields=True):
    """Admit a stream: what to say, how to sample it, how to chunk its audio, and for how long.
    ``stream_codes``: the server wants the codec frames themselves, not PCM."""

    stream_id: int
    prompt: PromptSpec = msgspec.field(default_factory=PromptSpec)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    chunk: ChunkPolicy = msgspec.field(default_factory=ChunkPolicy)
    seed: int = 0
    max_frames: int = 4096
    stream_codes: bool = False
    # continuous text: the frame cap follows the text so far (never above max_frames)
    text_cap: FrameCap | None = None

    def __post_init__(self) -> None:
        _check_stream_id(self.stream_id)
        if self.max_frames <= 0:
            raise ValueError(f"max_frames must be > 0, got {self.max_frames}")


class StreamStart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The talker's FIRST event of a stream on the frames ring: what the codec stage needs to
    know before its first frame (chunk policy, codes-only mode, the prompt's text tokens that
    the final chunk reports as ``input_tokens``)."""

    chunk: ChunkPolicy
    codes_only: bool = False
    input_tokens: int = 0
    # ICL voices: the last reference frames (int64 [n, G] little-endian bytes), decoded into the
    # stream's Code2Wav state before its first frame and not played (the official decoder
    # decodes the reference and the speech as one sequence and cuts the reference's audio)
    prime_codes: bytes = b""

    def __post_init__(self) -> None:
        if self.input_tokens < 0:
            raise ValueError(f"input_tokens must be >= 0, got {self.input_tokens}")

    def prime(self, codebooks: int) -> np.ndarray | None:
        """The priming frames as int64 [n, codebooks], or None."""
        if not self.prime_codes:
            return None
        if len(self.prime_codes) % (8 * codebooks):
            raise ValueError(f"prime_codes is not a whole number of {codebooks}-code frames")
        return np.frombuffer(self.prime_codes, dtype="<i8").reshape(-1, codebooks).copy()

    def to_payload(self) -> np.ndarray:
        """msgpack bytes as a uint8 array (a ring payload)."""
        return np.frombuffer(_encoder.encode(self), dtype=np.uint8).copy()

    @classmethod
    def from_payload(cls, payload: np.ndarray) -> "StreamStart":
        """Inverse of :meth:`to_payload`; raises msgspec.ValidationError naming a bad field."""
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8:
            raise ValueError("a StreamStart payload is msgpack bytes as a uint8 array, got "
                             f"{getattr(payload, 'dtype', type(payload).__name__)}")
        return _start_decoder.decode(payload.tobytes())


class AppendText(msgspec.Struct, tag="append_text", tag_field="type", frozen=True,
                 forbid_unknown_fields=True):
    """More text token ids for a continuous stream (in order); ``close``: no more will come
    (its tts_eos follows the last id)."""

    stream_id: int
    ids: list[int] = []
    close: bool = False

    def __post_init__(self) -> None:
        _check_stream_id(self.stream_id)
        if any(i < 0 for i in self.ids):
            raise ValueError("text token ids must be >= 0")


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


class MeasureCosts(msgspec.Struct, tag="measure_costs", tag_field="type", frozen=True):
    """To the talker: measure the memory read bandwidth and, with ``parts``, time the frame step
    at each batch size and the prefill; to the codec stage: time its calls (``edge.measure``).
    Each answers on its own control channel with a StatsReply of this request_id
    (``orchestrator.costs`` asks them one after the other, never while streams run)."""

    request_id: int = 0
    parts: bool = True


class CostUpdate(msgspec.Struct, tag="cost_update", tag_field="type", frozen=True):
    """The deployment's measured costs, for the prefill throttle: the prefill cost model and
    the decode-step time it starts from (``scheduling.capacity.MachineCosts``)."""

    prefill_fixed_s: float
    prefill_token_s: float
    frame_s: float


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


ControlMessage = Union[AddStream, AppendText, CancelStream, StatsRequest, StatsReply, Shutdown,
                       StageError, MeasureCosts, CostUpdate]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)
_start_decoder = msgspec.msgpack.Decoder(StreamStart)


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
