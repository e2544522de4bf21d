"""``omni-stream export-step``: write sanitized one-step ONNX graphs plus their manifests.

Output folder (one file set per part and cache layout):

    <part>-<layout>.onnx (+ .onnx.data for large graphs)   the sanitized step graph
    <part>-<layout>.json                                   its manifest (``manifest.py``, the
                                                           format every target writes): files,
                                                           tensors, the ``step`` section, the
                                                           self-check against the torch step
    embeddings.npz, loop.json                              (talker / code predictor) host-side
                                                           tables and greedy rules of the loop

``onnx_quantize.quantize_step`` adds ``<part>-<layout>.<scheme>.onnx`` and its manifest.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
from torch import nn

from omni_stream.export.manifest import (PARTS, CodecIdentity, ExportError, FileEntry, Manifest,
                                         StepSpec, TensorSpec)
from omni_stream.export.onnx_ops import op_histogram, sanitize
from omni_stream.export.onnx_step import (LAYOUTS, Code2WavOnnxStep, StepError, code_predictor_step,
                                          talker_step)
from omni_stream.export.runtime_onnx import LoopConfig, OrtRunner, StepCache, Tables, TorchRunner

log = logging.getLogger(__name__)

OPSET = 20
EXTERNAL_DATA_BYTES = 256 << 20  # graphs with more weights than this keep them in a .data file
CHECK_STEPS = 8  # steps of the self-check (exported graph vs the torch step, same feeds)


@dataclass
class ExportResult:
    part: str
    layout: str
    path: Path
    manifest: Manifest
    ops: dict[str, int]
    sanitized: dict[str, int]
    seconds: float


def build_step(weights_talker: nn.Module | None, part: str, layout: str, context: int,
               code2wav: nn.Module | None = None) -> nn.Module:
    """The torch step module of ``part`` (weights shared with the loaded model, fp32)."""
    if part not in PARTS:
        raise StepError(f"unsupported part '{part}': expected one of {', '.join(PARTS)}")
    if layout not in LAYOUTS:
        raise StepError(f"unknown cache layout '{layout}': expected one of {', '.join(LAYOUTS)}")
    if part == "talker":
        return talker_step(weights_talker, layout, context).eval()
    if part == "code_predictor":
        return code_predictor_step(weights_talker, layout, context).eval()
    return Code2WavOnnxStep(code2wav, layout, context).eval()


def describe(step: nn.Module, part: str) -> Manifest:
    """The manifest of a torch step module before it is written: tensors in and out and the
    ``step`` section (what ``StepCache`` needs to run it), no files or provenance yet."""
    def specs(items) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, tuple(shape), str(dt).removeprefix("torch."))
                     for n, shape, dt in items)

    with torch.no_grad():
        outs = step(*step.example_inputs())
    outputs = specs((n, o.shape, o.dtype) for n, o in zip(step.output_names(), outs))
    geometry = StepSpec(layout=step.layout, context=step.context, n_layers=step.n_layers,
                        n_kv=step.n_kv, head_dim=step.head_dim, rope_theta=float(step.rope_theta),
                        multi_head=bool(getattr(step, "multi_head", False)),
                        emit_hidden=bool(getattr(step, "emit_hidden", False)))
    return Manifest(format="onnx", part=part, files=(), inputs=specs(step.step_inputs()),
                    state=specs(step.state_inputs()), outputs=outputs, step=geometry,
                    chunk_frames=(1, 1) if part == "code2wav" else None)


def save_onnx(model, path: Path) -> None:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    big = sum(t.ByteSize() for t in model.graph.initializer) > EXTERNAL_DATA_BYTES
    onnx.save_model(model, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    onnx.checker.check_model(str(path))


def graph_files(path: Path) -> tuple[FileEntry, ...]:
    """The graph and, when its weights are external, their ``.data`` file."""
    data = path.with_name(path.name + ".data")
    return (FileEntry.of(path),) + ((FileEntry.of(data),) if data.is_file() else ())


def export_module(step: nn.Module, part: str, path: Path, source_checkpoint: str = "",
                  codec: CodecIdentity | None = None) -> ExportResult:
    """Export one torch step module with ``torch.onnx`` (dynamo), sanitize, check, save, check
    the saved graph against the module, write its manifest (``path`` with ``.json``)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        prog = torch.onnx.export(step, step.example_inputs(), input_names=step.input_names(),
                                 output_names=step.output_names(), dynamo=True, opset_version=OPSET,
                                 external_data=False, verbose=False)
    model = prog.model_proto
    report = sanitize(model, check=False)
    save_onnx(model, path)
    m = describe(step, part)
    m = replace(m, files=graph_files(path), codec=codec, source_checkpoint=source_checkpoint,
                exporter=versions(), verified=self_check(step, m, path))
    m = Manifest.read(m.write(path.with_suffix(".json")))
    return ExportResult(part, step.layout, path, m, dict(op_histogram(model)), report,
                        time.perf_counter() - t0)


@torch.no_grad()
def self_check(step: nn.Module, m: Manifest, path: Path, steps: int = CHECK_STEPS,
               seed: int = 0) -> dict:
    """Run the saved graph (ONNX Runtime) and the torch step it came from through the same
    runtime loop on the same random feeds for ``steps`` steps and compare every output. Raises
    ExportError below 80 dB (float rounding gives > 110 dB)."""
    from omni_stream.evaluation.metrics import snr_db

    rng = np.random.default_rng(seed)
    caches, runners = (StepCache(m), StepCache(m)), (TorchRunner(step), OrtRunner(path))
    inputs = {t.name: t for t in m.inputs}
    heads = step.head_w.shape[0] if m.step.multi_head else 0
    ref, got = [], []
    for i in range(min(steps, m.step.context)):
        if "codes" in inputs:
            x = rng.integers(0, step.model.cfg.codebook_size, inputs["codes"].shape[1])
        else:
            x = rng.standard_normal(inputs["x"].shape[-1]).astype(np.float32)
        head = i % heads if heads else None
        a, b = (c.step(r, x, head) for c, r in zip(caches, runners))
        ref += [a[k].reshape(-1) for k in sorted(a)]
        got += [b[k].reshape(-1) for k in sorted(a)]
    ref_a, got_a = np.concatenate(ref), np.concatenate(got)
    snr = float(snr_db(ref_a, got_a))
    res = dict(steps=min(steps, m.step.context), snr_db=round(snr, 1),
               max_abs_err=float(np.abs(ref_a - got_a).max()))
    if snr < 80.0:
        raise ExportError(f"{path}: the exported graph does not match the torch step (SNR "
                          f"{snr:.1f} dB < 80 dB): report this with the torch/onnx versions")
    return res


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for lib in ("onnx", "onnxruntime", "onnxscript"):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            pass
    return out


def loop_config(talker: nn.Module) -> LoopConfig:
    cfg = talker.cfg
    return LoopConfig(vocab=cfg.lm.vocab_size, groups=cfg.num_code_groups, eos=cfg.special.codec_eos,
                      suppressed=tuple(cfg.suppressed_ids))


@torch.no_grad()
def tables_of(talker: nn.Module) -> Tables:
    pad = talker.text_embed(torch.tensor([talker.cfg.special.tts_pad]))[0]
    res = torch.stack([t.weight for t in talker.code_predictor.model.codec_embedding])
    return Tables(talker.model.codec_embedding.weight.float().numpy().copy(),
                  res.float().numpy().copy(), pad.float().numpy().copy())


def write_loop_files(talker: nn.Module, out: Path) -> None:
    tables_of(talker).save(out / "embeddings.npz")
    (out / "loop.json").write_text(json.dumps(asdict(loop_config(talker))))


def read_loop_files(out: Path) -> tuple[Tables, LoopConfig]:
    d = json.loads((out / "loop.json").read_text())
    d["suppressed"] = tuple(d["suppressed"])
    return Tables.load(out / "embeddings.npz"), LoopConfig(**d)


def export_step(model_dir: str | Path, part: str, context: int, out_dir: str | Path,
                layouts: tuple[str, ...] = LAYOUTS) -> list[ExportResult]:
    """Load a checkpoint (fp32) and export ``part``'s decode step in each of ``layouts``."""
    from omni_stream.checkpoints.io import load_codec, load_model
    from omni_stream.export.manifest import codec_identity

    if part not in PARTS:
        raise StepError(f"unsupported part '{part}': expected one of {', '.join(PARTS)}")
    for lay in layouts:
        if lay not in LAYOUTS:
            raise StepError(f"unknown cache layout '{lay}': expected one of {', '.join(LAYOUTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = str(Path(model_dir).resolve())
    if part == "code2wav":
        c2w = load_codec(model_dir, dtype=torch.float32)
        codec = codec_identity(model_dir)
        return [export_module(build_step(None, part, lay, context, c2w), part,
                              out / f"{part}-{lay}.onnx", source, codec) for lay in layouts]
    talker = load_model(model_dir, dtype=torch.float32).weights.talker
    results = [export_module(build_step(talker, part, lay, context), part,
                             out / f"{part}-{lay}.onnx", source) for lay in layouts]
    write_loop_files(talker, out)
    return results


def load_decoder(export_dir: str | Path, layout: str, threads: int = 1, suffix: str = ""):
    """A ``StepDecoder`` over the exported talker and code predictor graphs in ``export_dir``
    (``suffix`` picks a quantized variant, e.g. ``.w8a16``), their files checked against their
    manifests first."""
    from omni_stream.export.runtime_onnx import StepDecoder

    d = Path(export_dir)
    parts = {}
    for part in ("talker", "code_predictor"):
        g = d / f"{part}-{layout}{suffix}.json"
        if not g.is_file():
            raise FileNotFoundError(f"{g} not found: run `omni-stream export-step --part {part} "
                                    f"--layout {layout} --out {d}` first")
        m = Manifest.read(g)
        parts[part] = (OrtRunner(m.check_files(), threads), m)
    tables, loop = read_loop_files(d)
    return StepDecoder(*parts["talker"], *parts["code_predictor"], tables, loop)
