"""Speculative code prediction: a cheap draft of the code predictor's sub-steps, verified by the
full predictor in one causal pass per round (one read of its weights for several codes).

The code predictor fills codebooks 1..G-1 of a frame in G-1 sequential sub-steps, each reading
all its weights; on a CPU the frame is bound by those reads. Here a draft (the predictor's
first ``draft_layers`` layers with its own final norm, embeddings, projection and heads)
proposes the next ``lookahead`` codes one by one, and the full predictor then runs over
[the last verified code ++ the drafts] in one pass, which gives its logits for every proposed
position at once.

Verification is coupled through the sampler's noise, not by the rejection rule of speculative
sampling: every draw (``engine.sampling.sample``) is Gumbel-max with noise keyed by (stream seed,
draw counter, token id), and code j of a frame always uses counter c0 + j, in the draft and in
the full predictor alike. The full predictor's draw at a proposed position is therefore exactly
the draw its plain sub-step would make, as long as every code before it is the one the plain
path drew, which holds up to and including the first position where a draft differs from the
full predictor's draw. That first differing draw is kept (the draft's is dropped), so the
frame's codes are the plain path's, greedy and sampled alike: a seed gives the same codes with
or without speculation (up to the rounding of a batched pass against single steps, as in
``FrameEngine.cp_logits_teacher_forced``). The rejection rule would keep the distribution but
change which codes each seed draws. The draft decides only how many passes the frame costs:
each round accepts every matching draft plus one code of the full predictor's own.

Rows of a batch move in lockstep: a round accepts the shortest run over the active rows (the
other rows recompute the same draws in the next round). The accepted length is read on the
host once per round, so this path is not for CUDA graphs. It runs on the torch engine and on
the CPU runtime (``engine/cpu``: its stack step, heads and projection, called per round; the
runtime's draws are the torch sampler's). The draft is the predictor's own first layers, so it
shares the predictor's KV cache: the keys and values of those layers at a position depend only
on the inputs up to it, which both write alike.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from omni_stream.engine.sampling import INVALID, sample

log = logging.getLogger(__name__)
LOG_EVERY = 1000  # frames between the acceptance lines in the log


@dataclasses.dataclass
class SpeculativeStats:
    """Totals since the engine started: frames, verification passes, codes proposed by the
    draft and how many of them the full predictor drew too."""

    frames: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def passes_per_frame(self) -> float:
        return self.passes / self.frames if self.frames else 0.0


class SpeculativeCodePredictor:
    """Codes 1..G-1 of slots [0, p) by draft-and-verify (``FrameEngine.predict_residual``'s
    contract: [p, G-1] int64, INVALID in every column of a row with a draw outside the
    codebook). ``draft_layers``: 1 .. layers-1 of the code predictor; ``lookahead``: codes the
    draft proposes per round (>= 1)."""

    def __init__(self, engine, draft_layers: int, lookahead: int = 4) -> None:
        n = engine.talker.code_predictor.model.cfg.num_hidden_layers
        if not isinstance(draft_layers, int) or not 1 <= draft_layers < n:
            raise ValueError(f"draft_layers must be an integer in [1, {n - 1}] (the code "
                             f"predictor has {n} layers), got {draft_layers!r}")
        if not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"lookahead must be an integer >= 1, got {lookahead!r}")
        self.engine, self.draft_layers, self.lookahead = engine, draft_layers, lookahead
        self.parts = engine.runtime.cp_parts(draft_layers)  # the runtime's predictor pieces
        self.stats = SpeculativeStats()

    def __call__(self, p: int) -> torch.Tensor:
        e, parts = self.engine, self.parts
        n_codes, size = e.cfg.num_code_groups - 1, e.codebook_size
        sp, cand, seed, c0 = e.cp_sp.rows(p), max(e._cand_cp[:p]), e.seed[:p], e.counter[:p]
        active = e.active[:p]

        def draw(h: torch.Tensor, j: int) -> torch.Tensor:  # code j from hidden [p, C]
            return sample(parts.logits(j, h), sp, seed, c0 + j, cand)

        def embed(j: int, code: torch.Tensor) -> torch.Tensor:  # input for code j -> [p, 1, C]
            return parts.project(parts.embed(j, code.clamp(0, size - 1)).unsqueeze(1))

        code0 = e.last_code0[:p].clamp(0, e.cfg.lm.vocab_size - 1)
        x = torch.stack((e.last_hidden[:p], parts.embed0(code0).to(e.last_hidden.dtype)), dim=1)
        x = parts.project(x)  # [p, 2, C]
        h_full = parts.run(parts.full, x, 0, p)[:, -1]  # predicts code 0 (and fills the draft's layers)
        codes = torch.empty(p, n_codes, dtype=torch.int64, device=x.device)
        j = 0
        while True:
            codes[:, j] = draw(h_full, j)  # the full predictor's own draw: always kept
            if j == n_codes - 1:
                break
            # the draft proposes codes j+1 .. j+n; inputs[m] (code j+m) goes to position j+2+m
            n = min(self.lookahead, n_codes - 1 - j)
            inputs = [embed(j, codes[:, j])]
            drafts = []
            for m in range(n):
                hd = parts.run(parts.draft, inputs[-1], j + 2 + m, p)[:, -1]
                drafts.append(draw(hd, j + 1 + m))
                if j + 1 + m < n_codes - 1:
                    inputs.append(embed(j + 1 + m, drafts[-1]))
            # the full predictor over [code j ++ drafts]: hidden m predicts code j+1+m
            hs = parts.run(parts.full, torch.cat(inputs, dim=1), j + 2, p)
            same = torch.stack([draw(hs[:, m], j + 1 + m) == drafts[m] for m in range(n)], dim=1)
            run = same.long().cumprod(dim=1).sum(dim=1)  # leading matches per row
            a = int(run[active].min()) if bool(active.any()) else n
            self.stats.passes += 1
            self.stats.drafted += n
            self.stats.accepted += a
            for m in range(a):
                codes[:, j + 1 + m] = drafts[m]
            j += 1 + a
            if j > n_codes - 1:
                break
            h_full = hs[:, a]  # predicts code j: drawn at the top of the loop
        self.stats.frames += 1
        if self.stats.frames % LOG_EVERY == 0:
            log.info("speculative code prediction (%d draft layers, lookahead %d): %d frames, "
                     "%.0f%% of drafts accepted, %.1f passes per frame (plain: %d sub-steps)",
                     self.draft_layers, self.lookahead, self.stats.frames,
                     100 * self.stats.acceptance, self.stats.passes_per_frame, n_codes)
        e.counter[:p] += n_codes
        ok = ((codes >= 0) & (codes < size)).all(dim=1, keepdim=True)  # validation at the source
        return torch.where(ok, codes, torch.full_like(codes, INVALID))


def enable(engine, draft_layers: int, lookahead: int = 4) -> SpeculativeCodePredictor:
    """Make ``engine`` predict its codes 1..G-1 speculatively; returns the predictor (its
    ``stats`` count passes and accepted drafts)."""
    spec = SpeculativeCodePredictor(engine, draft_layers, lookahead)
    engine.use_residual(spec)
    return spec


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per token i, the probability that a draft drawn from ``q`` and the full predictor's draw
    from ``p`` (probability vectors [V], the filtered distributions) are both i when they share
    their Gumbel noise: P(i) = 1 / sum_j max(p_j / p_i, q_j / q_i) (both draws are i exactly
    when g_i - g_j >= log max(p_j / p_i, q_j / q_i) for every j, the event that i wins a
    Gumbel-max over the weights max(...), whose probability is its normalised weight); 0
    where p_i or q_i is 0. Its sum is the chance a draft is accepted. float64 [V]."""
    p, q = p.double().reshape(-1), q.double().reshape(-1)
    if p.shape != q.shape or p.numel() == 0:
        raise ValueError(f"p and q must be probability vectors of one length, got {tuple(p.shape)} "
                         f"and {tuple(q.shape)}")
    both = (p > 0) & (q > 0)
    pi, qi = p[both], q[both]
    ratio = torch.maximum(p.unsqueeze(0) / pi.unsqueeze(1), q.unsqueeze(0) / qi.unsqueeze(1))
    out = torch.zeros_like(p)
    out[both] = 1.0 / ratio.sum(dim=1)
    return out
