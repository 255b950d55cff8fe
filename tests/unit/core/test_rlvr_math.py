"""The RLVR audit's math (rlhf_train/core/), against values worked out by hand in this file:

1. A row no reward source scored (``scored`` False) takes no part in its group's mean / std, the batch std,
   RLOO's leave-one-out mean or REINFORCE++-baseline's group mean, and gets advantage 0 (TRL >= 1.6,
   huggingface/trl#5902); before, it counted as a reward of 0 and got an advantage of its own.
2. ``zero_std_groups``: the groups a group-relative advantage is 0 for (DAPO's dynamic sampling drops them).
3. ``k3_loss_term``: the plain k3 and the ratio-weighted one (DeepSeek-V3.2 eq. 7) by value, and by gradient:
   over every token of a tiny vocabulary, the plain term's expected gradient is that of KL(π_ref ‖ π), the
   ratio-weighted one's that of KL(π ‖ π_ref) (Tang & Munos 2025).
4. The sequence-mean aggregations average over the rows that have a loss token (a row left out of the loss
   whole, e.g. a truncated response under ``mask_truncated_completions``, is in no denominator).

Budget: < 1 s.
"""
import math

import pytest
import torch

from rlhf_train.core.advantages import (
    group_mean_baseline,
    group_normalized_advantage,
    leave_one_out_advantage,
)
from rlhf_train.core.losses import aggregate_loss, loss_units

# three prompts × 3 samples; U = unscored (every source returned None: the weighted sum gave it 0)
#   group A: 1, U, 3    group B: 2, 2, U    group C: U, 4, U
SCORES = torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0, 0.0, 0.0, 4.0, 0.0])
SCORED = torch.tensor([True, False, True, True, True, False, False, True, False])


# --------------------------------------------------------------------------- 1. unscored rows
def test_grpo_leaves_unscored_rows_out_of_the_group_and_gives_them_zero():
    adv = group_normalized_advantage(SCORES, 3, "group", scored=SCORED)
    # A: scored 1 and 3, mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2) -> -1/sqrt(2), 0, 1/sqrt(2)
    # B: scored 2 and 2: no spread -> 0; C: one scored row -> 0 (no baseline to compare with)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-s, 0.0, s, 0, 0, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    # the defect: the unscored row counted as 0 -> group A's mean 4/3, std sqrt(7/3), the U row (0 - 4/3) / 1.5275
    old = group_normalized_advantage(SCORES, 3, "group")
    assert old[1].item() == pytest.approx(-(4 / 3) / math.sqrt(7 / 3), abs=1e-5)


def test_grpo_batch_std_and_no_scale_leave_unscored_rows_out():
    # batch std over the 5 scored scores 1, 3, 2, 2, 4: mean 2.4, squared deviations 1.96 + 0.36 + 0.16 + 0.16
    # + 2.56 = 5.2, unbiased variance 1.3, std 1.140175
    adv = group_normalized_advantage(SCORES, 3, "batch", scored=SCORED)
    b = 1 / math.sqrt(1.3)
    torch.testing.assert_close(adv, torch.tensor([-b, 0.0, b, 0, 0, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    adv = group_normalized_advantage(SCORES, 3, "none", scored=SCORED)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0, 1, 0, 0, 0, 0, 0, 0]))


def test_grpo_scale_eps():
    # one group (0, 1): mean 0.5, unbiased std sqrt(0.5) = 0.707107; with eps 0.1: 0.5 / 0.807107 = 0.619497
    adv = group_normalized_advantage(torch.tensor([0.0, 1.0]), 2, "group", eps=0.1)
    torch.testing.assert_close(adv, torch.tensor([-0.619497, 0.619497]), atol=1e-6, rtol=0)


def test_rloo_leave_one_out_over_the_scored_rows():
    # A: 1 - 3 = -2, U -> 0, 3 - 1 = 2; B: 2 - 2 = 0 twice; C: one scored row -> 0
    adv = leave_one_out_advantage(SCORES, 3, scored=SCORED)
    torch.testing.assert_close(adv, torch.tensor([-2.0, 0, 2, 0, 0, 0, 0, 0, 0]))
    # a group of four with one unscored: 1, 2, U, 6 -> k = 3, others' means (2 + 6) / 2, (1 + 6) / 2, (1 + 2) / 2
    adv = leave_one_out_advantage(torch.tensor([1.0, 2.0, 0.0, 6.0]), 4,
                                  scored=torch.tensor([True, True, False, True]))
    torch.testing.assert_close(adv, torch.tensor([-3.0, -1.5, 0.0, 4.5]))


def test_group_mean_baseline_over_the_scored_rows():
    adv = group_mean_baseline(SCORES, 3, scored=SCORED)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0, 1, 0, 0, 0, 0, 0, 0]))


# --------------------------------------------------------------------------- 2. zero-variance groups
def test_zero_std_groups():
    from rlhf_train.core.advantages import zero_std_groups

    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 0.0, 1.0, 0.0, 5.0, 0.0, float("nan"), 1.0, 2.0])
    scored = torch.tensor([True] * 6 + [True, False, True] + [False, True, False] + [True] * 3)
    # all equal | a spread | equal once the unscored row is left out | one scored row | a NaN (a fault: kept)
    assert zero_std_groups(scores, 3, scored).tolist() == [True, False, True, True, False]
    # a spread below 1e-6 of the scale is none; above it, one
    assert zero_std_groups(torch.tensor([1000.0, 1000.0 + 1e-4, 7.0, 7.5]), 2).tolist() == [True, False]


# --------------------------------------------------------------------------- 3. the KL term in the loss
def test_k3_loss_term_values():
    from rlhf_train.core.kl import k3_loss_term

    # π = 0.5, π_old = 0.25, π_ref = 0.25: k3 = π_ref/π − 1 − log(π_ref/π) = 0.5 − 1 + log 2 = 0.193147;
    # ratio-weighted: π/π_old = 2 -> 0.386294; outside the mask 0, even at −inf
    log_p = torch.tensor([[math.log(0.5), -math.inf]])
    old = torch.tensor([[math.log(0.25), 0.0]])
    ref = torch.tensor([[math.log(0.25), 0.0]])
    mask = torch.tensor([[True, False]])
    k3 = 0.5 - 1 + math.log(2)
    plain = k3_loss_term(log_p, old, ref, mask, ratio_weighted=False)
    weighted = k3_loss_term(log_p, old, ref, mask, ratio_weighted=True)
    torch.testing.assert_close(plain, torch.tensor([[k3, 0.0]]))
    torch.testing.assert_close(weighted, torch.tensor([[2 * k3, 0.0]]))


def test_k3_loss_term_gradients_follow_the_forward_and_reverse_kl():
    from rlhf_train.core.kl import k3_loss_term

    theta = torch.tensor([0.3, -1.2, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, 1.0], dtype=torch.float64), 0)
    tokens = torch.arange(4)

    def expected_gradient(ratio_weighted: bool) -> torch.Tensor:
        # E_{a ~ π_old}[term(a)] over every token (exact), at θ = θ_old; its gradient in θ
        log_p = torch.log_softmax(theta, 0)
        old = log_p.detach()
        term = k3_loss_term(log_p[tokens][None], old[tokens][None], ref[tokens][None],
                            torch.ones(1, 4, dtype=torch.bool), ratio_weighted)[0]
        return torch.autograd.grad((old.exp() * term).sum(), theta)[0]

    def kl_gradient(reverse: bool) -> torch.Tensor:
        log_p = torch.log_softmax(theta, 0)
        p, q = (log_p, ref) if reverse else (ref, log_p)  # KL(π ‖ π_ref) or KL(π_ref ‖ π)
        return torch.autograd.grad((p.exp() * (p - q)).sum(), theta)[0]

    forward, reverse = kl_gradient(reverse=False), kl_gradient(reverse=True)
    assert (forward - reverse).abs().max() > 0.05  # the two directions differ here
    torch.testing.assert_close(expected_gradient(ratio_weighted=False), forward)
    torch.testing.assert_close(expected_gradient(ratio_weighted=True), reverse)


# --------------------------------------------------------------------------- 4. rows left out of the loss
def test_sequence_means_count_only_rows_with_loss_tokens():
    loss = torch.tensor([[1.0, 1.0], [5.0, 5.0], [3.0, 7.0]])
    mask = torch.tensor([[True, True], [False, False], [True, False]])  # row 1 left out whole
    # token mean: (1 + 1 + 3) / 3; sequence means over the 2 rows with tokens: (1 + 3) / 2 and (2/2 + 3/2) / 2
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(5 / 3)
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(2.0)
    assert aggregate_loss(loss, mask, "seq_mean_token_sum_norm", norm_length=2).item() == pytest.approx(1.25)
    assert loss_units(mask, "seq_mean_token_mean").item() == 2 and loss_units(mask, "token_mean").item() == 3
    # every row with tokens: the mean over all B rows, as before
    full = torch.ones(3, 2, dtype=torch.bool)
    assert aggregate_loss(loss, full, "seq_mean_token_mean").item() == pytest.approx((1 + 5 + 5) / 3)
