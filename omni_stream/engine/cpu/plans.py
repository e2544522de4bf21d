"""Weight plans: which kind every product of the talker and the code predictor is packed in
(mixed precision per tensor), and what a frame then reads: bytes per kind (``frame_reads``), the
figure the profile prices a weight path by, and the kernels' own read rate (``kernel_read_gbs``)."""

from __future__ import annotations

import ctypes as C
import statistics
import time
from dataclasses import dataclass

import torch

from omni_stream.engine.cpu.abi import library
from omni_stream.engine.cpu.packing import KINDS, Q4_GROUP, kind_for, pack_weight
from omni_stream.engine.cpu.pool import Pool


PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, in packing order

ATTENTION = ("qkv", "o")


@dataclass(frozen=True)
class WeightPlan:
    """The weight kind of every product the runner packs (mixed precision per tensor).

    ``talker`` / ``cp``: the kind of each stack's products, ``talker_attention`` /
    ``cp_attention``: of its q|k|v and o instead (None: the stack's kind), ``early`` (fraction,
    kind): the first fraction of each stack's layers in that kind (their errors pass through
    every later layer),
    ``talker_head`` / ``cp_head``: the codec head and the code predictor's heads and projection
    (None: as the layers' default), ``overrides``: ("talker.3.qkv", kind) pairs that win over the
    rules (a measured allocation); ``smooth``: fold norm outliers into low-bit weights."""

    talker: str = "q4"
    cp: str = "q4"
    talker_attention: str | None = None
    cp_attention: str | None = None
    early: tuple[float, str] | None = None
    talker_head: str | None = None
    cp_head: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()
    smooth: bool = True

    def __post_init__(self) -> None:
        kinds = [self.talker, self.cp, self.talker_attention, self.cp_attention, self.talker_head,
                 self.cp_head] + [k for _, k in self.overrides] + ([self.early[1]] if self.early else [])
        for k in kinds:
            if k is not None and k not in KINDS:
                raise ValueError(f"unknown weight kind {k!r}: one of {', '.join(KINDS)}")
        for name, _ in self.overrides:
            parts = name.split(".")
            if len(parts) != 3 or parts[0] not in ("talker", "cp") or not parts[1].isdigit() \
                    or parts[2] not in PRODUCTS:
                raise ValueError(f"weight plan override {name!r}: name a product as "
                                 f"'talker|cp.LAYER.{'|'.join(PRODUCTS)}'")
        if self.early is not None and not 0.0 <= self.early[0] <= 1.0:
            raise ValueError(f"weight plan early fraction must be in [0, 1], got {self.early[0]}")

    def kind(self, stack: str, layer: int, layers: int, product: str) -> str:
        """The kind of ``product`` of layer ``layer`` (of ``layers``) of ``stack`` (talker/cp)."""
        over = dict(self.overrides).get(f"{stack}.{layer}.{product}")
        if over is not None:
            return over
        if self.early is not None and layer < round(self.early[0] * layers):
            return self.early[1]
        attn = self.talker_attention if stack == "talker" else self.cp_attention
        if attn is not None and product in ATTENTION:
            return attn
        return self.talker if stack == "talker" else self.cp

    def head(self, stack: str) -> str:
        return (self.talker_head or self.talker) if stack == "talker" else (self.cp_head or self.cp)

    def as_dict(self) -> dict:
        return dict(talker=self.talker, cp=self.cp, talker_attention=self.talker_attention,
                    cp_attention=self.cp_attention, early=list(self.early) if self.early else None,
                    talker_head=self.talker_head, cp_head=self.cp_head,
                    overrides=[list(o) for o in self.overrides], smooth=self.smooth)

    @classmethod
    def from_dict(cls, d: dict) -> "WeightPlan":
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown weight plan keys: {', '.join(sorted(extra))} "
                             f"(known: {', '.join(sorted(known))})")
        d = dict(d)
        if d.get("early") is not None:
            d["early"] = (float(d["early"][0]), str(d["early"][1]))
        d["overrides"] = tuple((str(a), str(b)) for a, b in d.get("overrides", ()))
        return cls(**d)

def product_bytes(n: int, k: int, kind: str) -> int:
    """Bytes a product of [n, k] weights of ``kind`` reads per call (its layout's real size)."""
    kind = kind_for(n, k, kind)
    if kind == "f32":
        return 4 * n * k
    if kind == "q8":
        return n * k + 8 * n  # bytes, then a scale and a row sum per row
    bits = {"q4": 4, "q5": 5, "q6": 6, "q8g": 8}[kind]
    return n * k * bits // 8 + n * (k // Q4_GROUP) * 4  # codes, then fp16 scale + offset

def frame_weight_bytes(talker_cfg, plan: WeightPlan) -> int:
    """Weight bytes one decode frame reads under ``plan`` (``config.TalkerConfig``): the
    talker's layers and head once, the code predictor's layers, one head and the projection
    once per sub-step (num_code_groups - 1). A frame is bound by these bytes, so this over the
    machine's read bandwidth is the floor of its time (how the profile prices a weight path)."""
    return frame_reads(talker_cfg, plan).total

@dataclass(frozen=True)
class FrameReads:
    """The weight bytes one decode frame reads, by weight kind: the talker's (once) and one
    code-predictor sub-step's (``sub_steps`` times a frame: the same weights again, which a
    large enough cache keeps between sub-steps)."""

    talker: dict[str, int]
    cp: dict[str, int]
    sub_steps: int

    @property
    def total(self) -> int:
        return sum(self.talker.values()) + self.sub_steps * sum(self.cp.values())

    @property
    def cp_bytes(self) -> int:
        return sum(self.cp.values())

def frame_reads(talker_cfg, plan: WeightPlan) -> FrameReads:
    """``FrameReads`` of one decode frame under ``plan`` (``config.TalkerConfig``)."""
    def add(into: dict[str, int], n: int, k: int, kind: str) -> None:
        kk = kind_for(n, k, kind)
        into[kk] = into.get(kk, 0) + product_bytes(n, k, kk)

    def layers(c, stack: str, into: dict[str, int]) -> None:
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
                  "gate_up": (2 * c.intermediate_size, c.hidden_size),
                  "down": (c.hidden_size, c.intermediate_size)}
        for i in range(c.num_hidden_layers):
            for p in PRODUCTS:
                add(into, *shapes[p], plan.kind(stack, i, c.num_hidden_layers, p))

    lm, cp = talker_cfg.lm, talker_cfg.code_predictor
    talker: dict[str, int] = {}
    layers(lm, "talker", talker)
    add(talker, lm.vocab_size, lm.hidden_size, plan.head("talker"))
    sub: dict[str, int] = {}
    layers(cp, "cp", sub)
    add(sub, cp.vocab_size, cp.hidden_size, plan.head("cp"))
    if cp.hidden_size != lm.hidden_size:  # the talker-to-code-predictor projection
        add(sub, cp.hidden_size, lm.hidden_size, plan.head("cp"))
    return FrameReads(talker, sub, talker_cfg.num_code_groups - 1)

def kernel_read_gbs(kind: str, threads: int, n: int = 3072, k: int = 1024, rows: int = 1,
                    seconds: float = 0.05, lib: C.CDLL | None = None) -> float:
    """How fast the runtime's ``kind`` product goes through its weights (GB/s of packed weight
    bytes) when they sit in the cache: a random [n, k] weight (a 0.6B MLP product: ~1.5-3 MB,
    cache-resident) times ``rows`` activation rows, called for ``seconds`` after a warm-up,
    median over five such runs. This is the kernel's own ceiling; a product whose weights come
    from memory runs at the lower of this and the read bandwidth."""
    lib = lib or library()
    packed = pack_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02,
                         None, kind)
    pool = Pool(threads, lib)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    y = torch.empty(rows, packed.n, dtype=torch.float32)
    nbytes = product_bytes(n, k, kind)

    def call() -> None:
        lib.oc_linear(pool.handle, C.byref(packed.struct), x.data_ptr(), rows, y.data_ptr())

    for _ in range(3):
        call()
    rates = []
    for _ in range(5):
        calls, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds / 5 or calls < 3:
            call()
            calls += 1
        rates.append(calls * nbytes / dt / 1e9)
    return statistics.median(rates)
