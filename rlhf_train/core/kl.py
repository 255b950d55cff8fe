"""Per-token estimators of KL(π || π_ref) from log-probs of tokens sampled from the policy π.

Shapes: B = batch (sequences), T = response tokens. ``log_p`` (policy) and ``log_q`` (reference) are
``[B, T]`` log-probs of the *sampled* tokens only, so the estimate needs no vocabulary-wide sum: with
``r = q / p``, ``k1 = -log r``, ``k2 = ½ (log r)²``, ``k3 = (r - 1) - log r``. k1 and k3 are unbiased;
k2 and k3 are ≥ 0 per token (k2 at the price of a bias, k3 without). Summed over a response, k1 and
k3 estimate the sequence KL that the KL penalty in the reward (``rlhf_train.rewards.shaping``) charges.

Reference:
  Schulman 2020, "Approximating KL Divergence" (joschu.net): the estimators k1, k2, k3.
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
