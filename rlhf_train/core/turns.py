"""Multi-turn episodes: per-token estimators over the policy's own tokens only.

Shapes: B = episodes, T = tokens after the first prompt. In a multi-turn episode the response row holds the
policy's assistant turns and, between them, the environment's messages (tool results, user replies), so the
action mask ``mask [B, T]`` (1 on the tokens the policy sampled) is not a prefix of the row. The
environment's tokens are no actions: they are part of the transition from the last token of one assistant
turn to the state its next turn starts from. An estimator that walks the timesteps (GAE, a return-to-go)
must therefore step from one action to the next action, skipping the environment's tokens, not treat them
as timesteps (each would add a discount factor, and GAE would read the value after a turn as 0, as if the
episode had ended there).

:func:`over_actions` does this for any such estimator: the actions of each row are moved to its front in
order (a stable sort on the mask: no loop over rows or tokens), the estimator runs on that contiguous
prefix, and its outputs go back to the actions' own positions (0 elsewhere). For a mask that already is a
prefix (a single-turn rollout) the permutation is the identity and the outputs are the estimator's own.

Reference: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16, ``A_t = Σ_{l≥0} (γλ)^l δ_{t+l}`` with ``δ_t = r_t + γ V(s_{t+1}) − V(s_t)``, where
``t`` counts the agent's decisions: here its sampled tokens, ``s_{t+1}`` the state of its next sampled token.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def action_order(mask: Tensor) -> Tensor:
    """``[B, T]`` long: for each row, the positions of its actions first (in order), then the others."""
    return torch.sort((~mask.bool()).to(torch.uint8), dim=-1, stable=True).indices


def compact(x: Tensor, order: Tensor) -> Tensor:
    """``x [B, T]`` with each row's actions moved to its front (``order`` from :func:`action_order`)."""
    return x.gather(-1, order)


def expand(x: Tensor, order: Tensor, mask: Tensor) -> Tensor:
    """Inverse of :func:`compact`: ``x [B, T]`` (actions at the front) back to the actions' positions, 0 elsewhere."""
    out = torch.zeros_like(x).scatter(-1, order, x)
    return torch.where(mask.bool(), out, torch.zeros((), dtype=x.dtype, device=x.device))


def over_actions(estimator: Callable[..., tuple[Tensor, ...]], mask: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
    """``estimator(*xs, mask)`` computed over the actions of each row only (see the module docstring).

    ``xs``: ``[B, T]`` tensors (rewards, values); ``estimator(*compacted xs, prefix mask) -> tuple of [B, T]``;
    returns those outputs at the actions' positions, 0 elsewhere. Example (γ = λ = 1), actions at 0 and 2 of
    ``[a, env, a, env]`` with rewards ``[0, ·, 1, ·]`` and values ``[0.5, ·, 0.25, ·]``: GAE sees two steps,
    ``δ = [0 + 0.25 − 0.5, 1 − 0.25]``, so the advantages are ``[0.5, 0, 0.75, 0]``.
    """
    order = action_order(mask)
    prefix = compact(mask.bool(), order)
    outs = estimator(*(compact(x, order) for x in xs), prefix)
    return tuple(expand(o, order, mask) for o in outs)
