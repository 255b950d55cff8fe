"""``trainer.precision`` and the sampler / trainer mismatch, through the trainer's own ``build_run`` + ``step``.

1. fp32: the rollout's π_old are the sampler's own log-probs (no second policy pass), the first ratio is 1
   and ``objective/sample_train_kl`` (sampler vs the update's first pass) is within 1e-6 of 0.
2. bf16 on CPU (PPO and GRPO): every pass under autocast, the trainer's own pass gives π_old (first ratio 1,
   first KL to the reference 0), the sampler's log-probs are kept and compared; every metric of the first
   iteration is finite and the mismatch is reported.
3. ``trainer.mixed_precision`` (the older name) is read as ``trainer.precision`` with one line; fp16 on a CPU
   is one ConfigError line before any model is built.
4. ``algorithm.is_correction`` on: the trainer's pass runs next to the sampler's log-probs and the loss logs
   ``objective/is_filtered_frac`` (0 in fp32, where the weights are 1 to rounding).

Budget: ~25 s on 2 CPU cores (five tiny runs of one iteration).
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

PPO_FAST = ("update.num_epochs=1",)

GRPO = ("algorithm=grpo", "rollout.num_samples=2", "data.batch_size=2", "update.num_epochs=1")


def _one_step(cfg):
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.state import TrainState
    from rlhf_train.loop.trainer import step

    run = build_run(cfg)
    state = TrainState.fresh(run.kl_controller, 0, 0, 3)
    metrics, ro = step(run, state, next(iter(run.loader)))
    return run, metrics, ro


def test_fp32_takes_the_sampler_log_probs_and_they_match_the_update(tiny_cfg):
    run, metrics, ro = _one_step(tiny_cfg(*PPO_FAST))
    assert run.accelerator.mixed_precision == "no" and not run.rollout.trainer_pass
    assert torch.equal(ro.sampler_log_prob, ro.sample_log_prob)  # no second policy pass
    assert abs(metrics["objective/sample_train_kl"]) <= 1e-6
    assert 0 <= metrics["objective/sample_train_kl_k2"] <= 1e-10
    assert metrics["val/first_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert "objective/is_filtered_frac" not in metrics  # no correction


@pytest.mark.parametrize("algorithm", [(), GRPO], ids=["ppo", "grpo"])
def test_bf16_on_cpu(tiny_cfg, algorithm):
    run, metrics, ro = _one_step(tiny_cfg("trainer.precision=bf16", *PPO_FAST, *algorithm))
    assert run.accelerator.mixed_precision == "bf16" and run.rollout.trainer_pass
    assert all(math.isfinite(v) for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
    mask = ro.masks.response
    # π_old from the trainer's pass (under the same autocast as the update): the first ratio is 1
    assert metrics["val/first_ratio"] == pytest.approx(1.0, abs=1e-3)
    # the sampler's log-probs are kept and differ from the trainer's by bf16 rounding, which is reported
    gap = (ro.sampler_log_prob - ro.sample_log_prob).abs()[mask]
    assert 0 < gap.max() < 0.5
    assert "objective/sample_train_kl" in metrics and metrics["objective/sample_train_kl_k2"] > 0
    if ro.ref_log_prob is not None:  # the reference is the initial policy, scored the same way: KL 0
        assert torch.equal(ro.ref_log_prob[mask], ro.sample_log_prob[mask])


def test_mixed_precision_is_the_older_name(tiny_cfg, caplog):
    from rlhf_train.loop.build import decide

    with caplog.at_level(logging.INFO, logger="rlhf_train.loop.precision"):
        assert decide(tiny_cfg("trainer.mixed_precision=no")).precision == "fp32"
    assert "trainer.mixed_precision=no is read as trainer.precision=fp32" in caplog.text
    assert decide(tiny_cfg("trainer.precision=bf16")).precision == "bf16"
    assert decide(tiny_cfg()).precision is None  # accelerate launch's, else fp32


def test_fp16_on_a_cpu_is_one_line_before_any_model(tiny_cfg, monkeypatch):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.trainer import train
    from rlhf_train.models import policy

    monkeypatch.setattr(policy, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=r"trainer\.precision=fp16 needs a GPU .* use trainer\.precision=bf16"):
        train(tiny_cfg("trainer.precision=fp16", "trainer.cpu=true"))


@pytest.mark.parametrize("algorithm", [(), GRPO], ids=["ppo", "grpo"])
def test_is_correction_runs_the_trainer_pass(tiny_cfg, algorithm):
    run, metrics, ro = _one_step(tiny_cfg("algorithm.is_correction.level=token", *PPO_FAST, *algorithm))
    assert run.rollout.trainer_pass and run.algorithm.corrects_mismatch
    mask = ro.masks.response
    torch.testing.assert_close(ro.sampler_log_prob[mask], ro.sample_log_prob[mask], atol=1e-5, rtol=0)
    assert metrics["objective/is_filtered_frac"] == 0.0  # fp32: every weight is 1 to rounding, inside [0, 2]
