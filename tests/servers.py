"""The settings block of a tiny-model test server, in one place.

Every server test on a tiny checkpoint runs the pipeline with these settings (two slots, short
streams, the one-frame-first chunk schedule, a queue timeout no test reaches) and names only
what it changes on top: ``tiny_settings(ckpt, max_queue=8)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_stream.orchestrator.settings import PipelineSettings
from omni_stream.scheduling.chunking import ChunkPolicy


def tiny_settings(ckpt: str | Path, **overrides: Any) -> PipelineSettings:
    """``PipelineSettings`` of a tiny test server for ``ckpt``, with ``overrides`` on top."""
    base: dict[str, Any] = dict(model_path=str(ckpt), max_streams=2, max_seq_len=512,
                                queue_timeout_s=60, schedule=ChunkPolicy(first=1, steady=4))
    base.update(overrides)
    return PipelineSettings(**base)
