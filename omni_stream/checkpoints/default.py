"""Where omni-stream keeps its files, and the embedded default model (``--model default``).

``cache_dir()`` is the root of everything written at run time (the default model, compiled
steps, chunk calibration); ``resolve_model_path`` turns ``default`` into the tiny random
checkpoint, written there on first use, so every command that takes ``--model``
(``add_model_argument``) runs with no download. Torch is imported only when the default model has to be written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_VERSION = "tiny-custom_voice-seed0-v1"


def cache_dir() -> Path:
    return Path(os.environ.get("OMNI_STREAM_CACHE_DIR", Path.home() / ".cache" / "omni-stream"))


def add_model_argument(parser) -> None:
    """``--model`` as every ``omni-stream`` command takes it: a checkpoint folder or ``default``,
    turned into a path by ``resolve_model_path`` when the command runs (parsing writes nothing)."""
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help=f"checkpoint folder (released layout), or '{DEFAULT_MODEL_NAME}': "
                             "the embedded tiny model")


def resolve_model_path(model: str | Path) -> Path:
    """``default`` -> the embedded tiny random checkpoint (written on first use), else a folder."""
    if str(model) != DEFAULT_MODEL_NAME:
        return Path(model)
    path = cache_dir() / "models" / DEFAULT_MODEL_VERSION
    marker = path / ".complete"
    if not marker.is_file():
        import fcntl

        from omni_stream.checkpoints.io import write_random_checkpoint

        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{DEFAULT_MODEL_VERSION}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not marker.is_file():
                log.info("writing the embedded default model to %s", path)
                write_random_checkpoint(path, "tiny", "custom_voice", seed=0)
                marker.write_text("ok\n")
    return path
