"""``omni-stream export-step``: write sanitized one-step ONNX graphs plus their manifests.

Output folder (one file set per part and cache layout):

    <part>-<layout>.onnx (+ .onnx.data for large graphs)   the sanitized step graph
    <part>-<layout>.json                                   StepSpec: shapes, layout, context,
                                                           bytes across the boundary per step
    embeddings.npz, loop.json                              (talker / code predictor) host-side
                                                           tables and greedy rules of the loop
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from omni_stream.export.onnx_ops import op_histogram, sanitize
from omni_stream.export.runtime_onnx import LoopConfig, StepSpec, Tables
from omni_stream.export.onnx_step import (LAYOUTS, Code2WavOnnxStep, StepError, code_predictor_step,
                                          talker_step)

log = logging.getLogger(__name__)

PARTS = ("talker", "code_predictor", "code2wav")
OPSET = 20
EXTERNAL_DATA_BYTES = 256 << 20  # graphs with more weights than this keep them in a .data file


@dataclass
class ExportResult:
    part: str
    layout: str
    path: Path
    spec: StepSpec
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


def spec_of(step: nn.Module, part: str) -> StepSpec:
    args = step.example_inputs()
    outs = step(*args)
    ins = {n: list(a.shape) for n, a in zip(step.input_names(), args)}
    dts = {n: str(a.numpy().dtype) for n, a in zip(step.input_names(), args)}
    return StepSpec(part=part, layout=step.layout, context=step.context, n_layers=step.n_layers,
                    n_kv=step.n_kv, head_dim=step.head_dim, rope_theta=float(step.rope_theta),
                    inputs=ins, outputs={n: list(o.shape) for n, o in zip(step.output_names(), outs)},
                    multi_head=bool(getattr(step, "multi_head", False)),
                    emit_hidden=bool(getattr(step, "emit_hidden", False)), input_dtypes=dts)


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


def export_module(step: nn.Module, part: str, path: Path) -> ExportResult:
    """Export one torch step module with ``torch.onnx`` (dynamo), sanitize, check, save."""
    t0 = time.perf_counter()
    with torch.no_grad():
        prog = torch.onnx.export(step, step.example_inputs(), input_names=step.input_names(),
                                 output_names=step.output_names(), dynamo=True, opset_version=OPSET,
                                 external_data=False, verbose=False)
    model = prog.model_proto
    report = sanitize(model, check=False)
    save_onnx(model, path)
    spec = spec_of(step, part)
    path.with_suffix(".json").write_text(json.dumps(asdict(spec), indent=1))
    return ExportResult(part, step.layout, path, spec, dict(op_histogram(model)), report,
                        time.perf_counter() - t0)


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

    if part not in PARTS:
        raise StepError(f"unsupported part '{part}': expected one of {', '.join(PARTS)}")
    for lay in layouts:
        if lay not in LAYOUTS:
            raise StepError(f"unknown cache layout '{lay}': expected one of {', '.join(LAYOUTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    if part == "code2wav":
        c2w = load_codec(model_dir, dtype=torch.float32)
        for lay in layouts:
            results.append(export_module(build_step(None, part, lay, context, c2w), part,
                                         out / f"{part}-{lay}.onnx"))
        return results
    model = load_model(model_dir, dtype=torch.float32)
    talker = model.weights.talker
    for lay in layouts:
        step = build_step(talker, part, lay, context)
        results.append(export_module(step, part, out / f"{part}-{lay}.onnx"))
    write_loop_files(talker, out)
    return results


def load_decoder(export_dir: str | Path, layout: str, threads: int = 1, suffix: str = ""):
    """A ``StepDecoder`` over the exported talker and code predictor graphs in ``export_dir``
    (``suffix`` picks a quantized variant, e.g. ``.w8a16``)."""
    from omni_stream.export.runtime_onnx import OrtRunner, StepDecoder

    d = Path(export_dir)
    parts = {}
    for part in ("talker", "code_predictor"):
        g = d / f"{part}-{layout}{suffix}.onnx"
        if not g.is_file():
            raise FileNotFoundError(f"{g} not found: run `omni-stream export-step --part {part} "
                                    f"--layout {layout} --out {d}` first")
        parts[part] = (OrtRunner(g, threads), StepSpec.from_json(d / f"{part}-{layout}.json"))
    tables, loop = read_loop_files(d)
    return StepDecoder(*parts["talker"], *parts["code_predictor"], tables, loop)
