"""The sampler at its edges and against its distribution.

- noise: every bit pattern the hash can produce maps strictly inside (0, 1) with finite Gumbel
  noise, in every float dtype (the old fp32 mapping reached exactly 1.0 -> +inf noise);
- masking: a removed token never wins, whatever its score (NaN, +inf, max float) or noise;
- extremes: temperature, top-k, top-p, counters and seeds at their limits never raise and
  never leave the allowed set;
- property: 10^7 draws per sampler (``OMNI_STREAM_SAMPLER_DRAWS`` raises it; 10^8 was run
  for the results) through the talker's and the code predictor's real filtering and drawing,
  each checked against an independent reference of the allowed set;
- goodness of fit: chi-square of sampled frequencies against softmax(logits / T) restricted
  to top-k / top-p, with repetition penalty and suppressed ids.
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest
import torch

from omni_stream.engine.frame import talker_scores
from omni_stream.engine.sampling import (INVALID, Candidates, SlotSampling, bits_to_uniform,
                                         candidates_needed, filter_candidates, greedy_pick,
                                         gumbel, sample, select, uniform_noise)

FMAX = torch.finfo(torch.float32).max
INT64_MAX = (1 << 63) - 1
EOS = 2150
TALKER_V, CP_V = 3072, 2048


def _with_top_bits(top: torch.Tensor, m: int) -> torch.Tensor:
    """int64 hash words whose top ``m`` bits are ``top`` and whose low bits are all ones."""
    low = (1 << (64 - m)) - 1
    return (top << (64 - m)) | low


def _sp(b: int, greedy=False, t=1.0, k=0, p=1.0) -> SlotSampling:
    def full(v, dtype):
        return v if isinstance(v, torch.Tensor) else torch.full((b,), v, dtype=dtype)
    return SlotSampling(full(greedy, torch.bool), full(t, torch.float32), full(k, torch.int64),
                        full(p, torch.float32))


# --- noise ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,m", [(torch.float32, 23), (torch.bfloat16, 7), (torch.float16, 10)])
def test_noise_is_strictly_inside_the_open_interval_for_every_bit_pattern(dtype, m):
    top = torch.arange(1 << m, dtype=torch.int64)  # every value the top m bits can take
    u = bits_to_uniform(_with_top_bits(top, m), dtype)
    assert u.dtype == dtype
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert float(u[-1]) == 1 - 2.0 ** -(m + 1) and float(u[0]) == 2.0 ** -(m + 1)
    assert bool((u[1:].float() > u[:-1].float()).all())  # exact: no two patterns collide
    g = gumbel(u.float())
    assert bool(torch.isfinite(g).all())
    # the bug this replaces: one bit more than the mantissa holds rounds the top value to 1.0
    old = (torch.tensor(float((1 << (m + 1)) - 1), dtype=dtype) + 0.5) / float(1 << (m + 1))
    assert float(old) == 1.0 and math.isinf(float(gumbel(old.float())))


def test_noise_at_extreme_words_and_float64():
    words = torch.tensor([0, 1, -1, INT64_MAX, -INT64_MAX - 1, 1 << 40], dtype=torch.int64)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        u = bits_to_uniform(words, dtype)
        assert bool((u > 0).all() & (u < 1).all()), (dtype, u)
        assert bool(torch.isfinite(gumbel(u.double())).all())


def test_noise_is_deterministic_per_seed_counter_token_and_uniform():
    seed = torch.tensor([0, 1, INT64_MAX, -1], dtype=torch.int64)
    ctr = torch.tensor([0, INT64_MAX, 5, 2**62], dtype=torch.int64)
    a = uniform_noise(seed, ctr, 4096)
    assert torch.equal(a, uniform_noise(seed, ctr, 4096))
    # token j's noise does not depend on which other tokens are asked for
    ids = torch.tensor([[7, 4000, 3]] * 4)
    assert torch.equal(uniform_noise(seed, ctr, ids, 4096), a[:, [7, 4000, 3]])
    # uniform: 16 equal bins over 2^20 draws (seeds x counters x tokens)
    u = uniform_noise(torch.arange(256), torch.arange(256) * 3, 4096).flatten()
    counts = torch.histc(u, bins=16, min=0, max=1)
    exp = u.numel() / 16
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert _chi2_sf(chi2, 15) > 1e-4, chi2


# --- masking -------------------------------------------------------------------------------------
def test_a_removed_candidate_never_wins_whatever_its_score_or_noise():
    b, k = 4096, 8
    gen = torch.Generator().manual_seed(0)
    vals = torch.randn(b, k, generator=gen) * 3 - 50
    allowed = torch.rand(b, k, generator=gen) < 0.3
    allowed[:, 0] |= ~allowed.any(dim=1)  # at least one per row
    poison = torch.tensor([float("nan"), float("inf"), FMAX, 1e30])
    vals = torch.where(allowed, vals, poison[torch.randint(0, 4, (b, k), generator=gen)])
    idx = torch.stack([torch.randperm(CP_V, generator=gen)[:k] for _ in range(b)])
    c = Candidates(idx, vals, allowed, CP_V)
    for seed, ctr in ((0, 0), (INT64_MAX, INT64_MAX), (-1, 12345)):
        pick = select(c, torch.full((b,), seed), torch.full((b,), ctr) + torch.arange(b))
        assert bool((pick.unsqueeze(1) == idx).logical_and(allowed).any(dim=1).all())
    none = Candidates(idx[:2], vals[:2], torch.zeros(2, k, dtype=torch.bool), CP_V)
    assert select(none, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)).tolist() == [INVALID] * 2


def test_nan_and_fully_masked_rows_give_invalid_not_an_arbitrary_id():
    v = 64
    scores = torch.randn(4, v)
    scores[0] = float("nan")
    scores[1] = float("-inf")
    scores[2, 5:] = float("nan")  # only ids 0..4 are candidates
    scores[3, :] = float("-inf")
    scores[3, 17] = float("nan")
    z = torch.zeros(4, dtype=torch.int64)
    for greedy in (False, True):
        out = sample(scores, _sp(4, greedy=greedy, t=0.9, k=3), z, z).tolist()
        assert out[0] == INVALID and out[1] == INVALID and out[3] == INVALID
        assert 0 <= out[2] < 5
    assert greedy_pick(torch.tensor([[1.0, 3.0, 3.0, float("nan")]])).item() == 1  # first max


@pytest.mark.parametrize("t", [1e-30, 1e-6, 0.9, 1e6, 1e30, FMAX])
@pytest.mark.parametrize("k", [0, 1, 50, TALKER_V - 1, TALKER_V, TALKER_V + 1, INT64_MAX])
@pytest.mark.parametrize("p", [1e-9, 0.5, 1.0])
def test_extreme_parameters_draw_allowed_tokens(t, k, p):
    gen = torch.Generator().manual_seed(1)
    b = 64
    logits = torch.randn(b, TALKER_V, generator=gen) * 5
    logits[0] = 0.0  # every token tied
    logits[1, :10] = float("inf")
    logits[2, 3] = FMAX
    logits[3] = -FMAX
    suppress = torch.zeros(TALKER_V, dtype=torch.bool)
    suppress[2048:] = True
    suppress[EOS] = False
    eos_col = torch.zeros(TALKER_V, dtype=torch.bool)
    eos_col[EOS] = True
    seen = torch.rand(b, TALKER_V, generator=gen) < 0.01
    scores = talker_scores(logits, seen, torch.full((b,), 1.05), torch.ones(b, dtype=torch.bool),
                           suppress, eos_col)
    seed = torch.randint(-INT64_MAX, INT64_MAX, (b,), generator=gen)
    ctr = torch.full((b,), INT64_MAX)
    out = sample(scores, _sp(b, t=t, k=k, p=p), seed, ctr, candidates_needed(k, TALKER_V))
    assert bool(((out >= 0) & (out < 2048)).all()), out  # never suppressed, never eos (blocked)
    if k == 1 or p == 1e-9:  # exactly one token survives: the best, lowest id on ties
        best = torch.stack([s.argmax() for s in scores])
        assert torch.equal(out, best)
    if k == 1:
        assert out[0].item() == 0  # all tied: the lowest id


def test_top_k_ties_go_to_the_lower_id_and_the_draw_does_not_depend_on_the_candidate_count():
    gen = torch.Generator().manual_seed(2)
    b, v = 512, CP_V
    # bf16-like logits: a coarse grid, so ties at the k-th value are common
    scores = (torch.randn(b, v, generator=gen) * 4).to(torch.bfloat16).float()
    seed, ctr = torch.arange(b), torch.arange(b) * 7
    sp = _sp(b, t=0.8, k=torch.randint(1, 60, (b,), generator=gen), p=0.95)
    picks = [sample(scores, sp, seed, ctr, kk) for kk in (60, 200, v)]
    assert torch.equal(picks[0], picks[1]) and torch.equal(picks[0], picks[2])


# --- property: draws through the real samplers never leave the reference allowed set -------------
def _reference_allowed(scores: np.ndarray, t: np.ndarray, k: np.ndarray, p: np.ndarray,
                       tol: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """Independent float64 reference: (allowed [R, V] bool, ambiguous [R] bool: a top-p
    boundary within ``tol`` of p, where fp32 rounding may decide either way)."""
    r, v = scores.shape
    allowed = np.zeros((r, v), dtype=bool)
    ambiguous = np.zeros(r, dtype=bool)
    ids = np.arange(v)
    for i in range(r):
        s = scores[i].astype(np.float64)
        order = np.lexsort((ids, -np.where(np.isfinite(s), s, -np.inf)))
        finite = order[np.isfinite(s[order])]
        kk = v if k[i] <= 0 or k[i] >= v else int(k[i])
        top = finite[:kk]
        z = (s[top] - s[top].max()) / t[i]
        pr = np.exp(z - np.log(np.exp(z).sum()))
        before = np.cumsum(pr) - pr
        if p[i] >= 1:
            keep = np.ones(len(top), dtype=bool)
        else:
            keep = before < p[i]
            keep[0] = True
            ambiguous[i] = bool(np.any(np.abs(before - p[i]) < tol))
        allowed[i, top[keep]] = True
    return allowed, ambiguous


def _talker_batch(r: int, gen: torch.Generator):
    logits = torch.randn(r, TALKER_V, generator=gen) * torch.empty(r, 1).uniform_(0.5, 4, generator=gen)
    suppress = torch.zeros(TALKER_V, dtype=torch.bool)
    suppress[2048:] = True
    suppress[EOS] = False
    eos_col = torch.zeros(TALKER_V, dtype=torch.bool)
    eos_col[EOS] = True
    seen = torch.rand(r, TALKER_V, generator=gen) < 0.02
    block = torch.rand(r, generator=gen) < 0.5
    scores = talker_scores(logits, seen, torch.empty(r).uniform_(1.0, 1.3, generator=gen), block,
                           suppress, eos_col)
    return scores


def _cp_batch(r: int, gen: torch.Generator):
    return torch.randn(r, CP_V, generator=gen) * torch.empty(r, 1).uniform_(0.5, 4, generator=gen)


@pytest.mark.parametrize("sampler", ["talker", "code_predictor"])
def test_millions_of_draws_never_leave_the_allowed_set(sampler):
    """The real filtering (temperature, top-k, top-p; for the talker after repetition penalty,
    suppressed ids and the eos block) and the real Gumbel draw, with random per-row settings;
    each row is filtered once and drawn from with many (seed, counter) pairs, including
    counters and seeds at the int64 limits. Every draw is checked against an independent
    float64 reference of the allowed set, and the filtered sets must equal the reference.

    A row's allowed candidates are a prefix of its (score desc, id asc) order, and the noise is
    keyed by token id, so drawing from the allowed prefix alone draws exactly what the full
    candidate list would: rows are drawn in blocks of similar prefix length, and rows whose
    top-k is off (the whole vocabulary allowed) get fewer draws each."""
    target = int(os.environ.get("OMNI_STREAM_SAMPLER_DRAWS", 10**7))  # draws per sampler
    scale = max(1.0, target / 10**7)
    rows, narrow_draws, wide_draws = 2700, int(5000 * scale), int(100 * scale)
    gen = torch.Generator().manual_seed(3 if sampler == "talker" else 4)
    scores = _talker_batch(rows, gen) if sampler == "talker" else _cp_batch(rows, gen)
    v = scores.shape[1]
    top_k = torch.tensor([1, 5, 50, 50, 50, 50, 0, 200, v + 5])[
        torch.randint(0, 9, (rows,), generator=gen)]
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.99])[torch.randint(0, 5, (rows,), generator=gen)]
    temp = torch.empty(rows).uniform_(0.3, 1.5, generator=gen)
    cand = max(candidates_needed(int(kk), v) for kk in top_k)
    c = filter_candidates(scores, _sp(rows, t=temp, k=top_k, p=top_p), cand)
    ref, ambiguous = _reference_allowed(scores.numpy(), temp.numpy(), top_k.numpy(), top_p.numpy())
    assert ambiguous.mean() < 0.05  # the exact-set comparison below covers the other rows
    got = np.zeros_like(ref)
    np.put_along_axis(got, c.idx.numpy(), c.allowed.numpy(), axis=1)
    clear = ~ambiguous
    assert np.array_equal(got[clear], ref[clear])
    allowed_t = torch.from_numpy(ref | got)  # on an ambiguous row either answer is right
    length = c.allowed.sum(dim=1)
    assert bool((c.allowed == (torch.arange(cand) < length.unsqueeze(1))).all())  # a prefix
    seeds = torch.randint(-INT64_MAX, INT64_MAX, (rows,), generator=gen)
    seeds[:3] = torch.tensor([0, INT64_MAX, -INT64_MAX - 1])
    base = torch.randint(0, INT64_MAX - narrow_draws, (rows,), generator=gen)
    base[:3] = torch.tensor([0, INT64_MAX - narrow_draws, -(1 << 62)])
    draws, bad = 0, 0
    order = torch.argsort(length)
    i = 0
    while i < rows:  # blocks of ~400k candidate slots: small enough to stay in cache
        width = int(length[order[min(i + 7, rows - 1)]])
        n = narrow_draws if width <= 64 else wide_draws
        block = order[i:i + max(1, 400_000 // (width * n))]
        i += len(block)
        width = int(length[block].max())
        sub = Candidates(c.idx[block, :width], c.vals[block, :width], c.allowed[block, :width],
                         v).expand(n)
        seed = seeds[block].repeat_interleave(n)
        ctr = base[block].repeat_interleave(n) + torch.arange(n).repeat(len(block))
        pick = select(sub, seed, ctr)
        row = block.repeat_interleave(n)
        ok = (pick >= 0) & allowed_t[row, pick.clamp(min=0)]
        bad += int((~ok).sum())
        draws += pick.numel()
    assert draws >= target
    assert bad == 0, f"{bad} of {draws} draws left the allowed set"


def _draw_many(c: Candidates, seed: torch.Tensor, ctr: torch.Tensor) -> torch.Tensor:
    """Draws from the single filtered row ``c`` [1, K] for each (seed, counter) pair, over
    the row's allowed prefix (see above), in cache-sized chunks."""
    width = int(c.allowed.sum())
    row = Candidates(c.idx[:, :width], c.vals[:, :width], c.allowed[:, :width], c.vocab)
    step = max(1, 400_000 // max(width, 1))
    out = []
    for i in range(0, len(seed), step):
        n = len(seed[i:i + step])
        out.append(select(row.expand(n), seed[i:i + step], ctr[i:i + step]))
    return torch.cat(out)


# --- goodness of fit -----------------------------------------------------------------------------
def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _expected(logits: np.ndarray, t: float, k: int, p: float, seen: np.ndarray | None = None,
              penalty: float = 1.0, suppressed: np.ndarray | None = None) -> np.ndarray:
    """softmax(penalised logits / T) restricted to top-k then top-p, in float64."""
    s = logits.astype(np.float64).copy()
    if seen is not None:
        s[seen] = np.where(s[seen] < 0, s[seen] * penalty, s[seen] / penalty)
    if suppressed is not None:
        s[suppressed] = -np.inf
    order = np.lexsort((np.arange(len(s)), -s))
    order = order[np.isfinite(s[order])]
    if 0 < k < len(order):
        order = order[:k]
    z = s[order] / t
    pr = np.exp(z - z.max())
    pr /= pr.sum()
    if p < 1:
        keep = (np.cumsum(pr) - pr) < p
        keep[0] = True
        order, pr = order[keep], pr[keep] / pr[keep].sum()
    out = np.zeros(len(s))
    out[order] = pr
    return out


def _chi_square(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson chi-square, pooling bins with expected count < 5 into one."""
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any() and exp[~big].sum() > 0:
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    o, e = np.array(obs_b, float), np.array(exp_b, float)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


CASES = {
    # name: (V, T, top_k, top_p, logit scale, penalty, suppress talker control ids)
    "talker_default": (TALKER_V, 0.9, 50, 1.0, 2.0, 1.05, True),
    "code_predictor_default": (CP_V, 0.9, 50, 1.0, 2.0, 1.0, False),
    "top_p_only": (CP_V, 0.7, 0, 0.8, 3.0, 1.0, False),
    "top_k_and_top_p": (TALKER_V, 1.3, 20, 0.6, 1.5, 1.2, True),
    "cold": (CP_V, 0.05, 50, 1.0, 1.0, 1.0, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_frequencies_match_the_target_distribution(case):
    v, t, k, p, scale, penalty, suppress_ids = CASES[case]
    n = 1_000_000
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()) % 1000)  # hash() varies per run
    logits = torch.randn(v, generator=gen) * scale
    seen = torch.zeros(v, dtype=torch.bool)
    seen[torch.argsort(logits, descending=True)[:30:3]] = True  # penalise some top tokens
    suppress = torch.zeros(v, dtype=torch.bool)
    if suppress_ids:
        suppress[2048:] = True
        suppress[EOS] = False
    eos_col = torch.zeros(v, dtype=torch.bool)
    scores = talker_scores(logits.unsqueeze(0), seen.unsqueeze(0), torch.tensor([penalty]),
                           torch.zeros(1, dtype=torch.bool), suppress, eos_col)
    c = filter_candidates(scores, _sp(1, t=t, k=k, p=p), candidates_needed(k, v))
    seed = torch.arange(n) // 1000  # 1000 streams x 1000 consecutive counters
    pick = _draw_many(c, seed, torch.arange(n) % 1000)
    counts = np.bincount(pick.numpy(), minlength=v)
    probs = _expected(logits.numpy(), t, k, p, seen.numpy(), penalty,
                      suppress.numpy() if suppress_ids else None)
    assert counts[probs == 0].sum() == 0
    stat, dof = _chi_square(counts, probs, n)
    if dof == 0:  # the filters leave one token (or one merged bin): every draw is in it
        assert counts[probs > 0].sum() == n
        return
    assert _chi2_sf(stat, dof) > 1e-4, (case, stat, dof)


def test_consecutive_draws_of_a_stream_are_independent():
    """Pairs (draw c, draw c + 1) of the same stream follow the product distribution."""
    v, n = 8, 400_000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    c = filter_candidates(logits, _sp(1, t=1.0), v)
    seed = torch.arange(n) // 2000
    ctr = torch.arange(n) % 2000
    pick = _draw_many(c, seed, ctr).numpy().reshape(-1, 2000)
    a, b = pick[:, :-1].ravel(), pick[:, 1:].ravel()
    joint = np.bincount(a * v + b, minlength=v * v)
    pr = torch.softmax(logits[0].double(), 0).numpy()
    stat, dof = _chi_square(joint, np.outer(pr, pr).ravel(), len(a))
    assert _chi2_sf(stat, dof) > 1e-4, (stat, dof)


# --- speculative code prediction: draft and full predictor coupled through the noise -------------
SPEC_CASES = {
    # name: (V, T, top_k, top_p, how the draft's logits relate to the target's)
    "close_draft": (CP_V, 0.9, 50, 1.0, "close"),
    "independent_draft": (64, 1.0, 0, 1.0, "independent"),
    "equal_draft": (CP_V, 0.9, 50, 1.0, "equal"),
    "disjoint_supports": (64, 1.0, 8, 1.0, "disjoint"),
    "top_p_and_cold": (CP_V, 0.3, 0, 0.7, "close"),
    "one_token": (CP_V, 0.9, 1, 1.0, "close"),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_draws_keep_the_target_distribution_and_accept_at_the_coupling_rate(case):
    """A million (seed, counter) draws of a draft (logits q) and of the full predictor (logits
    p) with the same noise, as speculative code prediction makes them: the kept code (always
    the full predictor's draw) follows the filtered softmax of p whatever the draft; a draft is
    accepted exactly when both draws agree, at the rate ``coupled_acceptance`` gives, token by
    token (chi-square over 'accepted as i' and 'rejected'); equal logits accept every draft,
    disjoint supports none."""
    from omni_stream.engine.speculative import coupled_acceptance

    v, t, k, p, how = SPEC_CASES[case]
    n = 1_000_000
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()) % 1000)
    target = torch.randn(v, generator=gen) * 2.0
    draft = {"close": target + 0.5 * torch.randn(v, generator=gen),
             "independent": torch.randn(v, generator=gen) * 2.0,
             "equal": target.clone(),
             "disjoint": -target}[how]
    cp_, cq = (filter_candidates(s.unsqueeze(0), _sp(1, t=t, k=k, p=p), candidates_needed(k, v))
               for s in (target, draft))
    seed, ctr = torch.arange(n) // 1000, torch.arange(n) % 1000
    kept, proposed = _draw_many(cp_, seed, ctr), _draw_many(cq, seed, ctr)
    probs_p = _expected(target.numpy(), t, k, p)
    probs_q = _expected(draft.numpy(), t, k, p)
    counts = np.bincount(kept.numpy(), minlength=v)
    assert counts[probs_p == 0].sum() == 0
    stat, dof = _chi_square(counts, probs_p, n)
    if dof > 0:
        assert _chi2_sf(stat, dof) > 1e-4, (case, stat, dof)
    joint = coupled_acceptance(torch.from_numpy(probs_p), torch.from_numpy(probs_q)).numpy()
    acc = (kept == proposed).numpy()
    rate = float(joint.sum())
    if how == "equal":
        assert acc.all() and rate == pytest.approx(1.0, abs=1e-9)
    elif how == "disjoint":
        assert not acc.any() and rate == 0.0
    cells = np.append(np.bincount(kept.numpy()[acc], minlength=v), (~acc).sum())
    stat, dof = _chi_square(cells, np.append(joint, 1.0 - rate), n)
    if dof > 0:
        assert _chi2_sf(stat, dof) > 1e-4, (case, stat, dof, rate, acc.mean())


def test_coupled_acceptance_at_its_edges():
    """Equal distributions accept with certainty (each token at its own probability), a
    one-token target accepts at the draft's chance of that token's Gumbel win, zeros on either
    side give 0, and bad shapes are refused."""
    from omni_stream.engine.speculative import coupled_acceptance

    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert torch.allclose(coupled_acceptance(p, p), p.double())
    one = torch.tensor([0.0, 1.0, 0.0, 0.0])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    # both draw token 1 iff it wins the draft's Gumbel-max: probability q_1
    assert torch.allclose(coupled_acceptance(one, q), torch.tensor([0, 0.25, 0, 0], dtype=torch.float64))
    assert float(coupled_acceptance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).sum()) == 0.0
    for a, b in ((torch.ones(3) / 3, torch.ones(4) / 4), (torch.zeros(0), torch.zeros(0))):
        with pytest.raises(ValueError, match="probability vectors"):
            coupled_acceptance(a, b)
