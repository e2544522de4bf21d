"""Export targets, one module per target, over the model's own modules.

    code2wav_step.py   the streaming Code2Wav as a pure function of explicit state
    torch_program.py   ``omni-stream export-decoder``: torch.export -> pt2 / AOTInductor (+ .pte)
    executorch.py      the ExecuTorch (.pte, XNNPACK) lowering
    runtime_torch.py   run a pt2 / AOTInductor / .pte program
    onnx_step.py       static one-step ONNX graphs: talker, code predictor, Code2Wav
    onnx_ops.py        the NPU op allowlist and the graph sanitizer
    onnx_export.py     ``omni-stream export-step``: torch.onnx export, ``load_decoder``
    onnx_quantize.py   w8a16 / w4a16 QDQ variants calibrated on recorded decodes
    runtime_onnx.py    the ONNX Runtime decode loop (caches, ring slots, masks, greedy codes)
    onnx_parity.py     eager histories and teacher-forced replays (the parity evidence)
    manifest.py        what a client checks before it runs a program, and the codec identity
    cli.py             the ``export-step`` command

Nothing here imports torch, onnx or executorch at package import.
"""
