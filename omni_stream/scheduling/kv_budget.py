"""KV-cache pricing and the memory budget it is admitted against.

A stream is admitted only when the KV cache it can *ever* need fits (no preemption, see
``admission.py``), so the price must be exact, not a guess: it comes from the geometry,

    bytes per position = layers x kv heads x head_dim x 2 (K and V) x dtype bytes,

priced per layer type where layers differ. A full-attention layer keeps every position; a
sliding-window layer keeps at most ``W``, so a stream of ``T`` positions costs
``full_per_token * T + sliding_per_token * min(T, W)``. ``KVCost.flat_per_token`` is the figure
with every layer priced as full (what a static cache that ignores windows allocates).

Where a raw config is ambiguous the price errs high, never low, and says so in ``warnings``:
missing ``head_dim`` -> hidden / heads, missing kv heads -> attention heads (MHA, the larger
cache), an unknown layer type -> full attention.

Our talker engine preallocates a static cache of ``max_slots x max_seq_len`` positions per layer
(``engine/step.KVCache``), so the budget first decides how many slots to allocate
(``plan_slots``); per-stream needs are then what admission sums against the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omni_stream.config import ConfigError, DecoderLMConfig, ModelConfig, TalkerConfig

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2,
    "bf16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1,
}

GiB = 1 << 30


def dtype_nbytes(dtype: int | str | Any) -> int:
    """Bytes per element: an int, a name ("bfloat16", "fp32"...) or anything with ``itemsize``
    (a torch or numpy dtype), so pricing needs no torch import."""
    if isinstance(dtype, bool):
        raise ValueError(f"dtype size must be an int, a dtype name or a dtype, not {dtype!r}")
    if isinstance(dtype, int):
        n = dtype
    elif isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype '{dtype}': use one of {', '.join(sorted(_DTYPE_BYTES))}"
                             " or pass its size in bytes")
        n = _DTYPE_BYTES[key]
    elif hasattr(dtype, "itemsize"):
        n = int(dtype.itemsize)
    else:
        raise ValueError(f"dtype size must be an int, a dtype name or a dtype, not {dtype!r}")
    if n <= 0:
        raise ValueError(f"dtype size must be positive, got {n}")
    return n


@dataclass(frozen=True)
class KVGeometry:
    """What the KV cache of a decoder stack looks like: one entry per layer in ``layer_types``."""

    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads <= 0 or self.head_dim <= 0 or not self.layer_types:
            raise ValueError("KVGeometry needs kv heads > 0, head_dim > 0 and at least one layer")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer types {bad} unknown: expected {' or '.join(LAYER_TYPES)}")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError("sliding_attention layers need a positive sliding_window")

    @classmethod
    def uniform(cls, layers: int, kv_heads: int, head_dim: int) -> "KVGeometry":
        return cls(kv_heads, head_dim, (FULL,) * layers)

    @property
    def num_full(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def num_sliding(self) -> int:
        return self.layer_types.count(SLIDING)


@dataclass(frozen=True)
class KVCost:
    """KV bytes per cached position, split by layer type (all layers of a type together)."""

    full_per_token: int
    sliding_per_token: int = 0
    sliding_window: int | None = None
    num_full: int = 0
    num_sliding: int = 0

    @property
    def flat_per_token(self) -> int:
        """Every layer priced as full attention (the static-cache figure)."""
        return self.full_per_token + self.sliding_per_token

    def bytes_for(self, tokens: int) -> int:
        """Exact bytes for ``tokens`` positions: sliding layers keep min(tokens, W)."""
        kept = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return self.full_per_token * tokens + self.sliding_per_token * kept


def _lm_of(cfg: ModelConfig | TalkerConfig | DecoderLMConfig) -> DecoderLMConfig:
    if isinstance(cfg, ModelConfig):
        return cfg.talker.lm
    if isinstance(cfg, TalkerConfig):
        return cfg.lm
    return cfg


def geometry_from_dict(d: Mapping[str, Any]) -> tuple[KVGeometry, list[str]]:
    """Geometry of a raw decoder config dict (a main ``config.json`` means its talker), with the
    conservative fallbacks described in the module docstring listed as warnings."""
    if isinstance(d.get("talker_config"), Mapping):
        d = d["talker_config"]
    warnings: list[str] = []
    if "num_hidden_layers" not in d:
        raise ConfigError("cannot price the KV cache: config has no 'num_hidden_layers'")
    layers = int(d["num_hidden_layers"])
    heads = d.get("num_attention_heads")
    kv = d.get("num_key_value_heads")
    if kv is None:
        if heads is None:
            raise ConfigError("cannot price the KV cache: neither 'num_key_value_heads' nor "
                              "'num_attention_heads' is set")
        kv = heads
        warnings.append(f"num_key_value_heads missing: assuming {heads} (= attention heads, MHA)")
    head_dim = d.get("head_dim")
    if head_dim is None:
        if heads is None or "hidden_size" not in d:
            raise ConfigError("cannot price the KV cache: 'head_dim' missing and no "
                              "'hidden_size' / 'num_attention_heads' to derive it")
        head_dim = int(d["hidden_size"]) // int(heads)
        warnings.append(f"head_dim missing: assuming hidden_size / heads = {head_dim}")
    window = d.get("sliding_window")
    window = int(window) if window else None
    types = _layer_types(d, layers, window, warnings)
    return KVGeometry(int(kv), int(head_dim), types, window if SLIDING in types else None), warnings


def _layer_types(d: Mapping[str, Any], layers: int, window: int | None,
                 warnings: list[str]) -> tuple[str, ...]:
    raw = d.get("layer_types")
    if raw is not None:
        raw = [str(t) for t in raw]
        if len(raw) != layers:
            warnings.append(f"layer_types has {len(raw)} entries for {layers} layers: "
                            "pricing every layer as full attention")
            return (FULL,) * layers
        unknown = sorted({t for t in raw if t not in LAYER_TYPES})
        if unknown:
            warnings.append(f"unknown layer types {unknown}: priced as full attention")
        out = [t if t in LAYER_TYPES else FULL for t in raw]
        if SLIDING in out and window is None:
            warnings.append("sliding_attention layers without 'sliding_window': priced as full")
            out = [FULL] * layers
        return tuple(out)
    if d.get("use_sliding_window") and window is not None:
        # Qwen2/3 convention: layers at index >= max_window_layers use the window.
        if "max_window_layers" not in d:
            warnings.append("use_sliding_window without max_window_layers: priced as full attention")
            return (FULL,) * layers
        first = int(d["max_window_layers"])
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    return (FULL,) * layers


def kv_geometry(cfg: ModelConfig | TalkerConfig | DecoderLMConfig | KVGeometry | Mapping[str, Any]
                ) -> tuple[KVGeometry, list[str]]:
    """Geometry plus warnings. Parsed configs are unambiguous and priced all-full: the engine
    runs every talker layer as full attention (``DecoderLMConfig`` refuses sliding windows)."""
    if isinstance(cfg, KVGeometry):
        return cfg, []
    if isinstance(cfg, Mapping):
        return geometry_from_dict(cfg)
    lm = _lm_of(cfg)
    return KVGeometry.uniform(lm.num_hidden_layers, lm.num_key_value_heads, lm.head_dim), []


def kv_bytes_per_token(cfg: ModelConfig | TalkerConfig | DecoderLMConfig | KVGeometry
                       | Mapping[str, Any], dtype_bytes: int | str | Any) -> KVCost:
    """Per-position KV bytes of ``cfg``'s talker (or the stack it describes) at ``dtype_bytes``.

    ``.flat_per_token`` prices every layer as full; ``.bytes_for(T)`` is the exact per-layer-type
    figure for ``T`` positions. Fallback warnings of a raw dict are dropped here; use
    ``kv_geometry`` or ``kv_budget_for`` to see them."""
    geo, _ = kv_geometry(cfg)
    per_layer = geo.num_key_value_heads * geo.head_dim * 2 * dtype_nbytes(dtype_bytes)
    return KVCost(full_per_token=per_layer * geo.num_full,
                  sliding_per_token=per_layer * geo.num_sliding,
                  sliding_window=geo.sliding_window if geo.num_sliding else None,
                  num_full=geo.num_full, num_sliding=geo.num_sliding)


def code_predictor_scratch_bytes(cfg: ModelConfig | TalkerConfig | DecoderLMConfig
                                 | Mapping[str, Any], slots: int, *,
                                 dtype_bytes: int | str | Any, positions: int | None = None) -> int:
    """Bytes of the code predictor's per-slot cache: ``positions`` (the number of code groups,
    16: [hidden, code0] then 14 sub-steps) per slot, rebuilt every frame but allocated once.

    A ``DecoderLMConfig`` is taken as the code predictor itself; a raw dict may be the main
    config, a talker config or the code predictor's own block."""
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    groups = 16
    if isinstance(cfg, ModelConfig):
        cfg = cfg.talker
    if isinstance(cfg, TalkerConfig):
        cp, groups = cfg.code_predictor, cfg.num_code_groups
        geo = KVGeometry.uniform(cp.num_hidden_layers, cp.num_key_value_heads, cp.head_dim)
    elif isinstance(cfg, DecoderLMConfig):
        geo = KVGeometry.uniform(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    else:
        d = cfg.get("talker_config", cfg)
        groups = int(d.get("num_code_groups", groups))
        d = d.get("code_predictor_config", d)
        groups = int(d.get("num_code_groups", groups))
        geo, _ = geometry_from_dict(d)
    n = positions if positions is not None else groups
    return slots * kv_bytes_per_token(geo, dtype_bytes).bytes_for(n)


@dataclass(frozen=True)
class KVBudget:
    """The KV memory streams are admitted against.

    ``total_bytes`` is the memory set aside for KV; ``headroom`` the usable share of it (the
    rest absorbs activations, fragmentation, allocator slack). Needs are rounded up to whole
    ``block_tokens`` blocks so the figure matches a block allocator and never under-counts.
    ``bytes_per_token`` prices full-attention layers; sliding layers, if any, add
    ``sliding_bytes_per_token`` for at most ``sliding_window`` positions.
    """

    total_bytes: int
    bytes_per_token: int
    block_tokens: int = 16
    headroom: float = 0.9
    sliding_bytes_per_token: int = 0
    sliding_window: int | None = None
    source: str = "explicit"
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.total_bytes < 0:
            raise ValueError(f"total_bytes must be >= 0, got {self.total_bytes}")
        if self.bytes_per_token < 0 or self.sliding_bytes_per_token < 0:
            raise ValueError("bytes per token must be >= 0")
        if self.bytes_per_token + self.sliding_bytes_per_token <= 0:
            raise ValueError("a KV budget needs a positive price per token")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not 0.0 < self.headroom <= 1.0:
            raise ValueError(f"headroom must be in (0, 1], got {self.headroom}")
        if self.sliding_bytes_per_token and (self.sliding_window or 0) <= 0:
            raise ValueError("sliding_bytes_per_token needs a positive sliding_window")

    @property
    def usable_bytes(self) -> int:
        return int(self.total_bytes * self.headroom)

    def round_tokens(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens) * self.block_tokens

    def bytes_for_tokens(self, tokens: int, *, rounded: bool = True) -> int:
        t = self.round_tokens(tokens) if rounded else tokens
        cost = self.bytes_per_token * t
        if self.sliding_bytes_per_token:
            w = self.round_tokens(self.sliding_window) if rounded else self.sliding_window
            cost += self.sliding_bytes_per_token * min(t, w)
        return cost

    def need_bytes(self, prompt_tokens: int, max_frames: int) -> int:
        """All the KV a stream can ever hold: prompt + max_frames + 1 positions, block-rounded
        (the +1 is the position written by the step after the last frame)."""
        if prompt_tokens < 0 or max_frames < 0:
            raise ValueError("prompt_tokens and max_frames must be >= 0")
        return self.bytes_for_tokens(prompt_tokens + max_frames + 1)

    def fits(self, used: int, need: int) -> bool:
        return used + need <= self.usable_bytes

    def max_tokens(self) -> int:
        """Positions the usable budget holds for one stream (full price per position)."""
        return self.usable_bytes // (self.bytes_per_token + self.sliding_bytes_per_token)

    def describe(self) -> str:
        layers = (f"{_fmt(self.bytes_per_token)}/token full"
                  + (f" + {_fmt(self.sliding_bytes_per_token)}/token sliding (W={self.sliding_window})"
                     if self.sliding_bytes_per_token else ""))
        warn = f"; {len(self.warnings)} warning(s): {'; '.join(self.warnings)}" if self.warnings else ""
        return (f"KV budget {_fmt(self.usable_bytes)} usable of {_fmt(self.total_bytes)} "
                f"(headroom {self.headroom:.2f}, from {self.source}); {layers}; "
                f"{self.block_tokens}-token blocks; ~{self.max_tokens():,} tokens{warn}")


def _fmt(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def kv_budget_for(config: ModelConfig | TalkerConfig | DecoderLMConfig | KVGeometry
                  | Mapping[str, Any], *, dtype_bytes: int | str | Any,
                  memory_bytes: int | None = None, weights_bytes: int | None = None,
                  free_memory_bytes: int | None = None, setting_bytes: int | None = None,
                  block_tokens: int = 16, headroom: float = 0.9) -> KVBudget:
    """The KV budget for ``config`` on this machine.

    Precedence: ``setting_bytes`` (an operator's explicit figure, taken as-is: headroom 1.0)
    > ``free_memory_bytes`` > ``memory_bytes``; from memory, the budget is
    (memory - ``weights_bytes``) x ``headroom``. ``weights_bytes`` is what the weights will still
    take out of that memory (pass 0 / None when the free figure was measured after loading them).
    Warnings (config fallbacks, weights not subtracted, nothing left) are in ``.warnings``."""
    geo, warnings = kv_geometry(config)
    cost = kv_bytes_per_token(geo, dtype_bytes)
    if setting_bytes is not None:
        if setting_bytes <= 0:
            raise ValueError(f"the KV budget setting must be positive, got {setting_bytes} bytes")
        total, source, headroom = int(setting_bytes), "setting", 1.0
    else:
        if free_memory_bytes is not None:
            mem, source = int(free_memory_bytes), "free memory"
        elif memory_bytes is not None:
            mem, source = int(memory_bytes), "device memory"
        else:
            raise ValueError("kv_budget_for needs setting_bytes, free_memory_bytes or memory_bytes")
        if weights_bytes is None:
            if free_memory_bytes is None:
                warnings.append("weights_bytes not given: device memory taken as all free for KV")
            weights = 0
        else:
            weights, source = int(weights_bytes), source + " - weights"
        total = mem - weights
        if total <= 0:
            warnings.append(f"no memory left for KV ({_fmt(mem)} memory, {_fmt(weights)} weights)")
            total = 0
    return KVBudget(total_bytes=total, bytes_per_token=cost.full_per_token,
                    block_tokens=block_tokens, headroom=headroom,
                    sliding_bytes_per_token=cost.sliding_per_token,
                    sliding_window=cost.sliding_window, source=source, warnings=tuple(warnings))


def plan_slots(budget: KVBudget, max_seq_len: int, *, scratch_bytes_per_slot: int = 0,
               max_slots: int | None = None) -> int:
    """How many talker slots of ``max_seq_len`` positions the budget can preallocate.

    The engine's static cache holds ``max_slots x max_seq_len`` positions per layer whatever the
    streams use, so a slot costs a full ``max_seq_len`` (exact, not block-rounded: the buffers are
    not paged) plus ``scratch_bytes_per_slot`` (the code predictor's per-slot cache, see
    ``code_predictor_scratch_bytes(cfg, 1, ...)``). Sliding layers, if a budget has any, are
    priced at their window (a ring-buffer cache); today's talker has none. Capped at
    ``max_slots``; 0 means not even one slot fits.

    With a static cache sized this way, admission's byte check never binds before the slot cap
    for streams within ``max_seq_len``; it binds when slots x max_seq_len is deliberately
    over-subscribed or the cache is paged."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    per_slot = budget.bytes_for_tokens(max_seq_len, rounded=False) + scratch_bytes_per_slot
    n = budget.usable_bytes // per_slot
    return int(n if max_slots is None else min(n, max_slots))


def static_cache_bytes(budget: KVBudget, slots: int, max_seq_len: int) -> int:
    """Bytes the static cache of ``slots x max_seq_len`` takes (for logs and checks)."""
    return slots * budget.bytes_for_tokens(max_seq_len, rounded=False)


__all__ = [
    "FULL", "SLIDING", "KVBudget", "KVCost", "KVGeometry", "code_predictor_scratch_bytes",
    "dtype_nbytes", "geometry_from_dict", "kv_budget_for", "kv_bytes_per_token", "kv_geometry",
    "plan_slots", "static_cache_bytes",
]
