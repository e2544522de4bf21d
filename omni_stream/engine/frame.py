"""The per-frame engine: talker + code predictor over fixed batch slots with static KV caches.

One ``step(P)`` advances every slot in ``[0, P)`` by one 80 ms frame:
  15 code-predictor sub-steps (fresh per-frame cache) -> the frame's 16 codes
  -> talker input = sum of the 16 code embeddings + the text-track embedding
  -> one talker step -> sampled codebook-0 of the next frame.
The step has no data-dependent Python branching and no host sync; the caller reads the new
codebook-0 ids once per frame to detect end of stream. Slots outside ``[0, P)`` are untouched,
so a scheduler that packs streams into the lowest free slots pays only for what runs.

Every code is checked where it is produced: a talker draw must be a codebook id (below the
codebook size) or eos, a code-predictor draw a codebook id. A row that fails either check (a
stream whose logits went NaN, or a sampler fault) gets ``INVALID`` as its next codebook-0 id;
its frame must not be emitted and its stream must be failed (``scrub`` then cleans the slot).
Lookups clamp their ids, so one bad row never raises inside the batched step: the other rows
compute exactly what they would have without it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from omni_stream.config import TalkerConfig
from omni_stream.engine.runtime import TalkerRuntime
from omni_stream.engine.step import KVCache, Rope
from omni_stream.engine.sampling import (INVALID, SamplingParams, SlotSampling, apply_repetition_penalty,
                                         candidates_needed, sample)
from omni_stream.models.talker import Talker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineShape:
    """Static sizes of the engine's buffers."""

    max_slots: int = 4
    max_seq_len: int = 2048  # talker cache positions per slot: prompt + frames
    max_trailing: int = 512  # text-track rows fed during decoding (text-streaming mode)

    def __post_init__(self) -> None:
        if self.max_slots <= 0 or self.max_seq_len <= 1 or self.max_trailing <= 0:
            raise ValueError("EngineShape sizes must be positive")


def talker_scores(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor,
                  block_eos: torch.Tensor, suppress: torch.Tensor,
                  eos_col: torch.Tensor) -> torch.Tensor:
    """The talker's processed scores [B, V] fp32: repetition penalty over the codebook-0
    history ``seen`` [B, V], then -inf on the suppressed ids [V] and, for rows still under
    min_new_tokens (``block_eos`` [B]), on eos (``eos_col`` [V])."""
    scores = apply_repetition_penalty(logits.float(), seen, penalty)
    banned = suppress.unsqueeze(0) | (block_eos.unsqueeze(1) & eos_col.unsqueeze(0))
    return scores.masked_fill(banned, float("-inf"))


class FrameEngine:
    def __init__(self, talker: Talker, shape: EngineShape, device: torch.device | str = "cpu",
                 cache_dtype: torch.dtype | None = None) -> None:
        self.talker = talker
        self.cfg: TalkerConfig = talker.cfg
        self.shape = shape
        self.device = torch.device(device)
        wdtype = talker.model.codec_embedding.weight.dtype  # (linears may be quantized)
        self.dtype = wdtype
        cdtype = cache_dtype or wdtype
        lm, cp = self.cfg.lm, self.cfg.code_predictor
        s = shape.max_slots
        self.kv = KVCache(lm, s, shape.max_seq_len, cdtype, self.device)
        self.cp_kv = KVCache(cp, s, self.cfg.num_code_groups, cdtype, self.device)
        self.rope = Rope(lm, shape.max_seq_len, self.device)
        self.cp_rope = Rope(cp, self.cfg.num_code_groups + 1, self.device)
        dev = self.device
        self.pos = torch.zeros(s, dtype=torch.int64, device=dev)
        self.last_hidden = torch.zeros(s, lm.hidden_size, dtype=wdtype, device=dev)
        self.last_code0 = torch.zeros(s, dtype=torch.int64, device=dev)
        self.seen = torch.zeros(s, lm.vocab_size, dtype=torch.bool, device=dev)
        self.n_gen = torch.zeros(s, dtype=torch.int64, device=dev)
        self.gen_step = torch.zeros(s, dtype=torch.int64, device=dev)
        self.trailing = torch.zeros(s, shape.max_trailing + 1, lm.hidden_size, dtype=wdtype, device=dev)
        self.trailing_len = torch.zeros(s, dtype=torch.int64, device=dev)
        # slots holding a running stream; idle and partly-prefilled slots inside [0, p) are
        # computed by step() but do not advance
        self.active = torch.zeros(s, dtype=torch.bool, device=dev)
        self.seed = torch.zeros(s, dtype=torch.int64, device=dev)
        self.counter = torch.zeros(s, dtype=torch.int64, device=dev)
        self.penalty = torch.ones(s, dtype=torch.float32, device=dev)
        self.min_new = torch.zeros(s, dtype=torch.int64, device=dev)
        self.talk_sp = SlotSampling.empty(s, dev)
        self.cp_sp = SlotSampling.empty(s, dev)
        # sampling candidates each slot needs (host-side: the step reads a Python int, no sync)
        self._cand_talk = [1] * s
        self._cand_cp = [1] * s
        self.codebook_size = self.cfg.code_predictor.vocab_size
        suppress = torch.zeros(lm.vocab_size, dtype=torch.bool, device=dev)
        suppress[list(self.cfg.suppressed_ids)] = True
        self.suppress = suppress
        self.eos = self.cfg.special.codec_eos
        eos_col = torch.zeros(lm.vocab_size, dtype=torch.bool, device=dev)
        eos_col[self.eos] = True
        self._eos_col = eos_col
        self._arange = torch.arange(s, device=dev)
        self._true = torch.ones((), dtype=torch.bool, device=dev)
        g = self.cfg.num_code_groups
        # code-predictor positions per sub-step: [0, 1] for the 2-token prefill, then 2..G-1
        self._cp_pos0 = torch.tensor([[0, 1]], device=dev).expand(s, 2)
        self._cp_pos = [torch.full((s, 1), j, dtype=torch.int64, device=dev) for j in range(g + 1)]
        # static_live: attend over the whole cache with a mask instead of slicing to the live
        # length (no host sync: required for CUDA-graph capture; see omni_stream.engine.graphs)
        self.static_live = False
        # what computes the step (engine.runtime): torch ops until use_native / use_vllm
        self.runtime: TalkerRuntime = TalkerRuntime(self)
        # where codes 1..G-1 come from when not from the runtime's code predictor: a remote
        # code-predictor stage, speculative prediction (use_residual)
        self._residual_source = None

    def use_native(self, talker_kind: str = "q4", cp_kind: str = "q4",
                   threads: int | None = None, *, lent_cpus: tuple[int, ...] = (),
                   lease=None, pack_cache=None, plan=None) -> None:
        """Run the talker step, its head, prefill and the code predictor's frame on the CPU
        runtime (``engine/cpu``) with the given weight paths; the engine's state is shared.
        ``lent_cpus``/``lease``: extra runtime threads on cores lent by another process while
        it does not hold the lease (``engine.cpu.pool.Pool``). ``pack_cache``: a file where
        the packed weights are kept between starts (``engine.cpu.packing.PackCache``). ``plan``: a
        ``engine.cpu.plans.WeightPlan`` (kind per product) instead of the two kinds."""
        from omni_stream.engine.cpu.native import NativeRunner

        if self.device.type != "cpu":
            raise ValueError(f"the CPU runtime runs on the CPU, not {self.device}")
        if self.runtime.name != "torch":
            raise ValueError(f"this engine already runs on {self.runtime.name}: pick one runtime")
        self.runtime = NativeRunner(self, talker_kind, cp_kind, threads, lent_cpus=lent_cpus,
                                    lease=lease, pack_cache=pack_cache, plan=plan)

    def use_vllm(self, model_path, threads: int | None = None) -> None:
        """Run the talker decoder and its KV cache on vLLM (``engine/vllm``): its scheduler
        places every step's tokens and its paged cache holds the streams' past; inputs, codes
        and the code predictor stay here; ``model_path``: the checkpoint folder vLLM reads the
        decoder's weights from (the same weights as this engine's). Frees this engine's own
        talker cache."""
        from omni_stream.engine.vllm.runner import VllmTalker

        if self.runtime.name != "torch":
            raise ValueError(f"this engine already runs on {self.runtime.name}: the vLLM engine "
                             "and the CPU runtime are two engines, pick one")
        self.runtime = VllmTalker(self, model_path, threads)
        self.kv = KVCache(self.cfg.lm, self.shape.max_slots, 1, self.kv.layers[0][0].dtype, self.device)
        # vLLM holds the decoder's weights now: drop this copy (the embeddings, heads and code
        # predictor stay; 1.7 GB at 0.6B in fp32)
        self.talker.model.layers = torch.nn.ModuleList()

    # ------------------------------------------------------------------ per-slot control
    def prefill(self, slot: int, embeds: torch.Tensor, trailing: torch.Tensor,
                params: SamplingParams, seed: int, start: int = 0, final: bool = True,
                total: int | None = None) -> int | None:
        """Run prompt positions [start, start + T) (embeds [T, C]) into ``slot``.

        A prompt may be fed in pieces (chunked prefill: ``final=False`` until the last piece);
        the first piece (``start == 0``) resets the slot's state. The last piece draws and
        returns the first codebook-0 id. ``trailing`` [N, C] are the text-track rows added to
        the decode steps (then tts_pad); only read on the first piece. ``total``: the whole
        prompt's positions (the vLLM engine needs it with the first of several pieces)."""
        t = embeds.shape[0]
        if start + t + 1 > self.shape.max_seq_len:
            raise ValueError(f"prompt of {start + t} positions does not fit max_seq_len {self.shape.max_seq_len}")
        if total is not None and (total < start + t or (final and total != start + t)):
            raise ValueError(f"a piece ending at {start + t} does not fit a prompt of {total} positions")
        if start == 0:
            self._reset_slot(slot, trailing, params, seed)
            self.runtime.start(slot, total if total is not None else (t if final else None))
        elif int(self.pos[slot]) != start:
            raise ValueError(f"slot {slot} holds {int(self.pos[slot])} prompt positions, not {start}")
        hidden = self.runtime.prefill(slot, embeds.to(self.dtype), start)  # [1, C]
        self.pos[slot] = start + t
        if not final:
            return None
        # history is reset only now: decode steps may have run over this slot between pieces
        self.seen[slot] = False
        self.n_gen[slot] = 0
        self.gen_step[slot] = 0
        self.counter[slot] = 0
        self.active[slot] = True
        self.last_hidden[slot] = hidden[0]
        sl = slice(slot, slot + 1)
        code0 = self._talker_draw(hidden, sl)
        return int(code0[0])

    def _reset_slot(self, slot: int, trailing: torch.Tensor, params: SamplingParams, seed: int) -> None:
        if trailing.shape[0] > self.shape.max_trailing:
            raise ValueError(f"{trailing.shape[0]} text-track rows exceed max_trailing {self.shape.max_trailing}")
        self.talk_sp.set(slot, not params.do_sample, params.temperature, params.top_k, params.top_p)
        self.cp_sp.set(slot, not params.sub_do_sample, params.sub_temperature, params.sub_top_k, params.sub_top_p)
        self.set_candidates(slot, params)
        self.penalty[slot] = params.repetition_penalty
        self.min_new[slot] = params.min_new_tokens
        self.seed[slot] = seed
        self.active[slot] = False
        n = trailing.shape[0]
        self.trailing[slot, :n] = trailing.to(self.dtype)
        self.trailing[slot, n:] = self.pad_row
        self.trailing_len[slot] = n

    def append_trailing(self, slot: int, rows: torch.Tensor) -> None:
        """Add text-track rows [n, C] after the slot's current ones (continuous text: more of
        the text arrived while the stream runs). ValueError past ``max_trailing``."""
        n, cur = rows.shape[0], int(self.trailing_len[slot])
        if cur + n > self.shape.max_trailing:
            raise ValueError(f"the text grew past {self.shape.max_trailing} tokens, the most one "
                             "stream takes: close the utterance and continue in a new one")
        self.trailing[slot, cur:cur + n] = rows.to(self.dtype)
        self.trailing_len[slot] = cur + n

    def _slot_state(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor a frame step moves on (the KV row it writes at ``pos`` is
        rewritten by the slot's next real step, and attention masks past ``pos``)."""
        return (self.active, self.pos, self.gen_step, self.last_hidden, self.last_code0,
                self.seen, self.n_gen, self.counter)

    @contextlib.contextmanager
    def holding(self, slots: list[int]):
        """Frame steps inside leave ``slots`` exactly as they were: a continuous stream waiting
        for its next text token sits out while the rest of the batch goes on. Their rows are
        computed and must be ignored by the caller."""
        if not slots:
            yield
            return
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        saved = [t[idx].clone() for t in self._slot_state()]
        self.active[idx] = False
        try:
            yield
        finally:
            for t, s in zip(self._slot_state(), saved):
                t[idx] = s

    def set_candidates(self, slot: int, params: SamplingParams) -> None:
        """Record how many top-scoring tokens the slot's draws must consider (1 when greedy)."""
        lm_v, cp_v = self.cfg.lm.vocab_size, self.codebook_size
        self._cand_talk[slot] = candidates_needed(params.top_k, lm_v) if params.do_sample else 1
        self._cand_cp[slot] = candidates_needed(params.sub_top_k, cp_v) if params.sub_do_sample else 1

    def set_cp_candidates(self, top_k: list[int], greedy: list[bool]) -> None:
        """The code predictor's candidate needs of rows [0, len(top_k)), for an engine that
        receives its rows' sampling settings per request (the split code-predictor stage)."""
        for row, (k, g) in enumerate(zip(top_k, greedy)):
            self._cand_cp[row] = 1 if g else candidates_needed(k, self.codebook_size)

    def release(self, slot: int) -> None:
        """The slot's stream is over: stop advancing it (its state is reset by the next prefill)."""
        self.active[slot] = False
        self._cand_talk[slot] = self._cand_cp[slot] = 1
        self.runtime.release(slot)

    def scrub(self, slot: int) -> None:
        """Release a slot whose stream failed and wipe what it may have poisoned: its KV rows
        (a NaN in a masked cache position still reaches attention as 0 * NaN), last hidden
        state, text-track rows and codes. Idle rows inside a batch then compute finite values."""
        self.release(slot)
        self.kv.clear(slot, int(self.pos[slot]) + 1)
        self.cp_kv.clear(slot)
        self.last_hidden[slot] = 0
        self.last_code0[slot] = 0
        self.trailing[slot] = self.pad_row
        self.trailing_len[slot] = 0

    @property
    def pad_row(self) -> torch.Tensor:
        if not hasattr(self, "_pad_row"):
            ids = torch.tensor([self.cfg.special.tts_pad], device=self.device)
            self._pad_row = self.talker.text_embed(ids)[0].to(self.dtype)
        return self._pad_row

    # ------------------------------------------------------------------ the frame step
    def talker_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The codec head on normed hidden states [B, C] -> fp32 logits [B, V]."""
        return self.runtime.logits(hidden)

    def _talker_draw(self, hidden: torch.Tensor, sl: slice) -> torch.Tensor:
        """hidden [B, C] (normed) -> next codebook-0 ids [B] (INVALID where the draw is not a
        codebook id or eos); updates history for rows ``sl``."""
        logits = self.talker_logits(hidden)
        scores = talker_scores(logits, self.seen[sl], self.penalty[sl],
                               self.n_gen[sl] < self.min_new[sl], self.suppress, self._eos_col)
        code0 = sample(scores, self.talk_sp.slice(sl), self.seed[sl], self.counter[sl],
                       max(self._cand_talk[sl]))
        # validation at the source: a codebook id or eos, nothing else leaves the talker
        safe = code0.clamp(0, self.cfg.lm.vocab_size - 1)
        ok = (code0 >= 0) & (code0 < self.cfg.lm.vocab_size) & ~self.suppress[safe]
        code0 = torch.where(ok, code0, torch.full_like(code0, INVALID))
        self.counter[sl] += 1
        rows = self._arange[sl]
        self.seen[rows, safe] = self._true  # a device tensor: a CUDA graph cannot copy a host True
        self.n_gen[sl] += 1
        self.last_code0[sl] = code0
        return code0

    def predict_residual(self, p: int) -> torch.Tensor:
        """The runtime's code predictor for slots [0, p): codes 1..G-1 [p, G-1] of the current
        frame; a row with any draw outside the codebook is INVALID in every column."""
        return self.runtime.residual(p)

    @property
    def residual_source(self):
        """Where ``step`` takes codes 1..G-1 from: ``fn(p) -> [p, G-1]`` (``predict_residual``'s
        contract)."""
        return self._residual_source or self.runtime.residual

    def use_residual(self, source=None) -> None:
        """Take codes 1..G-1 from ``source(p)`` (a remote code-predictor stage, speculative
        prediction, a timing wrapper); None: the runtime's own code predictor."""
        self._residual_source = source

    @contextlib.contextmanager
    def residual_given(self, codes: torch.Tensor):
        """Frame steps inside take codes 1..G-1 ``codes`` [p, G-1] as given (teacher forcing:
        evaluation.fidelity), then the source before comes back."""
        saved = self._residual_source
        self._residual_source = lambda _p: codes
        try:
            yield
        finally:
            self._residual_source = saved

    def follow_draws(self, other: "FrameEngine", rows: int) -> None:
        """Take the codebook-0 ids and draw history of slots [0, rows) from ``other`` (an engine
        over the same model): the next frame of each starts from the other's draws."""
        self.last_code0[:rows] = other.last_code0[:rows]
        self.seen[:rows] = other.seen[:rows]

    def inject_fault(self, slot: int, part: str) -> None:
        """Poison the inputs of ``slot``'s next frame (planned faults, ``stages.faults``):
        ``"talker"`` its text-track rows, ``"code_predictor"`` its last hidden state. The
        frame's validation must then fail that stream alone."""
        if part == "talker":
            self.trailing[slot] = float("nan")
        elif part == "code_predictor":
            self.last_hidden[slot] = float("nan")
        else:
            raise ValueError(f"no fault for {part!r}: 'talker' or 'code_predictor'")

    def cp_rows(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the code predictor reads of slots [0, p), for a code predictor elsewhere
        (``stages.cp_stage``): floats [p, C + 3] (last hidden state, greedy, temperature,
        top_p) and ints [p, 4] (codebook-0 id, seed, draw counter, top_k)."""
        sp = self.cp_sp
        floats = torch.cat((self.last_hidden[:p].float(), sp.greedy[:p, None].float(),
                            sp.temperature[:p, None], sp.top_p[:p, None]), dim=1)
        ints = torch.stack((self.last_code0[:p], self.seed[:p], self.counter[:p], sp.top_k[:p]),
                           dim=1)
        return floats, ints

    def load_cp_rows(self, floats: torch.Tensor, ints: torch.Tensor) -> int:
        """Set rows [0, p) from another engine's ``cp_rows`` (the code-predictor stage's engine
        predicts them next); returns p."""
        p, c = floats.shape[0], self.cfg.lm.hidden_size
        greedy = floats[:, c] > 0.5
        self.last_hidden[:p] = floats[:, :c].to(self.dtype)
        self.cp_sp.greedy[:p] = greedy
        self.cp_sp.temperature[:p] = floats[:, c + 1]
        self.cp_sp.top_p[:p] = floats[:, c + 2]
        self.last_code0[:p] = ints[:, 0]
        self.seed[:p] = ints[:, 1]
        self.counter[:p] = ints[:, 2]
        self.cp_sp.top_k[:p] = ints[:, 3]
        self.set_cp_candidates(ints[:, 3].tolist(), greedy.tolist())
        return p

    def advance_counters(self, p: int, draws: int) -> None:
        """Count ``draws`` draws made for slots [0, p) elsewhere (a remote code predictor)."""
        self.counter[:p] += draws

    @torch.inference_mode()
    def cp_logits_teacher_forced(self, hidden: torch.Tensor, code0: int,
                                 codes: torch.Tensor) -> torch.Tensor:
        """The code predictor's logits [G-1, codebook] fp32 of one frame with its inputs given
        instead of drawn: talker hidden state [1, C], codebook-0 id and codes 1..G-1 [G-1] (the
        last is no input). Two engines fed the same inputs this way compare their weights
        sub-step by sub-step (evaluation.fidelity) where free-running draws would diverge at
        the first flip; fed its own greedy codes, the argmax is what ``predict_residual``
        drew (in bf16 the torch path's one causal pass rounds unlike the sub-steps, so a
        near-tie may flip). Runs on the engine's own runtime and leaves its state alone (the
        CPU runtime borrows the last code-predictor cache slot, which every frame rewrites
        before reading it)."""
        g, size = self.cfg.num_code_groups, self.codebook_size
        c0 = torch.tensor([int(code0)], device=self.device).clamp(0, self.cfg.lm.vocab_size - 1)
        res = torch.as_tensor(codes, device=self.device).reshape(-1)[:g - 2].clamp(0, size - 1)
        cpm = self.talker.code_predictor
        x = torch.cat([hidden.reshape(1, -1).to(self.dtype), self.talker.codec_embed(c0)]  # [G, C]
                      + [cpm.model.codec_embedding[j](res[j:j + 1]) for j in range(g - 2)])
        return self.runtime.cp_teacher_forced(x)

    def step(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance slots [0, p) by one frame. Returns (codes [p, G] of the finished frame,
        next codebook-0 ids [p]). A row whose frame or next draw failed validation gets
        INVALID as its next id (do not emit its frame). Rows of idle slots in the range are
        computed and ignored."""
        residual = self.residual_source(p)  # [p, G-1], INVALID rows where the code predictor failed
        codes = torch.cat((self.last_code0[:p].unsqueeze(1), residual), dim=1)  # [p, G]
        frame_ok = (codes >= 0).all(dim=1)
        t = self.talker
        embeds = [t.codec_embed(codes[:, 0].clamp(0, self.cfg.lm.vocab_size - 1))]
        safe = residual.clamp(0, self.codebook_size - 1)
        embeds += [tab(safe[:, i]) for i, tab in enumerate(t.code_predictor.model.codec_embedding)]
        x = torch.stack(embeds, dim=1).sum(1)  # [p, C]
        idx = torch.minimum(self.gen_step[:p], self.trailing_len[:p])
        x = x + self.trailing[self._arange[:p], idx]
        hidden = self.runtime.step(x, self.pos[:p])
        self.last_hidden[:p] = hidden
        # only running slots advance; idle ones rewrite the same (unused) position
        act = self.active[:p].long()
        self.pos[:p] = (self.pos[:p] + act).clamp(max=self.shape.max_seq_len - 1)
        self.gen_step[:p] += act
        code0 = self._talker_draw(hidden, slice(0, p))
        code0 = torch.where(frame_ok, code0, torch.full_like(code0, INVALID))
        return codes, code0
