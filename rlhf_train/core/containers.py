"""Typed containers for token data, after torchrl's ``Tokens`` / ``Masks`` / ``LogProbs``.

Every rollout carries its tokens once per sequence, never once per timestep:

    prompt   [B, P]      left-padded prompt tokens (generation needs left padding)
    response [B, T]      generated tokens, right-padded with the pad id after EOS
    full     [B, P + T]  ``cat(prompt, response)``: what every model sees in its one forward pass

``Masks`` holds the matching boolean masks (1 = a real token), and ``LogProbs`` holds per-token
log-probabilities of the response tokens ([B, T], zero outside the response mask).
"""
from __future__ import annotations

import torch
from tensordict import TensorClass


class Tokens(TensorClass["nocast"]):
    """Token ids: ``prompt [B, P]`` (left-padded), ``response [B, T]``, ``full [B, P+T]``."""

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None


class Masks(TensorClass["nocast"]):
    """Boolean masks aligned with :class:`Tokens`.

    ``prompt [B, P]``: non-pad prompt tokens. ``response [B, T]``: response tokens up to and including
    the first EOS (the actions PPO trains on). ``full [B, P+T]``: the attention mask of ``Tokens.full``.
    """

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None


class LogProbs(TensorClass["nocast"]):
    """Per-token log-probabilities; rlhf_train fills ``response [B, T]`` (the sampled tokens)."""

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, L]`` for a left-padded batch: 0 at the first real token.

    ``generate`` derives positions this way for left-padded prompts; the training forward pass must
    use the same positions or its log-probs would not match the sampling distribution.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_mask_from_tokens(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``[B, T]`` bool: response positions up to and including the first EOS (all if none)."""
    is_eos = response == eos_token_id
    # number of EOS strictly before each position; a position belongs to the response while it is 0
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    return eos_before == 0


def left_pad(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the right end (left padding), vectorised. ``[B, L]`` → ``[B, L]``."""
    mask = mask.bool()
    # stable sort puts pads (key 0) first and keeps the order of real tokens (key 1)
    order = torch.sort(mask.long(), dim=-1, stable=True).indices
    return ids.gather(-1, order).masked_fill(~mask.gather(-1, order), pad_token_id), mask.gather(-1, order)
