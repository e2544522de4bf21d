"""``omni-stream export-step``: argument parsing and the printed summary (logic in exporter)."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export-step", help="export one static decode step (talker, code predictor, Code2Wav) to ONNX",
        description="Export a one-token (one-frame for code2wav) decode step with the KV cache as "
                    "explicit per-layer inputs/outputs, sanitized for NPU converters; see docs/npu_export.md.")
    p.add_argument("--model", required=True, help="checkpoint folder (released layout)")
    p.add_argument("--part", required=True, help="talker, code_predictor or code2wav")
    p.add_argument("--context", type=int, required=True,
                   help="keys attended per step (cache holds context-1): talker prompt+frames, "
                        "code_predictor 16, code2wav its sliding window (72)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--layout", choices=["roll", "ring", "both"], default="both",
                   help="cache layout: roll (window in, window out) or ring (new entry out)")
    p.add_argument("--quantize", action="append", default=[], choices=["w8a16", "w4a16"],
                   help="also write a QDQ variant calibrated on recorded decode runs (repeatable; "
                        "talker and code_predictor)")
    p.add_argument("--cp-context", type=int, default=16,
                   help="code-predictor context used by the calibration decode")
    p.add_argument("--talker-context", type=int, default=256,
                   help="talker context used by the calibration decode of the code predictor")
    p.add_argument("--calib-frames", type=int, default=24, help="frames per calibration utterance")
    p.set_defaults(func=cmd_export_step)
    return p


def cmd_export_step(a: argparse.Namespace) -> int:
    from pathlib import Path

    from omni_stream.export.manifest import PARTS
    from omni_stream.export.onnx_export import export_step
    from omni_stream.export.onnx_step import LAYOUTS

    if a.part not in PARTS:
        raise SystemExit(f"omni-stream export-step: unsupported part '{a.part}': expected one of "
                         f"{', '.join(PARTS)}")
    if a.quantize and a.part == "code2wav":
        raise SystemExit("omni-stream export-step: --quantize applies to talker and code_predictor "
                         "(Code2Wav runs on the GPU or CPU in float)")
    layouts = LAYOUTS if a.layout == "both" else (a.layout,)
    results = export_step(a.model, a.part, a.context, a.out, layouts)
    for r in results:
        b = r.manifest.boundary_bytes()
        print(f"{r.path}: {sum(r.ops.values())} nodes, {len(r.ops)} op types, "
              f"{b['total'] / 1024:.1f} KiB across the boundary per step, self-check "
              f"{r.manifest.verified['snr_db']} dB vs the torch step, {r.seconds:.1f} s")
    if a.quantize:
        import torch

        from omni_stream.export.onnx_quantize import calibration_feeds, quantize_step
        from omni_stream.checkpoints.io import load_model

        model = load_model(a.model, dtype=torch.float32)
        for lay in layouts:
            tctx = a.context if a.part == "talker" else a.talker_context
            cctx = a.context if a.part == "code_predictor" else a.cp_context
            feeds = calibration_feeds(model, lay, tctx, cctx, frames=a.calib_frames)[a.part]
            for scheme in a.quantize:
                src = Path(a.out) / f"{a.part}-{lay}.onnx"
                dst = quantize_step(src, src.with_name(f"{a.part}-{lay}.{scheme}.onnx"), feeds, scheme)
                print(f"{dst}: {scheme}, calibrated on {len(feeds)} recorded steps")
    return 0
