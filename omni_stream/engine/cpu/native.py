"""The runner the frame engine calls instead of torch ops on the CPU runtime.

``NativeRunner`` runs the same decode step as ``DecoderStack.forward`` (the one formulation:
``models/layers.py``) inside ``omni_cpu.cpp``: the talker's step for every row in one call, the
code predictor's whole frame (2-token prefill, 14 single-token steps, 15 heads and draws) in
another, prefill pieces in a third. It reads and writes the engine's own tensors (KV caches,
seeds, counters, sampling settings) through their data pointers, so the engine's bookkeeping,
the stages and the tests see one engine whichever runtime computes it.

The runtime's other rooms: ``abi`` (the C interface), ``pool`` (threads and core lending),
``packing`` (weight layouts, the pack cache), ``plans`` (kinds per product, bytes per frame).
"""

from __future__ import annotations

import ctypes as C
import logging
from pathlib import Path

import torch
from torch import nn

from omni_stream.engine.cpu.abi import (OcCache, OcCodePredictor, OcLayer, OcLinear, OcSampling,
                                        OcStack, library)
from omni_stream.engine.cpu.packing import PackCache, PackedLinear, Repack, pack_linear, smoothing
from omni_stream.engine.cpu.plans import PRODUCTS, WeightPlan
from omni_stream.engine.cpu.pool import CoreLease, Pool
from omni_stream.engine.runtime import TalkerRuntime

log = logging.getLogger(__name__)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()

def _scaled(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    return w if s is None else w.float() * s


class NativeStack:
    """A decoder stack (``DecoderStack``) packed for the runtime, over the engine's KV cache.
    Low-bit kinds take each layer's norm outliers into their weights (``smoothing``)."""

    def __init__(self, stack: nn.Module, cache_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 kind, packs: PackCache | None = None, smooth: bool = True) -> None:
        """``kind``: one kind for every product, or ``fn(layer, product) -> kind``."""
        kind_of = kind if callable(kind) else (lambda _i, _p, k=kind: k)
        cfg = stack.cfg
        if cfg.head_dim % 16:
            raise ValueError(f"the CPU runtime needs head_dim % 16 == 0, got {cfg.head_dim}")
        self.layers: list[tuple[PackedLinear, ...]] = []
        self.keep: list[torch.Tensor] = []
        arr = (OcLayer * cfg.num_hidden_layers)()
        packs = packs or PackCache(None)
        for i, layer in enumerate(stack.layers):
            a, m = layer.self_attn, layer.mlp
            qkv_w = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
            gu_w = (m.gate_proj.weight, m.up_proj.weight)
            ln1, ln2 = _f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight)
            kq, ko, kg, kd = (kind_of(i, p) for p in PRODUCTS)
            s1 = s2 = None
            if smooth and kq != "f32":  # cheap: gains and column maxima only
                s1 = smoothing(ln1, qkv_w)
                ln1 = ln1 / s1
            if smooth and kg != "f32":
                s2 = smoothing(ln2, gu_w)
                ln2 = ln2 / s2
            qkv = packs.pack(lambda: _scaled(torch.cat(qkv_w), s1), None, kq,
                             (sum(w.shape[0] for w in qkv_w), qkv_w[0].shape[1]))
            o = pack_linear(a.o_proj, ko, packs)
            gu = packs.pack(lambda: _scaled(torch.cat(gu_w), s2), None, kg,
                            (sum(w.shape[0] for w in gu_w), gu_w[0].shape[1]))
            down = pack_linear(m.down_proj, kd, packs)
            norms = [ln1, ln2, _f32(a.q_norm.weight), _f32(a.k_norm.weight)]
            self.layers.append((qkv, o, gu, down))
            self.keep += norms
            arr[i] = OcLayer(qkv=qkv.struct, o=o.struct, gate_up=gu.struct, down=down.struct,
                             ln1=norms[0].data_ptr(), ln2=norms[1].data_ptr(),
                             q_norm=norms[2].data_ptr(), k_norm=norms[3].data_ptr())
        norm = _f32(stack.norm.weight)
        self.keep.append(norm)
        self._arr = arr
        self.struct = OcStack(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                              heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, ffn=cfg.intermediate_size,
                              eps=cfg.rms_norm_eps, layer=arr, norm=norm.data_ptr())
        dt = cache_layers[0][0].dtype
        if dt not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the CPU runtime keeps KV caches in bf16 or fp32, not {dt}")
        ks = (C.c_void_p * len(cache_layers))(*[k.data_ptr() for k, _ in cache_layers])
        vs = (C.c_void_p * len(cache_layers))(*[v.data_ptr() for _, v in cache_layers])
        self._kv = (ks, vs)
        self.cache = OcCache(k=ks, v=vs, length=cache_layers[0][0].shape[2],
                             bf16=int(dt == torch.bfloat16))

class NativeRunner(TalkerRuntime):
    """The frame engine's talker step, talker head, prefill and code-predictor frame on the CPU
    runtime (``FrameEngine.use_native``; the ``engine.runtime.TalkerRuntime`` contract). ``talker_kind`` / ``cp_kind``: weight kind of the
    talker's and the code predictor's products (``KINDS``); ``plan``: a ``WeightPlan`` instead
    (mixed precision per product); ``threads``: the runtime's threads (the caller included);
    ``lent_cpus`` / ``lease``: more threads on another process's cores (``Pool``)."""

    def __init__(self, engine, talker_kind: str = "q4", cp_kind: str = "q4",
                 threads: int | None = None, *, lent_cpus: tuple[int, ...] = (),
                 lease: CoreLease | None = None, pack_cache: Path | None = None,
                 plan: WeightPlan | None = None) -> None:
        super().__init__(engine)
        self.plan = plan or WeightPlan(talker_kind, cp_kind)
        self.lib = library()
        self.pool = Pool(threads or torch.get_num_threads(), self.lib, lent_cpus=lent_cpus,
                         lease=lease)
        t, cp = engine.talker, engine.talker.code_predictor
        try:
            self._pack(engine, PackCache(pack_cache))
        except Repack:  # the cache file did not fit: pack everything and rewrite it
            self._pack(engine, PackCache(pack_cache, read=False))
        heads = (OcLinear * len(self.cp_heads))(*[h.struct for h in self.cp_heads])
        emb_dtype = t.model.codec_embedding.weight.dtype
        tables = [t.model.codec_embedding.weight] + [e.weight for e in cp.model.codec_embedding]
        if emb_dtype not in (torch.bfloat16, torch.float32) or any(x.dtype != emb_dtype for x in tables):
            raise ValueError(f"the CPU runtime reads bf16 or fp32 embedding tables, not {emb_dtype}")
        self.tables = [x.detach().contiguous() for x in tables]
        cp_emb = (C.c_void_p * (len(self.tables) - 1))(*[x.data_ptr() for x in self.tables[1:]])
        self.talker_rope = (engine.rope.cos.contiguous(), engine.rope.sin.contiguous())
        self.cp_rope = (engine.cp_rope.cos.contiguous(), engine.cp_rope.sin.contiguous())
        g = engine.cfg.num_code_groups
        self._keep = (heads, cp_emb)
        self.cp_struct = OcCodePredictor(
            stack=self.cp.struct, cache=self.cp.cache, heads=heads,
            proj=C.pointer(self.proj.struct) if self.proj is not None else None,
            talker_codec_emb=self.tables[0].data_ptr(), cp_emb=cp_emb,
            emb_bf16=int(emb_dtype == torch.bfloat16), talker_hidden=engine.cfg.lm.hidden_size,
            talker_vocab=engine.cfg.lm.vocab_size, cp_vocab=engine.codebook_size, groups=g,
            cos_tab=self.cp_rope[0].data_ptr(), sin_tab=self.cp_rope[1].data_ptr())

    def _pack(self, engine, packs: PackCache) -> None:
        t, cp = engine.talker, engine.talker.code_predictor
        plan = self.plan
        nt, nc = len(t.model.layers), len(cp.model.layers)
        self.talker = NativeStack(t.model, engine.kv.layers,
                                  lambda i, p: plan.kind("talker", i, nt, p), packs, plan.smooth)
        self.head = pack_linear(t.codec_head, plan.head("talker"), packs)
        self.cp = NativeStack(cp.model, engine.cp_kv.layers,
                              lambda i, p: plan.kind("cp", i, nc, p), packs, plan.smooth)
        self.cp_heads = [pack_linear(h, plan.head("cp"), packs) for h in cp.lm_head]
        proj = cp.small_to_mtp_projection
        self.proj = None if isinstance(proj, nn.Identity) else pack_linear(proj, plan.head("cp"), packs)
        if packs.loaded is not None and packs.i != len(packs.loaded):
            log.warning("the pack cache %s holds more products than this model: packing afresh",
                        packs.path)
            raise Repack
        packs.finish()

    name = "native"

    # ------------------------------------------------------------------ the contract
    def prefill(self, slot: int, x: torch.Tensor, start: int) -> torch.Tensor:
        t = x.shape[0]
        pos = torch.arange(start, start + t)
        return self.talker_step(x, torch.full((t,), slot), pos)[-1:].to(self.e.dtype)

    def step(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.talker_step(x, self.e._arange[:x.shape[0]], pos).to(self.e.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.head, hidden)

    def residual(self, p: int) -> torch.Tensor:
        return self.cp_frame(p)

    def cp_teacher_forced(self, x: torch.Tensor) -> torch.Tensor:
        """Sub-step by sub-step, as ``cp_frame`` calls them, in the last code-predictor cache
        slot (every frame rewrites it before reading it)."""
        g = self.e.cfg.num_code_groups
        slot, x, out = self.e.shape.max_slots - 1, x.float(), []
        for a, b in [(0, 2)] + [(j, j + 1) for j in range(2, g)]:  # the calls cp_frame makes
            slots, pos = torch.full((b - a,), slot, dtype=torch.int64), torch.arange(a, b)
            out.append(self.cp_step(self.cp_project(x[a:b]), slots, pos)[-1:])
        return torch.cat([self.linear(self.cp_heads[j], out[j]) for j in range(g - 1)])

    def cp_parts(self, draft_layers: int) -> "NativePredictorParts":
        return NativePredictorParts(self, draft_layers)

    def stats(self) -> dict[str, int]:
        if self.pool.lease is None:
            return {}
        own, borrowed = self.pool.jobs()  # runtime jobs run on its own cores / lent ones
        return {"lent_core_jobs": borrowed, "own_core_jobs": own}

    # ------------------------------------------------------------------ the runtime's calls
    def talker_step(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rows x [m, C] (token of slot slots[r] at position pos[r], attending the slot's cache
        [0, pos[r]]) -> normed hidden [m, C] fp32; writes their K/V into the engine's cache."""
        return self.stack_step(self.talker.struct, self.talker.cache, self.talker_rope, x, slots, pos)

    def cp_project(self, x: torch.Tensor) -> torch.Tensor:
        """Code-predictor inputs [m, talker C] -> [m, C] fp32 (its projection, if it has one)."""
        return self.linear(self.proj, x) if self.proj is not None else x.float()

    def cp_step(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                stack: OcStack | None = None) -> torch.Tensor:
        """``talker_step`` for the code predictor's stack (its inputs already projected), or
        for ``stack``, a struct over its first layers (``engine.speculative``), on its cache."""
        return self.stack_step(stack or self.cp.struct, self.cp.cache, self.cp_rope, x, slots, pos)

    def stack_step(self, stack: OcStack, cache: OcCache, rope: tuple[torch.Tensor, torch.Tensor],
                   x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = x.detach().float().contiguous().clone()  # the runtime updates it in place
        slots = slots.to(torch.int64).contiguous()
        pos = pos.to(torch.int64).contiguous()
        self.lib.oc_stack_step(self.pool.handle, C.byref(stack), C.byref(cache), h.shape[0],
                               slots.data_ptr(), pos.data_ptr(), rope[0].data_ptr(),
                               rope[1].data_ptr(), h.data_ptr())
        return h

    def linear(self, packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().contiguous()
        y = torch.empty(x.shape[0], packed.n, dtype=torch.float32)
        self.lib.oc_linear(self.pool.handle, C.byref(packed.struct), x.data_ptr(), x.shape[0],
                           y.data_ptr())
        return y

    def cp_frame(self, p: int) -> torch.Tensor:
        """The code predictor's frame for slots [0, p): codes 1..G-1 [p, G-1] (INVALID rows)."""
        e = self.e
        sp = e.cp_sp
        greedy = sp.greedy[:p].to(torch.int32).contiguous()
        top_k = sp.top_k[:p].clamp(max=2**31 - 1).to(torch.int32).contiguous()
        temp, top_p = sp.temperature[:p].contiguous(), sp.top_p[:p].contiguous()
        seed = e.seed[:p].contiguous()
        counter = e.counter[:p]  # a view of the engine's counters: advanced in place
        assert counter.is_contiguous()
        samp = OcSampling(greedy=greedy.data_ptr(), top_k=top_k.data_ptr(),
                          temperature=temp.data_ptr(), top_p=top_p.data_ptr(),
                          seed=seed.data_ptr(), counter=counter.data_ptr())
        hidden = e.last_hidden[:p].float().contiguous()
        code0 = e.last_code0[:p].contiguous()
        codes = torch.empty(p, e.cfg.num_code_groups - 1, dtype=torch.int64)
        self.lib.oc_code_predictor_frame(self.pool.handle, C.byref(self.cp_struct), p,
                                         hidden.data_ptr(), code0.data_ptr(), C.byref(samp),
                                         codes.data_ptr())
        return codes


class NativePredictorParts:
    """The code predictor's pieces on the CPU runtime, for speculative prediction
    (``TalkerRuntime.cp_parts``): its stack step (the draft: a stack struct over the first
    layers of the predictor's own), heads, projection and embedding tables."""

    def __init__(self, runner: NativeRunner, draft_layers: int) -> None:
        self.n = runner
        s = runner.cp.struct
        self.full = s
        self.draft = OcStack(layers=draft_layers, hidden=s.hidden, heads=s.heads,
                             kv_heads=s.kv_heads, head_dim=s.head_dim, ffn=s.ffn, eps=s.eps,
                             layer=s.layer, norm=s.norm)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.n.cp_project(x.reshape(-1, x.shape[-1])).view(x.shape[0], x.shape[1], -1)

    def run(self, stack, x: torch.Tensor, start: int, p: int) -> torch.Tensor:
        t = x.shape[1]
        slots = torch.arange(p, dtype=torch.int64).repeat_interleave(t)
        pos = (start + torch.arange(t, dtype=torch.int64)).repeat(p)
        return self.n.cp_step(x.reshape(p * t, -1), slots, pos, stack).view(p, t, -1)

    def logits(self, j: int, h: torch.Tensor) -> torch.Tensor:
        return self.n.linear(self.n.cp_heads[j], h)

    def embed(self, j: int, codes: torch.Tensor) -> torch.Tensor:
        return self.n.tables[1 + j][codes].float()

    def embed0(self, codes: torch.Tensor) -> torch.Tensor:
        return self.n.tables[0][codes].float()
