"""``MultiTurnRollout``: the rollout of episodes in an environment (``env=<name>``), token in, token out.

One call ``rollout(batch, kl_coef=β)`` plays ``B = data.batch_size x rollout.num_samples`` episodes (the
``num_samples`` episodes of a prompt adjacent: GRPO / RLOO groups), each with its own environment
(:mod:`rlhf_train.envs.base`), and returns ONE :class:`~rlhf_train.core.containers.Rollout`:

  1. :class:`~rlhf_train.rollout.episodes.EpisodePlayer` plays the episodes with the generation backend, token in,
     token out (the first prompt from ``env.reset(row)`` through the chat template; each turn sampled after the
     exact ids so far, ``env.step(message)``'s reply appended as a token suffix; the limits that end an episode:
     :mod:`rlhf_train.rollout.episodes`);
  2. the episodes become one batch: ``prompt [B, P]`` (the first prompts, left-padded) and ``response [B, T]``
     (everything after them, assistant and environment tokens, right-padded), ``masks.response`` on every real
     token of it and ``masks.assistant`` on the sampled ones (each turn's tokens with its EOS, once): only
     those carry log-probs, values, KL, advantages and loss; environment and tool tokens are context;
  3. :meth:`RolloutFromModel.score` scores the whole episode as a single-turn rollout is scored: ONE pass of the
     policy over prompt + episode (π_old and the values; the sampler's per-turn log-probs kept as
     ``sampler_log_prob``), one reference pass, the reward sources (the environment's summed step rewards
     among them, ``reward/env``, by ``env.weight``) and the shaping stack.

An episode always ends with the policy's own tokens, so ``done`` marks its last sampled token. Metrics:
:func:`~rlhf_train.rollout.episodes.episode_metrics`; the episodes with their messages stay in :attr:`episodes`
for the samples table. A raise in the environment's code is a :class:`~rlhf_train.rewards.sources.RewardFunctionError`:
the loop skips the batch, as for a reward function.
"""
from __future__ import annotations

from typing import Any

import torch

from rlhf_train.core.containers import Rollout
from rlhf_train.envs.base import EnvSpec, EpisodeRewards
from rlhf_train.rollout.episodes import Episode, EpisodePlayer, episode_metrics, episode_tensors, episode_text
from rlhf_train.rollout.rollout_from_model import RolloutFromModel

__all__ = ["MultiTurnRollout", "Episode", "episode_metrics", "episode_tensors", "episode_text"]


class MultiTurnRollout(RolloutFromModel):
    """:class:`RolloutFromModel` over episodes in an environment. See the module docstring.

    Args (besides :class:`RolloutFromModel`'s): ``env``: the ``env`` group (:class:`~rlhf_train.envs.base.EnvSpec`:
    a new environment per episode, ``max_turns``, ``max_tokens``); ``tokenizer``: the policy's, with its chat
    template; ``env_rewards``: the reward source of the episodes' rewards (in ``reward_sources``), or ``None``."""

    def __init__(self, *args, env: EnvSpec, tokenizer: Any, env_rewards: EpisodeRewards | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.env, self.tokenizer, self.env_rewards = env, tokenizer, env_rewards
        self.player = EpisodePlayer(env, tokenizer, self.eos_token_ids, self.pad_token_id)
        self.episodes: list[Episode] = []  # the last call's
        self.env_metrics: dict[str, float] = {}  # the last call's env/... metrics

    @torch.no_grad()
    def __call__(self, batch: dict, kl_coef: float = 0.0, *, generation_config=None) -> Rollout:
        if generation_config is not None:
            raise ValueError("MultiTurnRollout samples with its backend's own settings: no generation_config")
        device = batch["input_ids"].device
        with self.autocast():
            episodes, recorded = self.player.play_batch(self.backend, batch, self.num_samples)
            t = episode_tensors(episodes, self.pad_token_id, device)
            if self.env_rewards is not None:
                self.env_rewards.load(t["reward"])
            sampler = t["sampler_log_prob"] if recorded else None  # the backend's, when it records them
            ro = self.score({"columns": batch.get("columns")}, t["full"], t["prompt_mask"], sampler, kl_coef=kl_coef,
                            response_mask=t["response_mask"], assistant_mask=t["assistant_mask"], ended=t["ended"])
        self.episodes, self.env_metrics = episodes, episode_metrics(episodes)
        return ro
