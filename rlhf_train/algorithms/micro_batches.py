"""The micro-batches of one minibatch, and when their gradients are synchronised.

Three ways to split a minibatch (``[mbs]`` rows of ``P+T`` padded tokens each):

* ``update.gradient_accumulation_steps > 1``: that many equal slices of its rows, counted by Accelerate's
  ``accumulate``;
* otherwise, without packing, equal slices of at most ``update.micro_batch_tokens`` padded tokens
  (``rows × (P+T)``, or ``prompts × P + rows × T`` when a prompt's samples share its pass,
  ``trainer.shared_prompt``; ``null``: :data:`CPU_MICRO_BATCH_TOKENS` on a CPU, the whole minibatch on an
  accelerator). Why: the activations autograd keeps for the backward pass grow with the tokens of one
  pass (SmolLM2-135M's shape: ~50 KB per token and layer, 5.8 GB for 32 × 112 tokens through its 30
  layers), and summing the gradients of equal slices costs no FLOPs;
* with ``update.packing=true``: the rows packed first-fit decreasing into micro-batches of at most
  ``update.token_budget`` real tokens (:func:`rlhf_train.core.packing.first_fit_decreasing`), each one packed
  row without padding (:mod:`rlhf_train.models.packed`).

In the last two the number of micro-batches depends on the batch, so the accumulation is counted here, not by
Accelerate's fixed step count: the gradients are all-reduced (DDP) and the optimizer steps after the last
micro-batch only, and every process runs as many micro-batches as the process with the most
(:func:`rlhf_train.core.packing.split_bins`; equal slices: the largest count), so collectives stay in step.
The loss of each micro-batch is scaled to its share of the minibatch's units (``minibatch_update``), so the
summed gradient is the whole minibatch's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from rlhf_train.algorithms.configs import UpdateConfig
from rlhf_train.core.packing import first_fit_decreasing, split_bins

# update.micro_batch_tokens=null on a CPU: 1024 padded tokens per micro-batch bound the update's activations at
# SmolLM2-135M's shape to ~1.5 GB (4 micro-batches of 8 × 112 for a minibatch of 32), where one pass of the 32
# kept 5.8 GB; a GEMM of 1024 rows still runs at the CPU's full rate. On an accelerator the whole minibatch
# (one pass keeps the device busy; set a budget where its memory is short).
CPU_MICRO_BATCH_TOKENS = 1024


def micro_batch_tokens(cfg: UpdateConfig, device: torch.device) -> int | None:
    """The padded-token budget of one micro-batch (``None``: the whole minibatch at once)."""
    if cfg.micro_batch_tokens is not None:
        return cfg.micro_batch_tokens
    return CPU_MICRO_BATCH_TOKENS if device.type == "cpu" else None


def counted_here(cfg: UpdateConfig) -> bool:
    """Whether this module counts the accumulation (else Accelerate's ``accumulate`` does)."""
    return cfg.packing or cfg.gradient_accumulation_steps == 1


def micro_batches(full_mask: torch.Tensor, idx: torch.Tensor, cfg: UpdateConfig, accelerator,
                  shared_prompts: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """Row indices (into the rollout) of each micro-batch of the minibatch ``idx [mbs]``, whose attention
    masks are ``full_mask [mbs, P+T]``. ``shared_prompts``: ``(U, P)`` when the rows (ordered by prompt) hold
    ``U`` distinct prompts of ``P`` columns that the policy's pass runs once each
    (:mod:`rlhf_train.models.shared_prompt`): the trunk then sees ``U·P + mbs·T`` tokens, not ``mbs·(P+T)``,
    and the budget counts those."""
    if not cfg.packing:
        if cfg.gradient_accumulation_steps > 1:
            micro = len(idx) // cfg.gradient_accumulation_steps
            return [idx[k * micro:(k + 1) * micro] for k in range(cfg.gradient_accumulation_steps)]
        budget = micro_batch_tokens(cfg, accelerator.device)
        tokens = len(idx) * full_mask.shape[1]
        if shared_prompts is not None:
            (U, P), T = shared_prompts, full_mask.shape[1] - shared_prompts[1]
            tokens = U * P + len(idx) * T
        count = 1 if budget is None else min(len(idx), max(1, -(-tokens // budget)))
        if budget is not None and accelerator.num_processes > 1:  # as many backward passes on every process
            count = int(accelerator.gather(torch.tensor([count], device=accelerator.device)).max().item())
        return list(torch.tensor_split(idx, count))
    lengths = full_mask.sum(-1).tolist()
    bins = first_fit_decreasing(lengths, cfg.token_budget)
    if accelerator.num_processes > 1:  # the same number of backward passes on every process
        most = accelerator.gather(torch.tensor([len(bins)], device=accelerator.device)).max().item()
        bins = split_bins(bins, lengths, int(most))
    return [idx[torch.tensor(b, dtype=torch.long)] for b in bins]


@contextlib.contextmanager
def accumulation(accelerator, policy, cfg: UpdateConfig, last: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: Accelerate's ``accumulate`` with
    ``update.gradient_accumulation_steps > 1``; else ``accelerator.sync_gradients`` is True for the ``last``
    micro-batch only and the others run under ``no_sync`` (their gradients accumulate locally; the last
    backward all-reduces the sum)."""
    if not counted_here(cfg):
        with accelerator.accumulate(policy):
            yield
        return
    accelerator.sync_gradients = last
    with contextlib.nullcontext() if last else accelerator.no_sync(policy):
        yield
