"""Run an exported decoder step: one callable ``(codes [1, Q, n], state) -> (wav [1, n*spf],
state)`` whatever the format, so clients, the exporter's self-check and the benchmark share it.

Inputs are made contiguous (an AOTInductor program assumes the strides it was traced with) and
the ExecuTorch outputs are cloned: they live in the program's planned memory, which the next
call overwrites while reading its inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from omni_stream.export.manifest import ManifestError

__all__ = ["StepFn", "load_program"]

StepFn = Callable[[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]]


def load_program(fmt: str, path: str | Path, threads: int | None = None) -> StepFn:
    """Load the program file of format ``fmt``; raises ManifestError naming the fix when the
    file is unreadable or the runtime for the format is missing. ``threads``: intra-op threads
    (torch's for pt2/aoti, ExecuTorch's XNNPACK threadpool for pte, which otherwise uses every
    core whatever ``torch.set_num_threads`` says); None leaves the runtime's default."""
    path = Path(path)
    if fmt not in ("pt2", "aoti", "pte"):
        raise ManifestError(f"a '{fmt}' program is not a torch program (pt2, aoti or pte)"
                            + ("; ONNX steps run with omni_stream.export.runtime_onnx"
                               if fmt == "onnx" else ""))
    if not path.is_file():
        raise ManifestError(f"decoder program {path} is missing: re-export with "
                            "`omni-stream export-decoder`")
    if fmt == "pte":
        return _load_pte(path, threads)
    if threads:
        torch.set_num_threads(threads)
    try:
        if fmt == "pt2":
            fn = torch.export.load(str(path)).module()
        else:
            fn = torch._inductor.aoti_load_package(str(path))
    except Exception as e:  # the loaders raise many types on a bad file
        raise ManifestError(f"cannot load {fmt} decoder program {path} ({type(e).__name__}: "
                            f"{str(e)[:200]}): re-export with `omni-stream export-decoder`") from e

    def run(codes: torch.Tensor, state: list[torch.Tensor]):
        with torch.no_grad():
            wav, *new = fn(codes.contiguous(), *(s.contiguous() for s in state))
        return wav, new

    return run


def _load_pte(path: Path, threads: int | None) -> StepFn:
    try:
        from executorch.runtime import Runtime
    except ImportError as e:
        raise ManifestError(f"the executorch decoder needs the ExecuTorch runtime ({e}): "
                            "`pip install executorch==1.4.1`") from e
    if threads:
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(threads)  # process-wide; experimental API in executorch 1.4
    try:
        method = Runtime.get().load_program(path).load_method("forward")
    except Exception as e:  # the runtime raises RuntimeError/ValueError on a bad file
        raise ManifestError(f"cannot load ExecuTorch program {path} ({type(e).__name__}: "
                            f"{str(e)[:200]}): the file is not a valid .pte for this runtime; "
                            "re-export with `omni-stream export-decoder --format pte`") from e
    if method is None:
        raise ManifestError(f"ExecuTorch program {path} has no 'forward' method: re-export it")

    def run(codes: torch.Tensor, state: list[torch.Tensor]):
        outs = method.execute([codes.contiguous(), *(s.contiguous() for s in state)])
        wav, *new = (o.clone() for o in outs)
        return wav, new

    return run
