"""Building the PPO stage's components from the config, with the checks that run before any work.

``validate_config(cfg)`` rejects bad values Hydra's types cannot catch (one :class:`ConfigError` line);
``build_components(cfg)`` instantiates tokenizer, policy, reference, reward model, KL controller and prompt
dataset, then checks that prompts + responses fit the policy's context and probes the reward model's
output shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.core.kl import KL_ESTIMATORS
from rlhf_train.infra.errors import ConfigError
from rlhf_train.models.loading import context_length
from rlhf_train.rewards.transforms import check_transform_stack


@dataclass
class Components:
    tokenizer: Any
    policy: Any
    ref_model: Any
    reward_model: Any
    kl_controller: Any
    dataset: Any


def validate_config(cfg: DictConfig) -> None:
    """Bad values that Hydra's types cannot catch: one clear error before any work starts."""
    checks = [
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("data.batch_size", cfg.data.batch_size),
        ("ppo.minibatch_size", cfg.ppo.minibatch_size),
        ("ppo.num_epochs", cfg.ppo.num_epochs),
        ("ppo.gradient_accumulation_steps", cfg.ppo.gradient_accumulation_steps),
        ("trainer.num_iterations", cfg.trainer.num_iterations),
        ("trainer.checkpoint_every", cfg.trainer.checkpoint_every),
        ("trainer.samples_every", cfg.trainer.samples_every),
        ("trainer.max_consecutive_faults", cfg.trainer.max_consecutive_faults),
    ]
    if cfg.rollout.get("logprob_batch_size") is not None:
        checks.append(("rollout.logprob_batch_size", cfg.rollout.logprob_batch_size))
    if "target" in cfg.kl_controller:
        checks += [("kl_controller.target", cfg.kl_controller.target), ("kl_controller.horizon", cfg.kl_controller.horizon)]
    for key, value in checks:
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if cfg.ppo.minibatch_size % cfg.ppo.gradient_accumulation_steps:
        raise ConfigError(f"ppo.minibatch_size={cfg.ppo.minibatch_size} must be a multiple of "
                          f"ppo.gradient_accumulation_steps={cfg.ppo.gradient_accumulation_steps}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature} must be positive")
    if cfg.trainer.keep_checkpoints < 0:
        raise ConfigError(f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} must be >= 0 (0 keeps all)")
    # the reward-shaping stack is built after the models: check it now (KL estimator names, then a dry
    # run of every entry on a stand-in rollout, which is cheap: no model is involved)
    for name, entry in (cfg.get("transforms") or {}).items():
        estimator = entry.get("estimator") if hasattr(entry, "get") else None
        if estimator is not None and estimator not in KL_ESTIMATORS:
            raise ConfigError(f"transforms.{name}.estimator='{estimator}' is not valid; choose one of: "
                              f"{', '.join(KL_ESTIMATORS)}")
    check_transform_stack(cfg.get("transforms"))


def instantiate_or_config_error(*args, **kwargs):
    """``hydra.utils.instantiate``, except that a :class:`ConfigError` raised by the target comes out as
    itself (the one line the user sees) rather than wrapped in Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(*args, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def build_components(cfg: DictConfig, device: torch.device | str = "cpu") -> Components:
    """Instantiate tokenizer, policy, reference, reward model, KL controller and prompt dataset."""
    instantiate = instantiate_or_config_error

    # a model with neither weights nor an architecture would silently be a random full-size GPT-2
    # (e.g. `reward_model=pretrained` without a path: Hydra keeps the schema's null under its `???`)
    for group, what in (("policy", "a local model dir"), ("reward_model", "the dir of a trained reward model")):
        node = cfg.get(group)
        if node is not None and "pretrained" in node and (
                OmegaConf.is_missing(node, "pretrained") or not node.pretrained) and not node.get("config"):
            raise ConfigError(f"{group}.pretrained is not set (and {group}.config is empty): "
                              f"set {group}.pretrained=<{what}>")
    tokenizer = instantiate(cfg.tokenizer)
    policy = instantiate(cfg.policy, tokenizer=tokenizer)
    ref_model = instantiate(cfg.ref_model, policy=policy, tokenizer=tokenizer, device=None, _convert_="all")
    ref_model.to(cfg.ref_model.device or device)
    reward_model = instantiate(cfg.reward_model, tokenizer=tokenizer, device=None)
    reward_model.to(cfg.reward_model.device or device)
    kl_controller = instantiate(cfg.kl_controller)
    data_kwargs = {k: v for k, v in cfg.data.items() if k not in ("batch_size", "num_workers")}
    dataset = instantiate(data_kwargs, tokenizer=tokenizer)
    check_fits(cfg, policy, dataset)
    check_reward_model(reward_model, dataset)
    return Components(tokenizer, policy, ref_model, reward_model, kl_controller, dataset)


def check_fits(cfg: DictConfig, policy, dataset) -> None:
    ctx = context_length(policy.lm)
    need = dataset.prompt_width + cfg.rollout.max_new_tokens
    if ctx is not None and need > ctx:
        raise ConfigError(f"prompts ({dataset.prompt_width} tokens) + rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens}) = {need} exceed the policy's context of {ctx} tokens; "
                          f"lower data.max_prompt_length / data.max_prompt_tokens or rollout.max_new_tokens")
    if len(dataset) < cfg.data.batch_size:
        raise ConfigError(f"the prompt dataset has {len(dataset)} prompts, fewer than data.batch_size="
                          f"{cfg.data.batch_size}")
    if cfg.ppo.minibatch_size > cfg.data.batch_size:
        raise ConfigError(f"ppo.minibatch_size={cfg.ppo.minibatch_size} exceeds data.batch_size={cfg.data.batch_size}")


@torch.no_grad()
def check_reward_model(reward_model, dataset) -> None:
    """Probe the reward model on 2 prompts: it must return ``(rewards [B, L], end_scores [B])``."""
    n = min(2, len(dataset))
    probe = [dataset[i] for i in range(n)]
    device = next(reward_model.parameters(), torch.zeros(())).device
    ids = torch.stack([p["input_ids"] for p in probe]).to(device)
    mask = torch.stack([p["attention_mask"] for p in probe]).to(device)
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


def build_algorithm(cfg: DictConfig):
    """``(algorithm, update config, sampling params)``: the typed sections the update reads, from the
    ``ppo``, ``trainer`` and ``rollout`` config sections (the update never sees the whole config)."""
    from rlhf_train.algorithms.ppo import PPO, PPOConfig
    from rlhf_train.algorithms.update import UpdateConfig
    from rlhf_train.core.sampling import SamplingParams

    ppo = PPOConfig(**OmegaConf.to_container(cfg.ppo, resolve=True))
    update = UpdateConfig(num_epochs=ppo.num_epochs, minibatch_size=ppo.minibatch_size,
                          gradient_accumulation_steps=ppo.gradient_accumulation_steps, max_grad_norm=ppo.max_grad_norm,
                          max_consecutive_faults=cfg.trainer.max_consecutive_faults)
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    return PPO(ppo), update, sampling


def build_rollout(cfg: DictConfig, comps: Components, policy, accelerator, run_dir):
    """``RolloutFromModel`` over the prepared policy: the HF ``generate`` backend, the reward model as the
    reward source, the reference pass (in-process or a Ray service) and the transform stack from the config.
    No KL controller is handed to it: the loop owns the controller and passes its coefficient per call."""
    from rlhf_train.infra.distributed import in_policy_precision
    from rlhf_train.rewards.transforms import build_transform_stack
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    ref_fn = None
    if cfg.transforms.get("ref_logprob") and cfg.transforms.ref_logprob.get("use_ray_service"):
        from rlhf_train.models.ray_reference import ray_ref_log_prob_fn

        ref_fn = ray_ref_log_prob_fn(cfg, comps.ref_model, run_dir)
        comps.ref_model.to("cpu")  # the actor holds the reference now; free the accelerator's memory
    r = cfg.rollout
    rollout = RolloutFromModel(
        policy, comps.ref_model, comps.reward_model, max_new_tokens=r.max_new_tokens, score_clip=r.score_clip,
        tokenizer=comps.tokenizer, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, do_sample=r.do_sample,
        logprob_batch_size=r.logprob_batch_size, unwrap_fn=accelerator.unwrap_model, ref_log_prob_fn=ref_fn,
        # log-probs and values straight from generate's steps (no second policy pass), unless the loss's
        # forward runs under autocast while generate does not: then one scoring pass keeps ratio 1 exact
        logprobs_from_generate=accelerator.mixed_precision == "no",
    )
    if ref_fn is None and accelerator.mixed_precision != "no":
        rollout.ref_log_prob_fn = in_policy_precision(rollout.ref_log_prob_fn, accelerator)
    rollout.transforms = build_transform_stack(cfg.transforms, ref_log_prob_fn=rollout.ref_log_prob_fn,
                                               eos_token_id=rollout.eos_token_id)
    return rollout


def make_lr_scheduler(cfg: DictConfig, optimizer, num_update_steps: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.scheduler.name, optimizer, num_warmup_steps=cfg.scheduler.warmup_steps,
                         num_training_steps=max(num_update_steps, 1))
