"""Which rows the update trains on (rlhf_train/algorithms/selection.py) and the rows no source scored:

1. ``algorithm.filter_zero_std_groups`` (DAPO's dynamic sampling, no refill): the groups whose samples all got
   the same reward leave the update (its rollout holds the other groups' rows only, rounded up to a minibatch
   with rows whose loss mask is empty), ``update/dropped_rows`` counts them; with several processes every one
   trains on as many rows as the one that keeps the most (slow: 2 gloo processes that drop different numbers
   of rows stay in step).
2. An iteration in which every group's rewards are equal (GRPO, RLOO) skips its update: no optimizer step, the
   weights unchanged, one warning line, ``faults/no_signal_updates`` counted (checkpointed); PPO runs it.
3. ``algorithm.mask_truncated_completions``: a response cut at ``rollout.max_new_tokens`` without EOS is left
   out of the loss (worked by hand on a two-row batch).
4. A row every reward function scored ``None``: ``Rollout.unscored``, ``reward/frac_unscored``, advantage 0
   and out of its group's mean and std (worked by hand); a reward model's NaN stays a fault.
5. The keys' one-line checks.

Budget: ~20 s on 2 CPU cores (+ ~30 s for the slow 2-process test).
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.helpers.reliability import make_cfg

# the smoke config, 4 prompts × 4 samples per iteration (groups of 4), minibatches of 8, GRPO without a
# reference; the reward is one of the functions below, called once per batch in the trainer's process
GRPO = ["algorithm=grpo", "algorithm.beta=0", "rollout.num_samples=4", "update.minibatch_size=8",
        "reward_model=none", "+rewards.fn.workers=0"]


def one_group_spreads(prompts, completions, **_):
    """Per group of 4 adjacent rows: the first group all 1, the second 0, 1, 0, 1, the rest all 0."""
    return [1.0 if i < 4 else float(i % 2) if i < 8 else 0.0 for i in range(len(completions))]


def all_equal(prompts, completions, **_):
    return [1.0] * len(completions)


def second_unscored(prompts, completions, **_):
    """Per group of 4: 0, None, 2, 3 (the second row of every group scored by no source)."""
    return [None if i % 4 == 1 else float(i % 4) for i in range(len(completions))]


def length_parity(prompts, completions, **_):
    """1 for a completion of an odd number of characters, else 0: groups that tie and groups that do not."""
    return [float(len(c) % 2) for c in completions]


def _step(*overrides: str, fn: str):
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.state import TrainState
    from rlhf_train.loop.trainer import step

    run = build_run(make_cfg(*overrides, f"+rewards.fn._target_=tests.unit.algorithms.test_dynamic_sampling.{fn}"))
    state = TrainState.fresh(run.kl_controller, 0, 0, 3)
    return run, state, lambda: step(run, state, next(iter(run.loader)))


def _spy_update(monkeypatch) -> list:
    """The rollouts the update is handed, in order."""
    from rlhf_train.algorithms import update
    from rlhf_train.loop import trainer

    seen = []

    def spy(policy, optimizer, lr_scheduler, accelerator, rollout, *args):
        seen.append(rollout)
        return update.minibatch_update(policy, optimizer, lr_scheduler, accelerator, rollout, *args)

    monkeypatch.setattr(trainer, "minibatch_update", spy)
    return seen


# --------------------------------------------------------------------------- 1. zero-variance groups leave
def test_filter_zero_std_groups_trains_on_the_informative_groups_only(monkeypatch):
    seen = _spy_update(monkeypatch)
    run, state, go = _step(*GRPO, "algorithm.filter_zero_std_groups=true", fn="one_group_spreads")
    metrics, ro = go()
    # 3 of the 4 groups have no spread: their 12 rows leave; the 4 informative ones fill one minibatch of 8
    # with 4 rows whose loss mask is empty (they cost compute, never gradient: no token, no sequence counted)
    assert metrics["reward/frac_zero_std_groups"] == pytest.approx(0.75)
    assert metrics["update/dropped_rows"] == 12 and metrics["faults/no_signal_updates"] == 0
    chosen = seen[0]
    trains = chosen.masks.response.any(-1)
    assert chosen.batch_size[0] == 8 and trains.sum() == 4
    assert torch.equal(chosen.tokens.full[trains], ro.tokens.full[4:8])  # the second group, in its order
    assert (chosen.advantage[trains].abs().sum(-1) > 0).all()
    assert run.algorithm.loss_units(chosen.masks.response).item() == 4  # GRPO: a mean over the 4 sequences
    assert math.isfinite(metrics["loss/policy"]) and metrics["faults/skipped_updates"] == 0


def test_without_the_filter_every_row_is_trained_on(monkeypatch):
    seen = _spy_update(monkeypatch)
    run, state, go = _step(*GRPO, fn="one_group_spreads")
    metrics, ro = go()
    assert seen[0] is ro and metrics["update/dropped_rows"] == 0  # the rollout itself, untouched
    assert metrics["reward/frac_zero_std_groups"] == pytest.approx(0.75)


def test_several_processes_train_on_as_many_rows_as_the_one_that_keeps_most():
    from rlhf_train.algorithms.selection import RowSelection

    ro = _rollout(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 3.0]), group_size=2)
    select = RowSelection(group_size=2, minibatch_size=2, relative=True, filter_zero_std_groups=True)
    # here one informative group of 2 rows (rows 2, 3); another process keeps 5: both train on 6 rows
    other = torch.tensor([[5, 5]])
    chosen, dropped = select(ro, lambda t: torch.cat([t, other]))
    assert dropped == 6 and chosen.batch_size[0] == 6
    assert chosen.masks.response.any(-1).tolist() == [True, True, False, False, False, False]
    # alone: the 2 kept rows, one minibatch
    chosen, _ = select(ro, lambda t: t)
    assert chosen.batch_size[0] == 2 and chosen.masks.response.all()


@pytest.mark.slow
def test_two_processes_filter_different_numbers_of_groups_and_stay_in_step(tmp_path, tmp_path_factory):
    from tests.e2e.test_distributed import LAUNCH_2, WORKER, run

    cwd, cache = tmp_path / "two", tmp_path_factory.mktemp("cache")
    cwd.mkdir()
    run([*LAUNCH_2, WORKER, "+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "rollout.max_new_tokens=8",
         "trainer.num_iterations=3", "data.batch_size=4", *GRPO, "algorithm.filter_zero_std_groups=true",
         "+rewards.fn._target_=tests.unit.algorithms.test_dynamic_sampling.length_parity"], cwd, cwd / "dump", cache)
    ranks = [torch.load(cwd / "dump" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    dropped = [[m["update/dropped_rows"] for m in r["local_metrics"]] for r in ranks]
    assert len(dropped[0]) == len(dropped[1]) == 3 and dropped[0] != dropped[1], dropped  # the ranks differ
    assert all(math.isfinite(m["loss/policy"]) for r in ranks for m in r["local_metrics"] if "loss/policy" in m)
    # the same number of minibatches on both (else a collective would hang) and the same weights after
    assert ranks[0]["params"] and all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))


# --------------------------------------------------------------------------- 2. nothing to learn: no update
@pytest.mark.parametrize("flag", ["false", "true"])
def test_an_iteration_whose_groups_all_tie_skips_its_update(flag, caplog):
    run, state, go = _step(*GRPO, f"algorithm.filter_zero_std_groups={flag}", fn="all_equal")
    before = [p.detach().clone() for p in run.policy.parameters()]
    with caplog.at_level(logging.WARNING, logger="rlhf_train.loop.trainer"):
        metrics, _ = go()
    assert metrics["faults/no_signal_updates"] == 1 and metrics["reward/frac_zero_std_groups"] == 1.0
    assert "loss/policy" not in metrics and metrics["faults/skipped_updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))
    assert [r.message for r in caplog.records].count(
        "[rlhf_train] iteration 1: update skipped, no sample had anything to learn (every group's rewards equal, "
        "or every response left out of the loss); faults/no_signal_updates=1") == 1
    assert state.faults.state_dict()["no_signal"] == 1  # checkpointed with the other counters


def test_ppo_trains_on_equal_rewards():
    run, state, go = _step("reward_model=none", "+rewards.fn.workers=0", fn="all_equal")
    metrics, _ = go()
    assert metrics["faults/no_signal_updates"] == 0 and math.isfinite(metrics["loss/policy"])


# --------------------------------------------------------------------------- 3. truncated responses
def _rollout(score: torch.Tensor, group_size: int, T: int = 3, truncated=None):
    from rlhf_train.core.containers import Masks, Rollout, Tokens

    B = score.shape[0]
    lengths = torch.full((B,), T) if truncated is None else torch.where(truncated, T, 2)
    mask = torch.arange(T)[None] < lengths[:, None]
    done = torch.arange(T)[None] == (lengths - 1)[:, None]
    trunc = done & (truncated[:, None] if truncated is not None else torch.zeros(B, 1, dtype=torch.bool))
    reward = torch.zeros(B, T).masked_scatter(done, score)
    full = torch.arange(B * (T + 1)).view(B, T + 1)
    return Rollout(tokens=Tokens(full=full, response=full[:, 1:], batch_size=[B]),
                   masks=Masks(response=mask, full=torch.cat([torch.ones(B, 1, dtype=torch.bool), mask], 1),
                               batch_size=[B]),
                   reward=reward, reward_raw=reward.clone(), done=done, truncated=trunc, terminated=done & ~trunc,
                   sample_log_prob=torch.zeros(B, T), batch_size=[B])


def test_mask_truncated_completions_leaves_them_out_of_the_loss():
    from rlhf_train.algorithms import critic_free
    from rlhf_train.algorithms.base import PolicyOutput
    from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
    from rlhf_train.algorithms.selection import RowSelection

    # one group of 2: row 0 ends with EOS after 2 tokens (score 1), row 1 is cut at T = 3 (score 0)
    ro = _rollout(torch.tensor([1.0, 0.0]), group_size=2, truncated=torch.tensor([False, True]))
    algo = critic_free.grpo(AlgorithmConfig(name="grpo", kl_in_reward=False, loss_agg="token_mean"), UpdateConfig(),
                            group_size=2, max_new_tokens=3)
    ro.advantage, _ = algo.estimator(ro)  # (1 − 0.5) / (std 0.7071 + 1e-6) = ±0.707106 on every token
    select = RowSelection(group_size=2, minibatch_size=1, relative=True, mask_truncated=True)
    chosen, dropped = select(ro, lambda t: t)
    assert dropped == 1 and chosen.batch_size[0] == 1 and chosen.masks.response.tolist() == [[True, True, False]]
    # ratio 1: loss = mean over the 2 tokens of row 0 of −A = −0.707106 (with row 1: (−2 · 0.707 + 3 · 0.707) / 5)
    loss, _ = algo.loss(PolicyOutput(torch.zeros(1, 3), None, None), chosen)
    assert loss.item() == pytest.approx(-0.707106, abs=1e-5)
    full, _ = algo.loss(PolicyOutput(torch.zeros(2, 3), None, None), ro)
    assert full.item() == pytest.approx(0.707106 / 5, abs=1e-5)
    # every response cut: nothing to learn, no update
    everything = _rollout(torch.tensor([1.0, 0.0]), group_size=2, truncated=torch.tensor([True, True]))
    assert select(everything, lambda t: t) == (None, 2)


# --------------------------------------------------------------------------- 4. rows no source scored
def test_a_row_no_source_scored_gets_advantage_zero_and_leaves_its_group():
    run, state, go = _step(*GRPO, fn="second_unscored")
    metrics, ro = go()
    assert ro.unscored.tolist() == [False, True, False, False] * 4
    assert metrics["reward/frac_unscored"] == pytest.approx(0.25)
    # each group: 0, U, 2, 3 -> mean 5/3, unbiased std sqrt((25/9 + 1/9 + 16/9) / 2) = sqrt(7/3) over the scored
    s = math.sqrt(7 / 3)
    want = torch.tensor([-5 / 3 / s, 0.0, 1 / 3 / s, 4 / 3 / s]).repeat(4)
    adv = ro.advantage[:, 0]
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)
    assert (ro.advantage[ro.unscored] == 0).all()


def test_a_reward_models_nan_is_a_fault_not_unscored():
    from tensordict import TensorDict

    from rlhf_train.rollout.rollout_from_model import unscored_rows

    nan = float("nan")
    parts = TensorDict({"rm": torch.tensor([0.5, nan, 1.0]), "fn": torch.tensor([nan, nan, nan])}, batch_size=[3])
    total = torch.tensor([0.5, nan, 1.0])  # the reward model's NaN spoils its row's total
    assert unscored_rows(parts, total).tolist() == [False, False, False]
    parts = TensorDict({"a": torch.tensor([nan, 1.0]), "b": torch.tensor([nan, nan])}, batch_size=[2])
    assert unscored_rows(parts, torch.tensor([0.0, 1.0])).tolist() == [True, False]


# --------------------------------------------------------------------------- 5. one line for a bad key
@pytest.mark.parametrize("overrides, match", [
    (["algorithm.filter_zero_std_groups=true"], "use it with algorithm=grpo|rloo"),
    (["algorithm=reinforce_pp_baseline", "rollout.num_samples=2", "algorithm.filter_zero_std_groups=true"],
     "use it with algorithm=grpo|rloo"),
    (["algorithm=grpo", "rollout.num_samples=2", "algorithm.beta=0", "algorithm.kl_ratio_weighted=true"],
     "set algorithm.beta > 0"),
    (["algorithm=grpo", "rollout.num_samples=2", "algorithm.scale_eps=0"], "algorithm.scale_eps=0.0 must be positive"),
])
def test_bad_keys_fail_in_one_line(overrides, match):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=match):
        check_config(make_cfg(*overrides))
