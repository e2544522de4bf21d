"""The official sampling chain, vectorised over slots, with a per-stream counter-based RNG.

Order (as in the reference generate): logits -> fp32 -> repetition penalty over the stream's
codebook-0 history -> min-new-tokens eos block -> suppressed ids -> temperature -> top-k ->
top-p -> draw. Greedy rows take the argmax of the processed logits (penalty and suppression
still apply, as in the reference).

Draws use Gumbel-max with noise from a hash of (stream seed, draw counter, token id): each
stream's draws depend only on its own seed and history, never on which other streams share
the batch, and the whole chain is free of host syncs, so it can sit inside a CUDA graph.

Why a masked token can never be drawn, whatever the noise:
- the noise is built from integer hash bits so that it lies strictly inside (0, 1) in the
  dtype it is computed in (``uniform_noise``); its Gumbel transform is always finite;
- noise is drawn only for the candidates (the row's top-k tokens by score), and a candidate
  that top-k, top-p, suppression or the eos block removed is set to -inf AFTER the noise is
  added, so no noise value can lift it;
- NaN scores count as -inf; a row left with no finite candidate (a model that produced NaN
  everywhere) returns ``INVALID`` (-1) instead of an arbitrary id, for the caller to fail that
  stream (``FrameEngine`` checks every code where it is produced).

Top-k keeps exactly k tokens; ties at the boundary go to the lower token id (the order is
(score descending, id ascending)), so the kept set and every draw are the same whatever
number of candidates the batch computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omni_stream.config import SamplingParams  # noqa: F401  (re-exported: defined torch-free)

INVALID = -1  # a row with no token that may be drawn (all scores masked or NaN)

_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping multiply)."""
    x = (x ^ _shr(x, 30)) * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = (x ^ _shr(x, 27)) * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ _shr(x, 31)


_TOKEN_HASH: dict[tuple[str, int], torch.Tensor] = {}


def token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] int64: splitmix64 of each token id (made once per device and vocabulary)."""
    key = (str(device), vocab)
    if key not in _TOKEN_HASH:
        _TOKEN_HASH[key] = _mix(torch.arange(vocab, device=device, dtype=torch.int64) * _GOLDEN)
    return _TOKEN_HASH[key]


def noise_bits(seed: torch.Tensor, counter: torch.Tensor, tokens: torch.Tensor,
               vocab: int) -> torch.Tensor:
    """64 hash bits (int64) per (row seed, row counter, token id): seed/counter [B], tokens
    [B, K] (or [K], shared by all rows) with ids below ``vocab`` -> [B, K]. The row key and
    the token's hash are each mixed once, then their XOR is mixed again."""
    key = _mix(seed * _GOLDEN + counter)  # [B]
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    return _mix(key.unsqueeze(1) ^ token_hash(vocab, seed.device)[tokens])


def bits_to_uniform(bits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hash bits -> U(0, 1) strictly inside the open interval in ``dtype``.

    With m = the dtype's explicit mantissa bits (23 for fp32, 7 for bf16, 10 for fp16, 52 for
    fp64), the top m bits b give (b + 0.5) / 2^m: every value is exact in ``dtype`` (m + 1
    significant bits), the largest is 1 - 2^-(m+1) (the float just below 1) and the smallest
    2^-(m+1). Using one bit more (as (top24 + 0.5) / 2^24 in fp32 did) rounds the top values
    to exactly 1.0, whose Gumbel noise is +inf."""
    m = round(-math.log2(torch.finfo(dtype).eps))  # explicit mantissa bits
    top = _shr(bits, 64 - m)
    return (top.to(dtype) + 0.5) * (2.0 ** -m)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, tokens: torch.Tensor | int,
                  vocab: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U(0,1) noise [B, K] for token ids ``tokens`` ([B, K] or [K] below ``vocab``; or an int V
    for ids 0..V-1)."""
    if isinstance(tokens, int):
        vocab = tokens
        tokens = torch.arange(tokens, device=seed.device, dtype=torch.int64)
    if vocab is None:
        raise ValueError("uniform_noise: give the vocabulary size the token ids come from")
    return bits_to_uniform(noise_bits(seed, counter, tokens, vocab), dtype)


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from U(0,1); finite for every u strictly inside (0, 1)."""
    return -torch.log(-torch.log(u))


@dataclass
class SlotSampling:
    """Per-slot sampling tensors [S] for one sampler (talker or code predictor)."""

    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32

    @classmethod
    def empty(cls, slots: int, device: torch.device | str) -> "SlotSampling":
        return cls(
            greedy=torch.ones(slots, dtype=torch.bool, device=device),
            temperature=torch.ones(slots, dtype=torch.float32, device=device),
            top_k=torch.zeros(slots, dtype=torch.int64, device=device),
            top_p=torch.ones(slots, dtype=torch.float32, device=device),
        )

    def set(self, slot: int, greedy: bool, temperature: float, top_k: int, top_p: float) -> None:
        self.greedy[slot] = greedy
        self.temperature[slot] = temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p

    def rows(self, n: int) -> "SlotSampling":
        return SlotSampling(self.greedy[:n], self.temperature[:n], self.top_k[:n], self.top_p[:n])

    def slice(self, sl: slice) -> "SlotSampling":
        return SlotSampling(self.greedy[sl], self.temperature[sl], self.top_k[sl], self.top_p[sl])


def candidates_needed(params_top_k: int, vocab: int) -> int:
    """Candidates a row with this top-k needs: k, or the whole vocabulary when top-k is off."""
    return vocab if params_top_k <= 0 or params_top_k >= vocab else params_top_k


def _order_keys(s: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort like (score descending, token id ascending): the fp32 bit pattern
    made monotone (negative floats flipped), shifted up, the inverted id in the low bits."""
    b = s.view(torch.int32).to(torch.int64)
    mono = torch.where(b < 0, b ^ 0x7FFFFFFF, b)  # order-preserving int for every finite float
    v = s.shape[-1]
    ids = torch.arange(v, device=s.device, dtype=torch.int64)
    return mono * (1 << 32) + (v - 1 - ids)


@dataclass
class Candidates:
    """What filtering leaves for the draw, per row: the top-K token ids in (score desc, id asc)
    order, their scaled scores, and which of them top-k / top-p / masking still allow."""

    idx: torch.Tensor  # [B, K] int64 token ids
    vals: torch.Tensor  # [B, K] fp32 scores / T (shifted by the row max)
    allowed: torch.Tensor  # [B, K] bool
    vocab: int  # V, the width of the scores the ids index

    def expand(self, n: int) -> "Candidates":
        """Each row repeated ``n`` times (row-major), for many draws from one filtering."""
        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(n, dim=0)
        return Candidates(rep(self.idx), rep(self.vals), rep(self.allowed), self.vocab)


def filter_candidates(scores: torch.Tensor, sp: SlotSampling,
                      candidates: int | None = None) -> Candidates:
    """The filtering half of the chain: temperature, top-k, top-p over scores [B, V] (masked
    ids are -inf, NaN counts as -inf). ``candidates`` K must be at least every sampled row's
    top-k (the whole vocabulary for a row with top-k off); None: V."""
    v = scores.shape[-1]
    k_all = v if candidates is None else max(1, min(int(candidates), v))
    fmax = torch.finfo(torch.float32).max
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=fmax, neginf=float("-inf"))
    # shift by the row max before scaling so 1/T cannot overflow a score to +inf (a shift does
    # not change softmax, top-k, top-p or the Gumbel-max winner); a row that is all -inf
    # stays -inf (the clamp keeps -inf - -inf from making NaN)
    s = (s - s.amax(dim=-1, keepdim=True).clamp(min=-fmax)) / sp.temperature.unsqueeze(1)
    _, idx = torch.topk(_order_keys(s), k_all, dim=-1)  # [B, K], sorted
    vals = s.gather(1, idx)
    rank = torch.arange(k_all, device=s.device).unsqueeze(0)
    k = torch.where(sp.top_k > 0, sp.top_k.clamp(max=k_all), torch.full_like(sp.top_k, k_all))
    allowed = (rank < k.unsqueeze(1)) & (vals > float("-inf"))
    # top-p on the top-k-filtered distribution: keep a token while the mass before it is < p
    # (p = 1 keeps everything, whatever the rounding of the cumulative sum)
    probs = torch.softmax(vals.masked_fill(~allowed, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    allowed &= (before < sp.top_p.unsqueeze(1)) | (rank == 0) | (sp.top_p >= 1).unsqueeze(1)
    return Candidates(idx, vals, allowed, v)


def select(c: Candidates, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The drawing half: Gumbel-max over the allowed candidates -> token ids [B] (INVALID for
    a row without any). Noise is keyed by token id, so the winner does not depend on K; the
    mask is applied after the noise is added, so no noise value can lift a removed token."""
    g = gumbel(uniform_noise(seed, counter, c.idx, c.vocab))
    z = torch.where(c.allowed, c.vals + g, torch.full_like(c.vals, float("-inf")))
    pick = c.idx.gather(1, z.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(c.allowed.any(dim=-1), pick, torch.full_like(pick, INVALID))


def greedy_pick(scores: torch.Tensor) -> torch.Tensor:
    """argmax with NaN as -inf (first maximum on ties, as the reference); INVALID for a row
    with no finite score."""
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), neginf=float("-inf"))
    pick = s.argmax(dim=-1)
    ok = (s > float("-inf")).any(dim=-1)
    return torch.where(ok, pick, torch.full_like(pick, INVALID))


def sample(scores: torch.Tensor, sp: SlotSampling, seed: torch.Tensor, counter: torch.Tensor,
           candidates: int | None = None) -> torch.Tensor:
    """scores [B, V] fp32 (already penalised/suppressed) -> token ids [B] (int64).

    Rows whose ``greedy`` flag is set take the argmax; the others draw from
    softmax(top-p(top-k(scores / T))) by Gumbel-max with the row's own noise. ``candidates``:
    see ``filter_candidates`` (the engine passes the largest top-k of its slots). A row with no
    token that may be drawn gets INVALID."""
    drawn = select(filter_candidates(scores, sp, candidates), seed, counter)
    return torch.where(sp.greedy, greedy_pick(scores), drawn)


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """scores [B, V]; seen [B, V] bool history mask; penalty [B] (1.0 = off)."""
    p = penalty.unsqueeze(1)
    pen = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, pen, scores)
