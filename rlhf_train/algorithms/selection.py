"""Which rows of a scored rollout the update trains on: DAPO's dynamic sampling (``algorithm.
filter_zero_std_groups``), TRL's ``mask_truncated_completions``, and skipping an update that nothing can
be learned from.

* ``filter_zero_std_groups`` (GRPO, RLOO): a group whose samples all got the same sequence reward has
  advantage 0 on every row (:func:`rlhf_train.core.advantages.zero_std_groups`); its rows leave the update, so
  they cost no forward / backward pass and count in no token- or sequence-mean denominator (Yu et al. 2025,
  "DAPO", arXiv 2503.14476, §3.2: keep the groups with 0 < accuracy < 1). No refill: the groups are
  not replaced by newly generated ones (DAPO over-samples until the batch is full), so the update has fewer
  rows and fewer minibatches.
* ``mask_truncated_completions``: a response cut at ``rollout.max_new_tokens`` without EOS
  (``Rollout.truncated``) is left out of the loss (DAPO §3.4, "overlong filtering"); its reward still counts in
  its group's statistics, which
  the estimator computed before (as TRL's GRPOTrainer / RLOOTrainer).
* When no row of any process has a learning signal (every group's rewards equal, for an algorithm whose
  advantage is relative to the group; or every row left out), the update is skipped: no forward pass, no
  optimizer or LR step (the loop counts it and says so in one line).

Several processes: the minibatch loop must run the same number of times on each, so every process trains on
the same number of rows ``R`` = the largest kept count rounded up to a multiple of ``update.minibatch_size``
(at most the batch): its kept rows, then as many left-out rows as it takes, their loss mask emptied (they cost
compute, never gradient). With one process ``R`` is the kept count rounded up the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhf_train.algorithms.critic_free import scored_rows, sequence_rewards
from rlhf_train.core.advantages import zero_std_groups
from rlhf_train.core.containers import Rollout


@dataclass(frozen=True)
class RowSelection:
    """The ``algorithm`` keys that pick the update's rows, read once (:func:`rlhf_train.loop.build.decide`)."""

    group_size: int                     # rollout.num_samples: adjacent rows of one prompt
    minibatch_size: int                 # update.minibatch_size: rows per optimizer step
    relative: bool = False              # the estimator's advantage is 0 for a group of equal rewards (GRPO, RLOO)
    filter_zero_std_groups: bool = False
    mask_truncated: bool = False

    def informative(self, ro: Rollout) -> torch.Tensor:
        """``[B]`` bool: the rows of a group whose rewards are not all equal (every row when not ``relative``)."""
        B = ro.batch_size[0]
        if not self.relative or self.group_size < 2:
            return torch.ones(B, dtype=torch.bool, device=ro.device)
        seq = sequence_rewards(ro)  # what the group estimators compare
        return ~zero_std_groups(seq, self.group_size, scored_rows(ro)).repeat_interleave(self.group_size)

    def __call__(self, ro: Rollout, gather: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Rollout | None, int]:
        """``(the update's rollout, or None: skip the update; rows of this process left out of the loss)``.
        ``gather`` concatenates a tensor over processes (identity on one). Every row kept: ``ro`` itself."""
        B = ro.batch_size[0]
        keep = torch.ones(B, dtype=torch.bool, device=ro.device)
        if self.mask_truncated:
            keep &= ~ro.truncated.any(-1)
        informative = self.informative(ro)
        if self.filter_zero_std_groups:
            keep &= informative
        counts = gather(torch.stack([keep.sum(), (keep & informative).sum()]).reshape(1, 2).cpu()).reshape(-1, 2)
        dropped = B - int(keep.sum())
        if int(counts[:, 1].sum()) == 0:
            return None, dropped
        most = int(counts[:, 0].max())
        rows_per_process = min(B, -(-most // self.minibatch_size) * self.minibatch_size)
        if rows_per_process == B and dropped == 0:
            return ro, 0
        order = torch.cat([keep.nonzero().squeeze(-1), (~keep).nonzero().squeeze(-1)])[:rows_per_process]
        chosen = ro[order.to(ro.device)]
        trains = keep[order][:, None]
        for name in ("response", "assistant"):  # the loss mask (masks.actions: assistant, else response)
            mask = getattr(chosen.masks, name, None)
            if mask is not None:
                setattr(chosen.masks, name, mask & trains)
        return chosen, dropped
