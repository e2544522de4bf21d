"""Measuring the machine: memory read bandwidth, the frame step per batch size, Code2Wav calls.

Run inside the stage processes (their threads, pinning and engines are the ones that serve),
one after the other (the codec idle while the talker is timed and the other way round), at the
first start of a deployment; ``scheduling.capacity.MachineCosts`` holds the results. Each
figure is a median of a few repeats after a warm-up: seconds in all, not minutes.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Sequence

import torch

from omni_stream.scheduling.throttle import PrefillCostModel

log = logging.getLogger(__name__)

GB = 1e9


def memory_bandwidth_gbs(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of ``torch.sum`` over a ``mib`` MiB float32 tensor on ``threads``
    intra-op threads: the median of ``repeats`` passes after one that pages the buffer in.
    The decode is bound by reading weights, so this is the figure that sets a frame's cost."""
    if threads < 1 or mib < 1 or repeats < 1:
        raise ValueError("threads, mib and repeats must be >= 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
        x.sum()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        return x.numel() * 4 / statistics.median(times) / GB
    finally:
        torch.set_num_threads(before)


def measure_frame_steps(engine, step: Callable[[int], object], max_batch: int,
                        steps: int = 4) -> tuple[list[float], list[tuple[int, float]]]:
    """Median wall time of ``step(b)`` (one batched frame of ``b`` slots, code predictor
    included) for b = 1..``max_batch``, and (tokens, seconds) of the prefills that set the
    slots up (two prompt lengths: what the prefill cost model is fitted to). The slots are
    released after; their state is reset by the next prefill."""
    from omni_stream.config import SamplingParams

    c = engine.talker.model.cfg.hidden_size
    greedy = SamplingParams.greedy()
    trailing = torch.zeros(1, c, dtype=engine.dtype, device=engine.device)
    prefills: list[tuple[int, float]] = []
    frame_s: list[float] = []
    try:
        for b in range(1, max_batch + 1):
            rows = 32 if b % 2 else 8
            embeds = torch.zeros(rows, c, dtype=engine.dtype, device=engine.device)
            t0 = time.perf_counter()
            engine.prefill(b - 1, embeds, trailing, greedy, 0, start=0, final=True)
            prefills.append((rows, time.perf_counter() - t0))
            step(b)  # the first step at a new width may build kernels: not timed
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step(b)
                times.append(time.perf_counter() - t0)
            frame_s.append(statistics.median(times))
    finally:
        for slot in range(max_batch):
            engine.release(slot)
    return frame_s, prefills


def measure_codec_calls(decode: Callable[[list[int], torch.Tensor], object], codebooks: int,
                        max_slots: int, reset: Callable[[int], None],
                        shapes: Sequence[tuple[int, int]] = ((1, 1), (4, 1), (8, 1), (8, 2)),
                        repeats: int = 3) -> tuple[float, float, list[tuple[int, int, float]]]:
    """Code2Wav call cost: the median wall time of a decode of each (frames, streams) shape
    (streams capped at ``max_slots``), fitted as ``call_s + frame_s x frames x streams``.
    Returns (call_s, frame_s, [(frames, streams, seconds)]); every slot used is reset."""
    table = []
    used = 0
    for n, b in shapes:
        b = min(b, max_slots)
        used = max(used, b)
        codes = torch.zeros(b, codebooks, n, dtype=torch.long)
        decode(list(range(b)), codes)  # first use of a shape builds kernels: not timed
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            decode(list(range(b)), codes)
            times.append(time.perf_counter() - t0)
        table.append((n, b, statistics.median(times)))
    for slot in range(used):
        reset(slot)
    # the same non-negative line fit as the prefill's (fixed + per unit), rows as the unit
    line = PrefillCostModel.fit([(n * b, s) for n, b, s in table])
    return line.fixed_s, line.per_token_s, table


__all__ = ["measure_codec_calls", "measure_frame_steps", "memory_bandwidth_gbs"]
