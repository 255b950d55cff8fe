"""The critic-free math (rlhf_train/core/advantages.py, rlhf_train/core/losses.py) against values worked
out by hand in this file: GRPO's group-normalised advantage (group / batch / no std scaling), RLOO's
leave-one-out advantage, REINFORCE++'s return-to-go (and its group-mean baseline), the clipped
surrogate with clip-higher and a sequence-level ratio (GSPO), the three loss aggregations, and the
estimators and loss of :class:`rlhf_train.algorithms.critic_free.PolicyGradient` on small rollouts,
including groups whose rewards are all equal and masks with padding after EOS. Batch statistics over
two processes are checked with two threads standing in for them.

Budget: < 1 s.
"""
import math
import threading

import pytest
import torch

from rlhf_train.core.advantages import (
    discounted_returns,
    group_mean_baseline,
    group_normalized_advantage,
    leave_one_out_advantage,
)
from rlhf_train.core.losses import aggregate_loss, clipped_surrogate, loss_units

# two prompts × 3 samples: the first group spreads (1, 2, 3), the second is all equal (no signal)
SCORES = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])


def run_two_processes(fn, inputs):
    """``fn(x, all_reduce_sum)`` on two threads that stand in for two processes; an all-reduce sums both."""
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def reduce_for(rank):
        def reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return reduce

    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(inputs[r], reduce_for(r)))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# --------------------------------------------------------------------------- GRPO
def test_group_normalised_advantage_group_scale():
    # group 1: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> (-1, 0, 1); group 2: all 5 -> 0, not NaN
    adv = group_normalized_advantage(SCORES, 3, "group")
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), atol=1e-5)
    assert torch.isfinite(adv).all()


def test_group_normalised_advantage_batch_and_no_scale():
    # batch std of (1, 2, 3, 5, 5, 5): mean 3.5, squared deviations 6.25 + 2.25 + 0.25 + 3 × 2.25 = 15.5,
    # unbiased variance 15.5 / 5 = 3.1, std 1.760682
    std = math.sqrt(3.1)
    adv = group_normalized_advantage(SCORES, 3, "batch")
    assert torch.allclose(adv, torch.tensor([-1 / std, 0.0, 1 / std, 0.0, 0.0, 0.0]), atol=1e-5)
    # Dr. GRPO: the group mean subtracted, no division
    assert torch.equal(group_normalized_advantage(SCORES, 3, "none"), torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="scale"):
        group_normalized_advantage(SCORES, 3, "median")
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_normalized_advantage(SCORES, 4)


def test_a_faulty_score_spoils_only_its_group():
    scores = torch.tensor([1.0, float("nan"), 3.0, 1.0, 2.0, 3.0])
    for scale in ("group", "batch", "none"):
        adv = group_normalized_advantage(scores, 3, scale)
        assert torch.isnan(adv[:3]).all() and torch.isfinite(adv[3:]).all(), scale
    # batch std over the 5 finite scores (1, 3, 1, 2, 3): mean 2, squared deviations 1 + 1 + 1 + 0 + 1 = 4,
    # unbiased variance 4 / 4 = 1 -> the second group's (-1, 0, 1) / 1
    assert torch.allclose(group_normalized_advantage(scores, 3, "batch")[3:], torch.tensor([-1.0, 0.0, 1.0]))


def test_batch_scale_over_two_processes_equals_one():
    # each process holds one group; the batch std must be the one of all six scores
    parts = run_two_processes(lambda x, red: group_normalized_advantage(x, 3, "batch", all_reduce_sum=red),
                              [SCORES[:3], SCORES[3:]])
    assert torch.allclose(torch.cat(parts), group_normalized_advantage(SCORES, 3, "batch"), atol=1e-6)


# --------------------------------------------------------------------------- RLOO
def test_leave_one_out_advantage():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])
    # 1 - (2 + 3) / 2 = -1.5, 2 - (1 + 3) / 2 = 0, 3 - (1 + 2) / 2 = 1.5; the equal group gets 0
    assert torch.allclose(leave_one_out_advantage(scores, 3), torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    # pairs: each sample's baseline is the other one
    assert torch.allclose(leave_one_out_advantage(torch.tensor([0.0, 1.0, 2.0, 2.0]), 2),
                          torch.tensor([-1.0, 1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match=">= 2"):
        leave_one_out_advantage(scores, 1)


# --------------------------------------------------------------------------- REINFORCE++
def test_discounted_returns_ignore_padding_after_eos():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 5.0]])  # 5.0 sits after EOS: padding, must not count
    mask = torch.tensor([[True, True, True, False]])
    # gamma 1: G = (0.1 - 0.2 + 1, -0.2 + 1, 1, 0) = (0.9, 0.8, 1.0, 0)
    assert torch.allclose(discounted_returns(rewards, mask, 1.0), torch.tensor([[0.9, 0.8, 1.0, 0.0]]))
    # gamma 0.5: G_2 = 1, G_1 = -0.2 + 0.5 × 1 = 0.3, G_0 = 0.1 + 0.5 × 0.3 = 0.25
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.3, 1.0, 0.0]]))


def test_group_mean_baseline():
    assert torch.equal(group_mean_baseline(SCORES, 3), torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))


# --------------------------------------------------------------------------- the clipped surrogate
LOG_RATIO = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 7.0]])  # 7.0: after EOS
MASK = torch.tensor([[True, True, True, False]])


def test_clip_higher_per_token():
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, 9.0]])
    loss, st = clipped_surrogate(LOG_RATIO, old, adv, MASK, clip_low=0.2, clip_high=0.28)
    # ratio 1.5, A = 1: max(-1.5, -clip(1.5, 0.8, 1.28) = -1.28) = -1.28   clipped above
    # ratio 0.5, A = -1: max(0.5, clip(0.5, 0.8, 1.28) = 0.8) = 0.8         clipped below
    # ratio 1.1, A = 1: max(-1.1, -1.1) = -1.1                             not clipped
    # after EOS: 0, whatever the log ratio and advantage
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -1.1, 0.0]]), atol=1e-6)
    assert st["clipfrac"].item() == pytest.approx(2 / 3)
    assert st["clipfrac_low"].item() == pytest.approx(1 / 3)
    assert st["clipfrac_high"].item() == pytest.approx(1 / 3)
    assert st["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    # symmetric clip 0.2: the first token is cut at 1.2
    loss, _ = clipped_surrogate(LOG_RATIO, old, adv, MASK, clip_low=0.2, clip_high=0.2)
    assert loss[0, 0].item() == pytest.approx(-1.2)


def test_sequence_level_ratio_gspo():
    # s = exp(mean of the 3 response log ratios) = (1.5 × 0.5 × 1.1)^(1/3) = 0.825^(1/3) = 0.937892
    s = 0.825 ** (1 / 3)
    log_probs = LOG_RATIO.clone().requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    loss, st = clipped_surrogate(log_probs, torch.zeros(1, 4), adv, MASK, 0.2, 0.2, ratio_level="sequence")
    # s is inside [0.8, 1.2]: no clipping, every response token -A·s = -1.875784
    assert torch.allclose(loss, torch.tensor([[-2 * s, -2 * s, -2 * s, 0.0]]), atol=1e-6)
    assert st["ratio_mean"].item() == pytest.approx(s, rel=1e-6) and st["clipfrac"].item() == 0
    # token mean of -2s; d s / d log π_t = s / 3 for each of the 3 tokens -> gradient -2s/3, 0 after EOS
    aggregate_loss(loss, MASK, "token_mean").backward()
    assert torch.allclose(log_probs.grad, torch.tensor([[-2 * s / 3] * 3 + [0.0]]), atol=1e-6)
    # clipped at the sequence level: A < 0 and s = 0.9379 < 1 - 0.1 -> the whole sequence is clipped below
    _, st = clipped_surrogate(LOG_RATIO, torch.zeros(1, 4), -adv, MASK, 0.05, 0.05, ratio_level="sequence")
    assert st["clipfrac"].item() == 1.0 and st["clipfrac_low"].item() == 1.0 and st["clipfrac_high"].item() == 0


# --------------------------------------------------------------------------- loss aggregation
def test_loss_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 0.0, 0.0]])  # NaN / inf: padding
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)  # 3.0
    # Dr. GRPO: a constant divisor (the generation budget T = 4 by default)
    assert aggregate_loss(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    assert aggregate_loss(loss, mask, "seq_mean_token_sum_norm", 8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    assert loss_units(mask, "token_mean").item() == 4
    assert loss_units(mask, "seq_mean_token_mean").item() == 2 == loss_units(mask, "seq_mean_token_sum_norm").item()
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(loss, mask, "sum")


# --------------------------------------------------------------------------- on a rollout
def _rollout(score, kl, mask, done, group_size):
    from rlhf_train.core.containers import Masks, Rollout

    reward_raw = score[:, None] * done.float()
    B = score.shape[0]
    return Rollout(masks=Masks(response=mask, batch_size=[B]), reward_raw=reward_raw, reward_kl=-kl,
                   reward=reward_raw - kl, score=score, done=done, sample_log_prob=torch.zeros_like(kl),
                   batch_size=[B])


def test_reinforce_pp_baseline_estimator():
    from rlhf_train.algorithms.critic_free import ReinforcePP

    # one group of two: row 0 ends at EOS after 2 tokens (score 1), row 1 runs 3 tokens (score 3);
    # KL penalty 0.1 per response token, 0 after EOS
    mask = torch.tensor([[True, True, False], [True, True, True]])
    done = torch.tensor([[False, True, False], [False, False, True]])
    ro = _rollout(torch.tensor([1.0, 3.0]), 0.1 * mask.float(), mask, done, 2)
    adv, returns = ReinforcePP(gamma=1.0, group_size=2)(ro)
    assert returns is None
    # baseline: group mean score 2 -> per-token rewards (-0.1, 1 - 2 - 0.1, ·) and (-0.1, -0.1, 3 - 2 - 0.1)
    # returns-to-go: (-1.2, -1.1, ·) and (0.7, 0.8, 0.9)
    g = torch.tensor([-1.2, -1.1, 0.7, 0.8, 0.9])
    # whitened over the 5 response tokens: mean 0.02, unbiased variance 4.588 / 4 = 1.147
    want = (g - 0.02) / math.sqrt(1.147 + 1e-8)
    assert torch.allclose(adv[mask], want, atol=1e-5) and adv[0, 2] == 0
    # without the baseline: returns (0.8, 0.9, ·), (2.7, 2.8, 2.9) -> whitened the same way
    adv, _ = ReinforcePP(gamma=1.0)(_rollout(torch.tensor([1.0, 3.0]), 0.1 * mask.float(), mask, done, 1))
    g = torch.tensor([0.8, 0.9, 2.7, 2.8, 2.9])
    assert torch.allclose(adv[mask], (g - g.mean()) / g.std(), atol=1e-5)


def test_grpo_and_rloo_estimators_broadcast_over_response_tokens():
    from rlhf_train.algorithms.critic_free import GroupNormalized, LeaveOneOut

    mask = torch.tensor([[True, False], [True, True], [True, True], [True, False]])
    done = torch.tensor([[True, False], [False, True], [False, True], [True, False]])
    ro = _rollout(torch.tensor([0.0, 2.0, 1.0, 1.0]), torch.zeros(4, 2), mask, done, 2)
    adv, returns = GroupNormalized(2, "group")(ro)
    # group (0, 2): mean 1, std sqrt(2) -> ∓0.7071 on every response token; group (1, 1): 0
    s = 1 / math.sqrt(2)
    assert returns is None
    assert torch.allclose(adv, torch.tensor([[-s, 0.0], [s, s], [0.0, 0.0], [0.0, 0.0]]), atol=1e-5)
    adv, _ = LeaveOneOut(2)(ro)
    assert torch.allclose(adv, torch.tensor([[-2.0, 0.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]))


def test_policy_gradient_loss_with_kl_in_the_loss():
    from rlhf_train.algorithms.base import PolicyOutput
    from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
    from rlhf_train.algorithms import critic_free

    cfg = AlgorithmConfig(name="grpo", loss_agg="seq_mean_token_mean", kl_in_reward=False, beta=0.5)
    algo = critic_free.grpo(cfg, UpdateConfig(), group_size=2, max_new_tokens=2)
    assert not algo.needs_critic and algo.needs_reference and algo.kl_in_loss
    mask = torch.tensor([[True, True], [True, False]])
    mb = _rollout(torch.zeros(2), torch.zeros(2, 2), mask, mask, 2)
    mb.advantage = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    mb.ref_log_prob = torch.tensor([[-math.log(2.0), 0.0], [0.0, 0.0]])
    log_probs = torch.tensor([[0.0, 0.0], [0.0, -math.inf]])  # -inf after EOS (a top-k filtered pad)
    loss, stats = algo.loss(PolicyOutput(log_probs, None, None), mb)
    # ratio 1 everywhere: policy term per sequence (-1 - 1) / 2 = -1 and 1 / 1 = 1 -> mean 0
    # k3 with log p - log q = log 2: 1/2 - 1 + log 2 = 0.193147 on token (0, 0), else 0 ->
    # per sequence 0.193147 / 2 and 0 -> mean 0.048287; loss = 0 + 0.5 × 0.048287
    k3 = 0.5 - 1 + math.log(2.0)
    assert stats["loss/policy"].item() == pytest.approx(0.0, abs=1e-7)
    assert stats["loss/kl"].item() == pytest.approx(k3 / 4, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3 / 4, rel=1e-6)
    assert algo.loss_units(mask).item() == 2  # a mean over sequences
