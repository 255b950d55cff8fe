"""Which rows of a batch share their prompt: GRPO, RLOO and every algorithm with ``rollout.num_samples = G > 1``
sample G responses per prompt, so a batch of ``B`` rows holds ``U = B / G`` distinct prompts.

A pure tensor function over the left-padded layout of the rollout (``full [B, P+T]``, its mask, ``prompt_len = P``):
:mod:`rlhf_train.models.shared_prompt` runs each distinct prompt through a model once, and the update orders a
minibatch's rows by prompt so that a prompt's rows land in the same micro-batch
(:func:`rlhf_train.algorithms.update.minibatch_update`).
"""
from __future__ import annotations

import torch


def _prompt_keys(full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[B, P]``: the prompt tokens with every padding position set to −1 (two rows whose prompts differ only in
    what sits under the padding are the same prompt)."""
    return full[:, :prompt_len].long().masked_fill(~full_mask[:, :prompt_len].bool(), -1)


def prompt_groups(full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first [U], inverse [B])``: the first row of each of the ``U`` distinct prompts (in the order of those
    rows) and, for every row, which of them its prompt is (``first[inverse[b]]`` has row ``b``'s prompt);
    ``None`` when no two rows share a prompt (or there is no prompt).

    Example: prompts ``[a, a, b, b, a]`` give ``first = [0, 2]``, ``inverse = [0, 0, 1, 1, 0]``."""
    B = full.shape[0]
    if prompt_len <= 0 or B < 2:
        return None
    unique, inverse = torch.unique(_prompt_keys(full, full_mask, prompt_len), dim=0, return_inverse=True)
    U = unique.shape[0]
    if U == B:
        return None
    rows = torch.arange(B, device=full.device)
    first = torch.full((U,), B, dtype=torch.long, device=full.device).scatter_reduce(0, inverse, rows, "amin")
    order = first.argsort()  # torch.unique sorts the prompts; number them by their first row instead
    rank = torch.empty_like(order)
    rank[order] = torch.arange(U, device=full.device)
    return first[order], rank[inverse]

