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

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_p: Tensor, log_q: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(p || q), p = policy, q = reference, sampled from p. [B, T] -> [B, T].

    k1 = log p - log q                   (unbiased, can be negative)
    k2 = 0.5 * (log p - log q)^2         (biased, >= 0, low variance)
    k3 = (r - 1) - log r, r = q / p      (unbiased, >= 0)
    """
    log_ratio = log_p - log_q
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r with log r = -log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
