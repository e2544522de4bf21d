"""One manifest format for every export target, and the codec identity a server announces.

Every exported program, whatever runs it, is one decode step with explicit state: per-call
inputs, then the state tensors a fresh stream starts with as zeros; outputs, of which the state
the next call takes. ``Manifest`` says that much for any target (``format`` pt2, aoti, pte or
onnx; ``part`` code2wav, talker or code_predictor): its files with their SHA-256 and size, the
tensors in and out, the frames one call takes (Code2Wav programs) or the decode-step geometry
(``step``: cache layout, context, layers; ONNX steps), the source checkpoint, the library
versions, the exporter's self-check and, for Code2Wav, the codec's identity.

An exported Code2Wav is only correct for the codec weights it was exported from: decoding
another model's codes with it gives plausible-sounding garbage, not an error. So the manifest
records the codec's identity (a SHA-256 over the decoder tensors of the checkpoint, plus its
geometry), the server announces the same identity for the model it serves, and a client refuses
to decode when they differ. The file hashes catch a truncated or swapped file before a runtime
tries to load it.

This module needs no torch at import time: a client that only runs a ``.pte`` reads it too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "FORMATS", "PARTS", "CodecIdentity",
           "ExportError", "FileEntry", "Manifest", "ManifestError", "StepSpec", "TensorSpec",
           "check_codec_match", "codec_identity", "file_sha256"]

MANIFEST_NAME = "manifest.json"  # a folder's manifest (export-decoder writes one per folder)
MANIFEST_VERSION = 2
# format -> what runs it
FORMATS = {"pt2": "torch.export.load", "aoti": "torch._inductor.aoti_load_package",
           "pte": "executorch.runtime", "onnx": "onnxruntime (omni_stream.export.runtime_onnx)"}
PARTS = ("talker", "code_predictor", "code2wav")
_ITEMSIZE = {"float32": 4, "int64": 8, "bfloat16": 2, "float16": 2, "int32": 4, "uint8": 1}


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
class FileEntry:
    """One file of an exported program, relative to its manifest."""

    name: str
    sha256: str
    bytes: int

    @classmethod
    def of(cls, path: str | Path) -> "FileEntry":
        p = Path(path)
        return cls(p.name, file_sha256(p), p.stat().st_size)


@dataclass(frozen=True)
class TensorSpec:
    """A program input or output: name, shape (at the largest call) and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # numpy / torch dtype name without a prefix

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE.get(self.dtype, 4)
        for d in self.shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class StepSpec:
    """The decode-step section of an ONNX step's manifest: what the runtime loop needs to build
    each step's masks and rotary rows and to keep the caches (``runtime_onnx.StepCache``)."""

    layout: str  # roll (window in, window out) or ring (new entry out)
    context: int  # keys attended per step: context-1 cached entries plus the new one
    n_layers: int
    n_kv: int
    head_dim: int
    rope_theta: float
    multi_head: bool = False  # a ``head`` input picks the lm head (code predictor)
    emit_hidden: bool = False  # a ``hidden`` output (talker: it feeds the code predictor)

    @property
    def cache_len(self) -> int:
        return self.context - 1


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
    import torch
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
                h.update(t.reshape(-1).view(dtype=torch.uint8).numpy())
    c = cfg.code2wav
    return CodecIdentity(num_codebooks=c.num_quantizers, codebook_size=c.codebook_size,
                         sample_rate=c.sample_rate, samples_per_frame=c.samples_per_frame,
                         codec_sha256=h.hexdigest(), model_size=cfg.model_size,
                         variant=cfg.variant)


@dataclass(frozen=True)
class Manifest:
    """The manifest of one exported program (``<folder>/manifest.json`` for export-decoder,
    ``<part>-<layout>[.<scheme>].json`` beside each ONNX step).

    The program takes ``inputs`` then ``state`` (a fresh stream starts from zeros) and returns
    ``outputs``, which end with the next state in the same order. A Code2Wav program takes
    ``chunk_frames`` = [min, max] frames per call (the last dim of ``codes``; shapes are listed
    at the max) and re-decodes nothing: its state carries the attention window and every conv
    tail, so chunked decoding equals the one-pass decode. An ONNX step takes one token (one
    frame for Code2Wav) and its ``step`` section says how the runtime keeps its caches.
    """

    format: str
    part: str
    files: tuple[FileEntry, ...]  # the program first, then what loads with it (.onnx.data)
    inputs: tuple[TensorSpec, ...]  # per call, in program order
    state: tuple[TensorSpec, ...]  # carried from call to call, after the inputs
    outputs: tuple[TensorSpec, ...]
    dtype: str = "float32"
    chunk_frames: tuple[int, int] | None = None  # Code2Wav programs: [min, max] frames per call
    step: StepSpec | None = None  # ONNX decode steps
    codec: CodecIdentity | None = None  # Code2Wav: the codec the program decodes
    quantization: str = ""  # "" (float weights) or the QDQ scheme (w8a16, w4a16)
    source_checkpoint: str = ""
    exporter: dict[str, str] = field(default_factory=dict)  # library versions
    verified: dict[str, Any] = field(default_factory=dict)  # the exporter's self-check
    version: int = MANIFEST_VERSION
    path: Path | None = None  # where it was read from (not written)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ManifestError(f"unknown program format '{self.format}': expected one of "
                                f"{', '.join(FORMATS)}")
        if self.part not in PARTS:
            raise ManifestError(f"unknown part '{self.part}': expected one of {', '.join(PARTS)}")
        if self.chunk_frames is not None and not 1 <= self.chunk_frames[0] <= self.chunk_frames[1]:
            raise ManifestError(f"chunk frames must satisfy 1 <= min <= max, got {self.chunk_frames}")
        if self.format == "onnx" and self.step is None:
            raise ManifestError("an ONNX step's manifest needs its 'step' section")

    def check_complete(self) -> None:
        """What a written manifest must hold beyond a step's description (``describe``): its
        files and, for Code2Wav, the codec identity clients check."""
        if not self.files:
            raise ManifestError("a manifest lists at least the program file")
        if self.part == "code2wav" and self.codec is None:
            raise ManifestError("a Code2Wav program's manifest needs the codec identity")

    # ------------------------------------------------------------------ what clients read
    @property
    def program(self) -> str:
        return self.files[0].name

    @property
    def program_path(self) -> Path:
        return self._base() / self.program

    @property
    def max_chunk_frames(self) -> int:
        return self.chunk_frames[1] if self.chunk_frames else 1

    def boundary_bytes(self) -> dict[str, int]:
        """Bytes crossing the program boundary per call (weights excluded), at the largest call."""
        i = sum(t.nbytes for t in self.inputs + self.state)
        o = sum(t.nbytes for t in self.outputs)
        return {"in": i, "out": o, "total": i + o}

    def check_files(self) -> Path:
        """The program file, after checking that every listed file exists with its recorded
        size and hash (a truncated, swapped or missing file fails here, not in a runtime)."""
        fix = ("re-export with `omni-stream export-decoder`" if self.format != "onnx"
               else "re-export with `omni-stream export-step`")
        for f in self.files:
            p = self._base() / f.name
            if not p.is_file():
                raise ManifestError(f"program file {p} (listed in {self.path}) is missing: {fix}")
            size = p.stat().st_size
            if size != f.bytes or file_sha256(p) != f.sha256:
                raise ManifestError(f"program file {p} is corrupt or was replaced ({size} bytes, "
                                    f"hash differs from the manifest's): {fix}")
        return self.program_path

    def check_against(self, announced: Mapping[str, Any], server_model: str = "") -> None:
        """Refuse to decode a server's codes with this program unless the codec matches what the
        server announces (``session.updated`` ``session.codec``)."""
        if self.codec is None:
            raise ManifestError(f"{self.path} describes a {self.part} step, not a codec decoder")
        check_codec_match(self.codec, announced, f"decoder manifest {self.path}",
                          self.source_checkpoint, server_model)

    def _base(self) -> Path:
        return self.path.parent if self.path is not None else Path(".")

    # ------------------------------------------------------------------ I/O
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        return d

    def write(self, path: str | Path) -> Path:
        """Write to ``path`` (a folder: its ``manifest.json``); returns the file written."""
        self.check_complete()
        p = Path(path)
        if p.is_dir():
            p = p / MANIFEST_NAME
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return p

    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        """Read and check a manifest (a file, or a folder holding ``manifest.json``)."""
        p = Path(path)
        if p.is_dir():
            p = p / MANIFEST_NAME
        if not p.is_file():
            raise ManifestError(f"manifest {p} not found: export one with `omni-stream "
                                "export-decoder --model DIR --format pte --out DIR` (Code2Wav) or "
                                "`omni-stream export-step` (NPU steps)")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{p} is not a valid manifest (bad JSON: {e}): re-export it") from e
        if not isinstance(d, dict) or d.get("version") != MANIFEST_VERSION:
            got = d.get("version") if isinstance(d, dict) else "?"
            raise ManifestError(f"{p}: manifest version {got} is not {MANIFEST_VERSION}: "
                                "re-export with this omni-stream")
        try:
            return cls._from_dict(d, p)
        except ManifestError as e:
            raise ManifestError(f"{p}: {e}: re-export it") from e
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{p}: manifest field missing or malformed ({e}): re-export it") from e

    @classmethod
    def _from_dict(cls, d: dict[str, Any], p: Path) -> "Manifest":
        def tensors(key: str) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(t["name"], tuple(int(x) for x in t["shape"]), t["dtype"])
                         for t in d[key])

        opt = {k: d[k] for k in ("dtype", "quantization", "source_checkpoint", "exporter",
                                 "verified") if k in d}
        m = cls(format=d["format"], part=d["part"],
                   files=tuple(FileEntry(**f) for f in d["files"]),
                   inputs=tensors("inputs"), state=tensors("state"), outputs=tensors("outputs"),
                   chunk_frames=tuple(d["chunk_frames"]) if d.get("chunk_frames") else None,
                   step=StepSpec(**d["step"]) if d.get("step") else None,
                   codec=CodecIdentity(**d["codec"]) if d.get("codec") else None,
                   **opt, path=p)
        m.check_complete()
        return m


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
