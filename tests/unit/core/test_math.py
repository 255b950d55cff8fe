"""Hand-checked tests for the pure PPO maths in rlhf_train.core (masked, advantages, losses, kl, logprob_kernel).

Every expected number is worked out in comments; the audit fixes (issue 12) are in tests/unit/core/test_audit_fixes.py."""

import math

import pytest
import torch

from rlhf_train.core.advantages import gae
from rlhf_train.core.kl import KL_ESTIMATORS, kl_estimate
from rlhf_train.core.logprob_kernel import entropy_from_logits, logprobs_of_labels
from rlhf_train.core.losses import policy_loss, value_loss
from rlhf_train.core.masked import masked_mean, masked_sum, masked_var, masked_whiten

LN2 = math.log(2.0)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol, rtol=0)


# --------------------------------------------------------------------------- masked stats

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)  # masked entries: 1, 2, 4


def test_masked_sum_and_mean():
    close(masked_sum(X, M), 7.0)  # 1 + 2 + 4
    close(masked_sum(X, M, dim=1), [3.0, 4.0])  # row 0: 1 + 2, row 1: 4
    close(masked_mean(X, M), 7.0 / 3)  # 7 / 3 entries
    close(masked_mean(X, M, dim=1), [1.5, 4.0])  # 3 / 2, 4 / 1
    close(masked_mean(X, M.float()), 7.0 / 3)  # float mask works the same


def test_masked_var():
    # mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9
    close(masked_var(X, M, unbiased=True), 42 / 9 / 2)  # / (n - 1) = 7/3
    close(masked_var(X, M, unbiased=False), 42 / 9 / 3)  # / n = 14/9


def test_masked_whiten_ignores_masked_out_entries():
    x = torch.tensor([[1.0, 2.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    # mean over {1, 2} = 1.5; unbiased var = (0.25 + 0.25) / 1 = 0.5; std = sqrt(0.5) = 0.70711
    # whitened = (-0.5 / 0.70711, 0.5 / 0.70711, 0) = (-0.70711, 0.70711, 0)
    s = 0.5 / math.sqrt(0.5)
    close(masked_whiten(x, m), [[-s, s, 0.0]])
    # shift_mean=False adds the mean back: (1.5 - 0.70711, 1.5 + 0.70711, 0)
    close(masked_whiten(x, m, shift_mean=False), [[1.5 - s, 1.5 + s, 0.0]])
    # the masked-out value does not matter
    x2 = torch.tensor([[1.0, 2.0, -1e6]])
    close(masked_whiten(x2, m), masked_whiten(x, m))


# --------------------------------------------------------------------------- gae


def test_gae_hand_computed_full_mask():
    # gamma = 1, lam = 0.5, r = (0, 0, 1), V = (1, 2, 3), all 3 tokens are response
    # delta_0 = 0 + 1*2 - 1 = 1
    # delta_1 = 0 + 1*3 - 2 = 1
    # delta_2 = 1 + 0   - 3 = -2        (V after last token = 0: terminal)
    # A_2 = -2
    # A_1 = 1 + 0.5 * (-2) = 0
    # A_0 = 1 + 0.5 * 0    = 1
    # returns = A + V = (2, 2, 1)
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[1.0, 2.0, 3.0]])
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=0.5)
    close(adv, [[1.0, 0.0, -2.0]])
    close(ret, [[2.0, 2.0, 1.0]])


def test_gae_hand_computed_partial_mask():
    # gamma = 1, lam = 0.5, r = (0, 1, 5), V = (1, 2, 3), mask = (1, 1, 0): EOS at token 1
    # delta_0 = 0 + 1*2*m_1 - 1 = 1
    # delta_1 = 1 + 1*3*m_2 - 2 = -1      (m_2 = 0: V_2 is not bootstrapped)
    # A_1 = -1;  A_0 = 1 + 0.5 * (-1) = 0.5;  A_2 = 0 (masked)
    # returns = (1.5, 1, 0)
    r = torch.tensor([[0.0, 1.0, 5.0]])
    v = torch.tensor([[1.0, 2.0, 3.0]])
    m = torch.tensor([[True, True, False]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.5)
    close(adv, [[0.5, -1.0, 0.0]])
    close(ret, [[1.5, 1.0, 0.0]])


def test_gae_discount_gamma():
    # gamma = 0.5, lam = 1 (so gamma*lam = 0.5), r = (0, 0, 4), V = 0: advantages = discounted returns
    # A_2 = 4; A_1 = 0 + 0.5*4 = 2; A_0 = 0 + 0.5*2 = 1
    adv, ret = gae(torch.tensor([[0.0, 0.0, 4.0]]), torch.zeros(1, 3), torch.ones(1, 3), gamma=0.5, lam=1.0)
    close(adv, [[1.0, 2.0, 4.0]])
    close(ret, [[1.0, 2.0, 4.0]])


def _gae_loop(rewards, values, mask, gamma, lam):
    """Reference: the textbook reverse loop, one row and one step at a time."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        last = 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                continue
            next_v = values[b, t + 1].item() if t + 1 < T and mask[b, t + 1] else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    ret = (adv + values.double()) * mask.double()
    return adv, ret


def test_gae_matches_reverse_loop_random():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 7
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 1, 4, 0])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = _gae_loop(r, v, mask, 0.9, 0.8)
    close(adv, ref_adv, atol=1e-5)
    close(ret, ref_ret, atol=1e-5)


def test_gae_matches_torchrl_full_mask():
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    g = torch.Generator().manual_seed(1)
    B, T, gamma, lam = 3, 6, 0.95, 0.9
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv, ret = gae(r, v, torch.ones(B, T), gamma, lam)

    # torchrl wants [..., T, 1]; the last token is done and terminated (no bootstrap)
    next_v = torch.cat([v[:, 1:], torch.zeros(B, 1)], dim=1)
    done = torch.zeros(B, T, 1, dtype=torch.bool)
    done[:, -1] = True
    t_adv, t_ret = generalized_advantage_estimate(
        gamma, lam, v.unsqueeze(-1), next_v.unsqueeze(-1), r.unsqueeze(-1), done=done, terminated=done
    )
    close(adv, t_adv.squeeze(-1), atol=1e-5)
    close(ret, t_ret.squeeze(-1), atol=1e-5)


# --------------------------------------------------------------------------- losses


def test_policy_loss_hand_computed():
    eps = 0.2
    ratio = torch.tensor([[2.0, 0.5, 0.5, 3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # last token ignored
    log_probs = ratio.log().requires_grad_()
    old = torch.zeros(1, 4)
    # token 0: -A*r = -2.0, -A*clip(2, .8, 1.2) = -1.2 -> max -1.2 (clipped active)
    # token 1: -A*r = -0.5, -A*clip(.5)       = -0.8 -> max -0.5 (unclipped)
    # token 2: -A*r =  0.5, -A*clip(.5)       =  0.8 -> max  0.8 (clipped active)
    # loss = (-1.2 - 0.5 + 0.8) / 3 = -0.3
    loss, stats = policy_loss(log_probs, old, adv, mask, eps)
    close(loss, -0.3)
    close(stats["clipfrac"], 2 / 3)
    close(stats["ratio_mean"], 1.0)  # (2 + 0.5 + 0.5) / 3
    # approx_kl: (r-1) - ln r = (1 - ln2) + 2 * (-0.5 + ln2) = ln2 -> mean ln2 / 3
    close(stats["approx_kl"], LN2 / 3)
    assert all(not s.requires_grad for s in stats.values())
    # gradient flows only through the unclipped token 1: d(-A*r)/dlogp / 3 = -0.5 / 3
    loss.backward()
    close(log_probs.grad, [[0.0, -0.5 / 3, 0.0, 0.0]])


def test_value_loss_hand_computed():
    eps = 0.2
    v = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    old = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    R = torch.tensor([[0.0, 1.0, 2.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # t0: v_clip = 0 + clip(1) = 0.2; (1-0)^2 = 1,   (0.2-0)^2 = 0.04 -> 1    (not clipped)
    # t1: v_clip = 0;                 (0-1)^2 = 1,   (0-1)^2   = 1    -> 1    (tie: not clipped)
    # t2: v_clip = 1 + 0.2 = 1.2;     (2-2.5)^2 = .25, (1.2-2.5)^2 = 1.69 -> 1.69 (clipped)
    # loss = 0.5 * (1 + 1 + 1.69) / 3 = 0.615
    loss, stats = value_loss(v, old, R, mask, eps)
    close(loss, 0.615)
    close(stats["clipfrac"], 1 / 3)


# --------------------------------------------------------------------------- per-token from logits


def test_entropy_from_logits():
    # uniform over 2 -> ln 2; probs (1/4, 3/4) from logits (0, ln 3):
    # H = 0.25*ln4 + 0.75*ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    close(entropy_from_logits(logits), [[LN2, 0.562335]])
    # stable for huge logits: one-hot -> 0, no NaN
    close(entropy_from_logits(torch.tensor([[[1e4, 0.0, 0.0]]])), [[0.0]])
    # bf16 input, uniform over 4 -> ln 4 in float32
    h = entropy_from_logits(torch.zeros(1, 1, 4, dtype=torch.bfloat16))
    assert h.dtype == torch.float32
    close(h, [[math.log(4.0)]])


def test_kl_estimate_concrete_pair():
    # p = 0.5, q = 0.25: log p - log q = ln 2 = 0.693147
    # k1 = 0.693147; k2 = 0.5 * 0.693147^2 = 0.240227
    # k3: r = q/p = 0.5 -> (0.5 - 1) - ln 0.5 = -0.5 + 0.693147 = 0.193147
    lp, lq = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    close(kl_estimate(lp, lq, "k1"), [[LN2]])
    close(kl_estimate(lp, lq, "k2"), [[0.5 * LN2**2]])
    close(kl_estimate(lp, lq, "k3"), [[LN2 - 0.5]])
    close(kl_estimate(lp, lp, "k3"), [[0.0]])  # p == q -> 0


def test_kl_k3_nonnegative():
    g = torch.Generator().manual_seed(2)
    lp, lq = 3 * torch.randn(4, 50, generator=g), 3 * torch.randn(4, 50, generator=g)
    assert (kl_estimate(lp, lq, "k3") >= 0).all()
    assert (kl_estimate(lp, lq, "k2") >= 0).all()


def test_kl_invalid_estimator():
    assert KL_ESTIMATORS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="k1, k2, k3") as e:
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    assert "'k4'" in str(e.value) and "\n" not in str(e.value)


def test_logprobs_of_labels():
    # row 0: uniform over 4, label 2 -> -ln 4
    # row 1: logits (0, ln 3, -inf-ish), label 1 -> ln(3 / 4) = -0.287682
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0]], [[0.0, math.log(3.0), -1e9, -1e9]]])
    labels = torch.tensor([[2], [1]])
    close(logprobs_of_labels(logits, labels), [[-math.log(4.0)], [math.log(0.75)]])
    out = logprobs_of_labels(logits.bfloat16(), labels)
    assert out.dtype == torch.float32 and out.shape == (2, 1)
    close(out[0], [-math.log(4.0)])
