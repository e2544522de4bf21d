"""Phone NPU path: static one-step decode graphs (talker, code predictor, Code2Wav) for NPU
compilers, their ONNX Runtime loop, and w8a16 / w4a16 QDQ variants.

    step.py           torch step modules: explicit per-layer caches, roll and ring layouts
    code2wav_step.py  the one-frame Code2Wav step (sliding-window KV + conv tails)
    ops.py            NPU op allowlist and the graph sanitizer
    exporter.py       torch.onnx export, manifests, ``export_step`` / ``load_decoder``
    runtime.py        cache bookkeeping, masks, rotary rows, the greedy decode loop
    parity.py         eager histories and teacher-forced replays (the parity evidence)
    quantize.py       calibration from recorded decodes, QDQ quantization
    cli.py            ``omni-stream export-step``

Nothing here imports torch or onnx at package import; see docs/npu_export.md.
"""
