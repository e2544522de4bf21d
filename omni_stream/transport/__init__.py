"""Inter-process data plane: shared-memory rings (data), eventfd wake-ups, msgspec control."""

from .messages import (AddStream, AppendText, CancelStream, ChannelClosed, CloneSpec, ControlChannel,
                       ControlMessage, CostUpdate, MeasureCosts, PromptSpec, Shutdown, StageError, StatsReply, StatsRequest, StreamStart,
                       decode, encode)
from .notify import Notifier
from .record import DTYPES, HEADER_SIZE, FailReason, Flags, Message, MsgKind
from .ring import Ring, RingHandle
from .shm import (SEGMENT_PREFIX, SegmentRegistry, cleanup_stale, default_registry,
                  default_shm_dir, pid_alive)

__all__ = [
    "AddStream", "AppendText", "CancelStream", "ChannelClosed", "CloneSpec", "ControlChannel", "ControlMessage", "CostUpdate", "DTYPES",
    "FailReason", "Flags", "HEADER_SIZE", "MeasureCosts", "Message", "MsgKind", "Notifier", "PromptSpec", "Ring",
    "RingHandle", "SEGMENT_PREFIX", "SegmentRegistry", "Shutdown", "StageError", "StatsReply",
    "StatsRequest", "StreamStart",
    "cleanup_stale", "decode", "default_registry", "default_shm_dir", "encode", "pid_alive",
]
