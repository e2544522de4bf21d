"""Client-side Code2Wav: turn the codec frames a server streams into audio on this device.

Two backends behind one small interface (``check_server``, ``decode``):

* ``TorchDecoder``: the streaming decoder in eager torch (``Code2WavStream``, one slot), from a
  checkpoint folder; needs the omni-stream package.
* ``ProgramDecoder``: a program from ``omni-stream export-decoder`` (``.pte`` via the ExecuTorch
  runtime; ``pt2`` / ``aoti`` via torch), from its manifest. The state tensors the program takes
  and returns are held here, one stream at a time.

Both validate the frames before decoding (an out-of-range code would index past a codebook
table inside a compiled program) and check the server's announced codec against their own, so
a decoder for another model fails with a clear error instead of producing noise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from omni_stream.export.manifest import (CodecIdentity, Manifest, ManifestError,
                                          check_codec_match)

log = logging.getLogger(__name__)

__all__ = ["DecoderError", "FrameDecoder", "TorchDecoder", "ProgramDecoder", "make_decoder"]


class DecoderError(RuntimeError):
    """A local decoder that cannot be set up or cannot decode what arrived; says what to do."""


class FrameDecoder:
    """Decode one stream's codec frames, in order, into float32 samples in [-1, 1]."""

    name = "?"
    identity: CodecIdentity
    source = ""  # where the decoder came from, for error messages

    @property
    def sample_rate(self) -> int:
        return self.identity.sample_rate

    @property
    def samples_per_frame(self) -> int:
        return self.identity.samples_per_frame

    def check_server(self, announced: Mapping[str, Any], server_model: str = "") -> None:
        """Raise DecoderError unless the server's codec (``session.codec``) is this decoder's."""
        try:
            check_codec_match(self.identity, announced, f"the {self.name} decoder", self.source,
                              server_model)
        except ManifestError as e:
            raise DecoderError(str(e)) from None

    def dtype_fix(self, server_dtype: str) -> str:
        """How to get the server's samples when it decodes in ``server_dtype`` and this decoder
        in another dtype ("" when there is nothing to add to the client's note)."""
        return ""

    def reset(self) -> None:
        """Start a new stream (the next frames are frame 0 of an utterance)."""
        raise NotImplementedError

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """``codes [n, Q]`` int -> ``[n * samples_per_frame]`` float32: the next samples."""
        raise NotImplementedError

    def _checked(self, codes: np.ndarray) -> torch.Tensor:
        q, size = self.identity.num_codebooks, self.identity.codebook_size
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != q or codes.shape[0] < 1:
            raise DecoderError(f"codec frames must be [frames, {q}], got {list(codes.shape)}: "
                               "the server sent frames for another codec")
        if codes.dtype.kind not in "iu":
            raise DecoderError(f"codec frames must be integers, got {codes.dtype}")
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= size:
            raise DecoderError(f"codec frame values must lie in [0, {size}), got [{lo}, {hi}]: "
                               "the server sent codes for another codec")
        return torch.from_numpy(np.array(codes.T, dtype=np.int64, order="C"))[None]  # [1, Q, n]


class TorchDecoder(FrameDecoder):
    """Eager streaming Code2Wav from a checkpoint folder (``speech_tokenizer/``)."""

    name = "torch"
    DTYPES = ("auto", "float32", "bfloat16")

    def __init__(self, model_dir: str | Path, threads: int | None = None, dtype: str = "auto") -> None:
        """``dtype``: ``auto`` decodes in the dtype the server announces (bf16 with the codec
        stage's kernels: the server's samples where the CPU is of the same kind), else
        ``float32`` (the exact decode) or ``bfloat16``."""
        from omni_stream.export.manifest import codec_identity
        from omni_stream.checkpoints.io import CheckpointError, load_codec
        from omni_stream.models.code2wav import Code2WavStream
        from omni_stream.stages.codec_kernels import stage_kernels

        if dtype not in self.DTYPES:
            raise DecoderError(f"unknown decoder dtype {dtype!r}: use auto, float32 or bfloat16")
        if threads:
            torch.set_num_threads(threads)
        try:
            # the codec stage's kernels in fp32 too (packed GEMMs whose rounding does not
            # follow the chunking): the exact decode is then the fp32 server's, bit for bit
            self.model = stage_kernels(load_codec(model_dir, dtype=torch.float32).eval())
            self.identity = codec_identity(model_dir)
        except CheckpointError as e:
            raise DecoderError(f"--decoder-backend torch: {e}: pass --codec-model with the "
                               "checkpoint folder the server runs") from e
        self.source, self.choice, self.dtype = str(model_dir), dtype, "float32"
        self._stream_cls = Code2WavStream
        if dtype == "bfloat16":
            self._use(dtype)
        self.reset()

    def check_server(self, announced: Mapping[str, Any], server_model: str = "") -> None:
        super().check_server(announced, server_model)
        want = announced.get("decode_dtype")  # absent from the per-utterance checks
        if self.choice == "auto" and want in self.DTYPES and want != self.dtype:
            self._use(want)
            self.reset()

    def dtype_fix(self, server_dtype: str) -> str:
        return "--decoder-dtype auto decodes as the server does" if self.choice != "auto" else ""

    def _use(self, dtype: str) -> None:
        from omni_stream.checkpoints.io import load_codec
        from omni_stream.models.onednn import pin_decode_isa
        from omni_stream.stages.codec_kernels import stage_kernels

        if dtype == "bfloat16":
            pin_decode_isa()  # the codec stage's oneDNN level (before this process's first call)
        self.model = stage_kernels(load_codec(self.source, dtype=getattr(torch, dtype)).eval())
        self.dtype = dtype

    def reset(self) -> None:
        with torch.inference_mode():
            self.stream = self._stream_cls(self.model, 1)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        x = self._checked(codes)
        with torch.inference_mode():
            return self.stream.decode([0], x)[0].float().numpy()


class ProgramDecoder(FrameDecoder):
    """An exported streaming step (``pte`` / ``pt2`` / ``aoti``) from its manifest."""

    def __init__(self, manifest: str | Path, require_format: str | None = None,
                 threads: int | None = None) -> None:
        from omni_stream.export.runtime_torch import load_program

        try:
            self.manifest = m = Manifest.read(manifest)
            if m.part != "code2wav" or m.chunk_frames is None:
                raise ManifestError(f"{m.path} describes a {m.format} {m.part} step, not a "
                                    "streaming Code2Wav program: export one with "
                                    "`omni-stream export-decoder`")
            if require_format and m.format != require_format:
                raise ManifestError(f"{m.path} describes a '{m.format}' program; this backend "
                                    f"runs '{require_format}': export one with "
                                    f"`omni-stream export-decoder --format {require_format}`")
            self._fn = load_program(m.format, m.check_files(), threads=threads)
        except ManifestError as e:
            raise DecoderError(str(e)) from e
        self.name = {"pte": "executorch"}.get(m.format, m.format)
        self.dtype = m.dtype  # what the program computes in (export-decoder writes fp32)
        self.identity = m.codec
        self.source = str(m.path)
        self.max_chunk = m.max_chunk_frames
        self._dtypes = {"float32": torch.float32, "int64": torch.int64, "bfloat16": torch.bfloat16}
        self.reset()

    def check_server(self, announced: Mapping[str, Any], server_model: str = "") -> None:
        try:
            self.manifest.check_against(announced, server_model)
        except ManifestError as e:
            raise DecoderError(str(e)) from None

    def dtype_fix(self, server_dtype: str) -> str:
        """An exported program decodes in fp32, and no fp32 program reproduces a bf16 decode: the
        bf16 decode turns any difference in one rounding into ~30 dB over the next frames (even
        a program that rounds to bf16 where the server rounds lands 31-32 dB away at the released
        widths; benchmarks/tts/results/decoder_export_bench.md). Only the codec stage's own
        kernels give its samples."""
        if server_dtype != "bfloat16":
            return ""
        return ("no exported program reproduces a bf16 decode (it turns any rounding difference "
                "into ~30 dB): for the server's samples use --decoder-backend torch --codec-model "
                "<the server's checkpoint> on the same kind of CPU, or a server run with "
                "--codec-dtype fp32")

    def reset(self) -> None:
        self.state = [torch.zeros(s.shape, dtype=self._dtypes[s.dtype]) for s in self.manifest.state]

    def decode(self, codes: np.ndarray) -> np.ndarray:
        x = self._checked(codes)
        out = []
        for at in range(0, x.shape[2], self.max_chunk):  # the program takes <= max_chunk frames
            try:
                wav, self.state = self._fn(x[:, :, at:at + self.max_chunk], self.state)
            except (RuntimeError, ValueError) as e:
                raise DecoderError(f"{self.name} decoder failed on frames {at}..: {e}") from e
            out.append(wav.reshape(-1).float().numpy())
        return np.concatenate(out)


def make_decoder(backend: str, manifest: str | None = None, codec_model: str | None = None,
                 threads: int | None = 1, dtype: str = "auto") -> FrameDecoder:
    """The client's ``--decoder-backend`` (torch | executorch) as a decoder, or a DecoderError
    naming the missing option. ``threads`` defaults to 1: one stream decodes in real time on
    one core, and a second OpenMP thread on a busy machine stalls at every barrier (measured:
    torch at 2 threads next to a busy core ran 10x slower than at 1). ``dtype``: the torch
    backend's (``TorchDecoder``)."""
    if backend == "executorch":
        if not manifest:
            raise DecoderError("--decoder-backend executorch needs --pte-manifest PATH (from "
                               "`omni-stream export-decoder --format pte --out DIR`)")
        return ProgramDecoder(manifest, require_format="pte", threads=threads)
    if backend == "torch":
        if not codec_model:
            raise DecoderError("--decoder-backend torch needs --codec-model DIR: the checkpoint "
                               "folder the server runs (its speech_tokenizer/ is loaded)")
        return TorchDecoder(codec_model, threads=threads, dtype=dtype)
    raise DecoderError(f"unknown decoder backend '{backend}': use server, torch or executorch")
