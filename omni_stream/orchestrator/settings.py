"""What one pipeline deployment runs with (``PipelineSettings``, torch-free), and the chunk
calibration cache that belongs to it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from omni_stream.checkpoints.default import cache_dir
from omni_stream.config import check_engine
from omni_stream.scheduling.capacity import CostCache
from omni_stream.scheduling.chunking import ChunkPolicy
from omni_stream.scheduling.fingerprint import hardware_fingerprint
from omni_stream.scheduling.limits import FrameCap


@dataclass(frozen=True)
class PipelineSettings:
    model_path: str
    model_name: str = "qwen3-tts"
    dtype: str = "float32"
    codec_dtype: str | None = None  # Code2Wav's dtype; None: ``dtype`` (see ``decode_dtype``)
    weight_path: str | None = None  # talker/code-predictor weights: None = dtype, int8, int4
    compile: bool = False  # torch.compile the decoder steps (cached across restarts)
    # what runs the decode step: "torch" ops, the "native" CPU runtime, or "vllm" (the talker
    # decoder and its KV cache on vLLM: engine/vllm)
    engine: str = "torch"
    max_streams: int = 4  # talker slots
    max_seq_len: int = 2048
    max_queue: int = 16
    queue_timeout_s: float = 10.0
    default_max_frames: int = 1500  # 120 s of audio: the ceiling of the default frame cap
    frame_cap: FrameCap = field(default_factory=FrameCap)  # default cap that follows the text
    schedule: ChunkPolicy = field(default_factory=ChunkPolicy)  # audio chunk sizes per stream
    # the schedule came from this deployment's cached costs (``omni-stream serve`` puts the
    # policy they give in the profile's calibration layer); False: the backend derives it from
    # the costs it loads or measures at start (``scheduling.capacity.chunk_policy``)
    schedule_calibrated: bool = False
    schedule_fixed: bool = False  # the chunk sizes are the user's: the costs do not change them
    talker_threads: int = 1
    codec_threads: int = 1
    device: str = "cpu"
    cuda_graphs: bool = False  # talker frame step as CUDA graphs (needs cuda, placement together)
    placement: str = "together"  # talker and code predictor: "together" (one process) or "split"
    kv_budget_bytes: int | None = None  # None: exactly the static cache (slots x max_seq_len)
    max_overtakes: int = 4  # head-of-line: how often a queued request may be passed
    throttle: bool = True  # playback-slack prefill throttling in the talker stage
    cpu_sets: dict = field(default_factory=dict)  # stage ('talker'|'cp'|'codec') -> CPU ids
    cp_threads: int = 1
    lend_cores: bool = False  # codec's cores run talker runtime threads while it is idle
    # (draft layers, lookahead): the code predictor drafts and verifies (engine.speculative);
    # placement together, no CUDA graphs
    speculative_cp: tuple[int, int] | None = None
    # continuous text: a stream that gets no text for this long (and is not closed) fails with
    # 408 text_timeout, freeing its slot
    text_idle_timeout_s: float = 30.0
    # the most text tokens one continuous utterance takes (the talker's text-track rows per
    # slot, ``EngineShape.max_trailing``, less tts_eos)
    max_text_tokens: int = 511
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_engine(self.engine, self.device, self.compile)
        if self.engine == "vllm":
            for on, what in ((self.cuda_graphs, "cuda_graphs"),
                             (self.speculative_cp is not None, "speculative_cp"),
                             (self.placement != "together", "placement 'split'")):
                if on:
                    raise ValueError(f"{what} runs on engine 'torch' or 'native', not 'vllm' "
                                     "(vLLM runs eagerly with the code predictor beside it)")
        if self.placement not in ("together", "split"):
            raise ValueError(f"placement must be 'together' or 'split', not {self.placement!r}")
        if self.max_streams < 1 or self.max_queue < 0 or self.queue_timeout_s <= 0:
            raise ValueError("max_streams >= 1, max_queue >= 0 and queue_timeout_s > 0 required")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device!r}: set "
                             "cuda_graphs False (or --device cuda)")
        if self.cuda_graphs and self.placement != "together":
            raise ValueError("cuda_graphs needs placement 'together' (with 'split' the code "
                             "predictor runs in another process, outside the graph)")
        if self.speculative_cp is not None:
            why = ("needs placement 'together'" if self.placement != "together" else
                   "cannot run inside CUDA graphs (it reads the accepted length on the host); "
                   "set cuda_graphs false" if self.cuda_graphs else None)
            if why:
                raise ValueError(f"speculative code prediction {why}")
        if self.lend_cores:
            from omni_stream.edge.adapt import lend_cores_blocker

            why = lend_cores_blocker(self.engine, self.placement, self.cpu_sets)
            if why:
                raise ValueError(f"lend_cores {why}; set lend_cores false")

    @property
    def decode_dtype(self) -> str:
        """The dtype Code2Wav runs in."""
        return self.codec_dtype or self.dtype

    def calibration_fingerprint(self) -> str:
        """Measured costs hold for this hardware AND this checkpoint (its weight files' sizes
        and times) and deployment (engine, weight path, slots, threads, placement)."""
        key = [hardware_fingerprint(), str(self.model_path), _files_identity(self.model_path),
               self.dtype, self.decode_dtype, self.weight_path, self.compile, self.engine, self.max_streams,
               self.placement, self.talker_threads, self.codec_threads, self.cp_threads,
               self.lend_cores, self.speculative_cp, sorted((k, tuple(v)) for k, v in self.cpu_sets.items())]
        return hashlib.sha256(repr(key).encode()).hexdigest()[:16]

    def cost_cache(self) -> CostCache:
        """Where this deployment's measured costs are cached (``cache_dir()/calibration``)."""
        return CostCache(cache_dir() / "calibration", fingerprint=self.calibration_fingerprint())


def _files_identity(model_path: str) -> list:
    """(name, size, mtime) of the checkpoint's weight and config files: a new checkpoint at the
    same path is measured again."""
    import os

    out = []
    try:
        for e in sorted(os.scandir(model_path), key=lambda e: e.name):
            if e.is_file() and e.name.endswith((".safetensors", ".json")):
                st = e.stat()
                out.append((e.name, st.st_size, int(st.st_mtime)))
    except OSError:
        pass
    return out
