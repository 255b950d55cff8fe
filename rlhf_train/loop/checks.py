"""Every pre-flight check, in one module: bad input gets one :class:`ConfigError` line naming the key and
the fix, before any work starts (or, for what needs the built objects, before the first iteration).

* :func:`check_config` (the config alone, before anything is built): removed keys (``ppo.*``,
  ``rollout.hf_generate``, ``transforms.ref_logprob``) named with their new place; ``+``-added keys; names
  and ranges; the algorithm against ``rollout.num_samples``; model dirs that cannot load; the shaping stack
  dry-run on a stand-in rollout; LoRA with a Ray reference; the data (``rlhf_train/data/checks.py``: every
  row of ``data=prompts``, read before any model is built); the held-out evaluation's samples and split; ``env``;
* :func:`check_models_set` (right before the models are built): a policy or reward model with neither
  weights nor an architecture;
* :func:`check_built` (after the components are built): tokenizer / policy / reward-model vocabularies,
  prompts + responses within the policy's context, the batch against ``update.minibatch_size``, packing (the
  longest sequence within ``update.token_budget``, a policy that keeps packed sequences apart), the reward
  model's output shapes, every reward source on the first batch, ``env`` (``rlhf_train/envs/checks.py``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.algorithms.checks import check_algorithm
from rlhf_train.envs.checks import check_env_built, check_env_config
from rlhf_train.infra.errors import ConfigError
from rlhf_train.loop.precision import check_is_correction, check_precision
from rlhf_train.rewards.function_source import check_entries as check_reward_execution

UNCHECKED_SECTIONS = ("logger",)  # W&B settings may be passed through (and +logger.api_key is redacted)
REWARD_MODEL_FACTORY = "rlhf_train.models.reward_model.build_reward_model"  # a rewards.<name> entry's model


def check_config(cfg: DictConfig) -> None:
    """Every check that needs the config only, in order (see the module docstring)."""
    check_removed_keys(cfg)
    check_positive(cfg)
    check_algorithm(cfg)
    check_added_keys(cfg)
    check_ranges(cfg)
    check_model_dirs(cfg)
    check_reward_execution(cfg.get("rewards"))  # rewards.<name>.workers / timeout_s
    check_stack(cfg)
    check_data(cfg)
    check_evaluation(cfg)
    check_env_config(cfg)  # env: its keys; not the pipeline's evaluation stage (single completions)


def check_evaluation(cfg: DictConfig) -> None:
    """``evaluation`` (set and enabled): samples and pass@k's k in range; the RL loop's (``stage=rl``) held-out
    prompts exist: a dataset with splits, evaluated on another split than the one it trains on."""
    e = cfg.get("evaluation")
    if e is None or not e.enabled:
        return
    if e.num_samples < 1 or e.every < 0:
        raise ConfigError(f"evaluation.num_samples={e.num_samples} must be positive and evaluation.every={e.every} >= 0")
    if any(not 1 <= k <= e.num_samples for k in e.pass_k):
        raise ConfigError(f"evaluation.pass_k={list(e.pass_k)}: each k must be in 1..{e.num_samples} (num_samples)")
    if cfg.stage == "rl" and cfg.data.get("split", e.split) == e.split:  # (no split key: the same prompts)
        raise ConfigError(f"evaluation.split={e.split}: {cfg.data._target_} trains on these prompts; the RL loop's "
                          f"held-out evaluation needs others: another split (a dataset without splits holds out its "
                          f"last data.eval_holdout rows under any split but train), or evaluation=null")


def check_removed_keys(cfg: DictConfig) -> None:
    """Keys that moved: one line naming the new one (a recipe or override written for an older layout)."""
    from rlhf_train.algorithms.configs import MOVED_PPO_KEYS

    ppo = cfg.get("ppo")
    if ppo is not None:
        keys = list(ppo.keys()) if OmegaConf.is_dict(ppo) else []
        moved = [f"ppo.{k} -> {MOVED_PPO_KEYS[k]}.{k}" for k in keys if k in MOVED_PPO_KEYS]
        raise ConfigError("the `ppo` section is now `update` (the update's keys, every algorithm) and `algorithm` "
                          "(PPO's own: gamma, lam, vf_coef, clip_eps_value, whiten_advantages): "
                          + ("; ".join(moved) if moved else "rename ppo.<key> to update.<key> or algorithm.<key>"))
    if cfg.rollout.get("hf_generate") is not None:
        raise ConfigError("rollout.hf_generate is now a config group: use generation=hf_generate "
                          "(or generation=decode_loop, the default)")
    if (cfg.get("transforms") or {}).get("ref_logprob") is not None:
        raise ConfigError("transforms.ref_logprob is gone: the reference pass is not a shaping entry; its Ray "
                          "settings are ref_model.ray_service.* (e.g. ref_model.ray_service.enabled=true)")


def check_positive(cfg: DictConfig) -> None:
    checks = [
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("data.batch_size", cfg.data.batch_size),
        ("update.minibatch_size", cfg["update"].minibatch_size),
        ("update.num_epochs", cfg["update"].num_epochs),
        ("update.gradient_accumulation_steps", cfg["update"].gradient_accumulation_steps),
        ("trainer.num_iterations", cfg.trainer.num_iterations),
        ("trainer.checkpoint_every", cfg.trainer.checkpoint_every),
        ("trainer.samples_every", cfg.trainer.samples_every),
        ("trainer.max_consecutive_faults", cfg.trainer.max_consecutive_faults),
    ]
    if cfg.rollout.get("logprob_batch_size") is not None:
        checks.append(("rollout.logprob_batch_size", cfg.rollout.logprob_batch_size))
    if cfg["update"].get("micro_batch_tokens") is not None:
        checks.append(("update.micro_batch_tokens", cfg["update"].micro_batch_tokens))
    if "target" in cfg.kl_controller:
        checks += [("kl_controller.target", cfg.kl_controller.target), ("kl_controller.horizon", cfg.kl_controller.horizon)]
    checks += [(f"generation.{k}", cfg.generation[k]) for k in ("cache_multiple", "check_every") if k in cfg.generation]
    for key, value in checks:
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    u = cfg["update"]  # (cfg.update is DictConfig's dict method)
    check_packing_config(u)
    if u.minibatch_size % u.gradient_accumulation_steps:
        raise ConfigError(f"update.minibatch_size={u.minibatch_size} must be a multiple of "
                          f"update.gradient_accumulation_steps={u.gradient_accumulation_steps}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature} must be positive")
    if cfg.trainer.keep_checkpoints < 0:
        raise ConfigError(f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} must be >= 0 (0 keeps all)")


def check_packing_config(u: DictConfig) -> None:
    """``update.packing``: a positive ``update.token_budget``; the budget, not
    ``update.gradient_accumulation_steps``, splits each minibatch into micro-batches."""
    if not u.get("packing"):
        return
    if u.token_budget <= 0:
        raise ConfigError(f"update.token_budget={u.token_budget} must be positive (the most tokens in one packed "
                          f"micro-batch)")
    if u.gradient_accumulation_steps != 1:
        raise ConfigError(f"update.packing=true splits each minibatch into micro-batches of at most "
                          f"update.token_budget tokens: leave update.gradient_accumulation_steps at 1 (it is "
                          f"{u.gradient_accumulation_steps})")


def check_added_keys(cfg: DictConfig, prefix: str = "") -> None:
    """A key that a ``+`` override added to a section typed by a schema (or to a typed sub-section, such as
    ``policy.lora``): Hydra accepts it, nothing reads it."""
    for key in cfg:
        node, name = cfg.get(key), f"{prefix}{key}"
        if name in UNCHECKED_SECTIONS or not OmegaConf.is_dict(node):
            continue
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            known = {f.name for f in dataclasses.fields(schema)}
            extra = [k for k in node if k not in known]
            if extra:
                raise ConfigError(f"{name}.{extra[0]} is not a key of {name} (its keys: {', '.join(sorted(known))}); "
                                  f"remove the override (a '+' adds a key without checking it)")
        check_added_keys(node, f"{name}.")


def check_ranges(cfg: DictConfig) -> None:
    """Names and numbers out of range (``ValueError`` tracebacks or silent nonsense otherwise)."""
    from transformers import SchedulerType

    schedulers = [s.value for s in SchedulerType]
    if cfg.scheduler.name not in schedulers:
        raise ConfigError(f"scheduler.name='{cfg.scheduler.name}' is not valid; choose one of: {', '.join(schedulers)}")
    if cfg.scheduler.get("warmup_steps", 0) < 0:
        raise ConfigError(f"scheduler.warmup_steps={cfg.scheduler.warmup_steps} must be >= 0")
    check_precision(cfg.trainer)  # trainer.precision and its older name (rlhf_train/loop/precision.py)
    check_is_correction(cfg)
    if cfg.data.get("num_workers", 0) < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0 (0 loads in the main process)")
    lr = cfg.optimizer.get("lr")
    if lr is not None and not lr > 0:
        raise ConfigError(f"optimizer.lr={lr} must be positive")
    if cfg.optimizer.get("weight_decay", 0) < 0:
        raise ConfigError(f"optimizer.weight_decay={cfg.optimizer.weight_decay} must be >= 0")
    for key in ("init_kl_coef", "kl_coef"):
        value = cfg.kl_controller.get(key)
        if value is not None and value < 0:
            raise ConfigError(f"kl_controller.{key}={value} must be >= 0 (0 turns the KL penalty off)")
    r = cfg.rollout
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1] (1 = off)")
    if r.top_k < 0:
        raise ConfigError(f"rollout.top_k={r.top_k} must be >= 0 (0 = off)")
    p, a = cfg["update"], cfg.algorithm
    if p.get("clip_eps") is not None and not p.clip_eps > 0:
        raise ConfigError(f"update.clip_eps={p.clip_eps} must be positive (the ratio is clipped to 1 ± clip_eps)")
    if a.get("clip_eps_value") is not None and a.clip_eps_value < 0:
        raise ConfigError(f"algorithm.clip_eps_value={a.clip_eps_value} must be >= 0")
    for key in ("gamma", "lam"):
        if a.get(key) is not None and not 0 <= a.get(key) <= 1:
            raise ConfigError(f"algorithm.{key}={a.get(key)} must be in [0, 1]")
    if p.get("max_grad_norm") is not None and not p.max_grad_norm > 0:
        raise ConfigError(f"update.max_grad_norm={p.max_grad_norm} must be positive (or null: no clipping)")
    rollouts = cfg.data.batch_size * (r.get("num_samples", 1) or 1)
    if rollouts >= p.minibatch_size and rollouts % p.minibatch_size:  # (fewer: check_fits says "exceeds")
        per = f"data.batch_size={cfg.data.batch_size}" + (f" × rollout.num_samples={r.num_samples}"
                                                          if r.get("num_samples", 1) != 1 else "")
        raise ConfigError(f"{per} = {rollouts} rollouts per process is not a multiple of update.minibatch_size="
                          f"{p.minibatch_size}: the last {rollouts % p.minibatch_size} would never be trained on; "
                          f"make it a multiple")


def check_model_dirs(cfg: DictConfig) -> None:
    """Local model dirs that cannot load, and architectures that cannot be built."""
    for group in ("policy", "ref_model", "reward_model"):
        node = cfg.get(group)
        if not OmegaConf.is_dict(node):
            continue
        arch = node.get("config") or {}
        heads, width = arch.get("n_head", arch.get("num_attention_heads")), arch.get("n_embd", arch.get("hidden_size"))
        if heads and width and width % heads:
            key = "n_head" if "n_head" in arch else "num_attention_heads"
            raise ConfigError(f"{group}.config.{key}={heads} does not divide the width {width}; choose a divisor")
        pretrained = node.get("pretrained") if not OmegaConf.is_missing(node, "pretrained") else None
        _check_dir(pretrained, f"{group}.pretrained", node)
    for name, entry in (cfg.get("rewards") or {}).items():  # reward models listed under rewards.<name>
        if OmegaConf.is_dict(entry) and entry.get("_target_") == REWARD_MODEL_FACTORY:
            _check_dir(entry.get("pretrained"), f"rewards.{name}.pretrained", entry)


def _check_dir(pretrained, key: str, node) -> None:
    """A local model dir that cannot load (a Hub name is checked when it loads): one line naming ``key``."""
    from rlhf_train.models.model_dirs import check_model_dir

    if pretrained and Path(str(pretrained)).expanduser().is_dir():
        check_model_dir(str(Path(str(pretrained)).expanduser()), key, str(pretrained),
                        bool(node.get("trust_remote_code", False)))


def check_data(cfg: DictConfig) -> None:
    from rlhf_train.data.checks import check_data as check_data_section

    check_data_section(OmegaConf.to_container(cfg.data, resolve=True))


def check_stack(cfg: DictConfig) -> None:
    """The shaping stack (built after the models): KL estimator names, then a dry run of every entry on a
    stand-in rollout (cheap: no model); LoRA with a Ray reference (there is no reference model to serve)."""
    from rlhf_train.core.kl import KL_ESTIMATORS
    from rlhf_train.models.lora import lora_settings
    from rlhf_train.rewards.shaping import check_shaping

    for name, entry in (cfg.get("transforms") or {}).items():
        estimator = entry.get("estimator") if hasattr(entry, "get") else None
        if estimator is not None and estimator not in KL_ESTIMATORS:
            raise ConfigError(f"transforms.{name}.estimator='{estimator}' is not valid; choose one of: "
                              f"{', '.join(KL_ESTIMATORS)}")
    check_shaping(cfg.get("transforms"))
    if lora_settings(cfg.policy.get("lora")) is not None and cfg.ref_model.get("ray_service", {}).get("enabled"):
        raise ConfigError("ref_model.ray_service.enabled=true: with policy.lora.r>0 the reference is the policy with "
                          "its adapter disabled, no model to serve; set it to false (or policy.lora.r=0)")


def check_models_set(cfg: DictConfig) -> None:
    """Right before the models are built (a pipeline fills in the paths of its earlier stages first)."""
    for group, what in (("policy", "a local model dir"), ("reward_model", "the dir of a trained reward model")):
        # a model with neither weights nor an architecture would silently be a random full-size GPT-2
        node = cfg.get(group)
        if node is not None and node.get("_target_") and "pretrained" in node and (
                OmegaConf.is_missing(node, "pretrained") or not node.pretrained) and not node.get("config"):
            raise ConfigError(f"{group}.pretrained is not set (and {group}.config is empty): "
                              f"set {group}.pretrained=<{what}>")


# ---------------------------------------------------------------- after the components are built
def check_built(cfg: DictConfig, tokenizer, policy, reward_model, sources: dict, dataset) -> None:
    """Every check that needs the built components, in order (see the module docstring)."""
    check_vocabularies(tokenizer, policy, reward_model)
    check_fits(cfg, policy, dataset)
    check_packing_fits(cfg, policy, dataset)
    if reward_model is not None:
        check_reward_model(reward_model, dataset)
    probe_sources(sources, dataset, cfg.data.batch_size)  # every source scores the first batch
    check_env_built(cfg, tokenizer, policy, dataset)  # env: chat template, context, one environment built


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


def check_fits(cfg: DictConfig, policy, dataset) -> None:
    from rlhf_train.models.loading import context_length

    ctx = context_length(policy.lm)
    need = dataset.prompt_width + cfg.rollout.max_new_tokens
    if ctx is not None and need > ctx:
        raise ConfigError(f"prompts ({dataset.prompt_width} tokens) + rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens}) = {need} exceed the policy's context of {ctx} tokens; "
                          f"lower data.max_prompt_length / data.max_prompt_tokens or rollout.max_new_tokens")
    if len(dataset) < cfg.data.batch_size:
        raise ConfigError(f"the prompt dataset has {len(dataset)} prompts, fewer than data.batch_size="
                          f"{cfg.data.batch_size}")
    rollouts = cfg.data.batch_size * cfg.rollout.get("num_samples", 1)
    mbs = cfg["update"].minibatch_size
    if mbs > rollouts:
        raise ConfigError(f"update.minibatch_size={mbs} exceeds the rollouts per iteration, "
                          f"data.batch_size={cfg.data.batch_size} x rollout.num_samples="
                          f"{cfg.rollout.get('num_samples', 1)}")


def check_packing_fits(cfg: DictConfig, policy, dataset) -> None:
    """``update.packing``: the longest sequence fits in ``update.token_budget``, and the policy keeps packed
    sequences apart (:func:`rlhf_train.models.packed.check_packing`)."""
    u = cfg["update"]
    if not u.get("packing"):
        return
    need = dataset.prompt_width + cfg.rollout.max_new_tokens
    if u.token_budget < need:
        raise ConfigError(f"update.token_budget={u.token_budget} is less than the longest sequence: prompts "
                          f"({dataset.prompt_width} tokens) + rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) "
                          f"= {need}; set update.token_budget>={need}")
    from rlhf_train.models.packed import check_packing

    check_packing(policy.lm)


@torch.no_grad()
def check_reward_model(reward_model, dataset) -> None:
    """Probe the reward model on 2 prompts: it must return ``(rewards [B, L], end_scores [B])``."""
    from rlhf_train.data.prompts import collate

    n = min(2, len(dataset))
    probe = getattr(dataset, "collate", collate)([dataset[i] for i in range(n)])
    device = next(reward_model.parameters(), torch.zeros(())).device
    ids, mask = probe["input_ids"].to(device), probe["attention_mask"].to(device)
    try:
        out = reward_model(input_ids=ids, attention_mask=mask)
    except Exception as err:
        raise ConfigError(f"the reward model fails on a probe batch of {n} prompts ({type(err).__name__}: {err}); "
                          f"check reward_model") from None
    shapes = [tuple(o.shape) for o in out] if isinstance(out, (tuple, list)) else None
    if (shapes is None or len(shapes) != 2 or not all(isinstance(o, torch.Tensor) for o in out)
            or shapes[1] not in ((n,), (n, 1)) or len(shapes[0]) != 2 or shapes[0][0] != n):
        got = shapes if shapes is not None else f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}"
        raise ConfigError(f"the reward model's output has the wrong shape: on {n} prompts of {ids.shape[1]} tokens "
                          f"it returned {got}, expected (rewards [{n}, L], end_scores [{n}]); check reward_model")
    if not bool(torch.isfinite(out[1].float()).all()):
        raise ConfigError(f"the reward model returned NaN or inf end scores on a probe batch of {n} prompts; its "
                          f"weights may be damaged or it overflows in this precision: check reward_model")


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
