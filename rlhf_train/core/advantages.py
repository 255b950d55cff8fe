"""Advantage estimators over response tokens: generalised advantage estimation (GAE).

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
