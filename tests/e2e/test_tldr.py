"""The TL;DR recipes without the hub: tiny local stand-ins, and the offline failure.

1. ``+recipe=tldr_ppo`` composes and runs one PPO iteration (and the before/after evaluation) with a tiny
   GPT-2, the movie-review tokenizer, a tiny reward model and a 12-row dataset, all saved to local dirs
   and passed through the overrides a user sets offline.
2. ``+recipe=tldr_sft`` / ``tldr_rm`` run their stage on local stand-ins too (a few steps).
3. Without those overrides and without the hub, ``python -m rlhf_train +recipe=tldr_ppo`` fails at start
   with one ``Error:`` line naming the override to set (exit 2).

Budget: ~25 s on 2 quiet cores.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import zygote
from tests.unit.pipeline.test_run import compose

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Local dirs: tokenizer, tiny policy, tiny reward model, TL;DR-like and comparisons-like datasets."""
    import datasets
    import torch

    from rlhf_train.models.loading import build_causal_lm
    from rlhf_train.models.reward_model import RewardModel
    from rlhf_train.tasks.movie_reviews.tokenizer import movie_reviews_tokenizer

    root = tmp_path_factory.mktemp("tldr")
    tok = movie_reviews_tokenizer(cache_dir=None)
    tok.save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    tiny = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 128}
    build_causal_lm(None, tiny, tok).save_pretrained(root / "policy")
    trunk = build_causal_lm(None, tiny, tok).base_model
    RewardModel(trunk, trunk.config.hidden_size).save_pretrained(str(root / "rm"))
    posts = [f"SUBREDDIT: r/movies TITLE: film number {i} POST: I watched a film and it was {w}. TL;DR:"
             for i, w in enumerate(["good", "bad", "long", "short"] * 3)]
    datasets.Dataset.from_dict({"prompt": posts, "label": [" a film I saw" for _ in posts]}).save_to_disk(
        str(root / "tldr"))
    datasets.Dataset.from_dict({
        "prompt": posts, "chosen": ["TL;DR: the film was fine and I liked it"] * 12,
        "rejected": ["TL;DR: some words about nothing at all here"] * 12}).save_to_disk(str(root / "comparisons"))
    return root


def local(root: Path) -> list[str]:
    return [f"tokenizer.pretrained={root / 'tokenizer'}", f"data.dataset={root / 'tldr'}", "logger=none",
            "trainer.progress_bar=false", "trainer.num_threads=1", f"cache_dir={root / 'cache'}"]


def test_tldr_ppo_runs_one_iteration_with_local_stand_ins(stand_ins, tmp_path):
    from rlhf_train.pipeline.run import make_plan, run

    cfg = compose("+recipe=tldr_ppo", *local(stand_ins), f"policy.pretrained={stand_ins / 'policy'}",
                  f"reward_model.pretrained={stand_ins / 'rm'}", "trainer.num_iterations=1", "data.batch_size=4",
                  "update.minibatch_size=2", "rollout.max_new_tokens=8", "data.max_prompt_length=48",
                  "evaluation.num_prompts=4", "evaluation.batch_size=4")
    # the recipe carries the TL;DR hyper-parameters
    assert (cfg.kl_controller.init_kl_coef, cfg.kl_controller.target, cfg.kl_controller.horizon) == (0.1, 6.0, 10000)
    assert (cfg.rollout.score_clip, cfg.policy.dropout) == (10.0, 0.0)
    plan = make_plan(cfg)
    assert plan["sft_key"] is None and plan["rm_key"] is None  # explicit dirs: no SFT / RM stage
    run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rl_iterations"] == 1 and summary["num_prompts"] == 4 and summary["algorithm"] == "PPO"
    assert "judge_positive_rate_after" not in summary  # no sentiment judge for summaries
    assert (tmp_path / "metrics.csv").exists() or (tmp_path / "final_metrics.json").exists()


def test_tldr_sft_and_rm_stages_on_local_stand_ins(stand_ins, tmp_path):
    from rlhf_train.pipeline.run import run

    few = ["sft.max_steps=2", "sft.batch_size=4", "sft.max_len=48", "sft.eval_every=2", "sft.max_eval_examples=4",
           f"sft.init={stand_ins / 'policy'}", f"sft.dataset={stand_ins / 'tldr'}",
           f"rm.dataset={stand_ins / 'comparisons'}", "rm.max_steps=2", "rm.batch_size=4", "rm.max_len=48",
           "rm.eval_every=2", "rm.max_eval_pairs=4"]
    loss = run(compose("+recipe=tldr_sft", *local(stand_ins), *few), tmp_path / "sft")
    assert loss > 0
    acc = run(compose("+recipe=tldr_rm", *local(stand_ins), *few), tmp_path / "rm")
    summary = json.loads((tmp_path / "rm" / "rm_summary.json").read_text())
    assert 0.0 <= acc <= 1.0 and summary["timings"]["sft"]["reused"]  # tldr_rm reuses tldr_sft's stage


def test_tldr_offline_fails_at_start_with_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "RLHF_TRAIN_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    proc = zygote.run(["+recipe=tldr_ppo", f"hydra.run.dir={tmp_path / 'run'}"],
                      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "tokenizer.pretrained=" in errors[0]
    assert not (tmp_path / "cache" / "stages").exists()  # nothing started
