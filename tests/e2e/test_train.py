"""End to end, in process: ``rlhf_train.loop.trainer.train`` on the smoke recipe, and training that works.

1. The smoke recipe (tiny random policy and reward model, movie-review prompts) runs 2 iterations with
   the CSV logger: two rows of finite, namespaced metrics, a first PPO ratio of 1, checkpoints.
2. Training moves the reward: a tiny policy over a 32-token vocabulary and a reward model that pays
   the fraction of response tokens equal to one token id (about 1/32 at the start). 16 PPO
   iterations must raise the mean score several-fold (measured: 0.03 over the first 4 iterations,
   0.86 over the last 4; ~1.0 by iteration 20). Everything else is the trainer as configured;
   only ``tokenizer._target_`` and ``reward_model._target_`` point at the stand-ins below.

Budget: ~15 s on 2 quiet CPU cores (2-iteration smoke ~6 s, 16-iteration run ~8 s).
"""
import csv
import math
from pathlib import Path

import pytest
import torch
from torch import nn

CONF = str(Path(__file__).resolve().parents[2] / "conf")
TARGET_ID = 7          # the token the stand-in reward model pays for
RESPONSE_TOKENS = 8    # rollout.max_new_tokens of the learning test


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_train.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


# --------------------------------------------------------------------------- stand-ins (config _target_s)
def tiny_tokenizer(**_):
    """A 32-token word-level tokenizer: EOS ``<|endoftext|>`` = 0, pad ``<|pad|>`` = 1, words w2 … w31."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{f"w{i}": i for i in range(2, 32)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


class TokenCountRewardModel(nn.Module):
    """End score = fraction of the last ``RESPONSE_TOKENS`` attended positions holding ``TARGET_ID``
    (the response: prompt + response is what the rollout scores). Same interface as RewardModel."""

    def __init__(self, **_):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()), requires_grad=False)  # gives the module a device

    def forward(self, input_ids, attention_mask):
        hit = ((input_ids == TARGET_ID) & attention_mask.bool()).float()
        rewards = hit + self.anchor
        return rewards, hit[:, -RESPONSE_TOKENS:].sum(-1) / RESPONSE_TOKENS


# --------------------------------------------------------------------------- 1. the smoke recipe
def test_smoke_recipe_two_iterations(tmp_path):
    from rlhf_train.loop.trainer import train

    cfg = compose(["+recipe=smoke", "logger=csv", "trainer.progress_bar=false"])
    out = train(cfg, tmp_path)
    assert [h["iteration"] for h in out["history"]] == [1, 2]

    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    names = set(rows[0]) - {"iteration"}
    namespaces = {"objective", "policy", "loss", "val", "response", "completions", "reward", "update", "faults", "time"}
    assert all(n.split("/")[0] in namespaces or n == "lr" for n in names), names
    for key in ("objective/score", "objective/kl", "objective/kl_coef", "objective/reward_total", "loss/policy",
                "loss/value", "policy/entropy", "policy/clipfrac", "val/ratio", "val/first_ratio", "response/length"):
        assert key in names, key
    for row in rows:
        values = {k: float(v) for k, v in row.items() if v not in ("", None)}
        assert all(math.isfinite(v) for v in values.values()), values
        assert abs(values["val/first_ratio"] - 1.0) < 1e-5  # log-probs of the sampling distribution
        assert 0 < values["response/length"] <= cfg.rollout.max_new_tokens
    # the KL coefficient logged is the one the rollout used, the controller's
    assert float(rows[0]["objective/kl_coef"]) == pytest.approx(cfg.kl_controller.init_kl_coef, rel=1e-6)
    assert float(rows[1]["objective/kl_coef"]) == float(rows[0]["objective/kl_coef_next"])
    # one copy of the coefficient: the loop's controller; the rollout holds none (β comes with each call)
    assert float(rows[-1]["objective/kl_coef_next"]) == pytest.approx(out["run"].kl_controller.coef, rel=1e-6)
    assert not any("kl" in name for name in vars(out["rollout"]))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("iter_"))[-1] == "iter_000002"


# --------------------------------------------------------------------------- 2. training moves the reward
def test_training_raises_the_reward(tmp_path):
    from rlhf_train.loop.trainer import train

    cfg = compose([
        "+recipe=smoke", "logger=none", "trainer.progress_bar=false",
        f"tokenizer._target_={__name__}.tiny_tokenizer",
        f"reward_model._target_={__name__}.TokenCountRewardModel",
        "data=synthetic", "data.batch_size=16", "data.min_prompt_tokens=2", "data.max_prompt_tokens=4",
        "data.max_prompts=256",
        "policy.config.n_layer=1", "policy.config.n_embd=32",
        f"rollout.max_new_tokens={RESPONSE_TOKENS}",
        "update.num_epochs=2", "update.minibatch_size=8", "optimizer.lr=3e-3",
        "kl_controller.init_kl_coef=0.01",
        "trainer.num_iterations=16", "trainer.checkpoint_every=1000", "trainer.samples_every=1000",
        "trainer.seed=0",
    ])
    history = train(cfg, tmp_path)["history"]
    score = torch.tensor([h["objective/score"] for h in history])
    first, last = score[:4].mean().item(), score[-4:].mean().item()
    assert first < 0.15  # about 1/32 per token at the start
    assert last > first + 0.3 and last > 3 * first, score.tolist()  # measured: 0.03 → 0.86
    assert all(abs(h["val/first_ratio"] - 1.0) < 1e-5 for h in history)
