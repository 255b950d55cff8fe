"""Masked reductions over response tokens: sum, mean, variance, whitening (one process or all of them).

Shapes: B = batch (sequences), T = response tokens.
``mask`` is a bool or float ``[B, T]`` tensor: 1 on response tokens (a contiguous
prefix of each row, up to and including EOS), 0 after.

Entries outside the mask take no part in any reduction, whatever they hold: padding positions can carry
``-inf`` log-probs (a pad token outside the top-k / top-p set) or NaN, and ``x * mask`` would turn those
into NaN (``inf · 0``). Every function here selects with ``torch.where`` instead, which gives the same
bits as ``x * mask`` wherever the inputs are finite.

References:
  PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
  Advantage whitening: Huang et al. 2022, "The 37 Implementation Details of PPO" (detail 7, "Normalization
  of Advantages"); two-pass variance: Chan, Golub & LeVeque 1983, "Algorithms for computing the sample
  variance: analysis and recommendations", §1 (the two-pass algorithm, not the one-pass "textbook"
  Σx² − (Σx)²/n, which cancels catastrophically when the mean is large against the spread).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _inside(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` where the mask is non-zero and exactly 0 elsewhere, even where ``x`` is inf or NaN. [B, T]."""
    if mask.dtype == torch.bool:
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    m = mask.to(x.dtype)  # a float mask keeps its weights, as x * mask did
    return torch.where(m != 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is 1. x, mask: [B, T] -> scalar, or [B] with dim=1."""
    x = _inside(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked entries. [B, T] -> scalar, or per row [B] with dim=1.

    An empty mask (or empty row) gives 0, not NaN.
    """
    m = mask.to(x.dtype)
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), m, dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over masked entries (scalar), two-pass. Bessel-corrected if ``unbiased``."""
    m = mask.to(x.dtype)
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    if unbiased:
        n = m.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with mean/var over masked entries only. [B, T] -> [B, T], 0 where mask is 0.

    ``shift_mean=False`` keeps the original mean (only rescales), as in TRL.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _inside(whitened, mask)


def global_masked_whiten(
    x: Tensor, mask: Tensor, all_reduce_sum: Callable[[Tensor], Tensor] | None = None, eps: float = 1e-8
) -> Tensor:
    """Whiten ``x [B, T]`` with the mean and unbiased variance of the masked entries of *all* processes.

        n = Σ_p |mask_p|,   μ = Σ_p Σ_{mask_p} x / n,   σ² = Σ_p Σ_{mask_p} (x − μ)² / (n − 1)
        out = (x − μ) / √(σ² + eps) on masked entries, 0 elsewhere

    The variance is two-pass (Chan, Golub & LeVeque 1983, §1) and accumulated in float64 (float32 on
    MPS, which has no float64): the one-pass ``E[x²] − E[x]²`` in float32 loses every digit when the mean
    is large against the spread (mean 300, std 0.1 gave a whitened std of 1.23).

    Args:
        x: ``[B, T]`` values (e.g. GAE advantages) of this process.
        mask: ``[B, T]`` bool or 0/1; entries outside it take no part, even when inf or NaN, and come out 0.
        all_reduce_sum: sums a tensor over all processes and returns the result on every one (e.g.
            ``lambda t: accelerator.reduce(t, "sum")``); called twice, with a ``[2]`` then a ``[1]`` tensor,
            on every process. ``None`` = one process.
        eps: added to the variance before the square root.

    Returns:
        ``[B, T]`` in ``x``'s dtype.
    """
    reduce = all_reduce_sum if all_reduce_sum is not None else (lambda t: t)
    keep = mask if mask.dtype == torch.bool else mask != 0
    acc = torch.float32 if x.device.type == "mps" else torch.float64
    zero = torch.zeros((), dtype=acc, device=x.device)
    xa = torch.where(keep, x.to(acc), zero)
    first = reduce(torch.stack([xa.sum(), keep.sum().to(acc)]))  # pass 1: Σx and n over all processes
    n = first[1]
    mean = first[0] / n.clamp(min=1)
    centred = torch.where(keep, xa - mean, zero)
    sq = reduce((centred * centred).sum().reshape(1))[0]  # pass 2: Σ(x − μ)² over all processes
    var = sq / (n - 1).clamp(min=1)
    return torch.where(keep, centred * torch.rsqrt(var + eps), zero).to(x.dtype)
