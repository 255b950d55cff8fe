"""Per-token estimators of KL(π || π_ref) from log-probs of tokens sampled from the policy π.

Shapes: B = batch (sequences), T = response tokens. ``log_p`` (policy) and ``log_q`` (reference) are
``[B, T]`` log-probs of the *sampled* tokens only, so the estimate needs no vocabulary-wide sum: with
``r = q / p``, ``k1 = -log r``, ``k2 = ½ (log r)²``, ``k3 = (r - 1) - log r``. k1 and k3 are unbiased;
k2 and k3 are ≥ 0 per token (k2 at the price of a bias, k3 without). Summed over a response, k1 and
k3 estimate the sequence KL that the KL penalty in the reward (``rlhf_train.rewards.shaping``) charges.

References:
  Schulman 2020, "Approximating KL Divergence" (joschu.net): the estimators k1, k2, k3.
  Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL" (arXiv 2506.09477):
  what the gradient of a KL estimate used as a loss follows (:func:`k3_loss_term`).
  DeepSeek-AI 2025, "DeepSeek-V3.2" (arXiv 2512.02556, §3.1, eq. 7, the "unbiased KL estimate"): the k3
  term weighted by the importance ratio π / π_old.
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


def k3_loss_term(log_p: Tensor, old_log_p: Tensor, ref_log_p: Tensor, mask: Tensor, ratio_weighted: bool) -> Tensor:
    """The per-token KL term of a loss that puts the KL to the reference in the loss (GRPO's β term),
    ``[B, T]`` -> ``[B, T]``, 0 outside ``mask``. ``log_p`` = log π (with gradient), ``old_log_p`` = log π_old
    (the sampling policy's), ``ref_log_p`` = log π_ref, of tokens sampled from π_old.

        plain           k3(π, π_ref) = π_ref/π − 1 − log(π_ref/π)      (DeepSeekMath eq. 4; verl's
                                                                        ``low_var_kl``, which clamps it to ±10)
        ratio_weighted  (π/π_old) · k3(π, π_ref), ratio not detached   (DeepSeek-V3.2 eq. 7; TRL's
                                                                        ``use_bias_correction_kl``)

    The two have the same value at π = π_old (ratio 1) but not the same gradient. Differentiated, the plain
    term's expectation over tokens sampled from π = π_old is ``E_π[(1 − π_ref/π) ∇log π]`` = ∇ KL(π_ref ‖ π):
    it pulls towards the reference along the *forward* KL. The ratio-weighted term's is
    ``E_π[(log π − log π_ref) ∇log π]`` = ∇ KL(π ‖ π_ref), the *reverse* KL the RLHF objective penalises
    (Tang & Munos 2025: differentiating a KL estimate is not in general the gradient of the KL). Both are
    per token: neither carries how an earlier token changes the later tokens' KL (Tang & Munos's second
    pitfall).
    """
    inside = mask if mask.dtype == torch.bool else mask != 0
    zero = torch.zeros((), dtype=log_p.dtype, device=log_p.device)
    log_p = torch.where(inside, log_p, ref_log_p)  # log ratio 0 outside the mask: no inf − inf
    term = kl_estimate(log_p, ref_log_p, "k3")
    if ratio_weighted:
        term = torch.exp(torch.where(inside, log_p - old_log_p, zero)) * term
    return torch.where(inside, term, zero)
