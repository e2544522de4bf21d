"""torch.compile of the decoder steps, with the compiled kernels cached across restarts.

What is compiled: the talker's and the code predictor's ``DecoderStack.forward`` (the decode step, ``engine/step.py``) (layers, norms,
rotary, attention, the low-bit matmuls as external calls), with dynamic shapes so one graph
serves every batch size, prompt length and live cache length. Sampling stays eager (it is a
handful of ops per frame).

Warm start: inductor's FX-graph cache (generated C++ and its compiled .so) lives under
``<cache>/compile/torch-<version>`` (``OMNI_STREAM_CACHE_DIR``, default ~/.cache/omni-stream),
unless ``TORCHINDUCTOR_CACHE_DIR`` is already set. A second start with the same model shape,
torch and CPU finds every graph there: it still traces (seconds) but compiles nothing. The
counters ``compile_stats()`` returns say which happened.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from omni_stream.checkpoints.default import cache_dir

log = logging.getLogger(__name__)


def compile_cache_dir() -> Path:
    return cache_dir() / "compile" / f"torch-{torch.__version__.split('+')[0]}"


def setup_cache() -> Path:
    """Point inductor's on-disk caches at omni-stream's cache (a user's own setting wins).
    torch fills the variable with its default (/tmp/torchinductor_<user>) on first use, so
    that value counts as unset: /tmp is wiped on reboot and shared between users."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, "", default_cache_dir()):
        d = compile_cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
    import torch._inductor.config as ic

    ic.fx_graph_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compile_engine(engine) -> None:
    """Compile the decoder stacks ``engine`` (a ``FrameEngine``) runs. Idempotent."""
    setup_cache()
    import torch._dynamo.config as dynamo_config

    # the talker and the code predictor share DecoderStack.forward's code object, and so its
    # limit of compiled variants (8 by default): past it dynamo falls back to eager without a word
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    for stack in (engine.talker.model, engine.talker.code_predictor.model):
        if not getattr(stack, "_omni_compiled", False):
            stack.forward = torch.compile(stack.forward, dynamic=True)
            stack._omni_compiled = True


def compile_stats() -> dict[str, int]:
    """Inductor cache counters of this process: graphs compiled (miss) vs loaded (hit)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {"graphs_compiled": int(c.get("fxgraph_cache_miss", 0)),
            "graphs_from_cache": int(c.get("fxgraph_cache_hit", 0))}


@torch.inference_mode()
def warm_up(engine, frames: int = 2, code_predictor_only: bool = False) -> float:
    """Run throwaway prefills and steps so every graph a server needs is compiled (or loaded),
    and the native runtime's weights are paged in, before the first request, not during it.
    torch.compile specialises sizes 0 and 1 and
    gives equal sizes one symbol, so the shapes here are chosen to differ the way real traffic
    does: a prompt in two pieces (live length != piece length), then steps with one and with
    two slots (batch 1 and batch > 1 are separate graphs). The slots are released after; their
    state is reset by the next prefill. ``code_predictor_only``: just the code predictor (its
    own stage with placement split). Returns the seconds it took."""
    from omni_stream.config import SamplingParams

    t0 = time.perf_counter()
    slots = min(2, engine.shape.max_slots)
    if code_predictor_only:
        for p in range(1, slots + 1):
            for _ in range(frames):
                engine.predict_residual(p)
        return time.perf_counter() - t0
    c = engine.talker.model.cfg.hidden_size
    embeds = torch.zeros(20, c, dtype=engine.dtype, device=engine.device)  # >= 16 rows: AMX too
    trailing = torch.zeros(1, c, dtype=engine.dtype, device=engine.device)
    greedy = SamplingParams.greedy()
    for slot in range(slots):
        engine.prefill(slot, embeds, trailing, greedy, 0, start=0, final=False)
        engine.prefill(slot, embeds[:5], trailing, greedy, 0, start=len(embeds), final=True)
        for _ in range(frames):
            engine.step(slot + 1)
    for slot in range(slots):
        engine.release(slot)
    took = time.perf_counter() - t0
    log.info("decoder steps warm in %.1f s (%s)", took, compile_stats())
    return took
