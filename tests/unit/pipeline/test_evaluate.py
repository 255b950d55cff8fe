"""The pipeline's evaluation of verifiable rewards (rlhf_train/pipeline/evaluate.py, run.py, plan.py):

1. a shrunken pipeline with no reward model (``reward_model=none``: a reward function scores) runs SFT -> RL ->
   evaluation, skipping the reward-model stage; summary.json holds the ``eval/...`` metrics before and after
   (sampled and greedy: accuracy, pass@k, mean@k, completion length), consistent with the score, and report.md's
   table has their rows;
2. the RL stage evaluates during training only with ``evaluation.every`` > 0, and its cache key follows the
   reward functions and that evaluation;
3. the table's rows from a hand-made summary.

Budget: ~30 s on 2 cores (test 1).
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.config import compose

VOWEL = "tests.unit.loop.test_evaluation.vowel_start"  # 1 when the completion starts with a vowel
TINY = [
    "+recipe=sentiment_scratch", "policy=tiny_gpt2", "logger=none", "trainer.progress_bar=false",
    "trainer.num_threads=1", "sft.max_train_examples=200", "sft.max_eval_examples=32", "sft.max_steps=10",
    "sft.eval_every=10", "sft.batch_size=16", "sft.warmup_steps=2", "sft.max_len=32",
    "reward_model=none", f"+rewards.vowel._target_={VOWEL}", "data.prompt_baseline=false", "algorithm=grpo",
    "rollout.num_samples=2", "data.batch_size=8", "data.max_prompts=64", "rollout.max_new_tokens=6",
    "update.minibatch_size=8", "update.num_epochs=1", "trainer.num_iterations=3",
    "evaluation=verifiable", "evaluation.split=validation", "evaluation.num_prompts=12", "evaluation.batch_size=6",
    "evaluation.num_samples=4", "evaluation.pass_k=[1,2,4]", "evaluation.num_samples_shown=2",
]


@pytest.mark.slow
def test_pipeline_without_reward_model_reports_held_out_accuracy(tmp_path):
    from rlhf_train.pipeline.run import run

    cfg = compose([*TINY, f"cache_dir={tmp_path / 'cache'}"])
    run(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "rm" not in summary["timings"] and summary["stage_dirs"]["rm"] is None  # no reward-model stage
    assert summary["reward_sources"] == ["vowel"] and summary["num_samples"] == 4 and summary["num_prompts"] == 12
    for when in ("before", "after"):
        ev = summary[f"eval_{when}"]
        for key in ("sampled/vowel/accuracy", "sampled/vowel/pass@1", "sampled/vowel/pass@2", "sampled/vowel/pass@4",
                    "sampled/vowel/mean@4", "sampled/completion_length", "greedy/vowel/accuracy",
                    "greedy/completion_length"):
            assert 0 <= ev[f"eval/{key}"] <= (6 if "length" in key else 1), (when, key)
        # one source of weight 1: the score is that source's mean; pass@1 is the accuracy, pass@k grows with k
        assert summary[f"reward_{when}"] == pytest.approx(ev["eval/sampled/vowel/mean"])
        assert ev["eval/sampled/vowel/pass@1"] == pytest.approx(ev["eval/sampled/vowel/accuracy"])
        assert ev["eval/sampled/vowel/pass@1"] <= ev["eval/sampled/vowel/pass@2"] <= ev["eval/sampled/vowel/pass@4"]
    report = (tmp_path / "run" / "report.md").read_text()
    for row in ("score (weighted sum of sources)", "vowel: accuracy (greedy)", "vowel: pass@4 (sampled)",
                "completion length (sampled)", "(4 per prompt)"):
        assert row in report, row
    assert len(summary["samples"]) == 2 and "score " in report


def test_rl_stage_evaluates_only_with_every_and_its_key_follows_the_rewards(tmp_path):
    from rlhf_train.pipeline.plan import make_plan, rl_config

    def plan(*extra):
        return make_plan(compose([*TINY, f"cache_dir={tmp_path}", *extra]))

    cfg = compose([*TINY, f"cache_dir={tmp_path}"])
    assert rl_config(cfg, "p", None).evaluation is None  # every=0: the evaluation stage does before / after
    assert rl_config(cfg, "p", None).reward_model.pretrained is None
    every = compose([*TINY, f"cache_dir={tmp_path}", "evaluation.every=2"])
    assert rl_config(every, "p", None).evaluation.every == 2
    base = plan()
    assert base["rm_key"] is None and base["run_rm"] is False  # no reward model: no RM stage
    assert plan("evaluation.num_samples=8")["rl_key"] == base["rl_key"]  # the stage's output does not depend on it
    assert plan("evaluation.every=2")["rl_key"] != base["rl_key"]        # it does: the RL stage's history
    assert plan("+rewards.vowel.weight=0.5")["rl_key"] != base["rl_key"]  # the reward functions


def test_table_rows_from_the_eval_metrics():
    from rlhf_train.pipeline.evaluate import format_table

    summary = {"reward_before": 0.25, "reward_after": 0.75, "kl_per_sequence_before": 0.0, "kl_per_sequence": 1.5,
               "num_prompts": 3, "eval_split": "test", "reward_sources": ["correct", "reward_model"],
               "eval_before": {"eval/sampled/completion_length": 7.0, "eval/sampled/correct/accuracy": 0.25,
                               "eval/sampled/correct/pass@4": 0.5, "eval/sampled/reward_model/mean": 0.1},
               "eval_after": {"eval/sampled/completion_length": 5.0, "eval/sampled/correct/accuracy": 0.75,
                              "eval/sampled/correct/pass@4": 1.0, "eval/sampled/reward_model/mean": 0.2}}
    lines = format_table(summary, "initial", "GRPO").splitlines()
    rows = {ln[:34].strip(): ln[34:].split() for ln in lines[1:]}
    assert rows["score (weighted sum of sources)"] == ["0.250", "0.750"]
    assert rows["correct: accuracy (sampled)"] == ["0.250", "0.750"]
    assert rows["correct: pass@4 (sampled)"] == ["0.500", "1.000"]
    assert rows["completion length (sampled)"] == ["7.000", "5.000"]
    assert not any(label.startswith("reward_model") for label in rows)  # its mean is in the score row already
