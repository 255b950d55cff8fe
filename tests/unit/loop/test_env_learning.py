"""GRPO learns a task that only multi-turn information solves (tests/helpers/envs.py ``Secret``), with a tiny Llama
in seconds: whatever the policy says first, the environment then tells it a secret digit (3 or 7); the second turn
wins when it starts with that digit. The held-out games are half 3, half 7, so a policy that ignores the
conversation wins at most half of them (greedy: 0 or 1/2); the trained policy's greedy episodes win every one.

The model (``save_eos_llama``): random weights whose LM head favours EOS (turns end within a few tokens) and the two
digits (the first guesses are digits now and then), the digits' input embeddings told apart; the secret is said
8 times in its message (a louder signal for a one-layer model). GRPO (beta 0.05: the KL to the initial model keeps
it from collapsing to one digit before it reads the secret), a turn cut without EOS scores 0
(``env.truncated_reward``).

Budget: ~15 s of CPU, under a minute on 2 loaded cores (40 iterations of 64 episodes; the held-out evaluation
every 10).
"""
from __future__ import annotations

import csv
import json

from rlhf_train.loop.trainer import train
from tests.helpers.envs import chatml_tokenizer, save_eos_llama
from tests.helpers.reliability import make_cfg


def test_grpo_learns_to_use_what_an_earlier_turn_said(tmp_path):
    model = save_eos_llama(tmp_path / "policy", chatml_tokenizer(), eos_logit=6.0, favour=("3", "7"), favour_logit=5.0,
                           favour_embedding=1.0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "secret": "37"[i % 2]})
                            + "\n" for i in range(80)))
    cfg = make_cfg("policy=pretrained", f"policy.pretrained={model}", "tokenizer=pretrained", "tokenizer.pretrained=null",
                   "reward_model=none", "data=prompts", f"data.dataset={data}", "data.eval_holdout=16",
                   "data.max_prompts=null", "data.batch_size=8", "rollout.num_samples=8", "rollout.max_new_tokens=8",
                   "env._target_=tests.helpers.envs.Secret", "+env.kwargs.repeat=8", "env.max_turns=2",
                   "env.max_tokens=64", "env.truncated_reward=0.0", "algorithm=grpo", "algorithm.beta=0.05",
                   "update.minibatch_size=64", "update.num_epochs=1", "optimizer.lr=1e-2", "trainer.num_iterations=40",
                   "trainer.checkpoint_every=100", "evaluation=verifiable", "evaluation.split=test",
                   "evaluation.num_prompts=16", "evaluation.batch_size=16", "evaluation.num_samples=4",
                   "evaluation.greedy=true", "evaluation.every=10")
    train(cfg, tmp_path / "run")
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r["eval/greedy/env/accuracy"]]
    greedy = [float(r["eval/greedy/env/accuracy"]) for r in rows]
    sampled = [float(r["eval/sampled/env/accuracy"]) for r in rows]
    assert [r["iteration"] for r in rows] == ["0", "10", "20", "30", "40"]
    assert greedy[0] <= 0.5 and sampled[0] < 0.25, (greedy, sampled)  # before: as good as ignoring the secret, or worse
    # after: greedy wins every held-out game, which no policy that ignores the conversation can (at most half)
    assert max(greedy[1:]) == 1.0, (greedy, sampled)
    assert max(sampled[1:]) >= 0.75, (greedy, sampled)  # 64 sampled episodes: 4 s.e. above 0.5
