"""The held-out metrics (rlhf_train/core/eval_metrics.py) against values worked out by hand in this file:
accuracy with a threshold and unscored rows, the unbiased pass@k of Chen et al. 2021 (eq. 1) from binomials,
and mean@k with unscored samples.

Budget: < 1 s.
"""
import math

import pytest
import torch

from rlhf_train.core.eval_metrics import accuracy, is_correct, mean_at_k, nan_mean, pass_at_k

NAN = float("nan")


def test_accuracy_counts_rows_at_or_above_the_threshold_over_all_rows():
    scores = torch.tensor([1.0, 0.5, NAN, 1.0, 2.0])
    # >= 1.0: rows 0, 3, 4 -> 3 of 5 (the unscored row counts as wrong, and stays in the denominator)
    assert accuracy(scores).item() == pytest.approx(3 / 5)
    # >= 0.5: rows 0, 1, 3, 4 -> 4 of 5
    assert accuracy(scores, 0.5).item() == pytest.approx(4 / 5)
    assert is_correct(scores).tolist() == [True, False, False, True, True]
    # the mean leaves the unscored row out: (1 + 0.5 + 1 + 2) / 4
    assert nan_mean(scores).item() == pytest.approx(4.5 / 4)


def test_pass_at_k_by_hand():
    # 4 prompts x 4 samples; c correct per prompt = 0, 1, 2, 3
    correct = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 1], [1, 1, 0, 1]], dtype=torch.bool)
    # k = 1: c / n
    assert pass_at_k(correct, 1).tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75])
    # k = 2: 1 - C(4-c, 2) / C(4, 2), C(4, 2) = 6:
    #   c=0: 1 - 6/6 = 0;  c=1: 1 - C(3,2)/6 = 1 - 3/6 = 1/2;  c=2: 1 - C(2,2)/6 = 5/6;  c=3: n-c=1 < k -> 1
    assert pass_at_k(correct, 2).tolist() == pytest.approx([0.0, 0.5, 5 / 6, 1.0])
    # k = n = 4: any correct sample
    assert pass_at_k(correct, 4).tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])


def test_pass_at_k_matches_binomials_where_the_numbers_are_large():
    # n = 5, c = 2, k = 3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(torch.tensor([[1, 1, 0, 0, 0]], dtype=torch.bool), 3).item() == pytest.approx(0.9)
    # n = 200, c = 7, k = 10 (Chen et al.'s regime): the product form agrees with exact binomials
    correct = torch.zeros(1, 200, dtype=torch.bool)
    correct[0, :7] = True
    exact = 1 - math.comb(193, 10) / math.comb(200, 10)
    assert pass_at_k(correct, 10).item() == pytest.approx(exact, rel=1e-12)


def test_pass_at_k_refuses_k_outside_1_to_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(torch.ones(2, 3, dtype=torch.bool), 4)


def test_mean_at_k_averages_per_prompt_means_and_skips_unscored():
    scores = torch.tensor([[1.0, 0.0, NAN, 1.0],    # 2/3 (the unscored sample left out)
                           [0.0, 0.0, 0.0, 0.5],    # 1/8
                           [NAN, NAN, NAN, NAN]])   # nothing scored: left out of the average
    assert mean_at_k(scores).item() == pytest.approx((2 / 3 + 1 / 8) / 2)
    # the plain mean over rows weighs the first prompt's 3 scored samples against the second's 4
    assert nan_mean(scores.flatten()).item() == pytest.approx(2.5 / 7)
