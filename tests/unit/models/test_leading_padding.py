"""Prompt columns that every row pads are dropped before a pass (rlhf_train/core/containers.py:
``leading_padding``; rlhf_train/models/scoring.py: ``response_hidden``), and the update orders a minibatch's rows
by prompt length so that its micro-batches have such columns (rlhf_train/algorithms/update.py).

The loss and every gradient equal the pass over the whole padded width (GPT-2: learned absolute positions;
Llama: rotary), and the trunk sees the narrower batch.

Budget: ~5 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.packing import GPT2, LLAMA, P, T, assert_same, loss_and_grads, policy_of, unequal_rollout

SHORT = [(4, 180), (2, 3), (7, 100), (5, 1)]  # the longest prompt is 7 of P = 20 columns: 13 all-pad columns


def test_leading_padding_by_hand():
    from rlhf_train.core.containers import leading_padding

    assert leading_padding(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])) == 1   # row 2 starts at column 1
    assert leading_padding(torch.tensor([[1, 1, 1], [0, 0, 1]])) == 0         # row 1 starts at column 0
    assert leading_padding(torch.tensor([[0, 0, 0, 1], [0, 0, 0, 1]])) == 3
    assert leading_padding(torch.zeros(2, 3)) == 0                              # no real token: nothing dropped


def trunk_widths(model):
    """The ``[rows, width]`` of every trunk pass of ``model`` (its input embedding's calls)."""
    shapes: list[tuple[int, int]] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_dropping_all_pad_prompt_columns_keeps_the_loss_and_gradients(arch, name, monkeypatch):
    from rlhf_train.models import scoring

    policy, rollout = policy_of(arch), unequal_rollout(SHORT)
    widths = trunk_widths(policy.lm)
    dropped = loss_and_grads(policy, rollout, name, packed=False)
    assert widths == [(4, 7 + T)]
    monkeypatch.setattr(scoring, "leading_padding", lambda mask: 0)
    widths.clear()
    whole = loss_and_grads(policy, rollout, name, packed=False)
    assert widths == [(4, P + T)]
    assert_same(whole, dropped)


def test_the_update_puts_short_prompts_in_one_micro_batch():
    """PPO's shuffled minibatch of 8 rows, 2 micro-batches of 4: the 4 shortest prompts (2-5 tokens) run together,
    17 columns narrower than the 4 longest (15-18 tokens); without the ordering both micro-batches mix them."""
    from accelerate import Accelerator

    from rlhf_train.algorithms.update import minibatch_update
    from rlhf_train.infra.faults import Faults
    from rlhf_train.loop.build import decide
    from tests.helpers.reliability import make_cfg

    lengths = [(2, 10), (18, 3), (3, 7), (15, 1), (4, 9), (16, 2), (5, 10), (17, 5)]
    rollout = unequal_rollout(lengths)
    d = decide(make_cfg("algorithm=ppo", "update.minibatch_size=8", "update.num_epochs=2",
                        f"update.micro_batch_tokens={4 * (P + T)}"))
    policy = policy_of(GPT2)
    widths = trunk_widths(policy.lm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    minibatch_update(policy, optimizer, scheduler, Accelerator(cpu=True), rollout, d.algorithm, d.sampling, d.update,
                     torch.Generator().manual_seed(0), Faults(3))
    assert widths == [(4, 5 + T), (4, 18 + T)] * 2  # per epoch: the short prompts' micro-batch, then the long
