"""The micro-batches of one minibatch, and when their gradients are synchronised.

Without packing: ``update.gradient_accumulation_steps`` equal slices of the minibatch's rows, counted by
Accelerate's ``accumulate``. With ``update.packing=true``: the rows packed first-fit decreasing into
micro-batches of at most ``update.token_budget`` real tokens
(:func:`rlhf_train.core.packing.first_fit_decreasing`), each one packed row without padding
(:mod:`rlhf_train.models.packed`). Their number depends on the lengths, so the accumulation is counted
here, not by Accelerate's fixed step count: the gradients are all-reduced (DDP) and the optimizer steps after
the last micro-batch only, and every process runs as many micro-batches as the process with the most
(:func:`rlhf_train.core.packing.split_bins`), so collectives stay in step.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from rlhf_train.algorithms.configs import UpdateConfig
from rlhf_train.core.packing import first_fit_decreasing, split_bins


def micro_batches(full_mask: torch.Tensor, idx: torch.Tensor, cfg: UpdateConfig, accelerator) -> list[torch.Tensor]:
    """Row indices (into the rollout) of each micro-batch of the minibatch ``idx [mbs]``, whose attention
    masks are ``full_mask [mbs, P+T]``."""
    if not cfg.packing:
        micro = len(idx) // cfg.gradient_accumulation_steps
        return [idx[k * micro:(k + 1) * micro] for k in range(cfg.gradient_accumulation_steps)]
    lengths = full_mask.sum(-1).tolist()
    bins = first_fit_decreasing(lengths, cfg.token_budget)
    if accelerator.num_processes > 1:  # the same number of backward passes on every process
        most = accelerator.gather(torch.tensor([len(bins)], device=accelerator.device)).max().item()
        bins = split_bins(bins, lengths, int(most))
    return [idx[torch.tensor(b, dtype=torch.long)] for b in bins]


@contextlib.contextmanager
def accumulation(accelerator, policy, cfg: UpdateConfig, last: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: Accelerate's ``accumulate`` without packing; with it,
    ``accelerator.sync_gradients`` is True for the ``last`` micro-batch only and the others run under
    ``no_sync`` (their gradients accumulate locally; the last backward all-reduces the sum)."""
    if not cfg.packing:
        with accelerator.accumulate(policy):
            yield
        return
    accelerator.sync_gradients = last
    with contextlib.nullcontext() if last else accelerator.no_sync(policy):
        yield
