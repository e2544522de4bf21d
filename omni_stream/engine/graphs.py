"""CUDA-graph capture of the whole per-frame step, one graph per padded batch size.

On a GPU the frame step is ~2.5k small kernels (15 code-predictor sub-steps x 5 layers + the
talker's 28 layers + sampling); launching them one by one costs more than the math. We capture
``FrameEngine.step(P)`` for P in a ladder of padded sizes and replay the smallest graph that
covers the highest active slot. The engine runs in ``static_live`` mode (attention over the
whole cache under a mask) so the step has no host sync and fixed shapes; sampling uses the
counter-based noise in ``sampling.py``, so it is capturable too.

The same class degrades to plain eager calls on CPU (``enabled=False``), which is what the
tests exercise off-GPU; capture itself needs a CUDA device.
"""

from __future__ import annotations

import bisect
import logging

import torch

from omni_stream.engine.frame import FrameEngine

log = logging.getLogger(__name__)


def padded_sizes(max_slots: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then steps of 32 up to max_slots (inclusive)."""
    sizes, p = [], 1
    while p < min(max_slots, 32):
        sizes.append(p)
        p *= 2
    p = min(max_slots, 32)
    while p < max_slots:
        sizes.append(p)
        p += 32
    sizes.append(max_slots)
    return sorted(set(sizes))


class GraphedStep:
    """``step(p)`` with the same contract as ``FrameEngine.step`` (rows [0, p) valid)."""

    def __init__(self, engine: FrameEngine, enabled: bool | None = None,
                 sizes: list[int] | None = None) -> None:
        self.engine = engine
        if enabled is None:
            enabled = engine.device.type == "cuda"
        if enabled and engine.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine on a CUDA device")
        self.enabled = enabled
        self.sizes = sizes or padded_sizes(engine.shape.max_slots)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        if enabled:
            engine.static_live = True
            self._capture()

    def _capture(self) -> None:
        eng = self.engine
        snapshot = {k: v.clone() for k, v in vars(eng).items()
                    if isinstance(v, torch.Tensor) and not k.startswith("_")}
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            with torch.cuda.stream(stream):
                for p in self.sizes:  # warm-up: allocator, cuBLAS handles, autotuning
                    eng.step(p)
                    eng.step(p)
            torch.cuda.current_stream().wait_stream(stream)
            for p in sorted(self.sizes, reverse=True):  # largest first: smaller reuse its pool
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    codes, code0 = eng.step(p)
                pool = g.pool()
                self._graphs[p] = (g, codes, code0)
        torch.cuda.synchronize()
        for k, v in snapshot.items():  # undo what warm-up and capture did to slot state
            getattr(eng, k).copy_(v)
        log.info("captured %d CUDA graphs for batch sizes %s", len(self._graphs), self.sizes)

    def bucket(self, p: int) -> int:
        i = bisect.bisect_left(self.sizes, p)
        if i == len(self.sizes):
            raise ValueError(f"batch {p} exceeds max_slots {self.sizes[-1]}")
        return self.sizes[i]

    def step(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.enabled:
            return self.engine.step(p)
        g, codes, code0 = self._graphs[self.bucket(p)]
        g.replay()
        return codes[:p], code0[:p]
