"""The sampling distribution: temperature, then top-k, then top-p; and the distribution every log-prob is
taken under: the temperature alone.

top-k / top-p only decide which tokens can be drawn. Every log-prob the trainer records or computes (the
sampler's as it draws, π_old, the update's π, π_ref) is of ``softmax(logits / temperature)``
(:meth:`SamplingParams.for_scoring`), as TRL's and verl's losses score: under the filtered distribution a
sampled token leaves the top-k set after one optimizer step, its log π is −inf and the k3 KL
``inf − inf`` is NaN. The sampler records the same temperature-only log-prob (:func:`sample_filtered`),
so the first ratio of the update is exactly 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled (the ``rollout`` config's ``temperature`` / ``top_k`` / ``top_p``).

    Tokens are drawn from this distribution; their log-probs (the sampler's, the policy's, the
    reference's) are taken under the ``temperature`` alone (:meth:`for_scoring`), as TRL and verl do: a
    filter would give log π = −inf (an infinite KL, a NaN k3) to a sampled token outside it.
    """

    temperature: float = 1.0
    top_k: int = 0        # 0 = off
    top_p: float = 1.0    # 1.0 = off

    def for_scoring(self) -> "SamplingParams":
        """The distribution log-probs are taken under: this temperature, no top-k / top-p."""
        return SamplingParams(self.temperature, 0, 1.0)


# --------------------------------------------------------------------------------------------
# The sampling distribution, shared by rollout and loss
# --------------------------------------------------------------------------------------------
def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits ``[..., V]`` of the distribution tokens are *sampled from*: temperature, then top-k, top-p.

    Mirrors ``transformers``' TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper (the order
    ``generate`` applies them), so the samplers draw what ``generate`` would. Computed in float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample_filtered(logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` drawn from the filtered distribution (temperature, top-k,
    top-p: :func:`process_logits`, :func:`inverse_cdf_sample`), and its log-prob under the temperature
    alone, ``log softmax(logits / temperature)[token]``: ``(tokens [B] long, log_probs [B] float32)``.

    The log-prob is the one the update computes for the token (:meth:`SamplingParams.for_scoring`), so the
    first ratio is 1; the filter's own log-prob (its renormalised mass) would not be.
    """
    scaled = logits.float() / sampling.temperature if sampling.temperature != 1.0 else logits.float()
    probs = torch.softmax(process_logits(scaled, 1.0, sampling.top_k, sampling.top_p), -1)
    tokens = inverse_cdf_sample(probs)
    return tokens, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)


# --------------------------------------------------------------------------------------------
# Drawing a token: inverse-CDF sampling (one uniform per row)
# --------------------------------------------------------------------------------------------
def inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (rows summing to ~1), by inverse-CDF sampling: ``[B]`` long.

    One uniform per row from torch's global generator, a cumulative sum in float64 (no token's interval
    loses mass to rounding; zero-probability tokens have empty intervals), a binary search for the first
    ``cdf > u``. Why not ``torch.multinomial``: on CPU it draws one exponential per vocabulary entry.
    """
    cdf_dtype = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = probs.cumsum(-1, dtype=cdf_dtype)
    u = torch.rand(probs.shape[0], 1, dtype=cdf_dtype, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


# Vocabulary entries per block of the two-level search in sample_vocab_major.
_SAMPLE_BLOCK = 256


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of the non-decreasing ``cdf [B, K]``, the first index with ``cdf > u [B]``; where rounding
    put ``u`` at or past the row's total, the first index that reaches the total (it has mass > 0)."""
    hit = torch.searchsorted(cdf, u[:, None], right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(hit, last).squeeze(-1)


def sample_vocab_major(logits_t: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per column of vocabulary-major logits ``[V, B]`` from ``softmax(logits / temperature)``;
    returns ``(tokens [B] long, log π(token) [B] float32)``. **Overwrites** ``logits_t`` (float32) with
    ``exp(z/τ - max)``.

    Inverse-CDF sampling (one uniform ``u`` per row, the first token whose cumulative mass exceeds ``u·Σ``)
    in two levels, so the vocabulary is walked three times (max; exp in place; block sums) instead of the
    ~7 passes of ``softmax`` + a float64 ``cumsum`` over ``V``: first the block of 256 tokens (float64
    cumulative sum of the float32 block sums), then the token inside it (the same fraction of the block's
    mass, on the float64 cumulative sum of its 256 values). The same distribution as
    :func:`inverse_cdf_sample` on ``softmax`` (each token's probability to float32 rounding).
    Vocabulary-major because ``W @ hᵀ`` writes ``[V, B]`` faster than ``h @ Wᵀ`` writes ``[B, V]`` for a
    decode step's 32 rows on CPU (2.7-2.9 vs 4.7-5.6 ms at width 128, V = 50257, 2 threads, into a reused
    buffer). Sampling alone, 32 rows x 50257 (``benchmarks/decode_loop.py``, 2 threads): 1.4-3.5 -> 1.2 ms
    per step with huge pages (``THP_MEM_ALLOC_ENABLE=1``), 11.7 -> 1.6 ms without (the softmax + float64
    cumulative sum allocate ~19 MB every step; this sampler allocates nothing of size V).
    """
    V, B = logits_t.shape
    m = logits_t.amax(0)                                            # [B]
    e = logits_t.sub_(m)                                            # z - max (in place)
    if temperature != 1.0:
        e.mul_(1.0 / temperature)
    e.exp_()                                                        # unnormalised probabilities, ≤ 1
    blk = _SAMPLE_BLOCK
    nb = V // blk
    # block masses summed in float32 (6x faster than summing in float64), accumulated across blocks in float64
    sums = [e[: nb * blk].view(nb, blk, B).sum(1)] if nb else []
    if nb * blk < V:
        sums.append(e[nb * blk:].sum(0)[None])
    mass = torch.cat(sums).T.double()                               # [B, n_blocks]
    block_cdf = mass.cumsum(1)
    total = block_cdf[:, -1]                                        # Σ_v e  [B]
    u = torch.rand(B, dtype=torch.float64, device=e.device) * total
    block = _first_above(block_cdf, u)                              # [B]
    idx = block[:, None] * blk + torch.arange(blk, device=e.device)  # [B, blk] vocabulary ids of the block
    cols = torch.arange(B, device=e.device)[:, None]
    inside = e[idx.clamp(max=V - 1), cols].double().masked_fill_(idx >= V, 0.0)  # [B, blk]
    inside_cdf = inside.cumsum(1)
    # where u falls inside its block, as a fraction of the block's mass, mapped onto the float64 in-block sums
    block_mass = mass.gather(1, block[:, None]).squeeze(1)
    frac = (u - (block_cdf.gather(1, block[:, None]).squeeze(1) - block_mass)) / block_mass
    offset = _first_above(inside_cdf, frac * inside_cdf[:, -1])
    tokens = block * blk + offset
    log_probs = inside.gather(1, offset[:, None]).squeeze(1).log() - total.log()
    return tokens, log_probs.float()
