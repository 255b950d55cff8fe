"""``algorithm.is_correction`` in the algorithms' losses (PPO and the critic-free ones).

1. Weights of exactly 1 (the sampler's log-probs equal π_old) give the loss and the gradient of no
   correction, bit for bit, at both levels and in both modes.
2. The weights reach the loss: with the sampler's log-probs of one sequence off by ln 4 per token the
   sequence-level mask drops that sequence's policy term, and the loss equals the uncorrected loss of the
   other sequences' terms alone; ``objective/is_filtered_frac`` says 1 of 2.
3. No sampler log-probs (a backend that records none): one clear error.

Budget: < 1 s.
"""
from __future__ import annotations

import math

import pytest
import torch

from rlhf_train.algorithms.base import PolicyOutput
from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
from rlhf_train.algorithms.registry import build_algorithm
from rlhf_train.core.containers import Masks, Rollout

B, T = 2, 4


def _minibatch(sampler_shift: float = 0.0) -> Rollout:
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    old = -torch.rand(B, T) - 0.5
    return Rollout(masks=Masks(response=mask, batch_size=[B]), sample_log_prob=old,
                   sampler_log_prob=old + torch.tensor([[sampler_shift], [0.0]]),
                   advantage=torch.randn(B, T), values=torch.zeros(B, T), returns=torch.randn(B, T),
                   ref_log_prob=old - 0.1, batch_size=[B])


def _algorithm(name: str, **is_correction):
    extra = {"beta": 0.04, "kl_in_reward": False} if name == "grpo" else {}
    return build_algorithm(AlgorithmConfig(name=name, is_correction=is_correction, **extra), UpdateConfig(), 2, T)


def _loss_and_grad(algorithm, mb: Rollout):
    log_probs = (mb.sample_log_prob + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))
                 ).requires_grad_()
    values = torch.zeros(B, T, requires_grad=True) if algorithm.needs_critic else None
    loss, stats = algorithm.loss(PolicyOutput(log_probs, None, values), mb)
    return loss, torch.autograd.grad(loss, log_probs)[0], stats


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_unit_weights_are_no_correction_exactly(name, level, mode):
    mb = _minibatch()
    plain, plain_grad, plain_stats = _loss_and_grad(_algorithm(name), mb)
    corrected = _algorithm(name, level=level, mode=mode, threshold=[0.5, 2.0])
    assert corrected.corrects_mismatch and not _algorithm(name).corrects_mismatch
    loss, grad, stats = _loss_and_grad(corrected, mb)
    assert torch.equal(loss, plain) and torch.equal(grad, plain_grad)
    assert float(stats["objective/is_filtered_frac"]) == 0.0 and "objective/is_filtered_frac" not in plain_stats


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_sequence_mask_drops_a_sequence_by_hand(name):
    """Row 0's sampler log-probs are ln 4 above π_old on each of its 3 tokens: w = 4^-3, outside [0.5, 2]."""
    mb = _minibatch(sampler_shift=math.log(4))
    loss, _, stats = _loss_and_grad(_algorithm(name, level="sequence", mode="mask", threshold=[0.5, 2.0]), mb)
    assert float(stats["objective/is_filtered_frac"]) == 0.5
    # the same loss without a correction, with row 0's advantages 0 (its policy term 0: the mask's effect)
    dropped = _minibatch()
    dropped.advantage = torch.where(torch.tensor([[True], [False]]), 0.0, dropped.advantage)
    expected, _, _ = _loss_and_grad(_algorithm(name), dropped)
    torch.testing.assert_close(loss, expected, atol=1e-7, rtol=0)


def test_no_sampler_log_probs_is_one_clear_error():
    mb = _minibatch()
    mb.sampler_log_prob = None
    with pytest.raises(RuntimeError, match="recorded no log-probs"):
        _loss_and_grad(_algorithm("ppo", level="token"), mb)
