"""``omni-stream export-decoder``: the streaming Code2Wav as a program a client device runs.

One program per model: a streaming step with explicit state in and out (see ``code2wav_step``),
traced with ``torch.export`` with the frame count dynamic in ``[1, max_chunk]``; every chunk size
of the server's ramp (1, 2, 4, ... up to its catch-up cap of 32 frames) is one call. Formats:

* ``pt2``  the ExportedProgram (``torch.export.save``), run by ``torch.export.load(...).module()``;
* ``aoti`` AOTInductor-compiled shared library in a package, for this machine's CPU
  (``torch._inductor.aoti_load_package``); inputs must be contiguous;
* ``pte``  ExecuTorch program with the XNNPACK delegate (lowered in ``executorch.py``, run by
  ``executorch.runtime``).

The exporter decodes a short random stream with the exported program, chunk by chunk, and
compares it with the eager one-pass decode before it writes the manifest; the error is recorded
under ``verified``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from omni_stream.export.code2wav_step import (Code2WavStep, initial_state, native_conv_kernels,
                                              state_specs)
from omni_stream.export.executorch import lower_to_pte, require_executorch
from omni_stream.export.manifest import (ExportError, FileEntry, Manifest, TensorSpec,
                                         codec_identity)
from omni_stream.export.runtime_torch import load_program
from omni_stream.evaluation.metrics import snr_db

log = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK = 32  # the codec stage never sends more frames in one chunk (CodecStage.max_chunk)
VERIFY_CHUNKS = (1, 2, 4, 3, 8)  # the self-check's chunking: the ramp plus an odd size
PROGRAM_FILES = {"pt2": "code2wav_step.pt2", "aoti": "code2wav_step.aoti.pt2",
                 "pte": "code2wav_step.pte"}


def export_program(model_dir: str | Path, fmt: str, out: str | Path,
                   max_chunk: int = DEFAULT_MAX_CHUNK, progress: bool = True,
                   overwrite: bool = False) -> Manifest:
    """Export the streaming decoder of the checkpoint ``model_dir`` into folder ``out``
    (program + ``manifest.json``) and return the manifest."""
    if fmt not in PROGRAM_FILES:
        raise ExportError(f"unknown format '{fmt}': use one of {', '.join(PROGRAM_FILES)}")
    if not 1 <= max_chunk <= 256:
        raise ExportError(f"--max-chunk must be in [1, 256], got {max_chunk}")
    out = Path(out)
    fname = PROGRAM_FILES[fmt]
    if (out / fname).exists() and not overwrite:
        raise ExportError(f"{out / fname} exists: pass --overwrite or choose another --out")
    if fmt == "pte":
        require_executorch()
    out.mkdir(parents=True, exist_ok=True)
    from omni_stream.checkpoints.io import load_codec

    stages = ["load codec", "trace (torch.export)", _lower_label(fmt), "verify", "manifest"]
    with _Progress(stages, enabled=progress) as bar:
        with bar.stage():
            model = load_codec(model_dir, dtype=torch.float32).eval()
            identity = codec_identity(model_dir)
            if fmt == "pte":
                native_conv_kernels(model)
            step = Code2WavStep(model).eval()
        with bar.stage():
            ep = trace(step, max_chunk)
        with bar.stage():
            path = out / fname
            if fmt == "pt2":
                torch.export.save(ep, str(path))
            elif fmt == "aoti":
                torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
            else:
                path.write_bytes(lower_to_pte(ep))
        with bar.stage():
            verified = verify(model, load_program(fmt, path), max_chunk)
        with bar.stage():
            manifest = describe(model, fmt, max_chunk)
            manifest = replace(manifest, files=(FileEntry.of(path),), codec=identity,
                               source_checkpoint=str(Path(model_dir).resolve()),
                               exporter=_versions(fmt), verified=verified)
            manifest = Manifest.read(manifest.write(out))
    return manifest


def describe(model, fmt: str, max_chunk: int) -> Manifest:
    """The manifest of the streaming step without its files and provenance: ``codes`` then the
    state in, ``wav`` then the next state out, shapes at ``max_chunk`` frames."""
    cfg = model.cfg
    state = tuple(state_specs(model))
    return Manifest(
        format=fmt, part="code2wav", files=(), chunk_frames=(1, max_chunk),
        inputs=(TensorSpec("codes", (1, cfg.num_quantizers, max_chunk), "int64"),),
        state=state,
        outputs=(TensorSpec("wav", (1, max_chunk * cfg.samples_per_frame)),)
        + tuple(TensorSpec(f"{t.name}.next", t.shape, t.dtype) for t in state))


def trace(step: Code2WavStep, max_chunk: int) -> "torch.export.ExportedProgram":
    """``torch.export`` of the step, frames dynamic in [1, max_chunk]. The example input has
    ``max_chunk`` frames: tracing at a smaller size lets export narrow the dynamic bound."""
    from torch.export import Dim

    state = initial_state(step.model)
    codes = torch.zeros(1, step.model.cfg.num_quantizers, max_chunk, dtype=torch.long)
    frames = Dim("frames", min=1, max=max_chunk)
    with torch.no_grad():
        return torch.export.export(step, (codes, *state), strict=False,
                                   dynamic_shapes=({2: frames}, tuple(None for _ in state)))


@torch.no_grad()
def verify(model, program: Callable, max_chunk: int, seed: int = 0) -> dict:
    """Decode random frames with ``program`` in ramp-sized chunks, the last one ``max_chunk``
    frames (the bound of the dynamic dim), and compare with the eager one-pass decode. Raises
    ExportError if they differ beyond float rounding (SNR < 80 dB or a sample count mismatch)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    plan = [min(c, max_chunk) for c in VERIFY_CHUNKS] + [max_chunk]
    frames = sum(plan)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, frames), generator=g)
    ref = model(codes)[0]
    state, out, at = initial_state(model), [], 0
    for n in plan:
        wav, state = program(codes[:, :, at:at + n].contiguous(), state)
        out.append(wav.reshape(-1))
        at += n
    got = torch.cat(out)
    if got.shape != ref.shape:
        raise ExportError(f"exported decoder gave {got.numel()} samples for {frames} frames, "
                          f"expected {ref.numel()}")
    snr = snr_db(ref, got)
    res = dict(frames=frames, chunks=plan, max_abs_err=float((got - ref).abs().max()),
               snr_db=round(snr, 1))
    if snr < 80.0:
        raise ExportError(f"exported decoder does not match the eager decoder (SNR {snr:.1f} dB "
                          "< 80 dB): report this with the torch/executorch versions")
    return res


def _lower_label(fmt: str) -> str:
    return {"pt2": "save ExportedProgram", "aoti": "compile (AOTInductor)",
            "pte": "lower (ExecuTorch + XNNPACK)"}[fmt]


def _versions(fmt: str) -> dict[str, str]:
    v = {"torch": torch.__version__}
    if fmt == "pte":
        from importlib.metadata import version

        v["executorch"] = version("executorch")
    return v


class _Progress:
    """One bar over the export stages, each shown with its elapsed time (lowering is opaque:
    a minute or more on a small CPU, so the spinner is what tells the user it is alive)."""

    def __init__(self, stages: list[str], enabled: bool) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)

        self.stages = stages
        self.i = 0
        self.t0 = time.perf_counter()
        self.bar = Progress(SpinnerColumn(), TextColumn("[bold]export-decoder[/] {task.description}"),
                            BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            disable=not enabled)
        self.task = self.bar.add_task(stages[0], total=len(stages))

    def __enter__(self) -> "_Progress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    @contextlib.contextmanager
    def stage(self) -> Iterator[None]:
        name = self.stages[self.i]
        self.bar.update(self.task, description=name)
        t = time.perf_counter()
        yield
        log.debug("export-decoder: %s took %.1f s", name, time.perf_counter() - t)
        self.i += 1
        self.bar.update(self.task, advance=1,
                        description=self.stages[self.i] if self.i < len(self.stages) else "done")
