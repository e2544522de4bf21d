"""Uploaded voices on disk, so they survive a restart.

One file per voice, ``<lowercased name>.safetensors``: the tensors ``x_vector`` (float32 [C])
and, in ICL mode, ``ref_codes`` (int64 [frames, 16]); the rest (name as given, transcript,
duration, sample rate, creation time, format version) is JSON in the safetensors metadata
under ``omni_stream.voice``. A file is written whole to a temp file in the same folder, fsynced
and renamed over (``os.replace``), so a crash leaves either the old state or the new one; temp
files left by a crash are removed at start-up. Files are 0600 in a 0700 folder.

A voice's x-vector and codes only mean something to the checkpoint that made them, so each
checkpoint gets its own folder (``default_voice_dir``).

Names are case-preserving and case-insensitively unique, like the built-in speaker names the
server looks up case-insensitively.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from omni_stream.checkpoints.default import cache_dir
from omni_stream.errors import RequestError
from omni_stream.models.voice_clone import VoiceClone

__all__ = ["VoiceStore", "VoiceRecord", "validate_name", "default_voice_dir",
           "MAX_VOICES", "MAX_NAME_LEN", "FORMAT_VERSION"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_VOICES = 1000  # stored voices per checkpoint; more -> 507 voice_store_full
MAX_NAME_LEN = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_META_KEY = "omni_stream.voice"
_SUFFIX = ".safetensors"
_TMP_SUFFIX = ".tmp"  # temp files are ".<key>.<random>.tmp": a name cannot start with "."


def validate_name(name: Any) -> str:
    """The name as given if it may name a stored voice, else RequestError 400 ``invalid_voice_name``.

    1..64 of ``A-Z a-z 0-9 _ . -``, starting with a letter or digit, no ``..``: it becomes
    a file name, so nothing in it can leave the store's folder.
    """
    rule = (f"1-{MAX_NAME_LEN} characters from A-Z, a-z, 0-9, '_', '.', '-', starting with a "
            "letter or digit, without '..'")
    if not isinstance(name, str) or not name:
        raise RequestError(400, "invalid_voice_name", f"a voice name is required: {rule}",
                           param="name")
    if len(name) > MAX_NAME_LEN or not _NAME.fullmatch(name) or ".." in name:
        raise RequestError(400, "invalid_voice_name",
                           f"invalid voice name {name[:80]!r}: use {rule}", param="name")
    return name


def _key(name: str) -> str:
    return name.lower()


@dataclass(frozen=True, eq=False)
class VoiceRecord:
    """A stored voice: the clone, and what the API shows about it."""

    name: str  # as given (case preserved)
    clone: VoiceClone
    created_at: int  # unix seconds
    duration_s: float  # of the reference clip
    sample_rate: int  # the reference clip's original rate

    def as_json(self) -> dict[str, Any]:
        """The API's view (never the vectors or codes themselves)."""
        c = self.clone
        return {"object": "voice", "name": self.name, "mode": c.mode, "ref_text": c.ref_text,
                "duration_s": round(float(self.duration_s), 3),
                "frames": int(c.ref_codes.shape[0]) if c.ref_codes is not None else 0,
                "created_at": int(self.created_at)}


def _encode(rec: VoiceRecord) -> bytes:
    tensors = {"x_vector": rec.clone.x_vector}
    if rec.clone.ref_codes is not None:
        tensors["ref_codes"] = rec.clone.ref_codes
    meta = {"format_version": FORMAT_VERSION, "name": rec.name, "ref_text": rec.clone.ref_text,
            "created_at": rec.created_at, "duration_s": rec.duration_s,
            "sample_rate": rec.sample_rate}
    return st_save(tensors, metadata={_META_KEY: json.dumps(meta)})


def _decode(data: bytes) -> VoiceRecord:
    """File bytes -> VoiceRecord; ValueError/KeyError/SafetensorError when it is not one."""
    if len(data) < 8:
        raise ValueError("truncated file")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("truncated header")
    header = json.loads(data[8:8 + n])
    raw = (header.get("__metadata__") or {}).get(_META_KEY)
    if raw is None:
        raise ValueError(f"no '{_META_KEY}' metadata: not an omni-stream voice file")
    meta = json.loads(raw)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format version {meta.get('format_version')!r}, this omni-stream reads "
                         f"{FORMAT_VERSION}")
    tensors = st_load(data)
    x = tensors["x_vector"]
    codes = tensors.get("ref_codes")
    if x.dtype != np.float32 or x.ndim != 1:
        raise ValueError(f"x_vector is {x.dtype} {list(x.shape)}, expected float32 [C]")
    if codes is not None and (codes.dtype != np.int64 or codes.ndim != 2):
        raise ValueError(f"ref_codes is {codes.dtype} {list(codes.shape)}, expected int64 [frames, 16]")
    clone = VoiceClone(x_vector=x, ref_codes=codes, ref_text=meta.get("ref_text"))
    return VoiceRecord(name=validate_name(meta["name"]), clone=clone,
                       created_at=int(meta["created_at"]), duration_s=float(meta["duration_s"]),
                       sample_rate=int(meta["sample_rate"]))


def _fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable (POSIX; a no-op where dirs cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class VoiceStore:
    """Uploaded voices of one checkpoint, in memory and in ``root`` (see the module docstring).

    Thread-safe: the server calls it from worker threads. Write failures (disk full...)
    propagate as OSError and leave no partial file.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._lock = threading.Lock()
        self._voices: dict[str, VoiceRecord] = {}
        self._load()

    def _load(self) -> None:
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") and p.name.endswith(_TMP_SUFFIX):
                log.warning("removing %s, a voice file left half-written", p)
                p.unlink(missing_ok=True)
                continue
            if p.suffix != _SUFFIX or not p.is_file():
                continue
            try:
                rec = _decode(p.read_bytes())
                if _key(rec.name) + _SUFFIX != p.name:
                    raise ValueError(f"holds voice {rec.name!r}, whose file would be "
                                     f"{_key(rec.name)}{_SUFFIX}")
            except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
                log.warning("skipping voice file %s: %s", p, e)
                continue
            self._voices[_key(rec.name)] = rec
        log.info("voice store %s: %d voice(s)", self.root, len(self._voices))

    def add(self, name: str, clone: VoiceClone, duration_s: float, sample_rate: int) -> VoiceRecord:
        """Store a new voice. RequestError: 400 bad name, 409 the name (any case) exists, 507 full."""
        name = validate_name(name)
        if not (duration_s >= 0 and np.isfinite(duration_s)) or int(sample_rate) <= 0:
            raise ValueError(f"bad clip metadata: duration {duration_s}, sample rate {sample_rate}")
        rec = VoiceRecord(name=name, clone=clone, created_at=int(time.time()),
                          duration_s=float(duration_s), sample_rate=int(sample_rate))
        data = _encode(rec)
        with self._lock:
            old = self._voices.get(_key(name))
            if old is not None:
                raise RequestError(409, "voice_exists",
                                   f"a voice named {old.name!r} already exists (names are "
                                   "case-insensitive): delete it first "
                                   f"(DELETE /v1/audio/voices/{old.name}) or pick another name",
                                   param="name")
            if len(self._voices) >= MAX_VOICES:
                raise RequestError(507, "voice_store_full",
                                   f"the voice store is full ({MAX_VOICES} voices): delete "
                                   "voices that are no longer used")
            self._write(self.root / (_key(name) + _SUFFIX), data)
            self._voices[_key(name)] = rec
        return rec

    def _write(self, path: Path, data: bytes) -> None:
        tmp = self.root / f".{path.stem}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.root)

    def get(self, name: str) -> VoiceRecord | None:
        """The voice of that name in any case, or None."""
        with self._lock:
            return self._voices.get(_key(name)) if isinstance(name, str) else None

    def list(self) -> list[VoiceRecord]:
        """All stored voices, sorted by name (case-insensitively)."""
        with self._lock:
            return [self._voices[k] for k in sorted(self._voices)]

    def delete(self, name: str) -> bool:
        """Remove a voice (any case); False when there is none of that name."""
        if not isinstance(name, str):
            return False
        with self._lock:
            rec = self._voices.pop(_key(name), None)
            if rec is None:
                return False
            try:
                (self.root / (_key(name) + _SUFFIX)).unlink(missing_ok=True)
            except BaseException:
                self._voices[_key(name)] = rec
                raise
        _fsync_dir(self.root)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._voices)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("._")[:40] or "model"


def default_voice_dir(model_dir: Path | str) -> Path:
    """``<cache>/voices/<model folder name>-<fingerprint>``: the fingerprint hashes the
    checkpoint's resolved path and its config files, because a voice's x-vector and codes only
    fit the model that made them. FileNotFoundError when ``config.json`` is missing."""
    path = Path(model_dir).resolve()
    h = hashlib.sha256(str(path).encode())
    for rel in ("config.json", "speech_tokenizer/config.json"):
        f = path / rel
        if rel == "config.json" or f.is_file():
            h.update(b"\0" + rel.encode() + b"\0" + f.read_bytes())
    return cache_dir() / "voices" / f"{_slug(path.name)}-{h.hexdigest()[:12]}"
