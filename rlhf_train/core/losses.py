"""The losses of the policy update, per micro-batch: PPO's clipped surrogate and clipped value loss.

Shapes: all inputs ``[B, T]`` (B sequences, T response tokens); ``mask`` is 1 on response tokens (up
to and including EOS). Losses are masked means over tokens; the update rescales them to a mean over all
processes' tokens.

References:
  Clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.
  Clipped value loss: the OpenAI baselines PPO2 implementation, as described in Huang et al. 2022,
  "The 37 Implementation Details of PPO" (detail 9, "Value Function Loss Clipping").
  ``approx_kl`` statistic: the k3 estimator of Schulman 2020, "Approximating KL Divergence".
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlhf_train.core.masked import masked_mean


def policy_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate. All inputs [B, T] -> (scalar loss, stats of detached scalars).

        ratio = exp(log pi - log pi_old)
        loss  = masked_mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))

    stats: clipfrac (fraction of tokens where the clipped term is the larger one),
    approx_kl (masked mean of (ratio - 1) - log ratio, the k3 estimator), ratio_mean.

    Entries outside ``mask`` take no part, whatever they hold: a padding token outside the top-k / top-p
    set has log pi = -inf there, and the log ratio is set to 0 before ``exp`` so that neither the stats nor
    the gradient see inf - inf (inside the mask the values are unchanged, bit for bit).
    """
    inside = mask if mask.dtype == torch.bool else mask != 0
    log_ratio = torch.where(inside, log_probs - old_log_probs, torch.zeros((), dtype=log_probs.dtype,
                                                                           device=log_probs.device))
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.max(pg_loss1, pg_loss2), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_loss2 > pg_loss1).to(ratio.dtype), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps_value: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss. All inputs [B, T] -> (scalar loss, {"clipfrac"}).

        v_clip = old_v + clip(v - old_v, -eps, eps)
        loss   = 0.5 * masked_mean(max((v - R)^2, (v_clip - R)^2))
    """
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    vf_loss1 = (values - returns) ** 2
    vf_loss2 = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_loss1, vf_loss2), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((vf_loss2 > vf_loss1).to(values.dtype), mask)}
    return loss, stats
