"""``update.micro_batch_tokens`` (rlhf_train/algorithms/micro_batches.py): without packing a minibatch runs in
equal slices of at most that many padded tokens (``null``: 1024 on a CPU, the whole minibatch on an
accelerator), their gradients summed into one optimizer step per minibatch, so the weights after the update
are the one-pass update's (to float rounding, through AdamW), for a token-mean (PPO) and a sequence-mean
(GRPO, ``seq_mean_token_mean``) loss.

Budget: ~5 s on 2 CPU cores.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.packing import GPT2, P, T, policy_of, unequal_rollout
from tests.helpers.reliability import make_cfg

# 8 rows of 4 to 200 tokens, each P + T = 200 padded positions: two minibatches of 4 (800 padded tokens)
LENGTHS = [(4, 180), (20, 3), (1, 100), (10, 1), (3, 50), (15, 7), (2, 2), (20, 150)]


def decisions(*overrides: str):
    from rlhf_train.loop.build import decide

    return decide(make_cfg("update.minibatch_size=4", "update.num_epochs=2", "update.max_grad_norm=null",
                           *overrides))


def update(*overrides: str):
    """One minibatch_update: (weights after, optimizer steps, stats)."""
    from accelerate import Accelerator

    from rlhf_train.algorithms.update import minibatch_update
    from rlhf_train.infra.faults import Faults

    d = decisions(*overrides)
    policy = policy_of(GPT2)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = minibatch_update(policy, optimizer, scheduler, Accelerator(cpu=True), unequal_rollout(LENGTHS),
                             d.algorithm, d.sampling, d.update, torch.Generator().manual_seed(0), Faults(3))
    return [p.detach() for p in policy.parameters()], scheduler.last_epoch, stats


def rows_of(budget: str, device: str = "cpu", processes: int = 1, others: int = 1):
    from rlhf_train.algorithms.micro_batches import micro_batches

    accelerator = SimpleNamespace(device=torch.device(device), num_processes=processes,
                                  gather=lambda t: torch.cat([t, torch.tensor([others])]))
    mask = unequal_rollout(LENGTHS).masks.full
    idx = torch.tensor([7, 0, 2, 4])
    return [r.tolist() for r in micro_batches(mask[idx], idx, decisions(f"update.micro_batch_tokens={budget}").update,
                                              accelerator)]


def test_micro_batches_hold_at_most_the_budget_of_padded_tokens():
    assert P + T == 200  # each row: 200 padded positions
    assert rows_of("400") == [[7, 0], [2, 4]]
    assert rows_of("401") == [[7, 0], [2, 4]]        # 800 tokens need 2 slices of <= 401
    assert rows_of("399") == [[7, 0], [2], [4]]      # 3 slices, as equal as rows allow
    assert rows_of("50") == [[7], [0], [2], [4]]     # never less than one row
    assert rows_of("800") == [[7, 0, 2, 4]]
    # null: 1024 on a CPU (800 tokens: one pass), the whole minibatch on an accelerator
    from rlhf_train.algorithms.micro_batches import CPU_MICRO_BATCH_TOKENS

    assert CPU_MICRO_BATCH_TOKENS == 1024 and rows_of("null") == [[7, 0, 2, 4]]
    assert rows_of("null", device="cuda") == [[7, 0, 2, 4]]
    # several processes: as many micro-batches as the process with the most
    assert rows_of("800", processes=2, others=3) == [[7, 0], [2], [4]]


@pytest.mark.parametrize("algorithm", [
    [],  # PPO: token-mean policy loss + value loss
    ["algorithm=grpo", "rollout.num_samples=2", "algorithm.kl_in_reward=false", "algorithm.beta=0.1",
     "algorithm.loss_agg=seq_mean_token_mean", "update.ent_coef=0.01"],
])
def test_micro_batched_update_gives_the_one_pass_update(algorithm):
    whole, split = update(*algorithm, "update.micro_batch_tokens=800"), update(*algorithm, "update.micro_batch_tokens=300")
    assert whole[1] == split[1] == 4  # one optimizer step per minibatch (2 epochs x 2), not one per micro-batch
    for a, b in zip(whole[0], split[0]):  # AdamW's first steps scale a near-zero gradient's rounding up to ~lr
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert whole[2].keys() == split[2].keys()


def test_a_budget_that_is_not_positive_is_refused_before_work():
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match="update.micro_batch_tokens=0 must be positive"):
        check_config(make_cfg("update.micro_batch_tokens=0"))
