"""The pre-flight checks of the ``env`` group, called from :func:`rlhf_train.loop.checks.check_config` (the config
alone) and :func:`rlhf_train.loop.checks.check_built` (the tokenizer, policy and prompts built): one
:class:`~rlhf_train.infra.errors.ConfigError` line each, before any episode is played."""
from __future__ import annotations

from typing import Any

from rlhf_train.envs.base import env_spec, new_env
from rlhf_train.envs.chat import ChatFormat
from rlhf_train.infra.errors import ConfigError


def check_env_config(cfg: Any) -> None:
    """``env`` set: its keys (:func:`~rlhf_train.envs.base.env_spec`), and no pipeline evaluation stage (its
    before/after evaluation decodes single completions; the RL loop's held-out evaluation, ``stage=rl``, plays
    episodes)."""
    spec = env_spec(cfg.get("env"))
    e = cfg.get("evaluation")
    if spec is not None and cfg.get("stage") == "pipeline" and e is not None and e.get("enabled", True):
        raise ConfigError(f"env._target_={spec.target} with stage=pipeline: the pipeline's evaluation stage scores "
                          f"single completions, not episodes; run stage=rl with the evaluation group (it plays "
                          f"held-out episodes at iteration 0 and after the last) or set evaluation.enabled=false")


def check_env_built(cfg: Any, tokenizer: Any, policy: Any, dataset: Any) -> None:
    """``env`` set: the tokenizer has a chat template that renders an environment turn, a prompt + ``env.max_tokens``
    + a last turn of ``rollout.max_new_tokens`` fit the policy's context (and ``update.token_budget`` with
    packing), and ``env._target_`` builds an environment."""
    from rlhf_train.models.loading import context_length

    spec = env_spec(cfg.get("env"))
    if spec is None:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"env._target_={spec.target}: the tokenizer has no chat template, and episodes are chats; "
                          f"use the policy's own tokenizer (tokenizer.pretrained=null) or set tokenizer.chat_template")
    try:
        ChatFormat(tokenizer).suffix_ids([{"role": "user", "content": "x"}], "")
    except Exception as err:
        raise ConfigError(f"env._target_={spec.target}: the tokenizer's chat template cannot render an environment "
                          f"turn ({type(err).__name__}: {err})") from None
    ctx, T = context_length(policy.lm), cfg.rollout.max_new_tokens
    need = dataset.prompt_width + spec.max_tokens + T
    if ctx is not None and need > ctx:
        raise ConfigError(f"prompts ({dataset.prompt_width} tokens) + env.max_tokens ({spec.max_tokens}) + a last turn "
                          f"of rollout.max_new_tokens ({T}) = {need} exceed the policy's context of {ctx} tokens; "
                          f"lower env.max_tokens or rollout.max_new_tokens")
    u = cfg["update"]
    if u.get("packing") and u.token_budget < dataset.prompt_width + spec.max_tokens:
        raise ConfigError(f"update.token_budget={u.token_budget} is less than the longest episode: prompts "
                          f"({dataset.prompt_width} tokens) + env.max_tokens ({spec.max_tokens}); raise it")
    new_env(spec)  # the constructor runs once now: its errors come before training
