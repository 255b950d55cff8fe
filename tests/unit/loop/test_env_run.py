"""GRPO through the trainer on a scripted 2-turn environment (``env._target_``) with a tiny Llama: the run is built
from the config (MultiTurnRollout, the environment's reward as the ``env`` source), trains for a few iterations,
logs the ``env/...`` metrics and whole episodes in the samples, and its KL, advantages and loss leave the
environment's tokens out."""
from __future__ import annotations

import csv
import json
import math

import torch

from rlhf_train.algorithms.update import policy_forward
from rlhf_train.loop.build import build_run
from rlhf_train.loop.state import TrainState
from rlhf_train.loop.trainer import step, train
from rlhf_train.rollout.multi_turn import MultiTurnRollout
from tests.helpers.envs import chatml_tokenizer, save_eos_llama
from tests.helpers.reliability import make_cfg

ENV_METRICS = {"env/turns", "env/tool_calls", "env/tool_errors", "env/truncated_episodes", "env/template_drift"}


def env_cfg(tmp_path, *more):
    model = save_eos_llama(tmp_path / "policy", chatml_tokenizer())
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Guess the number {i}."}],
                                        "answer": i}) + "\n" for i in range(8)))
    return make_cfg("policy=pretrained", f"policy.pretrained={model}", "tokenizer=pretrained",
                    "tokenizer.pretrained=null", "reward_model=none", "data=prompts", f"data.dataset={data}",
                    "data.batch_size=2", "data.eval_holdout=0", "algorithm=grpo", "algorithm.beta=0.05",
                    "rollout.num_samples=2", "rollout.max_new_tokens=12", "env._target_=tests.helpers.envs.Scripted",
                    "+env.kwargs.turns=2", "+env.kwargs.vary=true", "env.max_tokens=80", "trainer.num_iterations=3", *more)


def test_grpo_on_a_two_turn_environment_ignores_the_environment_tokens(tmp_path):
    cfg = env_cfg(tmp_path)
    run = build_run(cfg)
    assert isinstance(run.rollout, MultiTurnRollout) and set(run.rollout.reward_sources) == {"env"}
    state = TrainState.fresh(run.kl_controller, 0, 0, 3)
    batch = next(iter(run.loader))
    metrics, ro = step(run, state, batch)
    env_tokens = ro.masks.response & ~ro.masks.assistant
    assert env_tokens.any() and metrics["env/turns"] > 1  # some episodes went past their first turn
    assert not ro.kl[env_tokens].any() and not ro.advantage[env_tokens].any()
    assert not ro.sample_log_prob[env_tokens].any() and not ro.ref_log_prob[env_tokens].any()
    assert ENV_METRICS <= set(metrics) and all(math.isfinite(float(metrics[k])) for k in metrics if k != "lr")
    assert math.isfinite(float(metrics["loss/policy"])) and math.isfinite(float(metrics["loss/kl"]))
    # the run's own loss (surrogate + β·k3 KL) has no gradient at the environment's tokens
    out = policy_forward(run.policy, ro, run.decisions.sampling, with_entropy=False)
    out.log_probs.retain_grad()
    run.algorithm.loss(out, ro)[0].backward()
    assert not out.log_probs.grad[env_tokens].any() and out.log_probs.grad[ro.masks.assistant].abs().sum() > 0


def test_train_logs_env_metrics_and_whole_episodes(tmp_path):
    cfg = env_cfg(tmp_path, "logger=csv", "trainer.samples_every=1")
    out = train(cfg, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and ENV_METRICS | {"reward/env/accuracy"} <= set(rows[0])
    losses = [float(r["loss/policy"]) for r in rows if r.get("loss/policy")]  # (an update with no signal logs none)
    assert losses and all(math.isfinite(x) for x in losses)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and samples[0]["episode"].startswith("[user] Guess the number between 1 and 10.")
    assert "[assistant]" in samples[0]["episode"]
    assert torch.isfinite(torch.tensor(out["metrics"]["objective/score"]))
