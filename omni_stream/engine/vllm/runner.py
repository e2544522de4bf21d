"""vLLM as the talker's engine: its scheduler and paged KV cache under the frame engine.

``VllmTalker`` replaces the frame engine's talker decoder and KV cache (``FrameEngine.use_vllm``):
the frame engine still builds every input row (prompt embeddings, the 16 code embeddings plus
the text row of a decode step), draws codes with its own sampling chain and runs the code
predictor; what vLLM runs is the Qwen3 stack over those rows, with its scheduler placing the
tokens and its paged KV cache holding every stream's past.

One engine slot is one vLLM request (id ``s<slot>.<n>``) whose prompt is ``[slot] * length``
placeholders (``model.py`` says why). A step of the frame engine is one ``LLMEngine.step()``:
the rows it feeds go into ``Feed``, and ``StepScheduler`` (vLLM's scheduler with a plan) lets
exactly the fed requests run, with exactly the fed token counts: a prefill piece of n rows
schedules n prompt tokens of one request and nothing else; a frame step schedules one decode
token of every live stream and leaves out those the talker stage holds (a continuous stream
waiting for text keeps its KV and position, as it does in the torch engine) and those whose
prompt is still being fed in pieces. The talker stage's admission, throttle and chunking decide
what runs, unchanged; vLLM decides where it sits in memory and how it is batched.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one uniprocess worker): the
engine reaches the model object to feed it and the scheduler to plan it, and a frame step costs
no inter-process hop. Eager mode (no torch.compile, no CUDA graphs: the feed lookup is data
dependent); no prefix caching (placeholder ids would alias between streams).
"""

from __future__ import annotations

import json
import logging
import os
import hashlib
import shutil
from pathlib import Path

import torch

from omni_stream.engine.runtime import TalkerRuntime

log = logging.getLogger(__name__)

_scheduler_cls = None


def _step_scheduler():
    """vLLM's ``Scheduler`` with a plan: ``plan`` {request id: tokens} runs those requests
    only, with that token budget (held requests are taken out of the running list for the
    call and put back in their order)."""
    global _scheduler_cls
    if _scheduler_cls is not None:
        return _scheduler_cls
    from vllm.v1.core.sched.scheduler import Scheduler

    class StepScheduler(Scheduler):
        plan: dict[str, int] | None = None

        def schedule(self, *args, **kwargs):
            plan = self.plan
            if plan is None:
                return super().schedule(*args, **kwargs)
            running = self.running
            self.running = [r for r in running if r.request_id in plan]
            held = [r for r in running if r.request_id not in plan]
            budget = self.max_num_scheduled_tokens
            self.max_num_scheduled_tokens = sum(plan.values())
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self.max_num_scheduled_tokens = budget
                self.running = self.running + held

    _scheduler_cls = StepScheduler
    return StepScheduler


def hf_config(lm, slots: int, max_len: int) -> dict:
    """The config.json vLLM reads for the talker decoder: a Qwen3 stack whose vocabulary is
    the engine's slots (ids are slots, ``model.py``)."""
    return {
        "architectures": ["OmniStreamTalker"], "model_type": "qwen3",
        "vocab_size": max(2, slots), "hidden_size": lm.hidden_size,
        "intermediate_size": lm.intermediate_size, "num_hidden_layers": lm.num_hidden_layers,
        "num_attention_heads": lm.num_attention_heads,
        "num_key_value_heads": lm.num_key_value_heads, "head_dim": lm.head_dim,
        "rms_norm_eps": lm.rms_norm_eps, "rope_theta": lm.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": lm.rope_theta},
        "max_position_embeddings": max_len, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def kv_bytes(lm, slots: int, max_len: int, dtype: torch.dtype, head_size: int,
             block: int = 128) -> int:
    """KV cache bytes for every slot at full length plus two blocks of rounding (vLLM never
    has to preempt a stream; CPU blocks hold up to 128 positions); ``head_size``: the
    attention's (``model.attention_head_size``)."""
    per_token = 2 * lm.num_hidden_layers * lm.num_key_value_heads * head_size
    return slots * (max_len + 2 * block) * per_token * torch.tensor([], dtype=dtype).element_size()


def model_dir(checkpoint: str | Path, lm, slots: int, max_len: int) -> Path:
    """The folder vLLM loads: the talker decoder's config.json and links to the checkpoint's
    weight files (one ``model.safetensors`` or shards with their index), read in place. Kept
    in the cache folder under a key of its contents, so starts reuse it and a killed process
    leaves nothing new behind."""
    from omni_stream.checkpoints.default import cache_dir

    src = Path(checkpoint).resolve()
    files = [src / "model.safetensors"]
    if not files[0].is_file():
        index = src / "model.safetensors.index.json"
        if not index.is_file():
            raise FileNotFoundError(f"{src}: no model.safetensors or model.safetensors.index.json")
        files = [index] + sorted({src / f for f in json.loads(index.read_text())["weight_map"].values()})
    config = json.dumps(hf_config(lm, slots, max_len), sort_keys=True)
    key = hashlib.sha256("\0".join([config] + [str(f) for f in files]).encode()).hexdigest()[:20]
    out = cache_dir() / "vllm-model" / key
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(f"{key}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in files:
        (tmp / f.name).symlink_to(f)
    (tmp / "config.json").write_text(config)  # last: a folder with it is complete
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class VllmTalker(TalkerRuntime):
    """The talker decoder of ``engine`` (a ``FrameEngine``) on an in-process vLLM engine (the
    ``engine.runtime.TalkerRuntime`` contract: prefill, step and the stream lifecycle here; the
    heads and the code predictor are the torch runtime's)."""

    name = "vllm"

    def __init__(self, engine, model_path: str | Path, threads: int | None = None) -> None:
        super().__init__(engine)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # one in-process worker: no OpenMP binding of vLLM's own (the stage's CPU set holds)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import EngineArgs, LLMEngine

        from omni_stream.engine.vllm.plugin import register
        from omni_stream.engine.vllm.model import Feed, attention_head_size

        register()
        lm, shape = engine.cfg.lm, engine.shape
        self.slots, self.max_len = shape.max_slots, shape.max_seq_len
        self.dtype = engine.dtype
        dev = engine.device
        folder = model_dir(model_path, lm, self.slots, self.max_len)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}[self.dtype]
        args = EngineArgs(
            model=str(folder), skip_tokenizer_init=True, dtype=dtype, load_format="safetensors",
            max_model_len=self.max_len, max_num_seqs=max(self.slots, 1),
            max_num_batched_tokens=max(self.max_len, 256), enable_chunked_prefill=True,
            enable_prefix_caching=False, enforce_eager=True, async_scheduling=False,
            scheduler_cls=_step_scheduler(),
            kv_cache_memory_bytes=kv_bytes(lm, self.slots, self.max_len, self.dtype,
                                            attention_head_size(lm.head_dim)),
            disable_log_stats=True, seed=0)
        # vLLM drops torch to one intra-op thread for serving unless OMP_NUM_THREADS is set,
        # and its CPU worker turns torch.set_num_threads into a no-op: this process's step
        # (the decoder's GEMMs, the code predictor) keeps the threads the stage was given
        threads = threads or torch.get_num_threads()
        set_threads = torch.set_num_threads
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        try:
            self.llm = LLMEngine.from_engine_args(args)
        finally:
            torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        core = self.llm.engine_core.engine_core
        self.scheduler = core.scheduler
        self.model = core.model_executor.driver_worker.worker.model_runner.model
        self.feed = Feed(self.slots, max(self.max_len, 1), lm.hidden_size, self.dtype, dev)
        self.out = torch.zeros(self.slots, lm.hidden_size, dtype=self.dtype, device=dev)
        self.model.bind(self.feed, self.out)
        self.req: list[str | None] = [None] * self.slots
        self._n = 0
        from vllm import SamplingParams

        self._params = SamplingParams

    # ------------------------------------------------------------------ requests
    def start(self, slot: int, total: int | None) -> None:
        """A new stream in ``slot`` whose prompt has ``total`` positions."""
        if total is None:
            raise ValueError("the vLLM engine needs the prompt's length (total) with its first "
                             "piece")
        if not 0 < total < self.max_len:
            raise ValueError(f"prompt of {total} positions does not fit max_seq_len {self.max_len}")
        self.release(slot)
        self._n += 1
        rid = f"s{slot}.{self._n}"
        params = self._params(temperature=0.0, max_tokens=self.max_len - total,
                              ignore_eos=True, detokenize=False)
        # vLLM answers with its internal id (ours plus a suffix): the scheduler's plan uses it
        self.req[slot] = self.llm.add_request(rid, {"prompt_token_ids": [slot] * total}, params)

    def release(self, slot: int) -> None:
        rid = self.req[slot]
        if rid is not None:
            self.req[slot] = None
            self.llm.abort_request([rid], internal=True)

    # ------------------------------------------------------------------ steps
    def prefill(self, slot: int, x: torch.Tensor, start: int) -> torch.Tensor:
        t = x.shape[0]
        return self.talker_step(x, torch.full((t,), slot), torch.arange(start, start + t))[-1:]

    def step(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        p = x.shape[0]
        return self.talker_step(x, self.e._arange[:p], pos, live=self.e.active[:p])

    def talker_step(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                    live: torch.Tensor | None = None) -> torch.Tensor:
        """Rows x [n, C] of slots [n] at positions pos [n] (rows of one slot consecutive and in
        order) -> each row's slot's last hidden state [n, C]. ``live`` [n]: rows to run (None:
        all); the others are not fed and read zeros."""
        f = self.feed
        f.n.zero_()
        keep = [True] * len(slots) if live is None else live.tolist()
        sl, ps = slots.tolist(), pos.tolist()
        plan: dict[str, int] = {}
        fed: list[int] = []
        i = 0
        while i < len(sl):  # runs of one slot's rows
            s, j = sl[i], i + 1
            while j < len(sl) and sl[j] == s:
                j += 1
            if keep[i]:
                rid = self.req[s]
                if rid is None:
                    raise RuntimeError(f"slot {s} has no vLLM request (prefill it first)")
                if rid in plan or ps[i:j] != list(range(ps[i], ps[i] + j - i)):
                    raise RuntimeError(f"slot {s}: rows not consecutive positions of one run")
                f.pos0[s] = ps[i]
                f.n[s] = j - i
                f.rows[s, :j - i] = x[i:j]
                plan[rid] = j - i
                fed.append(s)
            i = j
        self.out.zero_()
        if plan:
            self._run(plan, fed)
        hidden = self.out[slots]
        if live is None:
            return hidden
        return torch.where(live.bool().unsqueeze(-1), hidden, torch.zeros_like(hidden))

    def _run(self, plan: dict[str, int], fed: list[int]) -> None:
        sched = self.scheduler
        sched.plan = plan
        self.model._run_slots = None
        try:
            self.llm.step()
        finally:
            sched.plan = None
        ran = self.model._run_slots
        want = sorted(fed)
        if ran is None or sorted(ran.tolist()) != want:
            raise RuntimeError(f"vLLM ran slots {None if ran is None else sorted(ran.tolist())}, "
                               f"the step fed {want}")

    def close(self) -> None:
        for s in range(self.slots):
            self.release(s)
