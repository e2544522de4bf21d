"""The peers, pinned, and their virtualenvs under ``~/.cache/omni-stream/peers/<name>-<version>/``.

A peer's environment is built once (``python -m venv`` + ``pip install`` of the pinned version)
and marked complete with a stamp file, so an interrupted install is redone, not trusted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PEERS", "Peer", "ensure_venv", "peer_root"]


@dataclass(frozen=True)
class Peer:
    name: str  # the row label
    package: str  # the PyPI distribution
    version: str
    module: str  # what the worker imports
    extra: tuple[str, ...] = ()  # more pip requirements

    def __post_init__(self) -> None:
        if not self.version or any(c in self.version for c in "<>=~ "):
            raise ValueError(f"{self.name}: pin an exact version (got {self.version!r})")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PEERS = {
    "vox": Peer("vox", "vox-tts", "0.19.5", "vox"),
    "qwentts": Peer("qwentts", "realtimetts-qwen-native-cpu", "0.4.2", "qwentts_cpp_cpu"),
}


def peer_root() -> Path:
    return Path(os.environ.get("OMNI_STREAM_CACHE_DIR", Path.home() / ".cache" / "omni-stream")) / "peers"


def venv_dir(peer: Peer) -> Path:
    return peer_root() / f"{peer.package}-{peer.version}"


def ensure_venv(peer: Peer) -> Path:
    """The peer environment's python, installing it on first use (needs the package index)."""
    d = venv_dir(peer)
    py, stamp = d / "bin" / "python", d / ".omni-stream-installed"
    if stamp.exists() and py.exists():
        return py
    d.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(d)], check=True)
    r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", peer.requirement, *peer.extra],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"pip install {peer.requirement} failed: {r.stderr.strip()[-800:]}")
    subprocess.run([str(py), "-c", f"import {peer.module}"], check=True, capture_output=True)
    stamp.write_text(peer.requirement + "\n")
    return py
