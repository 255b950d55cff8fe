"""Numerical faults: a NaN/inf in rewards, log-probs, advantages or the loss skips that minibatch's update,
is counted (``faults/skipped_updates``), and ``trainer.max_consecutive_faults`` in a row stop the run with a
checkpoint of the last good state (issue 7).

Budget: ~2 s for the minibatch_update tests (tiny model, synthetic rollouts) + ~10 s for two in-process runs.
"""
from __future__ import annotations

import csv
import functools
import math

import pytest
import torch

from tests.helpers.reliability import make_cfg, tiny_policy

B, P, T, V = 4, 3, 5, 32


def _rollouts():
    """A batch of ``B`` synthetic rollouts with every field :func:`minibatch_update` reads."""
    from rlhf_train.core.containers import Masks, Rollout, Tokens

    g = torch.Generator().manual_seed(0)
    prompt, response = torch.randint(2, V, (B, P), generator=g), torch.randint(2, V, (B, T), generator=g)
    return Rollout(
        tokens=Tokens(full=torch.cat([prompt, response], 1), response=response, batch_size=[B]),
        masks=Masks(full=torch.ones(B, P + T, dtype=torch.bool), response=torch.ones(B, T, dtype=torch.bool),
                    batch_size=[B]),
        sample_log_prob=torch.full((B, T), -math.log(V)),
        values=torch.zeros(B, T),
        advantage=torch.randn(B, T, generator=g),
        returns=torch.randn(B, T, generator=g),
        reward=torch.randn(B, T, generator=g),
        batch_size=[B])


@functools.lru_cache(maxsize=1)
def _cfg():
    return make_cfg("update.num_epochs=2", "update.minibatch_size=2", "update.gradient_accumulation_steps=1")


def _update(td):
    """One ``minibatch_update`` (2 epochs x 2 minibatches of 2 rows): (fault_state, weights before, after, stats, error)."""
    from accelerate import Accelerator
    from rlhf_train.algorithms.update import minibatch_update
    from rlhf_train.infra.faults import Faults
    from rlhf_train.loop.build import decide

    d = decide(_cfg())
    algorithm, update_cfg, sampling = d.algorithm, d.update, d.sampling
    policy = tiny_policy(V)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = [p.detach().clone() for p in policy.parameters()]
    faults = Faults(max_consecutive=3)
    err = None
    try:
        stats = minibatch_update(policy, optimizer, scheduler, Accelerator(cpu=True), td, algorithm, sampling,
                                 update_cfg, torch.Generator().manual_seed(0), faults)
    except FloatingPointError as e:
        stats, err = None, e
    return faults, before, [p.detach() for p in policy.parameters()], stats, err


@pytest.mark.parametrize("key", ["reward", "sample_log_prob", "advantage", "returns", "values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_skips_only_its_minibatch(key, bad):
    td = _rollouts()
    getattr(td, key)[0, 2] = bad  # row 0 is in one minibatch per epoch
    faults, before, after, stats, err = _update(td)
    assert err is None and faults.skipped == 2
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the other minibatches did update
    assert math.isfinite(stats["loss/policy"])  # the skipped minibatches' stats are left out of the means


def test_non_finite_loss_skips_the_update(monkeypatch):
    from rlhf_train.algorithms.ppo import PPO

    real, calls = PPO.loss, []

    def nan_once(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 1 else loss), stats

    monkeypatch.setattr(PPO, "loss", nan_once)
    faults, *_ , err = _update(_rollouts())
    assert err is None and (faults.skipped, faults.consecutive) == (1, 0)


def test_max_consecutive_faults_stops_without_touching_the_weights():
    td = _rollouts()
    td.reward[:] = float("nan")  # every minibatch is faulty
    faults, before, after, _, err = _update(td)
    assert isinstance(err, FloatingPointError)
    assert "3 updates in a row were skipped" in str(err) and "trainer.max_consecutive_faults=3" in str(err)
    assert faults.skipped == 3
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_kl_controller_ignores_non_finite_kl():
    from rlhf_train.rewards.kl_controllers import AdaptiveKLController

    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(torch.tensor([float("nan"), float("inf")]))
    assert ctl.coef == 0.1
    ctl.update(torch.tensor([float("nan"), 12.0]))  # = update([12.0])
    assert ctl.coef == pytest.approx(0.1 * (1 + 0.2 * 1 / 100))


def test_whitening_ignores_faulty_rows():
    from rlhf_train.core.masked import global_masked_whiten

    x = torch.randn(4, 5)
    x[0, 1] = float("nan")
    mask = torch.ones(4, 5, dtype=torch.bool)
    rows_ok = torch.tensor([False, True, True, True])
    out = global_masked_whiten(x, mask & rows_ok[:, None])
    assert torch.isfinite(out).all()
    assert out[1:].mean().abs() < 1e-5 and (out[0] == 0).all()


# --------------------------------------------------------------------------------------------
# in a run: a NaN reward is skipped and counted; NaN rewards every iteration stop the run
# --------------------------------------------------------------------------------------------
def _nan_scores_from(monkeypatch, iteration: int, rows=slice(0, 1)):
    """From rollout ``iteration`` on, the reward model scores ``rows`` NaN."""
    from rlhf_train.rewards.sources import RewardModelSource
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    real, calls = RewardModelSource.__call__, []  # calls: rollouts so far (the pre-flight probe is not one)
    rollout_call = RolloutFromModel.__call__
    monkeypatch.setattr(RolloutFromModel, "__call__",
                        lambda self, *a, **k: calls.append(1) or rollout_call(self, *a, **k))

    def score(self, sequences):
        out = real(self, sequences)
        if len(calls) >= iteration:
            out = out.clone()
            out[rows] = float("nan")
        return out

    monkeypatch.setattr(RewardModelSource, "__call__", score)


def test_nan_reward_in_a_run_is_skipped_and_logged(tmp_path, monkeypatch):
    from rlhf_train.loop.trainer import train

    _nan_scores_from(monkeypatch, iteration=2)  # one prompt of every batch from iteration 2 on
    out = train(make_cfg("trainer.num_iterations=2", "trainer.checkpoint_every=10"), tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [float(r["faults/skipped_updates"]) for r in rows] == [0.0, 2.0]  # its minibatch, once per epoch
    assert math.isfinite(float(rows[1]["objective/kl_coef_next"]))  # the KL controller is not poisoned
    assert math.isfinite(float(rows[1]["loss/policy"]))
    assert all(torch.isfinite(p).all() for p in out["policy"].parameters())


def test_consecutive_faults_stop_the_run_with_a_checkpoint_of_the_last_good_state(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from rlhf_train.infra.resume import read_trainer_state, verify_checkpoint
    from rlhf_train.loop.trainer import train

    _nan_scores_from(monkeypatch, iteration=2, rows=slice(None))  # every reward NaN from iteration 2
    with pytest.raises(FloatingPointError) as exc:
        train(make_cfg("trainer.num_iterations=4", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0"),
              tmp_path / "run")
    msg = str(exc.value)
    assert "stopped in iteration 2" in msg and "trainer.max_consecutive_faults=3" in msg and "iter_000001" in msg
    last = tmp_path / "run" / "checkpoints" / "iter_000001"  # 1 iteration finished: resume redoes iteration 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["iter_000001"] and verify_checkpoint(last) is None
    # iteration 2 made no update: the checkpoint holds the weights of iteration 1, the last good ones
    monkeypatch.undo()  # (no NaN rewards in this one)
    train(make_cfg("trainer.num_iterations=1"), tmp_path / "one")
    w1 = load_file(tmp_path / "one" / "checkpoints" / "iter_000001" / "policy" / "model.safetensors")
    w2 = load_file(last / "policy" / "model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    faults = read_trainer_state(last)["faults"]
    assert faults["skipped"] == 3 and faults["consecutive"] == 0  # a resumed run gets a fresh budget
