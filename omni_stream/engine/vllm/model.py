"""The talker's decoder inside vLLM: the model class the plugin registers (imports vLLM).

vLLM runs token ids through its scheduler, paged KV cache and attention kernels; the talker's
input at a decode step is no token but the sum of the previous frame's 16 code embeddings and a
text-track row, computed by omni-stream's frame engine, and vLLM (0.32) has no hook for a
per-decode-step input embedding (``prompt_embeds`` covers the prompt only). So the ids this
model sees are not codes: every token of a request carries the request's engine slot, its
prompt is ``[slot] * length`` and the "sampled" next token is the slot again (``compute_logits``
returns logits that make greedy sampling pick it). The frame engine writes the inputs of each
step into ``feed`` before it asks vLLM to step; ``forward`` reads row (slot, position) for
every token, runs the Qwen3 stack (built here on vLLM's paged attention, RMSNorm and rotary kernels;
torch's GEMMs, ``TalkerStack`` says why) and
stores the normed hidden state of each slot's last fed position in ``out``, which the frame
engine reads back to draw codes with its own sampling chain. The code predictor, the codec head
and the sampler stay in the frame engine: they run per frame over a 16-position cache that
paging cannot help.

Only the decoder stack is a parameter of this model; vLLM's loader reads it from the checkpoint
folder (released layout) and ``load_weights`` maps it through omni-stream's strict key map.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

ARCHITECTURE = "OmniStreamTalker"
PICK = 0.0      # logit of the slot id (the token greedy sampling must take)
NEVER = -1e9    # every other id


class Feed:
    """Inputs of one vLLM step: ``rows`` [S, W, C] the embeddings of slot s at positions
    ``pos0[s] .. pos0[s] + n[s] - 1`` (n = 0: the slot feeds nothing this step)."""

    def __init__(self, slots: int, width: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rows = torch.zeros(slots, width, hidden, dtype=dtype, device=device)
        self.pos0 = torch.zeros(slots, dtype=torch.int64, device=device)
        self.n = torch.zeros(slots, dtype=torch.int64, device=device)


class OmniStreamTalker(nn.Module):
    """Qwen3-TTS talker decoder for vLLM; ids are engine slots (module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.config = cfg
        self.slots = int(cfg.vocab_size)
        self.model = TalkerStack(vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.feed: Feed | None = None
        self.out: torch.Tensor | None = None  # [S, C] last hidden state per slot
        self._run_slots: torch.Tensor | None = None

    def bind(self, feed: Feed, out: torch.Tensor) -> None:
        self.feed, self.out = feed, out

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self._inputs(input_ids, None)[0]

    def _inputs(self, ids: torch.Tensor, positions: torch.Tensor | None):
        f = self.feed
        if f is None:
            raise RuntimeError("the talker model runs only inside omni-stream's vLLM engine, "
                               "which feeds its inputs")
        s = ids.clamp(0, self.slots - 1)
        if positions is None:  # embedding alone (no position): the step's first row per slot
            positions = f.pos0[s]
        k = positions - f.pos0[s]
        valid = (ids >= 0) & (ids < self.slots) & (k >= 0) & (k < f.n[s])
        x = f.rows[s, k.clamp(0, f.rows.shape[1] - 1)]
        return torch.where(valid.unsqueeze(-1), x, torch.zeros_like(x)), s, k, valid

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if input_ids is None:
            raise RuntimeError("the talker model needs its slot ids (prompt embeddings are "
                               "not used: the feed carries every input)")
        x, s, k, valid = self._inputs(input_ids, positions)
        hidden = self.model(positions, x)
        f = self.feed
        last = valid & (k == f.n[s] - 1)  # each fed slot's last position this step
        self.out[s[last]] = hidden[last].to(self.out.dtype)
        # logits rows are the last token of every scheduled request, in batch order; a
        # request's tokens are contiguous and carry its slot, so runs of equal ids are requests
        vs = s[valid]
        if vs.numel():
            ends = torch.ones_like(vs, dtype=torch.bool)
            ends[:-1] = vs[1:] != vs[:-1]
            self._run_slots = vs[ends]
        else:
            self._run_slots = vs
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        logits = torch.full((n, self.slots), NEVER, dtype=torch.float32, device=hidden_states.device)
        slots = self._run_slots
        if slots is None or slots.numel() != n:
            raise RuntimeError(f"{n} logits rows for {0 if slots is None else slots.numel()} "
                               "fed requests: the batch is not laid out as the feed expects")
        logits[torch.arange(n, device=logits.device), slots] = PICK
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loader streams the checkpoint's tensors (the released layout: the model
        folder links the checkpoint's weight files); the talker decoder's are
        ``talker.model.layers.*`` and ``talker.model.norm.weight``, the key map of omni-stream's
        own ``DecoderStack``. Every one of them must come, with its shape, or this raises;
        everything else (embeddings, heads, code predictor, speaker encoder) is the frame
        engine's."""
        want = stack_keys(self.config)
        got: dict[str, tuple[int, ...]] = {}
        unexpected: list[str] = []

        def ours():
            for name, t in weights:
                if name.startswith(STACK_PREFIX):
                    key = name[len(STACK_PREFIX):]
                    if key in want:
                        got[key] = tuple(t.shape)
                        if got[key] == want[key]:
                            yield key, t
                    elif key.startswith(("layers.", "norm.")):
                        unexpected.append(name)
        loaded = self.model.load_weights(ours())
        missing = sorted(STACK_PREFIX + k for k in set(want) - set(got))
        bad = sorted(f"{STACK_PREFIX}{k} {shape} (config: {want[k]})"
                     for k, shape in got.items() if want[k] != shape)
        if missing or bad or unexpected:
            raise ValueError("checkpoint does not hold the talker decoder this config implies:"
                             + (f" missing {', '.join(missing[:6])}" if missing else "")
                             + (f" mis-shaped {', '.join(bad[:6])}" if bad else "")
                             + (f" unexpected {', '.join(sorted(unexpected)[:6])}"
                                if unexpected else ""))
        return {f"model.{n}" for n in loaded}


STACK_PREFIX = "talker.model."


def stack_keys(cfg) -> dict[str, tuple[int, ...]]:
    """omni-stream's talker decoder keys (under ``talker.model.``) and shapes for the dims of
    ``cfg`` (the talker's vLLM config): the strict key map of ``models.layers.DecoderStack``."""
    from omni_stream.config import DecoderLMConfig
    from omni_stream.models.layers import DecoderStack

    dims = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    lm = DecoderLMConfig(**{f: int(getattr(cfg, f)) for f in dims})
    with torch.device("meta"):
        stack = DecoderStack(lm)
    return {k: tuple(v.shape) for k, v in stack.state_dict().items()}


# ---------------------------------------------------------------- the decoder on vLLM's layers
# head sizes vLLM's CPU attention kernels take; a smaller head (the tiny test preset's 16) runs
# zero-padded to the next one, which changes no score (zeros add nothing to q.k) and no output
# (the padded value columns are zero and are cut off)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def attention_head_size(head_dim: int) -> int:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or head_dim in CPU_HEAD_SIZES:
        return head_dim
    for size in CPU_HEAD_SIZES:
        if size >= head_dim:
            return size
    raise ValueError(f"head_dim {head_dim} is larger than vLLM's CPU attention takes")


def rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 1e6)))


class TalkerAttention(nn.Module):
    """Qwen3 attention: q/k/v projections, RMSNorm per head on q and k, rotary (neox halves, as
    omni-stream's ``apply_rope``), vLLM's paged attention."""

    def __init__(self, cfg, cache_config, prefix: str) -> None:
        super().__init__()
        h, kv, d, c = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, kv * d, bias=False)
        self.v_proj = nn.Linear(c, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rotary_emb = get_rope(d, max_position=cfg.max_position_embeddings, is_neox_style=True,
                                   rope_parameters={"rope_type": "default",
                                                    "rope_theta": rope_theta(cfg)})
        self.pad = attention_head_size(d) - d
        self.attn = Attention(h, d + self.pad, d ** -0.5, num_kv_heads=kv,
                              cache_config=cache_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(n, self.h, self.d)).reshape(n, -1)
        k = self.k_norm(self.k_proj(x).reshape(n, self.kv, self.d)).reshape(n, -1)
        v = self.v_proj(x)
        q, k = self.rotary_emb(positions, q, k)
        if self.pad:
            def wide(t, heads):
                return nn.functional.pad(t.reshape(n, heads, self.d), (0, self.pad)).reshape(n, -1)
            q, k, v = wide(q, self.h), wide(k, self.kv), wide(v, self.kv)
        o = self.attn(q, k, v)
        if self.pad:
            o = o.reshape(n, self.h, self.d + self.pad)[..., :self.d].reshape(n, -1)
        return self.o_proj(o)


class TalkerMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        c, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(c, f, bias=False)
        self.up_proj = nn.Linear(c, f, bias=False)
        self.down_proj = nn.Linear(f, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class TalkerLayer(nn.Module):
    def __init__(self, cfg, cache_config, prefix: str) -> None:
        super().__init__()
        self.self_attn = TalkerAttention(cfg, cache_config, f"{prefix}.self_attn")
        self.mlp = TalkerMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TalkerStack(nn.Module):
    """Layers + final norm over input rows [N, C] at positions [N] -> normed hidden [N, C].

    The parameter names are omni-stream's (``layers.N.self_attn.q_proj.weight``, ...). The
    projections are torch linears, not vLLM's: on CPUs vLLM's unquantized GEMM is oneDNN with
    weights packed per call shape, whose rows round differently with the batch size (measured:
    with 3 streams in one step, one stream's greedy codes parted from its batch-1 codes at
    frame 94), so a stream's speech would depend on who else is speaking. torch's GEMM gives
    every row the same bits at any batch size, the torch engine's bits (greedy parity), and is
    what vLLM itself runs for unquantized weights on CUDA."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        cache = vllm_config.cache_config
        self.layers = nn.ModuleList(TalkerLayer(cfg, cache, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        done = set()
        for key, t in weights:
            p = params[key]
            getattr(p, "weight_loader", default_weight_loader)(p, t)
            done.add(key)
        return done
