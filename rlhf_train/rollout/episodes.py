"""Playing episodes, token in, token out: what the multi-turn rollout (:mod:`rlhf_train.rollout.multi_turn`) and the
held-out evaluation of an environment (:mod:`rlhf_train.loop.evaluation`) share.

:class:`EpisodePlayer` plays a batch of episodes with any generation backend, each with its own environment
(:mod:`rlhf_train.envs.base`):

  1. ``env.reset(row)`` gives each episode's first messages; the chat template renders them (with the
     environment's ``tools``) into the first prompt's ids;
  2. each turn, the backend samples an assistant turn for every active episode, continuing from the exact ids of
     the episode so far (left-padded into one batch; the history is never re-rendered), until EOS or the backend's
     ``max_new_tokens``; ``env.step(message)`` answers; its messages are tokenized as a suffix
     (:class:`~rlhf_train.envs.chat.ChatFormat`) and appended; finished episodes drop out of the batch.

An episode ends when the environment says so (``Step.messages`` is ``None``: terminated), or truncated: after
``env.max_turns`` assistant turns (the last one still gets its ``step`` and reward), when an assistant turn ends
without EOS (cut at ``rollout.max_new_tokens``; no ``step``: the message is unfinished), or when its tokens
after the first prompt would pass ``env.max_tokens`` (a turn cut there; an environment reply that leaves no room
for another turn is not appended). An episode always ends with the policy's own tokens; one a limit ended before
any step gave a reward is paid ``env.truncated_reward`` (``None``: none). Each turn re-reads the
episode so far (its prompt is prefilled again: no KV cache is kept between turns). Environment code runs in Python
per episode (reset, step, tools); a raise there is a :class:`~rlhf_train.rewards.sources.RewardFunctionError`.
:func:`episode_tensors` makes the batch's tensors, :func:`episode_metrics` the ``env/...`` metrics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from rlhf_train.core.containers import response_mask_from_tokens
from rlhf_train.envs.base import EnvSpec, Environment, Message, Step, as_step, new_env, tools_of
from rlhf_train.envs.chat import ChatFormat
from rlhf_train.rewards.sources import RewardFunctionError


@dataclass
class Episode:
    """One episode as it is played: its messages, and its ids with which of them the policy sampled."""

    env: Environment
    chat: ChatFormat
    messages: list[Message]
    prompt: list[int]
    response: list[int] = field(default_factory=list)  # every id after the first prompt
    sampled: list[bool] = field(default_factory=list)  # per id of response: the policy sampled it
    sampler_log_prob: list[float] = field(default_factory=list)  # per id of response (0 for the environment's)
    turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None  # the sum of the steps' rewards (None: no step gave one)
    ended: bool = False  # ended by the environment (not by a limit)
    drift: bool = False  # the template renders this conversation as other text than its ids

    def add(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.response += ids
        self.sampled += [sampled] * len(ids)
        self.sampler_log_prob += log_probs if log_probs is not None else [0.0] * len(ids)

    def record(self, step: Step) -> None:
        if step.reward is not None:
            self.reward = (self.reward or 0.0) + float(step.reward)
        info = step.info or {}
        self.tool_calls += int(info.get("tool_calls", 0))
        self.tool_errors += int(info.get("tool_errors", 0))


class EpisodePlayer:
    """Plays episodes of ``env`` (:class:`~rlhf_train.envs.base.EnvSpec`) with a generation backend; ``tokenizer``:
    the policy's, with its chat template. See the module docstring."""

    def __init__(self, env: EnvSpec, tokenizer: Any, eos_token_ids: Sequence[int], pad_token_id: int):
        self.env, self.tokenizer = env, tokenizer
        self.eos_token_ids, self.pad_token_id = tuple(eos_token_ids), int(pad_token_id)

    def play_batch(self, backend, batch: dict, num_samples: int) -> tuple[list[Episode], bool]:
        """``num_samples`` episodes per prompt of ``batch`` (adjacent), played to their ends with ``backend``:
        ``(episodes, whether the backend recorded the sampled tokens' log-probs)``."""
        episodes = [self.start(row) for row in self.rows(batch, num_samples)]
        return episodes, self.play(backend, episodes, batch["input_ids"].device)

    def rows(self, batch: dict, num_samples: int) -> list[dict[str, Any]]:
        """The dataset row of each episode (the samples of a prompt adjacent): ``prompt`` (its text, as the dataset
        tokenized it) and the prompt's other columns."""
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        texts = self.tokenizer.batch_decode([r[m].tolist() for r, m in zip(ids, mask)], skip_special_tokens=False)
        cols = batch.get("columns") or {}
        rows = [{"prompt": text, **{k: v[i] for k, v in cols.items()}} for i, text in enumerate(texts)]
        return [dict(row) for row in rows for _ in range(num_samples)]

    def start(self, row: dict[str, Any]) -> Episode:
        env = new_env(self.env)
        chat = ChatFormat(self.tokenizer, tools_of(env))
        messages = [dict(m) for m in self.call(env.reset, row)]
        return Episode(env, chat, messages, chat.prompt_ids(messages))

    def call(self, method, *args):
        """An environment's ``reset`` / ``step`` / tool code; a raise is a reward error (the loop skips the batch)."""
        try:
            return method(*args)
        except Exception as err:
            raise RewardFunctionError(f"environment {self.env.target}.{method.__name__} raised "
                                      f"{type(err).__name__}: {err}") from err

    def play(self, backend, episodes: list[Episode], device) -> bool:
        """Every episode to its end, a turn of every active episode per generation call; whether the backend
        recorded the sampled tokens' log-probs."""
        active, recorded = list(episodes), True
        while active:
            ids = [torch.tensor(e.prompt + e.response, dtype=torch.long) for e in active]
            prompt = pad_sequence(ids, batch_first=True, padding_value=self.pad_token_id, padding_side="left")
            mask = pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in ids], batch_first=True,
                                padding_side="left")
            gen = backend.generate(prompt.to(device), mask.to(device), 1)
            lengths = response_mask_from_tokens(gen.response, self.eos_token_ids).sum(-1).tolist()
            tokens = gen.response.tolist()
            log_probs = gen.log_probs.float().tolist() if gen.log_probs is not None else None
            recorded &= log_probs is not None
            active = [e for i, e in enumerate(active)
                      if self.turn(e, tokens[i][:lengths[i]], log_probs[i][:lengths[i]] if log_probs else None)]
        return recorded

    def turn(self, e: Episode, ids: list[int], log_probs: list[float] | None) -> bool:
        """Add one assistant turn ``ids`` to ``e`` and the environment's answer; whether ``e`` goes on."""
        room = self.env.max_tokens - len(e.response)
        with_eos = bool(ids) and ids[-1] in self.eos_token_ids and len(ids) <= room
        ids, log_probs = ids[:room], (log_probs[:room] if log_probs is not None else None)
        e.add(ids, True, log_probs)
        e.turns += 1
        e.messages.append({"role": "assistant", "content": e.chat.decode(ids[:-1] if with_eos else ids)})
        if not with_eos:  # cut at rollout.max_new_tokens or env.max_tokens: an unfinished message, no step
            return self.finish(e, ended=False)
        step = as_step(self.call(e.env.step, dict(e.messages[-1])), self.env.target)
        e.record(step)
        if step.messages is None:
            return self.finish(e, ended=True)
        if e.turns >= self.env.max_turns:
            return self.finish(e, ended=False)
        suffix = e.chat.suffix_ids(step.messages, e.chat.decode(ids[-1:]))
        if len(e.response) + len(suffix) >= self.env.max_tokens:  # no room left for another assistant token
            return self.finish(e, ended=False)
        e.messages += [dict(m) for m in step.messages]
        e.add(suffix, False)
        e.drift |= e.chat.drifted(e.messages, e.prompt + e.response, add_generation_prompt=True)
        return True

    def finish(self, e: Episode, ended: bool) -> bool:
        e.ended = ended
        if not ended and e.reward is None:  # cut by a limit before any step paid: env.truncated_reward (or none)
            e.reward = self.env.truncated_reward
        e.drift |= e.chat.drifted(e.messages, e.prompt + e.response, add_generation_prompt=False)
        return False


def episode_tensors(episodes: list[Episode], pad_token_id: int, device) -> dict[str, torch.Tensor]:
    """The batch of episodes: ``full [B, P+T]`` (left-padded first prompts, right-padded episodes), ``prompt_mask
    [B, P]``, ``response_mask`` / ``assistant_mask`` / ``sampler_log_prob [B, T]``, ``ended [B]``, ``reward [B]``
    (the summed step rewards, NaN for an episode no step paid)."""
    def pad(rows, value, dtype, left=False):
        return pad_sequence([torch.tensor(r, dtype=dtype) for r in rows], batch_first=True, padding_value=value,
                            padding_side="left" if left else "right").to(device)

    prompt = pad([e.prompt for e in episodes], pad_token_id, torch.long, left=True)
    prompt_mask = pad([[True] * len(e.prompt) for e in episodes], False, torch.bool, left=True)
    response = pad([e.response for e in episodes], pad_token_id, torch.long)
    return {"full": torch.cat([prompt, response], 1), "prompt_mask": prompt_mask,
            "response_mask": pad([[True] * len(e.response) for e in episodes], False, torch.bool),
            "assistant_mask": pad([e.sampled for e in episodes], False, torch.bool),
            "sampler_log_prob": pad([e.sampler_log_prob for e in episodes], 0.0, torch.float32),
            "ended": torch.tensor([e.ended for e in episodes], dtype=torch.bool, device=device),
            "reward": torch.tensor([float("nan") if e.reward is None else e.reward for e in episodes],
                                   dtype=torch.float32, device=device)}


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The ``env/...`` metrics of a batch of episodes (docs/metrics.md): means per episode (turns, tool calls, tool
    errors) and shares of the episodes (truncated by a limit, template drift)."""
    n = max(len(episodes), 1)
    return {"env/turns": sum(e.turns for e in episodes) / n,
            "env/tool_calls": sum(e.tool_calls for e in episodes) / n,
            "env/tool_errors": sum(e.tool_errors for e in episodes) / n,
            "env/truncated_episodes": sum(not e.ended for e in episodes) / n,
            "env/template_drift": sum(e.drift for e in episodes) / n}


def episode_text(e: Episode) -> str:
    """An episode's conversation with its roles, for the samples table."""
    return "\n".join(f"[{m.get('role')}] {m.get('content')}" for m in e.messages)
