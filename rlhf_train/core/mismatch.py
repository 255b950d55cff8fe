"""The sampler / trainer mismatch: how far the log-probs recorded at generation are from the trainer's own,
and the importance-sampling correction that reweights the policy loss for it.

Shapes: B = batch (sequences), T = response tokens; every input ``[B, T]``, ``mask`` 1 on response tokens.
``sampler`` holds log μ(a_t | s_t), the log-probs the generation backend recorded while it sampled (its
own kernels, precision, batch shapes), ``trainer`` log π(a_t | s_t) of the same tokens from the trainer's
forward pass with the same weights. In exact arithmetic they are equal; in practice they differ by
rounding (float32: ~1e-7 per token), a lower precision (bf16: ~1e-3) or another engine (vLLM, SGLang).

The tokens were drawn from μ, so with ``d = log μ − log π`` the k1 estimator ``mean(d)`` and the k2
estimator ``mean(½ d²)`` estimate KL(μ || π) (Schulman 2020, "Approximating KL Divergence": k1, k2);
:func:`mismatch_kl_sums` gives their sums for a mean over several micro-batches.

Importance-sampling correction (:func:`importance_weights`): the gradient of the policy loss is an
expectation under π_old (the trainer's), while the samples come from μ. Weighting each term by
``w = π_old / μ`` corrects it; the weights are bounded because a few large ones dominate the variance:

* ``level="token"``: ``w_t = π_old(a_t|s_t) / μ(a_t|s_t)`` per token (Yao et al. 2025, "Your Efficient
  RL Framework Secretly Brings You Off-Policy RL Training", truncated importance sampling, TIS);
* ``level="sequence"``: ``w = Π_t π_old / μ = exp(Σ_t (log π_old − log μ))`` for every token of a
  response: the exact likelihood ratio of the whole sequence (the product, not GSPO's length-normalised
  geometric mean, so that it is the ratio the off-policy correction calls for; Liu et al. 2025, "When
  Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch", sequence-level
  truncated and masked IS);
* ``mode="clip"``: ``w`` truncated to ``[low, high]`` (TIS; ``low`` is usually 0, i.e. no lower bound);
  ``mode="mask"``: ``w`` kept inside ``[low, high]`` and 0 outside, so the loss of those tokens /
  sequences is dropped (masked importance sampling, MIS; Liu et al. 2025).

Everything is computed from log-ratios, so a sequence ratio far outside ``[low, high]`` never overflows.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf_train.core.masked import masked_mean, masked_sum

IS_LEVELS = ("token", "sequence")
IS_MODES = ("clip", "mask")


def mismatch_kl_sums(sampler: Tensor, trainer: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(Σ d, Σ ½ d², n)`` over the response tokens, ``d = sampler − trainer`` (``[B, T]`` each): the sums
    of the k1 and k2 estimators of KL(μ || π) and the token count (Schulman 2020, k1 and k2), so that a mean
    over several micro-batches is ``Σ / n`` of their totals. Entries outside ``mask`` take no part."""
    d = sampler.float() - trainer.float()
    return masked_sum(d, mask), masked_sum(0.5 * d * d, mask), masked_sum(torch.ones_like(d), mask)


def importance_weights(trainer: Tensor, sampler: Tensor, mask: Tensor, level: str, mode: str, low: float,
                       high: float) -> tuple[Tensor, Tensor]:
    """``(w [B, T], filtered_frac)``: the importance-sampling weight of every response token (1 outside
    ``mask``) and the share of units whose weight fell outside ``[low, high]`` (clipped or masked; units:
    response tokens at ``level="token"``, sequences with a response at ``level="sequence"``).

        token     log w_t = log π_old − log μ                     (Yao et al. 2025, TIS)
        sequence  log w   = Σ_t (log π_old − log μ)  at every t   (Liu et al. 2025, sequence-level IS)
        clip      w = clamp(exp(log w), low, high)                (TIS)
        mask      w = exp(log w) if low ≤ w ≤ high else 0         (MIS)

    ``trainer``: log π_old of the sampled tokens (the trainer's pass before the update); ``sampler``:
    log μ, recorded at generation. The weights carry no gradient: they multiply the per-token loss.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {', '.join(IS_MODES)}")
    inside = mask if mask.dtype == torch.bool else mask != 0
    log_w = torch.where(inside, trainer.float() - sampler.float(), torch.zeros((), device=trainer.device))
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    lo, hi = (math.log(low) if low > 0 else -math.inf), math.log(high)
    outside = (log_w < lo) | (log_w > hi)
    if mode == "clip":
        w = torch.exp(log_w.clamp(lo, hi))
    else:
        w = torch.where(outside, torch.zeros((), device=log_w.device), torch.exp(log_w.clamp(max=hi)))
    w = torch.where(inside, w, torch.ones((), device=w.device)).detach()
    if level == "token":
        frac = masked_mean(outside.float(), inside)
    else:
        has_response = inside.any(-1)
        frac = (outside[:, 0] & has_response).float().sum() / has_response.sum().clamp(min=1)
    return w, frac
