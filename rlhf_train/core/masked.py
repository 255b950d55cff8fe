"""Pure tensor maths for PPO on language models.

Shapes: B = batch (sequences), T = response tokens, V = vocabulary.
``mask`` is a bool or float ``[B, T]`` tensor: 1 on response tokens (a contiguous
prefix of each row, up to and including EOS), 0 after.

References:
  PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
  GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
  KL estimators: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3).
"""
from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is 1. x, mask: [B, T] -> scalar, or [B] with dim=1."""
    x = x * mask.to(x.dtype)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked entries. [B, T] -> scalar, or per row [B] with dim=1.

    An empty mask (or empty row) gives 0, not NaN.
    """
    m = mask.to(x.dtype)
    return masked_sum(x, m, dim) / masked_sum(torch.ones_like(x), m, dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over masked entries (scalar). Bessel-corrected if ``unbiased``."""
    m = mask.to(x.dtype)
    var = masked_mean((x - masked_mean(x, m)) ** 2, m)
    if unbiased:
        n = m.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with mean/var over masked entries only. [B, T] -> [B, T], 0 where mask is 0.

    ``shift_mean=False`` keeps the original mean (only rescales), as in TRL.
    """
    m = mask.to(x.dtype)
    mean, var = masked_mean(x, m), masked_var(x, m)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m
