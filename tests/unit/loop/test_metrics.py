"""Per-iteration training metrics of verifiable rewards (rlhf_train/loop/metrics.py), on a hand-built Rollout:
``reward/<name>/accuracy``, ``completions/mean_length``, ``completions/clipped_ratio``,
``reward/frac_zero_std_groups``; and the warning for a reward source that scores every sample the same.

Budget: ~6 s on 2 quiet cores (one 3-iteration smoke run; the rest is arithmetic on small tensors).
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
from tensordict import TensorDict

NAN = float("nan")


def rollout(sources: dict, response_mask, terminated, reward_per_seq):
    """A Rollout of B rows, T = 3 response tokens; the per-sequence reward (and EOS) at each row's last token."""
    from rlhf_train.core.containers import Masks, Rollout

    mask = torch.tensor(response_mask, dtype=torch.bool)
    B, T = mask.shape
    last = (mask.sum(-1) - 1)[:, None]
    reward = torch.zeros(B, T).scatter(1, last, torch.tensor(reward_per_seq)[:, None])
    term = torch.zeros(B, T, dtype=torch.bool).scatter(1, last, torch.tensor(terminated)[:, None])
    zeros = torch.zeros(B, T)
    return Rollout(masks=Masks(prompt=mask, response=mask, full=torch.cat([mask, mask], 1), batch_size=[B]),
                   sample_log_prob=zeros, kl_per_sequence=torch.zeros(B), score_raw=torch.zeros(B),
                   reward_sources=TensorDict({k: torch.tensor(v) for k, v in sources.items()}, batch_size=[B]),
                   reward_raw=reward, reward_kl=zeros, reward=reward, terminated=term, batch_size=[B])


def test_accuracy_lengths_clipped_ratio_and_zero_std_groups_by_hand():
    from rlhf_train.loop.metrics import rollout_metrics

    ro = rollout({"answer": [1.0, 0.0, NAN, 1.0], "format": [1.0, 1.0, 1.0, 0.5], "rm": [0.3, 0.9, 2.0, -1.0]},
                 response_mask=[[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]],
                 terminated=[False, True, True, False],   # rows 0 and 3 hit max_new_tokens without EOS
                 reward_per_seq=[1.0, 0.0, 2.0, 2.0])      # groups of 2: (1, 0) varies, (2, 2) has zero std
    m = rollout_metrics(ro, group_size=2, accuracy={"answer": 1.0, "format": 0.75})
    assert m["reward/answer/accuracy"] == pytest.approx(2 / 4)  # 1, 1 correct; 0 wrong; None (NaN) not correct
    assert m["reward/format/accuracy"] == pytest.approx(3 / 4)  # threshold 0.75: 0.5 is not
    assert "reward/rm/accuracy" not in m                         # a reward model has no "correct"
    assert m["completions/mean_length"] == pytest.approx((3 + 1 + 2 + 3) / 4)
    assert m["completions/mean_length"] == m["response/length"]
    assert m["completions/clipped_ratio"] == pytest.approx(2 / 4)
    assert m["completions/clipped_ratio"] == pytest.approx(1 - float(m["response/eos_rate"]))
    assert m["reward/frac_zero_std_groups"] == pytest.approx(1 / 2)


def test_accuracy_is_for_every_source_but_the_reward_models():
    from rlhf_train.loop.metrics import accuracy_thresholds
    from rlhf_train.rewards.sources import FunctionRewardSource, RewardModelSource

    sources = {"rm": (RewardModelSource(torch.nn.Linear(1, 1)), 1.0),
               "answer": (FunctionRewardSource(lambda **_: [], None, "answer"), 1.0)}
    assert accuracy_thresholds(sources) == {"answer": 1.0}
    assert accuracy_thresholds(sources, 0.5) == {"answer": 0.5}


def test_a_constant_source_is_named_once_after_three_iterations():
    from rlhf_train.loop.metrics import ConstantSourceWatch

    watch = ConstantSourceWatch(3)
    batches = [{"fmt": [0.0, 0.0], "ans": [0.0, 1.0], "none": [NAN, NAN], "shifts": [0.0, 0.0], "part": [NAN, 1.0]},
               {"fmt": [0.0, 0.0], "ans": [0.0, 0.0], "none": [NAN, NAN], "shifts": [1.0, 1.0], "part": [1.0, 1.0]},
               {"fmt": [0.0, 0.0], "ans": [0.0, 0.0], "none": [NAN, NAN], "shifts": [1.0, 1.0], "part": [1.0, 1.0]}]
    lines = [watch.observe(TensorDict({k: torch.tensor(v) for k, v in b.items()}, batch_size=[2])) for b in batches]
    assert lines[:2] == [[], []]  # nothing before the third iteration
    assert lines[2] == [
        "reward source 'fmt' gave 0.0 to every sample for 3 iterations: check it (a format reward that never fires? "
        "a column it cannot read?)",
        "reward source 'none' gave None (no score) to every sample for 3 iterations: check it (a format reward that "
        "never fires? a column it cannot read?)"]
    again = TensorDict({"fmt": torch.zeros(2)}, batch_size=[2])
    assert watch.observe(again) == [] and watch.observe(again) == []  # once per source, only the first 3


def test_training_logs_accuracy_and_warns_about_a_format_reward_that_never_fires(tmp_path, caplog):
    """A tiny random policy never writes ``<think>...</think><answer>...</answer>``: the format reward scores 0
    for every sample; the run says so once, after 3 iterations, and logs each function's accuracy."""
    from rlhf_train.loop.trainer import train
    from tests.e2e.test_train import compose

    caplog.set_level(logging.WARNING, logger="rlhf_train.loop.trainer")
    out = train(compose(["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "trainer.num_threads=1",
                         f"cache_dir={tmp_path / 'cache'}", "trainer.checkpoint_every=100", "reward_model=none",
                         "trainer.num_iterations=4",
                         "+rewards.fmt._target_=rlhf_train.rewards.functions.think_answer_format",
                         "+rewards.len._target_=rlhf_train.rewards.functions.length_penalty", "+rewards.len.target=2"]),
                run_dir=tmp_path / "run")
    warned = [r.getMessage() for r in caplog.records if "to every sample" in r.getMessage()]
    assert warned == ["[rlhf_train] reward source 'fmt' gave 0.0 to every sample for 3 iterations: check it (a format "
                      "reward that never fires? a column it cannot read?)"]
    history = out["history"]
    assert [h["reward/fmt/accuracy"] for h in history] == [0.0] * 4
    assert all(not math.isnan(h["reward/len/accuracy"]) for h in history) and "completions/clipped_ratio" in history[0]
