"""The held-out evaluation of an environment (rlhf_train/loop/evaluation.py with ``env``): episodes played on
held-out prompts, token in, token out, as in training.

1. by hand: a scripted model guesses 5, then 7, in three guess-the-number games (secrets 5, 7, 9; 2 turns): it wins
   the first at turn 1, the second at turn 2, loses the third: success (``eval/greedy/env/accuracy``) 2/3, turns
   5/3, one game truncated by env.max_turns; another reward source scores the whole episodes;
2. the RL loop with an environment and ``evaluation``: ``eval/<mode>/env/...`` at iteration 0 and the last, the
   training's metrics and weights those of a run without it (the evaluation's forked RNG);
3. ``env.truncated_reward``: an episode whose first turn is cut scores it (0: a loss) instead of nothing.

Budget: ~15 s on 2 cores.
"""
from __future__ import annotations

import csv
import math

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_train.envs.base import EnvSpec, EpisodeRewards
from rlhf_train.envs.guess_number import GuessNumber, first_messages
from rlhf_train.envs.prompts import episode_prompts
from rlhf_train.loop.evaluation import evaluate_held_out
from rlhf_train.rollout.episodes import EpisodePlayer
from tests.helpers.envs import ScriptedBackend, chatml_tokenizer, save_eos_llama
from tests.helpers.reliability import make_cfg


class ResponseTokens:
    """A reward source: the tokens after the first prompt (assistant and environment's)."""

    def __call__(self, seqs):
        return seqs.full_mask[:, seqs.prompt_len:].sum(-1).float()


def test_episodes_evaluated_by_hand():
    tok = chatml_tokenizer()
    rows = [{"low": 1, "high": 10, "secret": s} for s in (5, 7, 9)]
    prompts = episode_prompts(tok, rows, first_messages)
    spec = EnvSpec(GuessNumber, 2, 200, 1.0, "guess", truncated_reward=0.0)
    player = EpisodePlayer(spec, tok, (tok.eos_token_id,), tok.pad_token_id)
    sources = {"env": (EpisodeRewards(), 1.0), "tokens": (ResponseTokens(), 0.0)}
    e = OmegaConf.create({"batch_size": 3, "num_samples": 1, "seed": 0, "accuracy_threshold": 1.0, "pass_k": []})
    metrics, rows_out = evaluate_held_out({"greedy": ScriptedBackend(tok, ["5", "7"])}, sources, prompts, e,
                                          (tok.eos_token_id,), tok.pad_token_id, player)
    assert rows_out["greedy"]["parts"]["env"].tolist() == [1.0, 1.0, 0.0]
    assert metrics["eval/greedy/env/accuracy"] == pytest.approx(2 / 3)  # the success rate
    assert metrics["eval/greedy/env/mean"] == pytest.approx(2 / 3)
    assert metrics["eval/greedy/env/turns"] == pytest.approx(5 / 3)
    assert metrics["eval/greedy/env/truncated_episodes"] == pytest.approx(1 / 3)  # the third: max_turns
    assert metrics["eval/greedy/env/template_drift"] == 0.0 and metrics["eval/greedy/env/tool_calls"] == 0.0
    # the policy's tokens: "5" + EOS per turn (2, 4, 4); the other source saw whole episodes (the reply included)
    assert metrics["eval/greedy/completion_length"] == pytest.approx(10 / 3)
    reply = len(tok.encode("\n<|im_start|>user\nMy number is higher than 5. Guess again.<|im_end|>\n"
                           "<|im_start|>assistant\n"))
    assert rows_out["greedy"]["parts"]["tokens"].tolist() == [2.0, 4.0 + reply, 4.0 + reply]


def test_a_cut_first_turn_scores_truncated_reward():
    tok = chatml_tokenizer()
    prompts = episode_prompts(tok, [{"low": 1, "high": 10, "secret": 5}], first_messages)
    batch = prompts.collate([prompts[0]])

    class Endless(ScriptedBackend):  # writes "5 5 5" and no EOS
        def generate(self, prompt, prompt_mask, num_samples=1, **kw):
            gen = super().generate(prompt, prompt_mask, num_samples)
            return type(gen)(gen.response[:, :-1], gen.log_probs[:, :-1], None)

    for truncated, reward in ((None, None), (0.0, 0.0), (-1.0, -1.0)):
        player = EpisodePlayer(EnvSpec(GuessNumber, 4, 200, 1.0, "guess", truncated), tok, (tok.eos_token_id,),
                               tok.pad_token_id)
        (episode,), _ = player.play_batch(Endless(tok, ["5 5 5"]), batch, 1)
        assert episode.turns == 1 and not episode.ended and episode.reward == reward


ENV = ["env._target_=rlhf_train.envs.guess_number.GuessNumber", "env.max_turns=3", "env.max_tokens=60",
       "env.truncated_reward=0.0"]
EVAL = ["evaluation=verifiable", "evaluation.split=test", "evaluation.num_prompts=6", "evaluation.batch_size=3",
        "evaluation.num_samples=2", "evaluation.greedy=true"]


@pytest.fixture(scope="module")
def env_runs(tmp_path_factory):
    from rlhf_train.loop.trainer import train

    model = save_eos_llama(tmp_path_factory.mktemp("model") / "policy", chatml_tokenizer(), favour=("5", "6"))
    common = ["policy=pretrained", f"policy.pretrained={model}", "tokenizer=pretrained", "tokenizer.pretrained=null",
              "reward_model=none", "data=guess_number", "data.batch_size=2", "data.size=3", "data.offset=40",
              "algorithm=grpo", "rollout.num_samples=2", "rollout.max_new_tokens=6", "trainer.num_iterations=2",
              *ENV]
    runs = {}
    for name, extra in (("plain", []), ("evaluated", EVAL)):
        run_dir = tmp_path_factory.mktemp(name)
        runs[name] = run_dir, train(make_cfg(*common, *extra), run_dir)
    return runs


def test_rl_loop_evaluates_episodes_and_leaves_the_training_unchanged(env_runs):
    run_dir, out = env_runs["evaluated"]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert [r["iteration"] for r in rows] == ["0", "1", "2"]
    keys = {f"eval/{mode}/{name}" for mode in ("sampled", "greedy")
            for name in ("env/accuracy", "env/mean", "env/turns", "env/tool_calls", "env/tool_errors",
                         "env/truncated_episodes", "env/template_drift", "completion_length")}
    keys |= {"eval/sampled/env/pass@2", "eval/sampled/env/mean@2"}
    for r in rows:
        assert all(bool(r[k]) == (r["iteration"] != "1") for k in keys), r
        if r["iteration"] != "1":
            assert all(math.isfinite(float(r[k])) for k in keys)
            assert 1 <= float(r["eval/greedy/env/turns"]) <= 3
    (_, plain), training = env_runs["plain"], lambda h: [{k: v for k, v in m.items()
                                                          if not k.startswith(("eval/", "time/"))} for m in h]
    assert training(out["history"]) == training(plain["history"])  # every training metric, bit for bit
    for (name, a), b in zip(plain["policy"].state_dict().items(), out["policy"].state_dict().values()):
        assert torch.equal(a, b), name
