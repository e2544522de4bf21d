"""What one pipeline deployment runs with (``PipelineSettings``, torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.scheduling.limits import FrameCap


@dataclass(frozen=True)
class PipelineSettings:
    model_path: str
    model_name: str = "qwen3-tts"
    dtype: str = "float32"
    weight_path: str | None = None  # talker/code-predictor weights: None = dtype, int8, int4
    compile: bool = False  # torch.compile the decoder steps (cached across restarts)
    max_streams: int = 4  # talker slots
    max_seq_len: int = 2048
    max_queue: int = 16
    queue_timeout_s: float = 10.0
    default_max_frames: int = 1500  # 120 s of audio: the ceiling of the default frame cap
    frame_cap: FrameCap = field(default_factory=FrameCap)  # default cap that follows the text
    schedule: ChunkPolicy = field(default_factory=ChunkPolicy)  # audio chunk sizes per stream
    talker_threads: int = 1
    codec_threads: int = 1
    device: str = "cpu"
    placement: str = "together"  # talker and code predictor: "together" (one process) or "split"
    kv_budget_bytes: int | None = None  # None: exactly the static cache (slots x max_seq_len)
    max_overtakes: int = 4  # head-of-line: how often a queued request may be passed
    throttle: bool = True  # playback-slack prefill throttling in the talker stage
    cpu_sets: dict = field(default_factory=dict)  # stage ('talker'|'cp'|'codec') -> CPU ids
    cp_threads: int = 1
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.placement not in ("together", "split"):
            raise ValueError(f"placement must be 'together' or 'split', not {self.placement!r}")
        if self.max_streams < 1 or self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise ValueError("max_streams >= 1, max_queue >= 0 and queue_timeout_s > 0 required")
