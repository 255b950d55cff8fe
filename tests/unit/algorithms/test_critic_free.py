"""The critic-free algorithms wired into the trainer (issue 14): ``algorithm=grpo|rloo|reinforce_pp``.

1. GRPO with beta = 0 raises the reward of the tiny token-count task (tests/e2e/test_train.py's stand-ins)
   and builds no reference model and no value head (no value-head parameters in the optimizer);
2. RLOO on the smoke recipe: KL in the reward (controller steps), the group metrics, no critic;
3. bad ``algorithm`` / ``rollout.num_samples`` combinations fail with one ConfigError line;
   a NaN reward spoils only its group's rows (their minibatches are skipped, the others train);
4. resume is exact for GRPO (2 iterations + resume to 3 == 3 straight);
5. (slow) 2 processes × 4 prompts × 2 samples give the gradient of 1 process × 8 prompts × 2 samples
   with a per-sequence loss normaliser and batch whitening (REINFORCE++), and every group stays whole
   on its process (greedy decoding: both samples of every group equal, so each group's std is 0).

Budget: ~20 s in process on 2 quiet cores (+ ~60 s for the slow 2-process test).
"""
from __future__ import annotations

import csv
import math
import sys

import pytest
import torch

from tests.helpers.reliability import make_cfg
from tests.e2e.test_train import RESPONSE_TOKENS, compose


# --------------------------------------------------------------------------- 1. GRPO learns, no reference / critic
def test_grpo_without_kl_raises_the_reward_and_builds_no_reference_or_value_head(tmp_path, monkeypatch):
    from rlhf_train.loop.trainer import train
    from rlhf_train.models import policy as policy_module

    def no_reference(*args, **kwargs):
        raise AssertionError("a reference model was built with algorithm.beta=0 and no KL in the reward")

    monkeypatch.setattr(policy_module, "build_reference", no_reference)
    cfg = compose([
        "+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "algorithm=grpo", "algorithm.beta=0",
        "ref_model._target_=rlhf_train.models.policy.build_reference",
        "tokenizer._target_=tests.e2e.test_train.tiny_tokenizer",
        "reward_model._target_=tests.e2e.test_train.TokenCountRewardModel",
        "data=synthetic", "data.batch_size=4", "rollout.num_samples=4", "data.min_prompt_tokens=2",
        "data.max_prompt_tokens=4", "data.max_prompts=256", "policy.config.n_layer=1", "policy.config.n_embd=32",
        f"rollout.max_new_tokens={RESPONSE_TOKENS}", "update.num_epochs=2", "update.minibatch_size=8",
        "optimizer.lr=3e-3", "trainer.num_iterations=16", "trainer.checkpoint_every=1000",
        "trainer.samples_every=1000", "trainer.seed=0",
    ])
    out = train(cfg, tmp_path)
    policy = out["policy"]
    assert out["rollout"].reference is None
    assert policy.value_head is None and not any("value_head" in n for n, _ in policy.named_parameters())
    history = out["history"]
    score = torch.tensor([h["objective/score"] for h in history])
    first, last = score[:4].mean().item(), score[-4:].mean().item()
    assert last > first + 0.3 and last > 3 * first, score.tolist()
    assert all(abs(h["val/first_ratio"] - 1.0) < 1e-5 for h in history)
    names = set(next(csv.reader(open(tmp_path / "metrics.csv"))))
    assert {"reward/group_std", "reward/frac_zero_std_groups", "policy/clipfrac_low", "policy/clipfrac_high"} <= names
    assert not names & {"loss/value", "val/clipfrac", "val/value_mean", "objective/kl", "loss/kl"}, names


# --------------------------------------------------------------------------- 2. RLOO: KL in the reward
def test_rloo_smoke_kl_in_the_reward(tmp_path):
    from rlhf_train.loop.trainer import train

    cfg = make_cfg("algorithm=rloo", "rollout.num_samples=2", "trainer.num_iterations=2", "trainer.checkpoint_every=1")
    out = train(cfg, tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert len(rows) == 2 and out["rollout"].reference.kind == "copy" and out["policy"].value_head is None
    assert float(rows[0]["objective/kl_coef"]) == pytest.approx(cfg.kl_controller.init_kl_coef)
    assert float(rows[1]["objective/kl_coef"]) == float(rows[0]["objective/kl_coef_next"])  # the controller steps
    assert "objective/kl" in rows[0] and "loss/value" not in rows[0] and float(rows[0]["reward/group_std"]) >= 0
    ckpt = tmp_path / "checkpoints" / "iter_000002"
    assert ckpt.is_dir() and not [n for n in torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
                                  if n is None]


def test_grpo_nan_reward_skips_only_its_group(tmp_path, monkeypatch):
    from rlhf_train.loop.trainer import train
    from tests.unit.loop.test_faults import _nan_scores_from

    _nan_scores_from(monkeypatch, iteration=2)  # the first sample of the first prompt, from iteration 2 on
    out = train(make_cfg("algorithm=grpo", "rollout.num_samples=2", "algorithm.scale_rewards=batch",
                         "trainer.num_iterations=2", "trainer.checkpoint_every=10"), tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    # its group's 2 rows sit in 1 or 2 of the 4 minibatches of each of the 2 epochs: 2 to 4 skipped, not all 8
    assert float(rows[0]["faults/skipped_updates"]) == 0 and 2 <= float(rows[1]["faults/skipped_updates"]) <= 4
    assert all(math.isfinite(float(rows[1][k])) for k in ("loss/policy", "policy/clipfrac", "val/ratio"))
    assert all(torch.isfinite(p).all() for p in out["policy"].parameters())


# --------------------------------------------------------------------------- 3. one clear line for bad input
@pytest.mark.parametrize("overrides, match", [
    (["algorithm=grpo"], "rollout.num_samples >= 2"),
    (["algorithm=rloo", "rollout.num_samples=1"], "rollout.num_samples >= 2"),
    (["algorithm.loss_agg=seq_mean_token_mean"], "does not apply to algorithm=ppo"),
    (["algorithm=grpo", "rollout.num_samples=2", "algorithm.kl_in_reward=true"], "algorithm.kl_in_reward=false"),
    (["algorithm=grpo", "rollout.num_samples=2", "algorithm.loss_agg=sum"], "algorithm.loss_agg='sum'"),
    (["algorithm=grpo", "rollout.num_samples=2", "algorithm.scale_rewards=median"], "scale_rewards"),
    (["algorithm=grpo", "rollout.num_samples=2", "algorithm.clip_high=-0.1"], "algorithm.clip_high"),
    (["algorithm=rloo", "rollout.num_samples=2", "update.minibatch_size=16"], "rollout.num_samples=2"),
])
def test_bad_algorithm_settings_fail_before_any_work(overrides, match):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.checks import check_config

    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)
        build_run(cfg)


def test_every_algorithm_option_composes_and_builds():
    from rlhf_train.loop.build import decide
    from rlhf_train.loop.checks import check_config

    for name in ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        cfg = make_cfg(f"algorithm={name}", "rollout.num_samples=2")
        check_config(cfg)
        algorithm = decide(cfg).algorithm
        assert algorithm.needs_critic == (name == "ppo")
        assert algorithm.kl_in_reward == (name != "grpo")


@pytest.mark.parametrize("variant", [
    ["algorithm.scale_rewards=none", "algorithm.loss_agg=seq_mean_token_sum_norm"],      # Dr. GRPO
    ["algorithm.loss_agg=token_mean", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28"],  # DAPO
    ["algorithm.ratio_level=sequence", "algorithm.clip_low=0.0003", "algorithm.clip_high=0.0004"],  # GSPO
], ids=["dr_grpo", "dapo", "gspo"])
def test_grpo_loss_variants_train(tmp_path, variant):
    from rlhf_train.loop.trainer import train

    out = train(make_cfg("algorithm=grpo", "rollout.num_samples=2", "trainer.num_iterations=1",
                         "trainer.checkpoint_every=10", *variant), tmp_path)
    m = out["metrics"]
    assert all(math.isfinite(float(m[k])) for k in ("loss/policy", "loss/kl", "policy/clipfrac_low",
                                                     "policy/clipfrac_high", "reward/group_std"))
    assert abs(float(m["val/first_ratio"]) - 1) < 1e-5 and float(m["faults/skipped_updates"]) == 0


# --------------------------------------------------------------------------- 4. exact resume
def test_grpo_resume_is_exact(tmp_path):
    from rlhf_train.loop.trainer import train

    common = ["algorithm=grpo", "rollout.num_samples=2", "trainer.checkpoint_every=10"]
    train(make_cfg(*common, "trainer.num_iterations=3"), tmp_path / "straight")
    train(make_cfg(*common, "trainer.num_iterations=2"), tmp_path / "resumed")
    train(make_cfg(*common, "trainer.num_iterations=3", "trainer.resume=auto"), tmp_path / "resumed")
    straight = (tmp_path / "straight" / "metrics.csv").read_text()
    assert straight.count("\n") == 4 and (tmp_path / "resumed" / "metrics.csv").read_text() == straight


# --------------------------------------------------------------------------- 5. two processes, groups intact
@pytest.mark.slow
def test_two_processes_keep_groups_and_give_the_gradient_of_one(tmp_path, tmp_path_factory):
    from tests.e2e.test_distributed import LAUNCH_2, WORKER, run

    cache = tmp_path_factory.mktemp("cache")
    common = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "rollout.do_sample=false",
              "update.num_epochs=1", "rollout.max_new_tokens=8", "algorithm=reinforce_pp", "rollout.num_samples=2",
              "algorithm.loss_agg=seq_mean_token_mean", "trainer.num_iterations=1"]
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    run([*LAUNCH_2, WORKER, *common, "data.batch_size=4", "update.minibatch_size=8"], two, two / "dump", cache)
    run([sys.executable, WORKER, *common, "data.batch_size=8", "update.minibatch_size=16",
         "update.gradient_accumulation_steps=2", f"hydra.run.dir={one / 'run'}"], one, one / "dump", cache)
    ranks = [torch.load(two / "dump" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = torch.load(one / "dump" / "rank0.pt", weights_only=False)
    assert [r["num_processes"] for r in ranks] == [2, 2]
    # greedy decoding: the 2 samples of a prompt are equal, so every group has std 0 only if it is whole
    for r in ranks:
        assert r["local_metrics"][0]["reward/frac_zero_std_groups"] == 1.0
    assert sorted(single["prompts"][0].tolist()) == sorted(torch.cat([r["prompts"][0] for r in ranks]).tolist())
    g2 = torch.cat([g.reshape(-1) for g in ranks[0]["first_grad"]])
    g1 = torch.cat([g.reshape(-1) for g in single["first_grad"]])
    assert g1.abs().max() > 0 and len(ranks[0]["first_grad"]) == len(single["first_grad"])
    torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6 * float(g1.abs().max()))
