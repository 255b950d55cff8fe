"""Building the PPO stage's components from the config, with the checks that run before any work.

``validate_config(cfg)`` rejects bad values Hydra's types cannot catch (one :class:`ConfigError` line);
``build_components(cfg)`` instantiates tokenizer, policy, reference, reward model, KL controller and prompt
dataset, then checks that prompts + responses fit the policy's context and probes the reward model's
output shapes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.core.kl import KL_ESTIMATORS
from rlhf_train.infra.errors import ConfigError
from rlhf_train.loop.inputs import (
    build_reward_model,
    build_sources,
    build_tokenizer,
    check_vocabularies,
    probe_sources,
)
from rlhf_train.models.loading import context_length
from rlhf_train.models.lora import adapter_disabled, is_peft_model, lora_settings
from rlhf_train.rewards.transforms import check_transform_stack

log = logging.getLogger(__name__)


@dataclass
class Components:
    tokenizer: Any
    policy: Any
    ref_model: Any
    reward_model: Any
    kl_controller: Any
    dataset: Any
    reward_sources: Any = None  # {name: (RewardSource, weight)}: the reward model and the `rewards` entries


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
    validate_algorithm(cfg)
    if cfg.ppo.minibatch_size % cfg.ppo.gradient_accumulation_steps:
        raise ConfigError(f"ppo.minibatch_size={cfg.ppo.minibatch_size} must be a multiple of "
                          f"ppo.gradient_accumulation_steps={cfg.ppo.gradient_accumulation_steps}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature} must be positive")
    if cfg.trainer.keep_checkpoints < 0:
        raise ConfigError(f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} must be >= 0 (0 keeps all)")
    # ---- issue 17 (reliability): '+'-added keys, names and ranges, batch vs minibatch, model dirs ----
    from rlhf_train.loop.config_checks import check_values

    check_values(cfg)
    # ---- end of issue 17's block ----
    # the reward-shaping stack is built after the models: check it now (KL estimator names, then a dry
    # run of every entry on a stand-in rollout, which is cheap: no model is involved)
    for name, entry in (cfg.get("transforms") or {}).items():
        estimator = entry.get("estimator") if hasattr(entry, "get") else None
        if estimator is not None and estimator not in KL_ESTIMATORS:
            raise ConfigError(f"transforms.{name}.estimator='{estimator}' is not valid; choose one of: "
                              f"{', '.join(KL_ESTIMATORS)}")
    check_transform_stack(cfg.get("transforms"))
    # LoRA (policy.lora.r > 0): the reference is the policy with its adapter off, there is no copy to serve
    if lora_settings(cfg.policy.get("lora")) is not None and (cfg.transforms.get("ref_logprob") or {}).get(
            "use_ray_service"):
        raise ConfigError("transforms.ref_logprob.use_ray_service=true: with policy.lora.r>0 the reference is the "
                          "policy with its adapter disabled, no model to serve; set it to false (or policy.lora.r=0)")


def validate_algorithm(cfg: DictConfig) -> None:
    """The ``algorithm`` section against ``rollout.num_samples`` and ``ppo``: one line naming the key and the fix."""
    from rlhf_train.algorithms.configs import ALGORITHM_NAMES
    from rlhf_train.core.advantages import SCALE_REWARDS
    from rlhf_train.core.losses import LOSS_AGGS, RATIO_LEVELS

    a, k = cfg.get("algorithm") or {}, cfg.rollout.get("num_samples", 1)
    name = a.get("name", "ppo")
    for key, value, allowed in (("name", name, ALGORITHM_NAMES), ("scale_rewards", a.get("scale_rewards", "group"),
                                SCALE_REWARDS), ("loss_agg", a.get("loss_agg", "token_mean"), LOSS_AGGS),
                                ("ratio_level", a.get("ratio_level", "token"), RATIO_LEVELS)):
        if value not in allowed:
            raise ConfigError(f"algorithm.{key}='{value}' is not valid; choose one of: {', '.join(allowed)}")
    if k is None or k < 1:
        raise ConfigError(f"rollout.num_samples={k} must be positive")
    if name in ("grpo", "rloo", "reinforce_pp_baseline") and k < 2:
        raise ConfigError(f"algorithm={name} compares the samples of a prompt: set rollout.num_samples >= 2 "
                          f"(got {k})")
    for key in ("clip_low", "clip_high", "norm_length"):
        if a.get(key) is not None and a.get(key) <= 0:
            raise ConfigError(f"algorithm.{key}={a.get(key)} must be positive (or null)")
    if a.get("beta", 0.0) < 0:
        raise ConfigError(f"algorithm.beta={a.get('beta')} must be >= 0")
    if a.get("beta", 0.0) > 0 and a.get("kl_in_reward", True):
        raise ConfigError(f"algorithm.beta={a.get('beta')} puts the KL in the loss while algorithm.kl_in_reward=true "
                          f"also puts it in the reward: set algorithm.kl_in_reward=false or algorithm.beta=0")
    if name == "ppo":
        default = {"loss_agg": "token_mean", "ratio_level": "token", "clip_low": None, "clip_high": None,
                   "kl_in_reward": True, "beta": 0.0}
        changed = [key for key, value in default.items() if a.get(key, value) != value]
        if changed:
            raise ConfigError(f"algorithm.{changed[0]} does not apply to algorithm=ppo (PPO: clipped surrogate with "
                              f"ppo.clip_eps, token mean, KL in the reward); choose algorithm=grpo|rloo|reinforce_pp")


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
        if node is not None and node.get("_target_") and "pretrained" in node and (
                OmegaConf.is_missing(node, "pretrained") or not node.pretrained) and not node.get("config"):
            raise ConfigError(f"{group}.pretrained is not set (and {group}.config is empty): "
                              f"set {group}.pretrained=<{what}>")
    algorithm = build_algorithm(cfg)[0]
    tokenizer = build_tokenizer(cfg, instantiate)  # follows the policy unless set (rlhf_train/loop/inputs.py)
    # a critic-free algorithm gets no value head (no value-head parameters to optimise or checkpoint)
    policy = instantiate(cfg.policy, tokenizer=tokenizer, value_head=algorithm.needs_critic)
    if not algorithm.needs_reference:  # no KL in the reward nor in the loss: no reference is built (or run)
        ref_model = None
    elif is_peft_model(policy.lm):  # LoRA: π_ref = the policy with its adapter disabled (build_rollout)
        ref_model = None
        log.info("[rlhf_train] policy.lora.r=%d: no reference copy is built; the reference is the policy with its "
                 "LoRA adapter disabled (ref_model.* is not used)", cfg.policy.lora.r)
    else:
        ref_model = instantiate(cfg.ref_model, policy=policy, tokenizer=tokenizer, device=None, _convert_="all")
        ref_model.to(cfg.ref_model.device or device)
    reward_model = build_reward_model(cfg, tokenizer, instantiate, device)  # None with reward_model=null
    check_vocabularies(tokenizer, policy, reward_model)
    reward_sources = build_sources(cfg, tokenizer, reward_model, device)  # + the `rewards` entries, by name
    kl_controller = instantiate(cfg.kl_controller)
    data_kwargs = {k: v for k, v in cfg.data.items() if k not in ("batch_size", "num_workers")}
    dataset = instantiate(data_kwargs, tokenizer=tokenizer)
    check_fits(cfg, policy, dataset)
    if reward_model is not None:
        check_reward_model(reward_model, dataset)
    probe_sources(reward_sources, dataset, cfg.data.batch_size)  # every source scores the first batch
    return Components(tokenizer, policy, ref_model, reward_model, kl_controller, dataset, reward_sources)


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
    rollouts = cfg.data.batch_size * cfg.rollout.get("num_samples", 1)
    if cfg.ppo.minibatch_size > rollouts:
        raise ConfigError(f"ppo.minibatch_size={cfg.ppo.minibatch_size} exceeds the rollouts per iteration, "
                          f"data.batch_size={cfg.data.batch_size} x rollout.num_samples="
                          f"{cfg.rollout.get('num_samples', 1)}")


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


def build_algorithm(cfg: DictConfig):
    """``(algorithm, update config, sampling params)``: the typed sections the update reads, from the
    ``algorithm``, ``ppo``, ``trainer`` and ``rollout`` config sections (the update never sees the whole
    config). ``algorithm.name`` picks PPO (GAE, critic) or the critic-free ``PolicyGradient``."""
    from rlhf_train.algorithms.configs import AlgorithmConfig
    from rlhf_train.algorithms.critic_free import PolicyGradient
    from rlhf_train.algorithms.ppo import PPO, PPOConfig
    from rlhf_train.algorithms.update import UpdateConfig
    from rlhf_train.core.sampling import SamplingParams

    ppo = PPOConfig(**OmegaConf.to_container(cfg.ppo, resolve=True))
    algo = AlgorithmConfig(**OmegaConf.to_container(cfg.algorithm, resolve=True)) if cfg.get("algorithm") else \
        AlgorithmConfig()
    update = UpdateConfig(num_epochs=ppo.num_epochs, minibatch_size=ppo.minibatch_size,
                          gradient_accumulation_steps=ppo.gradient_accumulation_steps, max_grad_norm=ppo.max_grad_norm,
                          max_consecutive_faults=cfg.trainer.max_consecutive_faults)
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    if algo.name == "ppo":
        return PPO(ppo), update, sampling
    return PolicyGradient(algo, ppo, cfg.rollout.get("num_samples", 1), cfg.rollout.max_new_tokens), update, sampling


def build_rollout(cfg: DictConfig, comps: Components, policy, accelerator, run_dir):
    """``RolloutFromModel`` over the prepared policy: the HF ``generate`` backend, the reward model as the
    reward source, the reference pass (in-process or a Ray service) and the transform stack from the config.
    No KL controller is handed to it: the loop owns the controller and passes its coefficient per call."""
    from rlhf_train.infra.distributed import in_policy_precision
    from rlhf_train.rewards.transforms import build_transform_stack
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    ref_fn = None
    lora_lm = accelerator.unwrap_model(policy).lm  # LoRA: the reference pass runs over it, adapter disabled
    needs_reference = build_algorithm(cfg)[0].needs_reference
    lora_lm = lora_lm if is_peft_model(lora_lm) and needs_reference else None
    if needs_reference and cfg.transforms.get("ref_logprob") and cfg.transforms.ref_logprob.get("use_ray_service"):
        from rlhf_train.models.ray_reference import ray_ref_log_prob_fn

        ref_fn = ray_ref_log_prob_fn(cfg, comps.ref_model, run_dir)
        comps.ref_model.to("cpu")  # the actor holds the reference now; free the accelerator's memory
    r = cfg.rollout
    rollout = RolloutFromModel(
        policy, lora_lm if lora_lm is not None else comps.ref_model, comps.reward_model,
        reward_sources=comps.reward_sources,
        max_new_tokens=r.max_new_tokens, score_clip=r.score_clip,
        tokenizer=comps.tokenizer, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, do_sample=r.do_sample,
        logprob_batch_size=r.logprob_batch_size, unwrap_fn=accelerator.unwrap_model, ref_log_prob_fn=ref_fn,
        num_samples=r.get("num_samples", 1),  # the samples of a prompt are adjacent rows (one process)
        hf_generate=r.get("hf_generate", False),
        # log-probs and values straight from generate's steps (no second policy pass), unless the loss's
        # forward runs under autocast while generate does not: then one scoring pass keeps ratio 1 exact;
        # LoRA: policy and reference log-probs from the same one-pass code (first iteration's KL exactly 0)
        logprobs_from_generate=accelerator.mixed_precision == "no" and lora_lm is None,
    )
    if lora_lm is not None:
        rollout.ref_log_prob_fn = adapter_disabled(rollout.ref_log_prob_fn, lora_lm)
    if ref_fn is None and rollout.ref_log_prob_fn is not None and accelerator.mixed_precision != "no":
        rollout.ref_log_prob_fn = in_policy_precision(rollout.ref_log_prob_fn, accelerator)
    entries = cfg.transforms
    if not needs_reference:  # no reference: the stack without its reference pass and KL (the rollout's kl = 0)
        entries = {k: v for k, v in cfg.transforms.items() if k not in ("ref_logprob", "kl")}
    rollout.transforms = build_transform_stack(entries, ref_log_prob_fn=rollout.ref_log_prob_fn,
                                               eos_token_id=list(rollout.eos_token_ids))
    return rollout


def make_lr_scheduler(cfg: DictConfig, optimizer, num_update_steps: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.scheduler.name, optimizer, num_warmup_steps=cfg.scheduler.warmup_steps,
                         num_training_steps=max(num_update_steps, 1))
