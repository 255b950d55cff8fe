"""The losses of the policy update, per micro-batch: PPO's clipped surrogate and clipped value loss, and
the critic-free per-token surrogate (clip-higher, sequence-level ratio) with its loss aggregations.

Shapes: all inputs ``[B, T]`` (B sequences, T response tokens); ``mask`` is 1 on response tokens (up
to and including EOS). Losses are masked means over tokens; the update rescales them to a mean over all
processes' tokens.

References:
  Clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.
  Clipped value loss: the OpenAI baselines PPO2 implementation, as described in Huang et al. 2022,
  "The 37 Implementation Details of PPO" (detail 9, "Value Function Loss Clipping").
  ``approx_kl`` statistic: the k3 estimator of Schulman 2020, "Approximating KL Divergence".
  Clip-higher and token-level aggregation: Yu et al. 2025, "DAPO" (eqs. 8, 10). GRPO's per-sequence
  token mean: Shao et al. 2024, "DeepSeekMath" (eq. 3). The constant divisor: Liu et al. 2025,
  "Understanding R1-Zero-Like Training" (Dr. GRPO, §3.1). Sequence-level ratio: Zheng et al. 2025,
  "Group Sequence Policy Optimization" (GSPO, eq. 7).
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlhf_train.core.masked import masked_mean, masked_sum


def policy_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate. All inputs [B, T] -> (scalar loss, stats of detached scalars).

        ratio = exp(log pi - log pi_old)
        loss  = masked_mean(w * max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))

    ``weights`` ``w [B, T]`` (no gradient): the importance-sampling correction of each token's term
    (:func:`rlhf_train.core.mismatch.importance_weights`; Yao et al. 2025, TIS: the truncated weight
    multiplies the clipped surrogate); ``None`` = 1 (``x * 1.0`` is ``x`` bit for bit, so all-ones
    weights give the same loss and gradient).

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
    per_token = torch.max(pg_loss1, pg_loss2)
    loss = masked_mean(per_token * weights if weights is not None else per_token, mask)
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


# ---------------------------------------------------------------------------------------------------
# The critic-free policy losses (GRPO, RLOO, REINFORCE++) and their variants: asymmetric clipping
# (DAPO), a sequence-level importance ratio (GSPO), three loss aggregations (DAPO / GRPO / Dr. GRPO).
# ---------------------------------------------------------------------------------------------------
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")


def clipped_surrogate(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                      clip_low: float, clip_high: float, ratio_level: str = "token", weights: Tensor | None = None
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped surrogate, NOT aggregated. All inputs ``[B, T]`` -> ``(loss [B, T], stats)``.

        ratio  = exp(log π − log π_old)                                   ratio_level="token"
               = exp(1/|y_i| Σ_t (log π − log π_old))  for every token      ratio_level="sequence" (GSPO)
        loss_t = w_t · max(−A_t · ratio, −A_t · clip(ratio, 1 − clip_low, 1 + clip_high))

    References: PPO (Schulman et al. 2017, eq. 7) with ε split into ``clip_low`` / ``clip_high``
    ("clip-higher", DAPO: Yu et al. 2025, eq. 10); the sequence-level ratio ``s_i(θ)`` of GSPO (Zheng et
    al. 2025, eq. 7), a length-normalised geometric mean of the token ratios.

    ``weights`` ``w [B, T]``: the importance-sampling correction, as in :func:`policy_loss` (``None`` = 1).
    The loss is 0 outside ``mask`` (log ratios there are set to 0 before ``exp``, as in
    :func:`policy_loss`). stats (detached, masked token means): ``clipfrac`` (the clipped term is the
    larger one), ``clipfrac_low`` (… with ratio < 1 − clip_low, i.e. A < 0), ``clipfrac_high`` (… with
    ratio > 1 + clip_high, i.e. A > 0), ``approx_kl`` (k3 of the token ratios), ``ratio_mean``.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {', '.join(RATIO_LEVELS)}")
    inside = mask if mask.dtype == torch.bool else mask != 0
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    log_ratio = torch.where(inside, log_probs - old_log_probs, zero)
    if ratio_level == "sequence":
        seq = masked_mean(log_ratio, inside, dim=-1)[:, None]
        ratio = torch.where(inside, torch.exp(seq).expand_as(log_ratio), zero + 1)
    else:
        ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.max(pg_loss1, pg_loss2)
    loss = torch.where(inside, per_token * weights if weights is not None else per_token, zero)
    with torch.no_grad():
        clipped = (pg_loss2 > pg_loss1) & inside
        f = ratio.dtype
        stats = {
            "clipfrac": masked_mean(clipped.to(f), inside),
            "clipfrac_low": masked_mean((clipped & (ratio < 1.0 - clip_low)).to(f), inside),
            "clipfrac_high": masked_mean((clipped & (ratio > 1.0 + clip_high)).to(f), inside),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, inside),
            "ratio_mean": masked_mean(ratio, inside),
        }
    return loss, stats


def loss_units(mask: Tensor, agg: str) -> Tensor:
    """How many units :func:`aggregate_loss` averages over: response tokens (``token_mean``) or sequences
    with at least one token in ``mask`` (the ``seq_mean_*`` modes: a row whose loss mask is empty, e.g. a
    truncated response under ``algorithm.mask_truncated_completions``, is in no denominator). The update
    weights each micro-batch's loss by its units, so that N processes × B/N rows give the gradient of 1 × B."""
    if agg == "token_mean":
        return mask.sum()
    if agg in LOSS_AGGS:
        return (mask != 0).any(-1).sum()
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {', '.join(LOSS_AGGS)}")


def aggregate_loss(loss: Tensor, mask: Tensor, agg: str, norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over ``mask``:

        token_mean               Σ_{i,t} l / Σ_{i,t} m                   (DAPO, Yu et al. 2025, eq. 8:
                                                                          every token weighs the same)
        seq_mean_token_mean      1/B' Σ_i (Σ_t l_{i,t} / |y_i|)          (GRPO, Shao et al. 2024, eq. 3)
        seq_mean_token_sum_norm  1/B' Σ_i (Σ_t l_{i,t} / norm_length)    (Dr. GRPO, Liu et al. 2025, §3.1:
                                                                          a constant divisor, no length bias)

    B' counts the rows with at least one token in ``mask`` (B when every row has one, as every rollout
    does: a response holds at least one token); a row left out of the loss whole is in no mean.
    ``norm_length`` (``seq_mean_token_sum_norm`` only) defaults to ``T``, the generation budget.
    """
    inside = mask if mask.dtype == torch.bool else mask != 0
    if agg == "token_mean":
        return masked_mean(loss, inside)
    rows = inside.any(-1).sum().clamp(min=1)
    if agg == "seq_mean_token_mean":
        return masked_mean(loss, inside, dim=-1).sum() / rows
    if agg == "seq_mean_token_sum_norm":
        return (masked_sum(loss, inside, dim=-1) / float(norm_length or loss.shape[-1])).sum() / rows
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {', '.join(LOSS_AGGS)}")
