"""The embedded default (``python -m rlhf_train`` = ``+recipe=default``, recipes/default.md), offline and fast.

SmolLM2-135M-Instruct takes minutes per run on a CPU, so a tiny random Llama (built from config, with the
small byte-level BPE as its tokenizer) stands in for it through the same recipe: policy from a
pretrained dir (no SFT stage), the policy's own tokenizer, LoRA, GRPO, the MiniLM reward model stage, the
judge, and the evaluation's outputs: summary.json (>= 20 before/after samples, the fluency measures and
their bound), rl_curves.png and report.md (table, plot, 10 samples). Budget: ~20 s on 2 quiet cores.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.pipeline.test_run import compose

RECIPE = "+recipe=default"


def test_recipe_selects_the_real_model_and_no_sft():
    cfg = compose(RECIPE)
    assert cfg.stage == "pipeline" and cfg.get("sft") is None
    assert cfg.policy.pretrained.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and cfg.policy.lora.r == 16
    assert cfg.tokenizer.pretrained is None  # follows the policy: SmolLM2's own tokenizer
    assert cfg.algorithm.name == "grpo" and cfg.rollout.num_samples >= 2
    assert cfg.data.sentiment == "negative" and cfg.evaluation.split != cfg.data.split
    assert cfg.evaluation.num_prompts >= 256 and cfg.evaluation.num_samples_shown >= 20


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A 1-layer width-32 Llama with a byte-level BPE of 512 tokens trained on 400 reviews."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_train.data.tokenizers import validate_tokenizer
    from rlhf_train.tasks.movie_reviews.bpe import train_tokenizer
    from rlhf_train.tasks.movie_reviews.data import load_reviews

    cache = tmp_path_factory.mktemp("real_cache")
    tok = validate_tokenizer(train_tokenizer([r.text for r in load_reviews("imdb")[:400]], vocab_size=512,
                                             cache_dir=str(cache)), "tokenizer")
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), num_hidden_layers=1, hidden_size=32,
                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                               max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = cache / "tiny_llama"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_tiny_stand_in_runs_the_recipe_and_reports(tiny_llama, tmp_path):
    from rlhf_train.pipeline.run import run

    cfg = compose(RECIPE, f"policy.pretrained={tiny_llama}", "policy.lora.r=4", f"cache_dir={tmp_path / 'cache'}",
                  "logger=none", "trainer.progress_bar=false", "trainer.num_threads=1", "trainer.num_iterations=2",
                  "data.batch_size=4", "data.max_prompts=64", "rollout.max_new_tokens=6",
                  "update.minibatch_size=8", "rm.max_train_pairs=64", "rm.max_eval_pairs=32", "rm.max_steps=5",
                  "rm.eval_every=5", "evaluation.num_prompts=24", "evaluation.batch_size=24")
    run_dir = tmp_path / "run"
    value = run(cfg, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("reward_before", "reward_after", "judge_positive_rate_before", "judge_positive_rate_after",
                "kl_per_sequence", "fluency_logprob_before", "fluency_logprob_after", "repetition_rate_before",
                "repetition_rate_after", "fluency_max_drop", "fluency_within_bound", "timings", "samples"):
        assert key in summary, key
    assert value == summary["judge_positive_rate_after"] and summary["num_prompts"] == 24
    assert abs(summary["kl_per_sequence_before"]) < 1e-4 and summary["sft"] == {"from": str(tiny_llama)}
    assert summary["fluency_logprob_before"] < 0 and 0 <= summary["repetition_rate_after"] <= 1
    assert len(summary["samples"]) == 20
    assert {"prompt", "before", "after", "reward_before", "reward_after", "judge_prob_before",
            "judge_prob_after"} <= set(summary["samples"][0])
    assert (run_dir / "rl_curves.png").stat().st_size > 0
    report = (run_dir / "report.md").read_text()
    assert "## Before / after" in report and "![reward and KL](rl_curves.png)" in report
    assert summary["algorithm"] == "GRPO" and "| GRPO |" in report and "2 GRPO iterations" in report
    assert "before (initial)" in report and "after (GRPO)" in report and "KL per sequence vs initial" in report
    assert "judge positive rate (continuation)" in report and "log-lik./token under initial model" in report
    assert report.count("**[") == 10 and report.count("- *before*") == 10 and report.count("- *after*") == 10
    assert " ".join(summary["samples"][0]["prompt"].split()).replace("|", "\\|") in report


def test_repetition_rate_by_hand():
    from rlhf_train.pipeline.evaluate import repetition_rate

    # "a b c a b c": 3-grams abc bca cab abc -> 1 of 4 repeats; "x y": no 3-gram (left out of the mean)
    assert repetition_rate(["a b c a b c", "x y"]) == pytest.approx(0.25)
    assert repetition_rate(["great great great great great"]) == pytest.approx(2 / 3)  # 3 grams, 1 distinct
    assert repetition_rate([]) == 0.0


def test_negative_openings_only(tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.tasks.movie_reviews.bpe import train_tokenizer
    from rlhf_train.tasks.movie_reviews.data import load_reviews, split_reviews
    from rlhf_train.tasks.movie_reviews.prompts import movie_review_prompts

    tok = train_tokenizer([r.text for r in load_reviews("imdb")[:400]], vocab_size=512, cache_dir=str(tmp_path))
    neg = movie_review_prompts(tok, split="validation", sentiment="negative")
    val = split_reviews(load_reviews("imdb"), seed=0)["validation"]
    assert len(neg) == sum(int(r.label) == 0 for r in val)
    with pytest.raises(ConfigError, match="data.sentiment='mixed'"):
        movie_review_prompts(tok, split="validation", sentiment="mixed")


def test_bad_sentiment_fails_before_any_stage(tiny_llama, tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.pipeline.run import run

    cfg = compose(RECIPE, f"policy.pretrained={tiny_llama}", f"cache_dir={tmp_path / 'cache'}", "logger=none",
                  "data.sentiment=mixed")
    with pytest.raises(ConfigError, match=r"data.sentiment='mixed' is not valid; choose one of all, negative, positive"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "cache" / "stages").exists()  # no stage started
