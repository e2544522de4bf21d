"""Export targets, one module per target, over the model's own modules (no copy of their math).

    manifest.py        the one manifest format every target writes (files + hashes, tensors in,
                       state, out, chunk range or step geometry, provenance, self-check, codec
                       identity) and the codec identity a server announces
    code2wav_step.py   the streaming Code2Wav as a pure function of explicit state
    torch_program.py   ``omni-stream export-decoder``: torch.export -> pt2 / AOTInductor (+ .pte)
    executorch.py      the ExecuTorch (.pte, XNNPACK) lowering
    runtime_torch.py   run a pt2 / AOTInductor / .pte program
    onnx_step.py       static one-step ONNX modules: talker, code predictor, Code2Wav
    onnx_export.py     ``omni-stream export-step``: torch.onnx, sanitize, self-check, manifests,
                       ``load_decoder``
    onnx_ops.py        the NPU op allowlist and the graph sanitizer
    onnx_quantize.py   w8a16 / w4a16 QDQ variants calibrated on recorded decodes
    runtime_onnx.py    the ONNX Runtime decode loop (caches, ring slots, masks, greedy codes)
    onnx_parity.py     eager histories and teacher-forced replays (the parity evidence)
    cli.py             the ``export-decoder`` and ``export-step`` commands

Nothing here imports torch, onnx or executorch at package import.
"""
