"""The manifest of an exported decoder, and the codec identity a server announces.

An exported Code2Wav is only correct for the codec weights it was exported from: decoding
another model's codes with it gives plausible-sounding garbage, not an error. So the manifest
records the codec's identity (a SHA-256 over the decoder tensors of the checkpoint, plus its
geometry), the server announces the same identity for the model it serves, and a client refuses
to decode when they differ. The manifest also records the program file's hash, so a truncated
or swapped file is caught before the runtime tries to load it.

This module needs no torch at import time: a client that only runs a ``.pte`` reads it too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "FORMATS", "ExportError", "Manifest", "ManifestError",
           "CodecIdentity", "check_codec_match", "codec_identity", "file_sha256"]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
# format -> (program file name, what runs it)
FORMATS = {"pt2": ("code2wav_step.pt2", "torch.export.load"),
           "aoti": ("code2wav_step.aoti.pt2", "torch._inductor.aoti_load_package"),
           "pte": ("code2wav_step.pte", "executorch.runtime")}


class ExportError(RuntimeError):
    """Export failed in a way the user can act on; the message says how."""


class ManifestError(ValueError):
    """A manifest or program that cannot be used; the message says what to do."""


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CodecIdentity:
    """What must agree between the codes a server sends and the decoder a client runs."""

    num_codebooks: int
    codebook_size: int
    sample_rate: int
    samples_per_frame: int
    codec_sha256: str  # over the checkpoint's decoder tensors (names, dtypes, shapes, bytes)
    model_size: str = ""
    variant: str = ""

    def __post_init__(self) -> None:
        for k in ("num_codebooks", "codebook_size", "sample_rate", "samples_per_frame"):
            if int(getattr(self, k)) < 1:
                raise ManifestError(f"codec {k} must be >= 1, got {getattr(self, k)}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def codec_identity(model_dir: str | Path) -> CodecIdentity:
    """Identity of the codec in a checkpoint folder. Hashes the decoder tensors (not the file:
    the codec file also carries the unused encoder, and tensor order in a file is arbitrary).
    Reads every decoder weight once (~0.5 GB for the released codec: about a second)."""
    from safetensors import safe_open

    from omni_stream.checkpoints.io import _weight_files, read_config

    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    h = hashlib.sha256()
    for f in _weight_files(model_dir / "speech_tokenizer"):
        with safe_open(str(f), framework="pt") as sf:
            for k in sorted(x for x in sf.keys() if x.startswith("decoder.")):
                t = sf.get_tensor(k).contiguous()
                h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(dtype=_uint8()).numpy())
    c = cfg.code2wav
    return CodecIdentity(num_codebooks=c.num_quantizers, codebook_size=c.codebook_size,
                         sample_rate=c.sample_rate, samples_per_frame=c.samples_per_frame,
                         codec_sha256=h.hexdigest(), model_size=cfg.model_size,
                         variant=cfg.variant)


def _uint8():
    import torch

    return torch.uint8


@dataclass(frozen=True)
class Manifest:
    """``manifest.json`` of ``omni-stream export-decoder``.

    The program is one streaming step with explicit state: inputs ``codes [1, Q, n]`` (int64,
    1 <= n <= max_chunk_frames) then the state tensors listed in ``state`` (a fresh stream
    starts from zeros); outputs ``wav [1, n * samples_per_frame]`` then the next state in the
    same order. No frames are re-decoded (``left_context_frames`` 0): the state carries the
    attention window and every conv tail, so chunked decoding equals the one-pass decode.
    """

    format: str
    program: str  # file name, relative to the manifest
    program_sha256: str
    program_bytes: int
    codec: CodecIdentity
    max_chunk_frames: int
    state: list[dict[str, Any]]  # [{name, shape, dtype}] in program input order
    dtype: str = "float32"
    min_chunk_frames: int = 1
    left_context_frames: int = 0
    source_checkpoint: str = ""
    exporter: dict[str, str] = field(default_factory=dict)  # library versions
    verified: dict[str, Any] = field(default_factory=dict)  # exporter's self-check
    version: int = MANIFEST_VERSION
    path: Path | None = None  # where it was read from (not written)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ManifestError(f"unknown program format '{self.format}': expected one of "
                                f"{', '.join(FORMATS)}")
        if not 1 <= self.min_chunk_frames <= self.max_chunk_frames:
            raise ManifestError("chunk frames must satisfy 1 <= min <= max, got "
                                f"{self.min_chunk_frames}..{self.max_chunk_frames}")
        if not self.state or self.state[0].get("name") != "pos":
            raise ManifestError("manifest state must start with 'pos'")

    # ------------------------------------------------------------------ I/O
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        d["codec"] = self.codec.as_dict()
        d["sample_rate"] = self.codec.sample_rate  # duplicated at top level for humans
        return d

    def write(self, out_dir: str | Path) -> Path:
        p = Path(out_dir) / MANIFEST_NAME
        p.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        return p

    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        """Read and check a manifest (a file, or a folder holding ``manifest.json``)."""
        p = Path(path)
        if p.is_dir():
            p = p / MANIFEST_NAME
        if not p.is_file():
            raise ManifestError(f"decoder manifest {p} not found: export one with "
                                "`omni-stream export-decoder --model DIR --format pte --out DIR`")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{p} is not a valid manifest (bad JSON: {e}): re-export it") from e
        if not isinstance(d, dict) or d.get("version") != MANIFEST_VERSION:
            raise ManifestError(f"{p}: manifest version {d.get('version') if isinstance(d, dict) else '?'} "
                                f"is not {MANIFEST_VERSION}: re-export with this omni-stream")
        try:
            codec = CodecIdentity(**d["codec"])
            kw = {k: d[k] for k in ("format", "program", "program_sha256", "program_bytes",
                                    "max_chunk_frames", "state")}
            opt = {k: d[k] for k in ("dtype", "min_chunk_frames", "left_context_frames",
                                     "source_checkpoint", "exporter", "verified") if k in d}
            return cls(codec=codec, **kw, **opt, path=p)
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{p}: manifest field missing or malformed ({e}): re-export it") from e

    @property
    def program_path(self) -> Path:
        base = self.path.parent if self.path is not None else Path(".")
        return base / self.program

    def check_program_file(self) -> Path:
        """The program file, after checking that it exists and matches the recorded hash."""
        p = self.program_path
        if not p.is_file():
            raise ManifestError(f"decoder program {p} (listed in {self.path}) is missing: "
                                "re-export with `omni-stream export-decoder`")
        size = p.stat().st_size
        if size != self.program_bytes or file_sha256(p) != self.program_sha256:
            raise ManifestError(f"decoder program {p} is corrupt or was replaced ({size} bytes, "
                                f"hash differs from the manifest's): re-export with "
                                "`omni-stream export-decoder`")
        return p

    # ------------------------------------------------------------------ compatibility
    def check_against(self, announced: Mapping[str, Any], server_model: str = "") -> None:
        """Refuse to decode a server's codes with this program unless the codec matches what the
        server announces (``session.updated`` ``session.codec``)."""
        check_codec_match(self.codec, announced, f"decoder manifest {self.path}",
                          self.source_checkpoint, server_model)


def check_codec_match(mine: CodecIdentity, announced: Mapping[str, Any], what: str,
                      source: str = "", server_model: str = "") -> None:
    """Raise ManifestError unless ``announced`` (a server's codec announcement) describes the
    codec ``mine`` of the decoder ``what``. The weights hash decides when the server sends one;
    the geometry (codebooks, sizes, rates) is checked always."""
    where = f"the server's model '{server_model}'" if server_model else "the server's model"
    fix = ("export a decoder from the checkpoint the server runs: `omni-stream export-decoder "
           "--model <that checkpoint> --format ... --out DIR`")
    for k in ("num_codebooks", "codebook_size", "sample_rate", "samples_per_frame"):
        if k in announced and int(announced[k]) != int(getattr(mine, k)):
            raise ManifestError(f"{what} is for another model: {k} {getattr(mine, k)} here, "
                                f"{announced[k]} for {where}; {fix}")
    theirs = announced.get("codec_sha256")
    if theirs and theirs != mine.codec_sha256:
        desc = "/".join(x for x in (announced.get("model_size"), announced.get("variant")) if x)
        raise ManifestError(
            f"{what} is for another model: its codec weights (sha256 {mine.codec_sha256[:12]}"
            f"{f', from {source}' if source else ''}) differ from {where}"
            f"{f' ({desc})' if desc else ''} (sha256 {theirs[:12]}); {fix}")
