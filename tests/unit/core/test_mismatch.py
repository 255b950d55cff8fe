"""``core.mismatch`` and the weighted policy losses, against values worked out by hand.

Two responses, the second one token shorter (its last entry is outside the mask and holds a value that
would break any reduction that looked at it). Log-ratios ``d = log π_old − log μ``:

    row 0: ln 2, 0, −ln 4        token weights 2, 1, 0.25     sequence: Σ d = −ln 2   -> w = 0.5
    row 1: ln ½, ln 3, (outside) token weights 0.5, 3, -      sequence: Σ d = ln 1.5  -> w = 1.5
"""
from __future__ import annotations

import math

import pytest
import torch

from rlhf_train.core.losses import clipped_surrogate, policy_loss
from rlhf_train.core.mismatch import importance_weights, mismatch_kl_sums

MASK = torch.tensor([[True, True, True], [True, True, False]])
SAMPLER = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -4.0]])
D = torch.tensor([[math.log(2), 0.0, -math.log(4)], [math.log(0.5), math.log(3), 1e4]])
TRAINER = SAMPLER + D


def test_mismatch_kl_sums_by_hand():
    k1, k2, n = mismatch_kl_sums(SAMPLER, TRAINER, MASK)
    # sampler − trainer = −d: −ln 2, 0, ln 4, ln 2, −ln 3
    assert float(n) == 5
    assert float(k1) == pytest.approx(math.log(4 / 3), abs=1e-6)
    l2, l3 = math.log(2), math.log(3)
    assert float(k2) == pytest.approx(0.5 * (l2 ** 2 + 4 * l2 ** 2 + l2 ** 2 + l3 ** 2), abs=1e-6)
    # equal log-probs: exactly 0
    assert mismatch_kl_sums(SAMPLER, SAMPLER, MASK)[:2] == (torch.tensor(0.0), torch.tensor(0.0))


@pytest.mark.parametrize("mode, expected", [
    ("clip", [[2.0, 1.0, 0.4], [0.5, 2.5, 1.0]]),   # 0.25 raised to 0.4, 3 cut to 2.5
    ("mask", [[2.0, 1.0, 0.0], [0.5, 0.0, 1.0]]),   # 0.25 and 3 dropped
])
def test_token_level_by_hand(mode, expected):
    w, frac = importance_weights(TRAINER, SAMPLER, MASK, "token", mode, 0.4, 2.5)
    torch.testing.assert_close(w, torch.tensor(expected), atol=1e-6, rtol=0)
    assert float(frac) == pytest.approx(2 / 5)  # 2 of the 5 response tokens were outside [0.4, 2.5]
    assert not w.requires_grad


@pytest.mark.parametrize("mode, expected", [
    ("clip", [[0.6, 0.6, 0.6], [1.5, 1.5, 1.0]]),   # row 0's 0.5 raised to 0.6
    ("mask", [[0.0, 0.0, 0.0], [1.5, 1.5, 1.0]]),   # row 0 dropped
])
def test_sequence_level_by_hand(mode, expected):
    w, frac = importance_weights(TRAINER, SAMPLER, MASK, "sequence", mode, 0.6, 2.5)
    torch.testing.assert_close(w, torch.tensor(expected), atol=1e-6, rtol=0)
    assert float(frac) == pytest.approx(1 / 2)  # 1 of 2 sequences


def test_no_lower_bound_and_no_overflow():
    """``low = 0`` clips only from above (TIS); a sequence ratio of exp(1000) is clipped / masked, not inf."""
    w, frac = importance_weights(TRAINER, SAMPLER, MASK, "token", "clip", 0.0, 2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.25], [0.5, 2.5, 1.0]]), atol=1e-6, rtol=0)
    assert float(frac) == pytest.approx(1 / 5)
    far = torch.full((1, 100), 10.0)
    mask = torch.ones(1, 100, dtype=torch.bool)
    assert torch.equal(importance_weights(far, torch.zeros(1, 100), mask, "sequence", "clip", 0.0, 2.0)[0],
                       torch.full((1, 100), 2.0))
    assert torch.equal(importance_weights(far, torch.zeros(1, 100), mask, "sequence", "mask", 0.0, 2.0)[0],
                       torch.zeros(1, 100))


def test_unknown_level_or_mode():
    with pytest.raises(ValueError, match="level"):
        importance_weights(TRAINER, SAMPLER, MASK, "batch", "clip", 0.0, 2.0)
    with pytest.raises(ValueError, match="mode"):
        importance_weights(TRAINER, SAMPLER, MASK, "token", "drop", 0.0, 2.0)


def test_weighted_losses_by_hand_and_all_ones_is_no_correction():
    """ratio 1 (log π = log π_old): each token's term is −A, so the loss is masked_mean(−w · A)."""
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, 1.0, 0.0]])
    w = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.0, 1.0]])
    lp = SAMPLER.clone().requires_grad_()
    loss, _ = policy_loss(lp, SAMPLER, adv, MASK, 0.2, weights=w)
    assert float(loss.detach()) == pytest.approx(-(2 * 1 + 1 * -2 + 0 + 0.5 * 0.5 + 0) / 5)
    per_token, _ = clipped_surrogate(lp, SAMPLER, adv, MASK, 0.2, 0.2, weights=w)
    torch.testing.assert_close(per_token, torch.tensor([[-2.0, 2.0, 0.0], [-0.25, 0.0, 0.0]]))
    # all-ones weights: the same loss and gradient, bit for bit
    torch.manual_seed(0)
    lp = (SAMPLER + 0.1 * torch.randn(2, 3)).requires_grad_()
    for fn in (lambda w: policy_loss(lp, SAMPLER, adv, MASK, 0.2, weights=w)[0],
               lambda w: clipped_surrogate(lp, SAMPLER, adv, MASK, 0.2, 0.3, "sequence", weights=w)[0].sum()):
        plain, ones = fn(None), fn(torch.ones(2, 3))
        assert torch.equal(plain, ones)
        assert torch.equal(torch.autograd.grad(plain, lp)[0], torch.autograd.grad(ones, lp)[0])
