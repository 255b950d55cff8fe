"""Multi-turn rollouts, token in, token out (rlhf_train/rollout/multi_turn.py), with a tiny random Llama and a ChatML
template: the episode's tokens are exactly the sampled ids and the environment's suffixes, the assistant mask covers
exactly the sampled tokens, KL / advantages / loss ignore the environment's tokens, template drift is found, tool
failures are messages, and max_turns / the token budget end episodes."""
from __future__ import annotations

import copy

import pytest
import torch

from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
from rlhf_train.algorithms.registry import build_algorithm
from rlhf_train.algorithms.update import policy_forward
from rlhf_train.core.containers import is_eos
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.envs.base import EnvSpec, EpisodeRewards
from rlhf_train.envs.tools import ToolEnvironment
from rlhf_train.generation.decode_loop import DecodeLoopBackend
from rlhf_train.loop.metrics import sample_rows
from rlhf_train.models.policy import build_policy
from rlhf_train.models.reference import frozen_copy
from rlhf_train.rewards.shaping import KLDivergence, RewardAdjustment
from rlhf_train.rollout.multi_turn import MultiTurnRollout
from tests.helpers.envs import (
    CHATML,
    DRIFTING,
    Recording,
    Scripted,
    ScriptedBackend,
    add,
    broken,
    chatml_tokenizer,
    favour_eos,
    llama_config,
    slow,
)

FIRST = [{"role": "user", "content": "Guess the number between 1 and 10."}]
REPLY = "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"  # ChatML after a sampled <|im_end|>


def build(make_env, *, max_turns=4, max_tokens=400, num_samples=1, template=CHATML, texts=None, max_new_tokens=24,
          value_head=False):
    """A MultiTurnRollout over a tiny Llama (its head favouring <|im_end|>), a perturbed copy as the reference and
    the environment's reward as the only source; ``texts``: scripted model turns instead of sampling."""
    tok = chatml_tokenizer(template)
    torch.manual_seed(0)
    policy = build_policy(tok, config=llama_config(tok), value_head=value_head)
    favour_eos(policy.lm, tok.eos_token_id, 5.0)
    ref_lm = copy.deepcopy(policy.lm)
    with torch.no_grad():
        for p in ref_lm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend = (Recording(DecodeLoopBackend(policy, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                           max_new_tokens=max_new_tokens))
               if texts is None else ScriptedBackend(tok, texts))
    rewards = EpisodeRewards()
    rollout = MultiTurnRollout(policy, backend, frozen_copy(ref_lm, SamplingParams()), {"env": (rewards, 1.0)},
                               {"kl": KLDivergence("k1"), "reward": RewardAdjustment()},
                               eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                               max_new_tokens=max_new_tokens, num_samples=num_samples,
                               env=EnvSpec(make_env, max_turns, max_tokens, 1.0, "test env"), tokenizer=tok,
                               env_rewards=rewards)
    return rollout, tok, backend


def prompts(tok, answers=(7, 3)):
    ids = torch.tensor([tok.encode("Guess")] * len(answers))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "columns": {"answer": list(answers)}}


def collect(cls, *args, **kwargs):
    """A factory of ``cls`` environments that keeps every one it made."""
    made = []

    def make():
        made.append(cls(*args, **kwargs))
        return made[-1]
    return make, made


def test_a_three_turn_episode_is_the_sampled_ids_and_the_environment_suffixes_exactly():
    make, envs = collect(Scripted, 3)
    rollout, tok, backend = build(make)
    ro = rollout(prompts(tok), kl_coef=0.1)
    assert len(backend.calls) == 3 and all(e.ended for e in rollout.episodes)  # every turn ended with EOS
    first = tok.apply_chat_template(FIRST, add_generation_prompt=True, tokenize=True, return_dict=False)
    reply = tok(REPLY, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    for b in range(2):
        sampled = []
        for _, _, gen in backend.calls:  # each turn: the row's ids up to and including its first EOS
            row = gen.response[b].tolist()
            sampled.append(row[:row.index(eos) + 1])
        expected = first + sampled[0] + reply + sampled[1] + reply + sampled[2]
        assert ro.tokens.full[b][ro.masks.full[b]].tolist() == expected
        assert ro.tokens.prompt[b][ro.masks.prompt[b]].tolist() == first
        # the assistant mask: exactly the sampled tokens, each turn's EOS once
        response, assistant = ro.tokens.response[b], ro.masks.assistant[b]
        flags = []
        for k, ids in enumerate(sampled):
            flags += [True] * len(ids) + ([False] * len(reply) if k < 2 else [])
        n = len(flags)
        assert assistant[:n].tolist() == flags and not assistant[n:].any()
        assert ro.masks.response[b].tolist() == [True] * n + [False] * (response.shape[0] - n)
        assert int((is_eos(response, eos) & assistant).sum()) == 3
        # the sampler's log-probs of those tokens are kept where they were sampled; π_old is the one policy pass
        sampler = torch.cat([gen.log_probs[b, :len(ids)] for (_, _, gen), ids in zip(backend.calls, sampled)])
        torch.testing.assert_close(ro.sampler_log_prob[b][assistant], sampler)
        torch.testing.assert_close(ro.sample_log_prob[b][assistant], sampler, atol=1e-4, rtol=1e-4)
        assert not ro.sample_log_prob[b][~assistant].any()
        assert ro.done[b].nonzero().item() == n - 1 and ro.terminated[b].any()
        assert envs[b].seen[1]["content"] == tok.decode(sampled[1][:-1])  # the environment read the turn's text
    assert envs[0].rows[0]["answer"] == 7 and envs[0].rows[0]["prompt"] == "Guess"
    torch.testing.assert_close(ro.score_raw, torch.tensor([3.0, 3.0]))  # the environment's reward, weight 1
    assert rollout.env_metrics == {"env/turns": 3.0, "env/tool_calls": 0.0, "env/tool_errors": 0.0,
                                   "env/truncated_episodes": 0.0, "env/template_drift": 0.0}
    row = sample_rows(ro, tok, 1, rollout.episodes)[0]
    assert row["episode"].startswith("[user] Guess the number") and row["episode"].count("[assistant]") == 3


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_kl_advantages_and_loss_are_zero_on_environment_tokens(name):
    make, _ = collect(Scripted, 3)
    rollout, tok, _ = build(make, num_samples=2, value_head=name == "ppo")
    ro = rollout(prompts(tok), kl_coef=0.1)
    env_tokens = ro.masks.response & ~ro.masks.assistant
    assert env_tokens.sum() > 0 and ro.masks.assistant.sum() > 0
    assert not ro.kl[env_tokens].any() and ro.kl[ro.masks.assistant].abs().sum() > 0
    assert not ro.ref_log_prob[env_tokens].any() and not ro.reward[env_tokens].any()
    algorithm = build_algorithm(AlgorithmConfig(name=name, beta=0.1 if name == "grpo" else 0.0), UpdateConfig(),
                                2, ro.tokens.response.shape[1])
    ro.advantage, ro.returns = algorithm.estimator(ro)
    assert not ro.advantage[env_tokens].any() and ro.advantage[ro.masks.assistant].abs().sum() > 0
    out = policy_forward(rollout.policy, ro, SamplingParams(), with_entropy=False)
    out.log_probs.retain_grad()
    if out.values is not None:
        out.values.retain_grad()
    loss, _ = algorithm.loss(out, ro)
    loss.backward()
    assert not out.log_probs.grad[env_tokens].any() and out.log_probs.grad[ro.masks.assistant].abs().sum() > 0
    if name == "ppo":  # the critic is trained at the sampled tokens only; GAE reads no value at a tool token
        assert not out.values.grad[env_tokens].any()
        before = ro.advantage.clone()
        ro.values = ro.values.masked_fill(env_tokens, 100.0)
        torch.testing.assert_close(algorithm.estimator(ro)[0], before)


@pytest.mark.parametrize("template, drift", [(CHATML, 0.0), (DRIFTING, 1.0)])
def test_a_template_that_re_renders_the_history_differently_is_detected(template, drift):
    make, _ = collect(Scripted, 2)
    rollout, tok, _ = build(make, template=template, texts=["<think>hm</think>I say 5.", "I say 7."])
    ro = rollout(prompts(tok))
    assert rollout.env_metrics["env/template_drift"] == drift
    # the tokens are the sampled ones either way (nothing is re-rendered)
    assert tok.decode(ro.tokens.full[0][ro.masks.full[0]]).count("<think>hm</think>I say 5.") == 1


class Calculator(ToolEnvironment):
    tools = [add, slow, broken]
    tool_timeout_s = 0.2

    def reset(self, row):
        return [{"role": "user", "content": "2 + 3?"}]

    def reward(self, text):
        return float("5" in text)


def test_tool_timeouts_and_exceptions_become_tool_messages_in_the_episode():
    texts = ['<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>',
             '<tool_call>{"name": "broken", "arguments": {"x": 2}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    rollout, tok, _ = build(Calculator, texts=texts)
    ro = rollout(prompts(tok))
    assert rollout.env_metrics == {"env/turns": 3.0, "env/tool_calls": 3.0, "env/tool_errors": 2.0,
                                   "env/truncated_episodes": 0.0, "env/template_drift": 0.0}
    tool = [m["content"] for m in rollout.episodes[0].messages if m["role"] == "tool"]
    assert tool == ["Error: the tool slow did not return within 0.2 s", "Error: the tool broken raised ValueError: no 2",
                    "5"]
    text = tok.decode(ro.tokens.full[0][ro.masks.full[0]])
    assert text.startswith("<|im_start|>system\nTools: add slow broken<|im_end|>")  # announced by the template
    assert "<|im_start|>tool\nError: the tool slow did not return within 0.2 s<|im_end|>" in text
    torch.testing.assert_close(ro.score_raw, torch.tensor([1.0, 1.0]))


def test_max_turns_ends_episodes():
    make, envs = collect(Scripted, None)  # never done by itself
    rollout, tok, backend = build(make, max_turns=2)
    rollout(prompts(tok))
    assert [len(e.seen) for e in envs] == [2, 2]  # the last turn still gets its step (and reward)
    assert rollout.env_metrics["env/turns"] == 2.0 and rollout.env_metrics["env/truncated_episodes"] == 1.0
    assert len(backend.calls) == 2 and all(e.messages[-1]["role"] == "assistant" for e in rollout.episodes)


def test_the_token_budget_ends_episodes():
    make, _ = collect(Scripted, None)
    rollout, tok, _ = build(make, max_turns=50, max_tokens=30)
    ro = rollout(prompts(tok))
    assert ro.tokens.response.shape[1] <= 30 and ro.masks.response.sum(-1).max() <= 30
    assert rollout.env_metrics["env/truncated_episodes"] == 1.0
    assert all(e.turns >= 2 for e in rollout.episodes)  # several turns fit before the budget ends them
    # the episode ends with the policy's own tokens (an environment reply with no room after it is not appended)
    last = ro.masks.response.sum(-1) - 1
    assert ro.masks.assistant[torch.arange(2), last].all()


def test_groups_of_episodes_per_prompt_are_adjacent():
    make, envs = collect(Scripted, 2)
    rollout, tok, _ = build(make, num_samples=2)
    ro = rollout(prompts(tok, answers=(7, 3)))
    assert ro.batch_size[0] == 4 and [e.rows[0]["answer"] for e in envs] == [7, 7, 3, 3]
    assert ro.tokens.response.shape[0] == 4 and not torch.equal(ro.tokens.response[0], ro.tokens.response[1])
