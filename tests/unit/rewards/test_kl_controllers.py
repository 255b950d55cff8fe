"""Hand-checked tests for rlhf_train.rewards.kl_controllers."""

import pytest
import torch

from rlhf_train.rewards.kl_controllers import AdaptiveKLController, ConstantKLController


def test_constant_controller():
    c = ConstantKLController(0.05)
    assert c.update([100.0, 200.0]) == 0.05 and c.coef == 0.05
    c2 = ConstantKLController(1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.coef == 0.05


def test_adaptive_update_positive_error_clipped():
    # KL_t = (8 + 10) / 2 = 9; e = clip(9/6 - 1 = 0.5) = 0.2; n = 2
    # coef = 0.1 * (1 + 0.2 * 2 / 10000) = 0.1 * 1.00004 = 0.100004
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert c.update([8.0, 10.0]) == pytest.approx(0.100004, abs=1e-12)
    assert c.coef == pytest.approx(0.100004, abs=1e-12)


def test_adaptive_update_negative_error_clipped():
    # KL_t = (1 + 2) / 2 = 1.5; e = clip(1.5/6 - 1 = -0.75) = -0.2; n = 2
    # coef = 0.1 * (1 - 0.2 * 2 / 10000) = 0.099996
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert c.update(torch.tensor([1.0, 2.0])) == pytest.approx(0.099996, abs=1e-12)


def test_adaptive_update_unclipped_error():
    # KL_t = 6.6; e = 6.6/6 - 1 = 0.1 (inside the clip); n = 1
    # coef = 0.1 * (1 + 0.1 * 1 / 10) = 0.101
    c = AdaptiveKLController(0.1, target=6.0, horizon=10)
    assert c.update([6.6]) == pytest.approx(0.101, abs=1e-12)


def test_adaptive_empty_leaves_coef():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10)
    assert c.update([]) == 0.1
    assert c.update(torch.empty(0)) == 0.1


def test_adaptive_state_dict_round_trip():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update([8.0, 10.0])
    d = c.state_dict()
    c2 = AdaptiveKLController(0.5, target=1.0, horizon=5)
    c2.load_state_dict(d)
    assert (c2.coef, c2.target, c2.horizon) == (c.coef, 6.0, 10000)
    assert c2.update([3.0]) == c.update([3.0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(init_kl_coef=-0.1, target=6.0, horizon=10), "init_kl_coef"),
        (dict(init_kl_coef=0.1, target=0.0, horizon=10), "target"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=0), "horizon"),
    ],
)
def test_adaptive_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdaptiveKLController(**kwargs)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchrl calls np.clip on a tensor
def test_adaptive_matches_torchrl_when_fed_reward_kl():
    """torchrl's controller expects values = -coef * KL (reward_kl), one per step; fed per-sequence
    values that way, it gives the same update as ours fed the per-sequence KL directly."""
    from torchrl.data.llm.utils import AdaptiveKLController as TorchRLAdaptive

    ours = AdaptiveKLController(0.1, target=6.0, horizon=100)
    theirs = TorchRLAdaptive(init_kl_coef=0.1, target=6.0, horizon=100)
    for kl_seq in ([8.0, 10.0], [5.0, 6.0, 6.3], [1.0]):
        reward_kl = [-theirs.coef * k for k in kl_seq]  # length n: one value per sequence
        expected = float(theirs.update(reward_kl))
        assert ours.update(kl_seq) == pytest.approx(expected, rel=1e-6)
