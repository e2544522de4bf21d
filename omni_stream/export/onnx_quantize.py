"""w8a16 / w4a16 QDQ variants of an exported step, calibrated on real decode activations.

Scheme (what NPU toolchains take as a pre-quantized graph): weights int8 or int4, symmetric,
per output channel; activations uint16, asymmetric, per tensor, ranges from MinMax calibration.
The graph stays the fp32 one with QuantizeLinear/DequantizeLinear pairs around every quantized
tensor (QDQ format, opset 21, where 16-bit and 4-bit Q/DQ are standard ONNX), so a converter
(QNN, TFLite) reads the scales and compiles integer kernels.

Calibration data are the step's own feeds recorded while the fp32 graphs decode real prompts
(``RecordingRunner`` around the ORT runners of ``StepDecoder``): caches, masks and positions are
those of an actual utterance, not random tensors.

On ONNX Runtime CPU these graphs run with whatever its optimizer makes of the Q/DQ pairs
(weight DequantizeLinear + MatMul may become integer kernels; 16-bit activation pairs stay extra
elementwise work), so their CPU latency is a CPU figure, not an NPU one; they are here for
fidelity (what the integer graph computes) and for the converters, which read the scales.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import numpy as np

from omni_stream.export.onnx_ops import NPU_OPS, check_ops

log = logging.getLogger(__name__)

SCHEMES = ("w8a16", "w4a16")


@contextmanager
def _quiet_root():
    """onnxruntime.quantization logs advice on the root logger at WARNING; keep it at DEBUG."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


class _Feeds:
    """CalibrationDataReader over recorded feeds (keeps only the graph's inputs)."""

    def __init__(self, feeds: Iterable[dict[str, np.ndarray]], names: set[str]) -> None:
        self._it = iter([{k: v for k, v in f.items() if k in names} for f in feeds])

    def get_next(self):
        return next(self._it, None)

    def rewind(self) -> None:  # pragma: no cover - the quantizer calibrates in one pass
        raise NotImplementedError


def quantize_step(fp32_path: str | Path, out_path: str | Path, feeds: list[dict[str, np.ndarray]],
                  scheme: str) -> Path:
    """Write the QDQ ``scheme`` variant of ``fp32_path`` calibrated on ``feeds`` (and, when the
    fp32 graph has one, its manifest ``<out>.json``); returns its path."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme '{scheme}': expected one of {', '.join(SCHEMES)}")
    if not feeds:
        raise ValueError("quantization needs calibration feeds recorded from a decode run (got none)")
    weight_type = QuantType.QInt8 if scheme == "w8a16" else QuantType.QInt4
    names = {i.name for i in ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"]).get_inputs()}

    class Reader(_Feeds, CalibrationDataReader):
        pass

    out_path = Path(out_path)
    data = out_path.with_name(out_path.name + ".data")
    if data.exists():
        data.unlink()
    big = Path(str(fp32_path) + ".data").exists()
    with _quiet_root():
        quantize_static(str(fp32_path), str(out_path), Reader(feeds, names), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt16, weight_type=weight_type, per_channel=True,
                        calibrate_method=CalibrationMethod.MinMax, use_external_data_format=big,
                        extra_options={"WeightSymmetric": True, "ActivationSymmetric": False})
    model = onnx.load(str(out_path), load_external_data=False)
    check_ops(model, NPU_OPS)
    src = Path(fp32_path).with_suffix(".json")
    if src.is_file():  # the variant's manifest: the fp32 one with its own files and scheme
        from omni_stream.export.manifest import Manifest
        from omni_stream.export.onnx_export import graph_files

        m = Manifest.read(src)
        m = replace(m, files=graph_files(out_path), quantization=scheme,
                    verified={"calibration_feeds": len(feeds)})
        m.write(out_path.with_suffix(".json"))
    return out_path


CALIBRATION_TEXTS = (
    "The weather today is calm, with light winds from the west.",
    "Please call me back when you have a minute; it is about the train times.",
)


def calibration_feeds(model, layout: str, talker_context: int, cp_context: int, frames: int = 24,
                      texts: tuple[str, ...] = CALIBRATION_TEXTS, cp_every: int = 5
                      ) -> dict[str, list[dict[str, np.ndarray]]]:
    """Decode ``texts`` greedily with the torch forms of both steps (the exported graphs' own
    math) and record each step's feeds: every talker step, every ``cp_every``-th code-predictor
    step. ``model`` is a loaded checkpoint (fp32)."""
    from omni_stream.export.onnx_export import describe, loop_config, tables_of
    from omni_stream.export.onnx_step import code_predictor_step, talker_step
    from omni_stream.export.runtime_onnx import RecordingRunner, StepDecoder, TorchRunner
    from omni_stream.models.prompt import PromptBuilder, PromptRequest

    talker = model.weights.talker
    ts = talker_step(talker, layout, talker_context).eval()
    cs = code_predictor_step(talker, layout, cp_context).eval()
    sinks: dict[str, list] = {"talker": [], "code_predictor": []}
    dec = StepDecoder(RecordingRunner(TorchRunner(ts), sinks["talker"]), describe(ts, "talker"),
                      RecordingRunner(TorchRunner(cs), sinks["code_predictor"], keep=lambda i: i % cp_every == 0),
                      describe(cs, "code_predictor"), tables_of(talker), loop_config(talker))
    builder = PromptBuilder(model.config, talker, model.tokenizer)
    voice = next(iter(model.config.talker.speakers), None)
    for text in texts:
        p = builder.build(PromptRequest(text=text, language="auto", speaker=voice))
        n = min(frames, talker_context - p.length)
        if n < 1:
            raise ValueError(f"calibration prompt of {p.length} positions does not fit the talker "
                             f"context {talker_context}; export with a larger --context")
        dec.generate(p.embeds.float().numpy(), p.trailing.float().numpy(), n, stop_on_eos=False)
    return sinks
