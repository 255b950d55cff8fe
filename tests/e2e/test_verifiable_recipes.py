"""The verifiable-reward recipes (docs/verifiable-rewards.md), offline and fast.

1. ``+recipe=arithmetic_grpo`` selects SmolLM2 + LoRA, GRPO, the answer check and a held-out evaluation of >= 200
   prompts whose facts are never trained on; a tiny chat Llama stands in for SmolLM2 (minutes per run on a CPU)
   through the same recipe, which then runs end to end: RL stage, before / after evaluation with accuracy sampled
   and greedy, summary.json and report.md with 10 samples.
2. ``+recipe=gsm8k_grpo`` composes with the real hub names; without the hub it stops at start with one ``Error:``
   line naming the override for a local copy (``policy.pretrained=``; with a local policy, ``data.dataset=``); a
   local copy of GSM8K's rows is read, the answer after ``####`` extracted.

Budget: ~30 s on 2 quiet cores.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import zygote
from tests.unit.pipeline.test_run import compose

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_chat_llama(tmp_path_factory) -> Path:
    from tests.helpers.arithmetic import tiny_chat_llama

    return tiny_chat_llama(tmp_path_factory.mktemp("tiny_chat_llama"))


def test_arithmetic_recipe_selects_the_verifiable_path():
    cfg = compose("+recipe=arithmetic_grpo")
    assert cfg.stage == "pipeline" and cfg.get("sft") is None and cfg.get("rm") is None
    assert cfg.policy.pretrained.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and cfg.policy.lora.r > 0
    assert cfg.reward_model._target_ is None and cfg.algorithm.name == "grpo" and cfg.rollout.num_samples >= 2
    assert cfg.rewards.correct._target_ == "rlhf_train.rewards.functions.final_answer_match"
    assert cfg.data._target_.endswith("arithmetic_prompts") and (cfg.data.split, cfg.evaluation.split) == ("train", "test")
    assert cfg.evaluation.num_prompts >= 200 and cfg.evaluation.greedy and not cfg.evaluation.judge
    assert cfg.evaluation.num_samples_shown >= 10


@pytest.mark.slow
def test_tiny_stand_in_runs_the_arithmetic_recipe(tiny_chat_llama, tmp_path):
    from rlhf_train.pipeline.run import run

    cfg = compose("+recipe=arithmetic_grpo", f"policy.pretrained={tiny_chat_llama}", "policy.lora.r=4",
                  f"cache_dir={tmp_path / 'cache'}", "logger=none", "trainer.progress_bar=false",
                  "trainer.num_threads=1", "trainer.num_iterations=2", "data.batch_size=2", "rollout.num_samples=4",
                  "update.minibatch_size=4", "rollout.max_new_tokens=4", "evaluation.num_prompts=12",
                  "evaluation.batch_size=12")
    value = run(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward_sources"] == ["correct"] and summary["num_prompts"] == 12 and summary["rl_iterations"] == 2
    for key in ("eval/sampled/correct/accuracy", "eval/greedy/correct/accuracy", "eval/sampled/completion_length"):
        assert 0.0 <= summary["eval_before"][key] and 0.0 <= summary["eval_after"][key], key
    assert value == summary["reward_after"] and summary["sft"] == {"from": str(tiny_chat_llama)}
    assert {"prompt", "before", "after"} <= set(summary["samples"][0]) and len(summary["samples"]) == 10
    report = (tmp_path / "run" / "report.md").read_text()
    assert report.count("- *before*") == 10 and "correct" in report
    assert not list((tmp_path / "cache" / "stages").glob("rm-*"))  # no reward-model stage


def test_gsm8k_recipe_composes_with_the_hub_names():
    cfg = compose("+recipe=gsm8k_grpo")
    assert cfg.policy.pretrained == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.data.dataset == "openai/gsm8k"
    assert cfg.algorithm.name == "grpo" and cfg.rollout.num_samples >= 2 and cfg.policy.lora.r > 0
    assert cfg.rewards.correct._target_ == "rlhf_train.rewards.functions.final_answer_match"
    assert (cfg.data.split, cfg.evaluation.split) == ("train", "test") and cfg.evaluation.num_prompts == 1319


def _offline(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "RLHF_TRAIN_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    return zygote.run(["+recipe=gsm8k_grpo", *overrides,
                       f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                      timeout=300)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def test_gsm8k_offline_fails_at_start_with_one_line(tmp_path):
    error = _one_error(_offline(tmp_path))
    assert "Qwen/Qwen2.5-0.5B-Instruct" in error and "policy.pretrained=" in error
    assert not (tmp_path / "cache" / "stages").exists()  # nothing started


def test_gsm8k_offline_with_a_local_policy_names_the_data_override(tiny_chat_llama, tmp_path):
    error = _one_error(_offline(tmp_path, f"policy.pretrained={tiny_chat_llama}"))
    assert "openai/gsm8k" in error and "data.dataset=DIR" in error and "'main'" in error
    assert not (tmp_path / "cache" / "stages").exists()


def test_gsm8k_rows_from_a_local_copy(tmp_path):
    import datasets

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.tasks.gsm8k.prompts import final_number, gsm8k_prompts
    from tests.helpers.arithmetic import chat_tokenizer

    assert final_number("5 + 7 = <<5+7=12>>12 apples.\n#### 12") == "12"
    assert final_number("... #### 1,000") == "1000" and final_number("#### -3") == "-3"
    assert final_number("no final line") is None
    rows = {"question": ["Tom has 5 apples and gets 7 more. How many?", "What is 10 times 100?"],
            "answer": ["5 + 7 = 12\n#### 12", "10 * 100 = 1000\n#### 1,000"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "gsm8k"))
    tok = chat_tokenizer(tmp_path / "tok")
    ds = gsm8k_prompts(tok, dataset=str(tmp_path / "gsm8k"), split="test", system_prompt="Think.")
    assert [ds[i]["columns"]["answer"] for i in range(2)] == ["12", "1000"]
    assert ds.text[0] == f"<|system|>Think.<|user|>{rows['question'][0]}<|assistant|>"
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                 for q, a in zip(rows["question"], rows["answer"])))
    assert len(gsm8k_prompts(tok, dataset=str(tmp_path / "rows.jsonl"), split="train")) == 2
    with pytest.raises(ConfigError, match="has no splits"):
        gsm8k_prompts(tok, dataset=str(tmp_path / "rows.jsonl"), split="test")
