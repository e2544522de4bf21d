"""The official sampling chain, vectorised over slots, with a per-stream counter-based RNG.

Order (as in the reference generate): logits -> fp32 -> repetition penalty over the stream's
codebook-0 history -> min-new-tokens eos block -> suppressed ids -> temperature -> top-k ->
top-p -> draw. Greedy rows take the argmax of the processed logits (penalty and suppression
still apply, as in the reference).

Draws use Gumbel-max with noise from a hash of (stream seed, draw counter, token id): each
stream's draws depend only on its own seed and history, never on which other streams share
the batch, and the whole chain is free of host syncs, so it can sit inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_stream.config import SamplingParams  # noqa: F401  (re-exported: defined torch-free)

_MASK63 = (1 << 63) - 1


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping multiply)."""
    x = (x ^ _shr(x, 30)) * -4658895280553007687  # 0xbf58476d1ce4e5b9
    x = (x ^ _shr(x, 27)) * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ _shr(x, 31)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) noise [B, vocab] from per-row seed/counter [B] (int64)."""
    tok = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    key = _mix(seed * -7046029254386353131 + counter)  # 0x9e3779b97f4a7c15
    x = _mix(key.unsqueeze(1) + tok.unsqueeze(0) * -7046029254386353131)
    top24 = _shr(x, 40).to(torch.float32)
    return (top24 + 0.5) / float(1 << 24)


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


def sample(scores: torch.Tensor, sp: SlotSampling, seed: torch.Tensor,
           counter: torch.Tensor) -> torch.Tensor:
    """scores [B, V] fp32 (already penalised/suppressed) -> token ids [B] (int64).

    Rows whose ``greedy`` flag is set take the argmax; the others draw from
    softmax(top-p(top-k(scores / T))) by Gumbel-max with the row's own noise."""
    v = scores.shape[-1]
    greedy_pick = scores.argmax(dim=-1)
    s = scores / sp.temperature.unsqueeze(1)
    sorted_s, _ = torch.sort(s, dim=-1, descending=True)
    k = torch.where(sp.top_k > 0, sp.top_k.clamp(max=v), torch.full_like(sp.top_k, v))
    kth = sorted_s.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    s = s.masked_fill(s < kth, float("-inf"))
    # top-p on the top-k-filtered distribution: drop tokens whose preceding mass exceeds p
    sorted_f = sorted_s.masked_fill(sorted_s < kth, float("-inf"))
    probs = torch.softmax(sorted_f, dim=-1)
    cum = probs.cumsum(dim=-1)
    keep_sorted = (cum - probs) < sp.top_p.unsqueeze(1)
    keep_sorted[:, 0] = True
    # threshold = smallest kept sorted score
    n_keep = keep_sorted.sum(dim=-1, keepdim=True)
    pth = sorted_f.gather(1, n_keep - 1)
    s = s.masked_fill(s < pth, float("-inf"))
    u = uniform_noise(seed, counter, v)
    gumbel = -torch.log(-torch.log(u))
    drawn = (s + gumbel).argmax(dim=-1)
    return torch.where(sp.greedy, greedy_pick, drawn)


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """scores [B, V]; seen [B, V] bool history mask; penalty [B] (1.0 = off)."""
    p = penalty.unsqueeze(1)
    pen = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, pen, scores)
