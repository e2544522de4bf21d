"""``omni-stream export-decoder`` and ``export-step``: argument parsing and the printed summary
(the work is in ``torch_program`` and ``onnx_export``).

Both take ``--model`` as every ``omni-stream`` command does: a checkpoint folder or ``default``
(the embedded model, ``checkpoints.default.resolve_model_path``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from omni_stream.checkpoints.default import add_model_argument, resolve_model_path

log = logging.getLogger(__name__)


def add_export_parsers(subparsers) -> None:
    x = subparsers.add_parser("export-decoder", help="export the streaming Code2Wav for client-side "
                                                     "decoding (pt2, AOTInductor or ExecuTorch .pte)")
    add_model_argument(x)
    x.add_argument("--format", choices=["pt2", "aoti", "pte"], required=True)
    x.add_argument("--out", required=True, help="output folder (program + manifest.json)")
    x.add_argument("--max-chunk", type=int, default=32,
                   help="most frames one decode call takes (the server's chunk cap)")
    x.add_argument("--overwrite", action="store_true")
    x.add_argument("--no-progress", action="store_true", help="no progress bar")
    x.set_defaults(func=cmd_export_decoder)

    p = subparsers.add_parser(
        "export-step", help="export one static decode step (talker, code predictor, Code2Wav) to ONNX",
        description="Export a one-token (one-frame for code2wav) decode step with the KV cache as "
                    "explicit per-layer inputs/outputs, sanitized for NPU converters; see docs/npu_export.md.")
    add_model_argument(p)
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


def cmd_export_decoder(a: argparse.Namespace) -> int:
    from omni_stream.export.manifest import ExportError, ManifestError
    from omni_stream.export.torch_program import export_program

    try:
        m = export_program(resolve_model_path(a.model), a.format, a.out, max_chunk=a.max_chunk,
                           progress=not a.no_progress, overwrite=a.overwrite)
    except (ExportError, ManifestError, ValueError) as e:
        print(f"omni-stream export-decoder: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {m.program_path} ({m.files[0].bytes / 1e6:.1f} MB, {m.format}, chunks "
          f"1..{m.max_chunk_frames} frames, self-check SNR {m.verified.get('snr_db')} dB) and "
          f"{m.path}")
    return 0


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
    model_dir = resolve_model_path(a.model)
    results = export_step(model_dir, a.part, a.context, a.out, layouts)
    for r in results:
        b = r.manifest.boundary_bytes()
        print(f"{r.path}: {sum(r.ops.values())} nodes, {len(r.ops)} op types, "
              f"{b['total'] / 1024:.1f} KiB across the boundary per step, self-check "
              f"{r.manifest.verified['snr_db']} dB vs the torch step, {r.seconds:.1f} s")
    if a.quantize:
        import torch

        from omni_stream.checkpoints.io import load_model
        from omni_stream.export.onnx_quantize import calibration_feeds, quantize_step

        model = load_model(model_dir, dtype=torch.float32)
        for lay in layouts:
            tctx = a.context if a.part == "talker" else a.talker_context
            cctx = a.context if a.part == "code_predictor" else a.cp_context
            feeds = calibration_feeds(model, lay, tctx, cctx, frames=a.calib_frames)[a.part]
            for scheme in a.quantize:
                src = Path(a.out) / f"{a.part}-{lay}.onnx"
                dst = quantize_step(src, src.with_name(f"{a.part}-{lay}.{scheme}.onnx"), feeds, scheme)
                print(f"{dst}: {scheme}, calibrated on {len(feeds)} recorded steps")
    return 0
