"""The user's own model, data and reward, checked before any work (issue 13): helpers of
:func:`rlhf_train.loop.components.build_components`.

* :func:`build_tokenizer`: the tokenizer follows the policy unless set (``tokenizer.pretrained=null`` takes
  ``policy.pretrained``'s; a trained tokenizer of a recipe gives way to the policy dir's own, with one log line);
* :func:`check_vocabularies`: tokenizer, policy and reward model agree on the vocabulary, or one line says which;
* :func:`build_sources`: the reward sources dict (``reward_model`` group + ``rewards`` entries);
* :func:`probe_sources`: the first batch scored by every source (prompts with empty completions).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)


def _policy_dir(cfg: DictConfig) -> str | None:
    from rlhf_train.models.loading import check_loadable

    src = cfg.policy.get("pretrained") if not OmegaConf.is_missing(cfg.policy, "pretrained") else None
    return check_loadable(src, "policy.pretrained") if src else None


def _has_tokenizer(path: str | None) -> bool:
    from rlhf_train.models.hf_reward_model import has_tokenizer

    return bool(path) and os.path.isdir(path) and has_tokenizer(path)


def build_tokenizer(cfg: DictConfig, instantiate) -> Any:
    """The tokenizer: ``cfg.tokenizer``, or the policy's own (see the module docstring)."""
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
    tokenizer = instantiate(tok_cfg)
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


def _embeddings(model) -> int | None:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    return int(emb.num_embeddings) if emb is not None and hasattr(emb, "num_embeddings") else None


def check_vocabularies(tokenizer, policy, reward_model) -> None:
    """Every id of the tokenizer has a policy embedding, and a reward model that reads the policy's ids
    (not re-encoding) has the policy's vocabulary: otherwise it would score ids of another vocabulary."""
    n_tok, n_policy = len(tokenizer), _embeddings(policy.lm)
    if n_policy is not None and n_policy < n_tok:
        raise ConfigError(f"vocabulary mismatch: the tokenizer has {n_tok} tokens but the policy has {n_policy} "
                          f"token embeddings; use the policy's own tokenizer (tokenizer.pretrained=null)")
    if reward_model is None or getattr(reward_model, "reencodes", False) or hasattr(reward_model, "encoder_tokenizer"):
        return
    trunk = getattr(reward_model, "trunk", None) or getattr(reward_model, "model", None)
    n_rm = _embeddings(trunk) if trunk is not None else None
    if n_rm is not None and n_policy is not None and n_rm != n_policy:
        raise ConfigError(f"vocabulary mismatch: the reward model (reward_model.pretrained) has {n_rm} token "
                          f"embeddings, the policy {n_policy}: it would score the policy's ids in another vocabulary; "
                          f"use a reward model trained on the policy's tokenizer, or one that ships its own tokenizer")


def build_reward_model(cfg: DictConfig, tokenizer, instantiate, device) -> torch.nn.Module | None:
    """The ``reward_model`` group (``reward_model=null``: none; the ``rewards`` entries score alone)."""
    node = cfg.get("reward_model")
    if node is None or not node.get("_target_"):
        return None
    rm = instantiate(node, tokenizer=tokenizer, device=None)
    return rm.to(node.get("device") or device)


def build_sources(cfg: DictConfig, tokenizer, reward_model, device) -> dict:
    from rlhf_train.rewards.sources import build_reward_sources

    node = cfg.get("reward_model")
    entries = cfg.get("rewards")
    entries = OmegaConf.to_container(entries, resolve=True) if entries else {}
    return build_reward_sources(reward_model, entries, tokenizer, tokenizer.pad_token_id,
                                cfg.rollout.get("logprob_batch_size"),
                                float(node.get("weight", 1.0)) if node is not None else 1.0, device)


@torch.no_grad()
def probe_sources(sources: dict, dataset, batch_size: int) -> None:
    """Score the first batch (its prompts, with empty completions) with every source; one line on failure."""
    from rlhf_train.data.prompts import collate
    from rlhf_train.rewards.sources import Sequences, probe_reward_sources

    n = min(batch_size, len(dataset))
    batch = getattr(dataset, "collate", collate)([dataset[i] for i in range(n)])
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    columns = batch.get("columns") or {}
    # the reward_model group's model was probed already (check_reward_model): the others are scored here
    others = {name: entry for name, entry in sources.items() if name != "reward_model"}
    if others:
        probe_reward_sources(others, Sequences(ids, mask, ids.shape[1], columns))


def guarded_rollout(make_rollout, fault_state: dict, max_consecutive: int, accelerator=None):
    """``make_rollout()``, except that a reward function that raises (:class:`RewardFunctionError`) skips this
    batch: ``None`` is returned and counted in ``fault_state["reward_errors"]`` (``faults/reward_errors``);
    ``max_consecutive`` such batches in a row stop the run (``FloatingPointError``, the loop's fault stop).
    With several processes, one failing process makes all skip (they stay in step)."""
    from rlhf_train.rewards.sources import RewardFunctionError

    err, ro = None, None
    try:
        ro = make_rollout()
    except RewardFunctionError as e:
        err = e
    failed = err is not None
    if accelerator is not None and accelerator.num_processes > 1:
        flag = torch.tensor(float(failed), device=accelerator.device)
        failed = bool(accelerator.reduce(flag, "sum").item() > 0)
    if not failed:
        if fault_state.get("reward_consecutive"):  # (the key exists only once a reward function has failed)
            fault_state["reward_consecutive"] = 0
        return ro
    fault_state["reward_errors"] = fault_state.get("reward_errors", 0) + 1
    fault_state["reward_consecutive"] = fault_state.get("reward_consecutive", 0) + 1
    log.warning("[rlhf_train] batch skipped: %s", err or "a reward function failed on another process")
    if fault_state["reward_consecutive"] >= max_consecutive:
        raise FloatingPointError(f"{fault_state['reward_consecutive']} batches in a row were skipped because a reward "
                                 f"function failed (trainer.max_consecutive_faults={max_consecutive}); last: "
                                 f"{err or 'on another process'}")
    return None
