"""Client-side decoding: the streaming Code2Wav exported as a program with explicit state.

``decoder_step`` (the pure step function), ``decoder`` (``omni-stream export-decoder``: pt2,
AOTInductor, ExecuTorch .pte), ``manifest`` (what a client checks), ``runtime`` (run any of them).
"""
