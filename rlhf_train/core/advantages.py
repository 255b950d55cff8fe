"""Advantage estimators over response tokens: generalised advantage estimation (GAE, PPO) and the
critic-free ones: group-normalised (GRPO), leave-one-out (RLOO), return-to-go (REINFORCE++).

Shapes: B = batch (sequences), T = response tokens. ``rewards``, ``values`` and ``mask`` are ``[B, T]``;
``mask`` is 1 on response tokens (a contiguous prefix of each row, up to and including EOS), 0 after.
Each response token is one action with its own reward (e.g. a KL penalty at every token, the score at
the last); the value after the last response token is 0 (the episode ends there).

Why a matmul: the backward recursion ``A_t = δ_t + γλ A_{t+1}`` would be T tiny kernel launches per
batch; :func:`gae` computes the same sum as one ``[B, T] @ [T, T]`` product with a triangular discount
matrix (T is at most a few hundred tokens, so the matrix is cheap).

Reference:
  Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
  eq. 16: ``A_t = Σ_{l≥0} (γλ)^l δ_{t+l}``, ``δ_t = r_t + γ V(s_{t+1}) - V(s_t)``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    rewards, values, mask: [B, T] -> (advantages [B, T], returns [B, T]).

        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = sum_{k >= t} (gamma * lam)^(k - t) * delta_k * m_k
        R_t     = A_t + V_t

    The value after the last response token is 0: the episode ends (EOS) or is
    truncated there, and like TRL / "N+ implementation details" we treat it as terminal.
    Advantages and returns are 0 outside the mask.
    """
    m = mask.to(values.dtype)
    T = values.shape[-1]
    next_values = torch.cat([values[:, 1:] * m[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = (rewards + gamma * next_values - values) * m  # [B, T]
    # The backward recursion A_t = delta_t + gamma*lam*A_{t+1} is a Python loop over T
    # (T tiny kernel launches per batch, slow on GPU). Instead unroll it as one matmul with
    # an upper-triangular discount matrix W[t, k] = (gamma*lam)^(k-t) for k >= t, else 0:
    # A = deltas @ W^T. T is at most a few hundred, so the [T, T] matrix is cheap.
    t = torch.arange(T, device=values.device)
    lag = t[None, :] - t[:, None]  # lag[t, k] = k - t
    W = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0).to(values.dtype), 0.0)
    advantages = (deltas @ W.T) * m
    returns = (advantages + values) * m
    return advantages, returns


# ---------------------------------------------------------------------------------------------------
# Critic-free estimators. ``scores [B]`` are per-sequence rewards; the ``group_size`` samples of one
# prompt are adjacent rows (row ``i * group_size + j`` is sample ``j`` of prompt ``i``), so a group is a
# row of ``scores.view(-1, group_size)``. A group stays on one process, so group statistics need no
# communication; only ``scale="batch"`` (and the REINFORCE++ whitening) reduce over processes.
#
# ``scored [B]`` (bool, None = every row): False for a row that no reward source scored (every source
# returned None). Such a row takes no part in any statistic (its group's mean / std, the batch std) and
# gets advantage 0, as TRL does (>= 1.6, huggingface/trl#5902: GRPO and RLOO); counting it as a reward of
# 0 would move its siblings' baseline and give it an advantage it has no signal for.
# ---------------------------------------------------------------------------------------------------
SCALE_REWARDS = ("group", "batch", "none")


def _groups(scores: Tensor, group_size: int) -> Tensor:
    if scores.dim() != 1 or group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"scores must be [B] with B a multiple of group_size={group_size}; got {tuple(scores.shape)}")
    return scores.view(-1, group_size)


def _scored(scored: Tensor | None, g: Tensor) -> Tensor:
    """``scored [B]`` as ``[G, k]`` bool (all True when None)."""
    return torch.ones_like(g, dtype=torch.bool) if scored is None else scored.to(torch.bool).view_as(g)


def _group_centred(g: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """``(r − mean over the scored rows of the group, 0 at unscored rows) [G, k]`` and the scored count ``[G, 1]``."""
    n = w.sum(-1, keepdim=True)
    mean = torch.where(w, g, torch.zeros((), dtype=g.dtype, device=g.device)).sum(-1, keepdim=True) / n.clamp(min=1)
    return torch.where(w, g - mean, torch.zeros((), dtype=g.dtype, device=g.device)), n


def group_normalized_advantage(scores: Tensor, group_size: int, scale: str = "group", eps: float = 1e-6,
                               all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
                               scored: Tensor | None = None) -> Tensor:
    """GRPO's outcome advantage, one value per sequence. ``scores [B]`` -> ``[B]``.

    Shao et al. 2024, "DeepSeekMath" §4.1.2 (outcome supervision): ``Â_i = (r_i − mean(r)) / std(r)`` over
    the group of one prompt's samples, every token of sequence i getting ``Â_i``. ``scale``:

        group: (r_i − mean_g) / (std_g + eps)      std_g the unbiased std of the group (GRPO)
        batch: (r_i − mean_g) / (std_B + eps)      std_B the unbiased std of all processes' scores
        none:  (r_i − mean_g)                      Dr. GRPO (Liu et al. 2025, §3.1: no std normalisation)

    ``eps`` (``algorithm.scale_eps``): 1e-6 as verl's ``compute_grpo_outcome_advantage``; TRL's GRPOTrainer
    adds 1e-4. A group whose rewards are all equal gets 0 for every sample (no signal), never NaN. A
    non-finite score makes its own group's advantages non-finite (the update skips those rows) and is left
    out of std_B. ``scored [B]``: rows no source scored are left out of mean, std and std_B and get 0
    (the section comment above). ``all_reduce_sum`` (``scale="batch"`` only) sums a tensor over processes
    (``None``: one process).
    """
    g = _groups(scores, group_size)
    if scored is None:
        centred_g = g - g.mean(-1, keepdim=True)
        n = torch.full_like(g[:, :1], group_size)
    else:
        centred_g, n = _group_centred(g, _scored(scored, g))
    centred = centred_g.reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        if scored is None:
            std = g.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(g)
        else:  # unbiased std over the scored rows (fewer than two: their centred value is 0 already)
            std = ((centred_g * centred_g).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        out = centred_g / (std + eps)
        return (out if scored is None else torch.where(_scored(scored, g), out, 0.0)).reshape(-1)
    if scale == "batch":
        reduce = all_reduce_sum if all_reduce_sum is not None else (lambda t: t)
        acc = torch.float64 if scores.device.type != "mps" else torch.float32
        ok = torch.isfinite(scores)  # a faulty (NaN / inf) score spoils its own group only, not the batch std
        if scored is not None:
            ok = ok & scored.to(torch.bool)
        s = torch.where(ok, scores.to(acc), torch.zeros((), dtype=acc, device=scores.device))
        first = reduce(torch.stack([s.sum(), ok.sum().to(acc)]))
        mean, n = first[0] / first[1].clamp(min=1), first[1]
        sq = reduce(torch.where(ok, (s - mean) ** 2, 0.0).sum().reshape(1))[0]
        std = (sq / (n - 1).clamp(min=1)).sqrt().to(scores.dtype)
        return centred / (std + eps)
    raise ValueError(f"unknown scale {scale!r}; expected one of {', '.join(SCALE_REWARDS)}")


def leave_one_out_advantage(scores: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """RLOO's advantage, one value per sequence. ``scores [B]`` -> ``[B]``.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", §3.3 (after Kool et al. 2019): each sample's baseline is the mean reward of
    the *other* k − 1 samples of its prompt,

        A_i = r_i − 1/(k−1) Σ_{j≠i} r_j  =  k/(k−1) · (r_i − mean_g(r))

    so it is unbiased (the baseline does not depend on sample i). Needs ``group_size >= 2``. ``scored
    [B]``: k and the sum run over the group's scored rows; an unscored row, and every row of a group with
    fewer than two scored ones, gets 0 (as TRL's RLOOTrainer).
    """
    if group_size < 2:
        raise ValueError(f"leave-one-out needs group_size >= 2, got {group_size}")
    g = _groups(scores, group_size)
    if scored is None:
        others = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
        return (g - others).reshape(-1)
    w = _scored(scored, g)
    n = w.sum(-1, keepdim=True)
    total = torch.where(w, g, torch.zeros((), dtype=g.dtype, device=g.device)).sum(-1, keepdim=True)
    others = (total - g) / (n - 1).clamp(min=1)
    return torch.where(w & (n >= 2), g - others, torch.zeros((), dtype=g.dtype, device=g.device)).reshape(-1)


def group_mean_baseline(scores: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """``r_i − mean_g(r)``: the group-mean baseline of REINFORCE++-baseline (Hu 2025, §3; the math of
    OpenRLHF's ``reinforce_baseline`` estimator). ``scores [B]`` -> ``[B]``; ``scored [B]``: the mean over
    the group's scored rows, 0 at the unscored ones."""
    g = _groups(scores, group_size)
    if scored is None:
        return (g - g.mean(-1, keepdim=True)).reshape(-1)
    return _group_centred(g, _scored(scored, g))[0].reshape(-1)


def zero_std_groups(scores: Tensor, group_size: int, scored: Tensor | None = None, rtol: float = 1e-6) -> Tensor:
    """``[G]`` bool: True for a group whose scored samples all got the same reward (spread ≤ ``rtol`` ×
    max(1, max |r|)), or that has fewer than two scored samples: a group-relative advantage (GRPO, RLOO) is
    0 for all of it. ``scores [B]``. DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2: keep the
    groups with 0 < accuracy < 1, the constraint of its objective) drops these groups. A group holding a
    non-finite score is not one (its rows are a fault, which the update counts and skips)."""
    g = _groups(scores, group_size)
    w = _scored(scored, g)
    inf = torch.full((), float("inf"), dtype=g.dtype, device=g.device)
    spread = torch.where(w, g, -inf).amax(-1) - torch.where(w, g, inf).amin(-1)
    scale = torch.where(w, g.abs(), torch.zeros((), dtype=g.dtype, device=g.device)).amax(-1).clamp(min=1)
    finite = torch.where(w, torch.isfinite(g), True).all(-1)
    return finite & ((w.sum(-1) < 2) | (spread <= rtol * scale))


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go over response tokens: ``G_t = Σ_{k≥t} γ^(k−t) r_k m_k``. ``[B, T]`` -> ``[B, T]``, 0 outside.

    REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", §3: the per-token reward carries the KL penalty, the advantage is the return-to-go, then
    normalised over the global batch). The same triangular matmul as :func:`gae` (GAE with V = 0, λ = 1).
    """
    m = mask.to(rewards.dtype)
    T = rewards.shape[-1]
    t = torch.arange(T, device=rewards.device)
    lag = t[None, :] - t[:, None]
    W = torch.where(lag >= 0, gamma ** lag.clamp(min=0).to(rewards.dtype), 0.0)
    return ((rewards * m) @ W.T) * m
