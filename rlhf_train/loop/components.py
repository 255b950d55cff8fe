"""Building each component of a run from its config group: the tokenizer (follows the policy unless
set), the reward model and the reward sources, the reference (ONE object, its kind decided here), the
generation backend (``generation=...``), the shaping stack and the LR schedule. :mod:`rlhf_train.loop.build`
calls them in order; the checks they need are :mod:`rlhf_train.loop.checks`'.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.core.sampling import SamplingParams
from rlhf_train.infra.errors import ConfigError, instantiate_or_config_error
from rlhf_train.models.lora import is_peft_model
from rlhf_train.models.reference import Reference, adapter_off, frozen_copy, remote

log = logging.getLogger(__name__)


def _policy_dir(cfg: DictConfig) -> str | None:
    from rlhf_train.models.loading import check_loadable

    src = cfg.policy.get("pretrained") if not OmegaConf.is_missing(cfg.policy, "pretrained") else None
    return check_loadable(src, "policy.pretrained") if src else None


def _has_tokenizer(path: str | None) -> bool:
    from rlhf_train.models.hf_reward_model import has_tokenizer

    return bool(path) and os.path.isdir(path) and has_tokenizer(path)


def build_tokenizer(cfg: DictConfig) -> Any:
    """``cfg.tokenizer``, or the policy's own: ``tokenizer.pretrained=null`` takes ``policy.pretrained``'s; a
    trained tokenizer of a recipe gives way to the policy dir's own (one log line); a named one that
    disagrees with the policy's vocabulary is an error."""
    from rlhf_train.data.tokenizers import pretrained_tokenizer
    from rlhf_train.models.hf_reward_model import same_vocabulary

    tok_cfg = cfg.tokenizer
    follows = "pretrained" in tok_cfg and not tok_cfg.pretrained
    policy_dir = _policy_dir(cfg)
    if follows:
        if not policy_dir:
            raise ConfigError("tokenizer.pretrained is not set and the policy has no pretrained dir to take it from "
                              "(policy.pretrained is null): set tokenizer.pretrained=<a tokenizer dir or hub name>")
        return pretrained_tokenizer(policy_dir, tok_cfg.get("trust_remote_code", False))
    tokenizer = instantiate_or_config_error(tok_cfg)
    if _has_tokenizer(policy_dir):
        own = pretrained_tokenizer(policy_dir, cfg.policy.get("trust_remote_code", False))
        if not same_vocabulary(own, tokenizer):
            if "pretrained" in tok_cfg:  # the user named a tokenizer: say so rather than guess
                raise ConfigError(f"vocabulary mismatch: tokenizer.pretrained={tok_cfg.pretrained} ({len(tokenizer)} "
                                  f"tokens) is not the tokenizer of policy.pretrained={cfg.policy.pretrained} "
                                  f"({len(own)} tokens); set tokenizer.pretrained=null to use the policy's own")
            log.info("[rlhf_train] tokenizer: using the policy's own tokenizer from %s (the configured one has a "
                     "different vocabulary)", policy_dir)
            return own
    return tokenizer


def build_reference_model(cfg: DictConfig, policy, tokenizer, needs_reference: bool, device) -> torch.nn.Module | None:
    """The reference's own model, when it has one: ``None`` without a KL term (no reference at all) and with
    LoRA (the reference is the policy with its adapter off: no copy is built)."""
    if not needs_reference:
        return None
    if is_peft_model(policy.lm):
        log.info("[rlhf_train] policy.lora.r=%d: no reference copy is built; the reference is the policy with its "
                 "LoRA adapter disabled (ref_model.* is not used)", cfg.policy.lora.r)
        return None
    node = {k: v for k, v in OmegaConf.to_container(cfg.ref_model, resolve=True).items() if k != "ray_service"}
    ref_model = instantiate_or_config_error(node, policy=policy, tokenizer=tokenizer, device=None, _convert_="all")
    return ref_model.to(cfg.ref_model.device or device)


def build_reference(cfg: DictConfig, policy_lm, ref_model, sampling: SamplingParams, accelerator,
                    run_dir) -> Reference:
    """π_ref, decided here once: the Ray actor (``ref_model.ray_service.enabled``), the policy with its
    adapter off (LoRA), or the frozen copy. Local kinds run under the policy's autocast in mixed precision."""
    batch = cfg.rollout.get("logprob_batch_size")
    autocast = accelerator.autocast if accelerator.mixed_precision != "no" else None
    budget = cfg["update"].token_budget if cfg["update"].get("packing") else None  # packed scoring passes
    if is_peft_model(policy_lm):
        return adapter_off(policy_lm, sampling, batch, autocast, budget)
    if cfg.ref_model.get("ray_service", {}).get("enabled"):
        from rlhf_train.models.ray_reference import ray_ref_log_prob_fn

        fn = ray_ref_log_prob_fn(cfg, ref_model, run_dir)
        ref_model.to("cpu")  # the actor holds the reference now; free the accelerator's memory
        return remote(fn, "ray")
    if budget:
        from rlhf_train.models.packed import check_packing

        check_packing(ref_model, "the reference model")
    return frozen_copy(ref_model, sampling, batch, autocast, budget)


def build_reward_model(cfg: DictConfig, tokenizer, device) -> torch.nn.Module | None:
    """The ``reward_model`` group (``reward_model=null``: none; the ``rewards`` entries score alone)."""
    node = cfg.get("reward_model")
    if node is None or not node.get("_target_"):
        return None
    rm = instantiate_or_config_error(node, tokenizer=tokenizer, device=None)
    return rm.to(node.get("device") or device)


def build_sources(cfg: DictConfig, tokenizer, reward_model, device) -> dict:
    """``{name: (RewardSource, weight)}``: the reward model (``reward_model.weight``) and the ``rewards`` entries."""
    from rlhf_train.rewards.sources import build_reward_sources

    node = cfg.get("reward_model")
    entries = cfg.get("rewards")
    entries = OmegaConf.to_container(entries, resolve=True) if entries else {}
    if reward_model is None and not entries and (cfg.get("env") or {}).get("_target_"):
        return {}  # the environment's reward alone (build_env adds it)
    return build_reward_sources(reward_model, entries, tokenizer, tokenizer.pad_token_id,
                                cfg.rollout.get("logprob_batch_size"),
                                node.get("weight", 1.0) if node is not None else 1.0, device)


def build_env(cfg: DictConfig, sources: dict):
    """The ``env`` group: ``(EnvSpec, EpisodeRewards)``, the episodes' reward added to ``sources`` as ``env`` (by
    ``env.weight``), or ``(None, None)`` without an environment."""
    from rlhf_train.envs.base import EpisodeRewards, env_spec

    env = env_spec(cfg.get("env"))
    if env is None:
        return None, None
    if "env" in sources:
        raise ConfigError("rewards.env: the name 'env' is the environment's reward (env.weight); choose another name")
    sources["env"] = (rewards := EpisodeRewards(), env.weight)
    return env, rewards


def build_dataset(cfg: DictConfig, tokenizer):
    data_kwargs = {k: v for k, v in cfg.data.items() if k not in ("batch_size", "num_workers")}
    return instantiate_or_config_error(data_kwargs, tokenizer=tokenizer)


def build_backend(cfg: DictConfig, policy, eos_token_ids: tuple[int, ...], pad_token_id: int,
                  sampling: SamplingParams, with_scores: bool, unwrap_fn):
    """The ``generation`` group's backend over the (prepared) policy, with the rollout's settings
    (``_target_``: a backend class, or a factory such as ``generation=auto``'s that picks one)."""
    from hydra.utils import get_object

    r = cfg.rollout
    eos = list(eos_token_ids) if len(eos_token_ids) > 1 else eos_token_ids[0]
    node = OmegaConf.to_container(cfg.generation, resolve=True)
    try:
        backend_cls = get_object(node.pop("_target_"))
        if not callable(backend_cls):
            raise TypeError(f"{backend_cls!r} is not a class or function")
    except Exception as err:
        raise ConfigError(f"generation._target_: {err}; choose generation=auto, decode_loop, static_cache or "
                          "hf_generate") from None
    # called directly, not through hydra's instantiate: the runtime objects (policy, SamplingParams) stay as they are
    return backend_cls(policy, eos_token_id=eos, pad_token_id=pad_token_id, max_new_tokens=r.max_new_tokens,
                       sampling=sampling, do_sample=r.do_sample, with_scores=with_scores, unwrap_fn=unwrap_fn, **node)


def make_lr_scheduler(cfg: DictConfig, optimizer, num_update_steps: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.scheduler.name, optimizer, num_warmup_steps=cfg.scheduler.warmup_steps,
                         num_training_steps=max(num_update_steps, 1))
