"""Episodes with every algorithm, LoRA and the export (+recipe=guess_number with a tiny Llama and a ChatML
template): PPO (its value head read at the policy's own tokens only, GAE stepping over the environment's),
RLOO, REINFORCE++ and its baseline variant train through the trainer with the environment's tokens out of the
advantages and the loss; GRPO with a LoRA adapter (the reference: the adapter off) trains only the adapter; the run
exports a plain Hugging Face model dir whose chat template and weights are the trained policy's.

Budget: ~25 s on 2 cores (one iteration per algorithm, tiny model).
"""
from __future__ import annotations

import math

import pytest
import torch

from rlhf_train.algorithms.update import policy_forward
from rlhf_train.loop.build import build_run
from rlhf_train.loop.state import TrainState
from rlhf_train.loop.trainer import step, train
from rlhf_train.rollout.multi_turn import MultiTurnRollout
from tests.helpers.config import compose
from tests.helpers.envs import chatml_tokenizer, save_eos_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_eos_llama(tmp_path_factory.mktemp("model") / "policy", chatml_tokenizer(), favour=("1", "2", "3", "4", "5"))


def recipe(tiny, *more):
    """``+recipe=guess_number`` at a tiny size: games of 4 numbers (1-4 or 2-5; the model favours those digits), 2
    games x 2 episodes per iteration."""
    return compose(["+recipe=guess_number", "policy=pretrained", f"policy.pretrained={tiny}", "policy.lora.r=0",
                    "data.max_prompts=8", "data.batch_size=2", "data.size=4", "data.offset=1", "rollout.num_samples=2",
                    "rollout.max_new_tokens=6", "update.minibatch_size=4", "evaluation.num_prompts=4",
                    "evaluation.batch_size=4", "logger=csv", "trainer.progress_bar=false", "trainer.num_iterations=1",
                    *more])


@pytest.mark.parametrize("algorithm", ["ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_algorithm_trains_on_episodes_and_ignores_the_environment_tokens(tiny, algorithm):
    cfg = recipe(tiny, f"algorithm={algorithm}", "algorithm.beta=0", "policy.value_head_init_std=0.1",  # KL: reward
                 "evaluation.enabled=false")
    run = build_run(cfg)
    assert isinstance(run.rollout, MultiTurnRollout) and run.algorithm.needs_critic == (algorithm == "ppo")
    state = TrainState.fresh(run.kl_controller, 0, 0, 3)
    found = False
    for batch in run.loader:  # until a batch whose episodes went past their first turn
        metrics, ro = step(run, state, batch)
        env_tokens = ro.masks.response & ~ro.masks.assistant
        if env_tokens.any():
            found = True
            break
    assert found
    assert not ro.advantage[env_tokens].any() and not ro.kl[env_tokens].any()
    assert ro.advantage[ro.masks.assistant].abs().sum() > 0
    assert all(math.isfinite(float(v)) for k, v in metrics.items() if k.startswith(("loss/", "objective/")))
    if algorithm == "ppo":  # values at the policy's tokens only; the returns as well
        assert not ro.values[env_tokens].any() and ro.values[ro.masks.assistant].abs().sum() > 0
        assert not ro.returns[env_tokens].any()
    out = policy_forward(run.policy, ro, run.decisions.sampling, with_entropy=False)
    out.log_probs.retain_grad()
    run.algorithm.loss(out, ro)[0].backward()
    assert not out.log_probs.grad[env_tokens].any() and out.log_probs.grad[ro.masks.assistant].abs().sum() > 0


def test_lora_on_episodes_trains_the_adapter_and_exports_the_trained_policy(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = train(recipe(tiny, "policy.lora.r=4", "trainer.num_iterations=2", "optimizer.lr=1e-2"), tmp_path)
    policy, run = out["policy"], out["run"]
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert run.rollout.reference.kind == "adapter_off"
    assert "eval/greedy/env/accuracy" in out["metrics"] and "eval/greedy/env/turns" in out["metrics"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert tok.chat_template == run.tokenizer.chat_template
    episode = run.rollout.episodes[0]
    ids = torch.tensor([episode.prompt + episode.response])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, policy.lm(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tiny)
        assert not torch.allclose(base(input_ids=ids).logits, exported(input_ids=ids).logits)  # the adapter merged
