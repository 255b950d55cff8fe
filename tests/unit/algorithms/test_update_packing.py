"""``update.packing=true`` in the minibatch update (rlhf_train/algorithms/update.py, micro_batches.py): each
minibatch becomes several packed micro-batches of at most ``update.token_budget`` tokens, their gradients
accumulate and the optimizer steps once per minibatch, so the weights after the update are the padded
path's (to float rounding: 1e-5 relative gradients, through AdamW).

Budget: ~5 s on 2 CPU cores.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.packing import GPT2, policy_of, unequal_rollout
from tests.helpers.reliability import make_cfg

# 8 rows of 4 to 200 tokens: two minibatches of 4, each packed into several micro-batches of <= 210 tokens
LENGTHS = [(4, 180), (20, 3), (1, 100), (10, 1), (3, 50), (15, 7), (2, 2), (20, 150)]
BUDGET = 210


@functools.lru_cache(maxsize=None)
def decisions(packing: bool):
    from rlhf_train.loop.build import decide

    return decide(make_cfg("update.minibatch_size=4", "update.num_epochs=1", "update.max_grad_norm=null",
                           f"update.packing={str(packing).lower()}", f"update.token_budget={BUDGET}"))


def update(packing: bool):
    """One minibatch_update: (weights after, optimizer steps, stats)."""
    from accelerate import Accelerator

    from rlhf_train.algorithms.update import minibatch_update
    from rlhf_train.infra.faults import Faults

    d = decisions(packing)
    policy = policy_of(GPT2)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = minibatch_update(policy, optimizer, scheduler, Accelerator(cpu=True), unequal_rollout(LENGTHS),
                             d.algorithm, d.sampling, d.update, torch.Generator().manual_seed(0), Faults(3))
    return [p.detach() for p in policy.parameters()], scheduler.last_epoch, stats


def test_micro_batches_hold_at_most_the_token_budget():
    from accelerate import Accelerator

    from rlhf_train.algorithms.micro_batches import micro_batches

    mask = unequal_rollout(LENGTHS).masks.full
    idx = torch.tensor([7, 0, 2, 4])  # 170, 184, 101, 53 tokens
    rows = micro_batches(mask[idx], idx, decisions(True).update, Accelerator(cpu=True))
    assert [r.tolist() for r in rows] == [[0], [7], [2, 4]]  # first-fit decreasing: 184 | 170 | 101 + 53
    assert all(mask[r].sum() <= BUDGET for r in rows)
    padded = micro_batches(mask[idx], idx, decisions(False).update, Accelerator(cpu=True))
    assert [r.tolist() for r in padded] == [[7, 0, 2, 4]]


def test_packed_update_gives_the_padded_update():
    padded, packed = update(False), update(True)
    assert padded[1] == packed[1] == 2  # one optimizer step per minibatch, not one per micro-batch
    for a, b in zip(padded[0], packed[0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert padded[2].keys() == packed[2].keys()


@pytest.mark.parametrize("override,message", [
    ("update.token_budget=0", "update.token_budget=0 must be positive"),
    ("update.gradient_accumulation_steps=2", "leave update.gradient_accumulation_steps at 1"),
])
def test_packing_settings_are_checked_before_work(override, message):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=message):
        check_config(make_cfg("update.packing=true", override))


def test_a_token_budget_below_the_longest_sequence_is_refused():
    from types import SimpleNamespace

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_packing_fits

    cfg = make_cfg("update.packing=true", "update.token_budget=20", "rollout.max_new_tokens=8")
    with pytest.raises(ConfigError, match=r"update.token_budget=20 is less than the longest sequence: prompts "
                                          r"\(16 tokens\) \+ rollout.max_new_tokens \(8\) = 24; set update.token_budget>=24"):
        check_packing_fits(cfg, policy_of(GPT2), SimpleNamespace(prompt_width=16))
    check_packing_fits(make_cfg("update.packing=true", "update.token_budget=24", "rollout.max_new_tokens=8"),
                       policy_of(GPT2), SimpleNamespace(prompt_width=16))


def test_a_packed_run_scores_and_updates_as_the_padded_run(tiny_cfg):
    """A whole iteration (LoRA: the policy's scoring pass and the reference with its adapter off run packed
    too), with gradient checkpointing: the same rollout log-probs, reference log-probs and update."""
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.state import TrainState
    from rlhf_train.loop.trainer import step

    out = {}
    for packing in (False, True):
        run = build_run(tiny_cfg("policy.lora.r=4", "rollout.max_new_tokens=12", f"update.packing={str(packing).lower()}",
                                 "update.token_budget=40", f"update.gradient_checkpointing={str(packing).lower()}"))
        assert run.rollout.token_budget == (40 if packing else None) and run.rollout.reference.kind == "adapter_off"
        metrics, ro = step(run, TrainState.fresh(run.kl_controller, 0, 0, 3), next(iter(run.loader)))
        out[packing] = metrics, ro, [p.detach().clone() for p in run.policy.parameters() if p.requires_grad]
    (m0, ro0, w0), (m1, ro1, w1) = out[False], out[True]
    assert torch.equal(ro0.tokens.full, ro1.tokens.full)  # generation is not packed
    torch.testing.assert_close(ro1.sample_log_prob, ro0.sample_log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ro1.ref_log_prob, ro0.ref_log_prob, rtol=1e-5, atol=1e-5)
    assert m1["val/first_ratio"] == pytest.approx(1.0, abs=1e-5)
    for a, b in zip(w0, w1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_policy_gradient_checkpointing_is_now_an_update_key():
    from rlhf_train.config.moved_keys import moved_key_message

    assert moved_key_message("policy.gradient_checkpointing=true").startswith(
        "policy.gradient_checkpointing is now update.gradient_checkpointing")
