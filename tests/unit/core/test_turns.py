"""Per-token estimators over a multi-turn episode's own tokens (rlhf_train/core/turns.py), worked by hand."""
from __future__ import annotations

import torch

from rlhf_train.core.advantages import discounted_returns, gae
from rlhf_train.core.turns import over_actions


def test_gae_steps_from_one_sampled_token_to_the_next():
    """Schulman et al. 2016 eq. 16 over the agent's decisions, γ = λ = 1. Row 0: actions at 0 and 2 of
    [a, env, a, env]; rewards [0, ·, 1, ·], values [0.5, ·, 0.25, ·] (· : 9, never read).
    δ_0 = 0 + V(s_2) − V(s_0) = 0.25 − 0.5 = −0.25, δ_2 = 1 + 0 − 0.25 = 0.75 (the episode ends after it):
    A_2 = 0.75, A_0 = −0.25 + 0.75 = 0.5; returns A + V: 1.0 and 1.0. Row 1 is single-turn (a prefix mask)."""
    mask = torch.tensor([[True, False, True, False], [True, True, True, False]])
    rewards = torch.tensor([[0.0, 9.0, 1.0, 9.0], [0.0, 0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 9.0, 0.25, 9.0], [1.0, 0.5, 0.5, 0.0]])
    adv, ret = over_actions(lambda r, v, m: gae(r, v, m, 1.0, 1.0), mask, rewards, values)
    torch.testing.assert_close(adv[0], torch.tensor([0.5, 0.0, 0.75, 0.0]))
    torch.testing.assert_close(ret[0], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    # a prefix mask: the estimator's own result (row 1 through plain GAE)
    plain_adv, plain_ret = gae(rewards[1:], values[1:], mask[1:], 1.0, 1.0)
    assert torch.equal(adv[1:], plain_adv) and torch.equal(ret[1:], plain_ret)
    # plain GAE over the gapped mask would read V = 0 after the first turn (as if the episode ended there)
    wrong, _ = gae(rewards[:1], values[:1], mask[:1], 1.0, 1.0)
    assert wrong[0, 0].item() == 0.25


def test_a_return_to_go_is_not_discounted_by_environment_tokens():
    """γ = 0.5, actions at 0, 3, 4 of five tokens, rewards 1, 2, 4 there: G_4 = 4, G_3 = 2 + 0.5·4 = 4,
    G_0 = 1 + 0.5·4 = 3 (the two environment tokens between 0 and 3 are no steps)."""
    mask = torch.tensor([[True, False, False, True, True]])
    rewards = torch.tensor([[1.0, 7.0, 7.0, 2.0, 4.0]])
    (returns,) = over_actions(lambda r, m: (discounted_returns(r, m, 0.5),), mask, rewards)
    torch.testing.assert_close(returns, torch.tensor([[3.0, 0.0, 0.0, 4.0, 4.0]]))
