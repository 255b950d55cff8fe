"""``build_run(cfg)``: everything one training run needs, each decision made once, in one :class:`Run`.

The decisions, read from the config exactly once (:class:`Decisions`): the algorithm (the registry's, by
``algorithm.name``), the group size (``rollout.num_samples``), whether a reference runs and what it is
(frozen copy | the policy with its LoRA adapter off | a Ray actor: :mod:`rlhf_train.models.reference`),
the precision (``trainer.precision``: :mod:`rlhf_train.loop.precision`) and the generation backend
(``generation=...``).
The steps, in the order the RNG sees them (same seed, same initial weights on every process):

  1. the config checks (:func:`rlhf_train.loop.checks.check_config`), then the decisions;
  2. tokenizer, the prompt dataset (first: its errors come before any model is built), policy (a value
     head only for an algorithm with a critic), the reference's model, the reward model and sources, the
     KL controller; the checks that need them
     (:func:`rlhf_train.loop.checks.check_built`);
  3. optimizer over the trainable parameters (LoRA: adapter + value head), LR schedule, data loader;
     Accelerate prepares policy, optimizer and loader;
  4. the reference, the backend, the shaping stack and the ``RolloutFromModel`` that assembles them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.algorithms.base import Algorithm
from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
from rlhf_train.algorithms.selection import RowSelection
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.infra.errors import instantiate_or_config_error
from rlhf_train.loop import checks
from rlhf_train.loop.components import (
    build_backend,
    build_dataset,
    build_env,
    build_reference,
    build_reference_model,
    build_reward_model,
    build_sources,
    build_tokenizer,
    make_lr_scheduler,
)
from rlhf_train.loop.precision import ACCELERATE_NAMES, check_device_precision, decide_precision
from rlhf_train.models.scoring import set_fp32_lm_head
from rlhf_train.models.shared_prompt import set_shared_prompt
from rlhf_train.rollout.multi_turn import MultiTurnRollout
from rlhf_train.rollout.rollout_from_model import RolloutFromModel, special_ids


@dataclass(frozen=True)
class Decisions:
    """What the config decides, read once."""

    algorithm: Algorithm
    update: UpdateConfig
    sampling: SamplingParams       # the rollout's sampling distribution (log-probs: its temperature alone)
    group_size: int                # rollout.num_samples: completions per prompt, adjacent rows
    precision: str | None          # trainer.precision: fp32 | bf16 | fp16 (None: what `accelerate launch` was given)
    rows: RowSelection | None = None  # the rows the update trains on (filter_zero_std_groups, mask_truncated_...)

    @property
    def needs_reference(self) -> bool:
        return self.algorithm.needs_reference


def decide(cfg: DictConfig) -> Decisions:
    """The typed sections the run reads (the update never sees the whole config)."""
    from rlhf_train.algorithms.registry import build_algorithm

    update = UpdateConfig(**OmegaConf.to_container(cfg["update"], resolve=True))
    algo = AlgorithmConfig(**OmegaConf.to_container(cfg.algorithm, resolve=True))
    group_size = cfg.rollout.num_samples
    algorithm = build_algorithm(algo, update, group_size, cfg.rollout.max_new_tokens)
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    rows = RowSelection(group_size, update.minibatch_size, getattr(algorithm.estimator, "relative_to_group", False),
                        algo.filter_zero_std_groups, algo.mask_truncated_completions)
    return Decisions(algorithm, update, sampling, group_size, decide_precision(cfg.trainer), rows)


@dataclass
class Run:
    """One run's objects. ``rollout`` is what the loop calls each iteration; ``gather`` / ``all_reduce_sum``
    collect over processes (identity / ``None`` on one)."""

    cfg: DictConfig
    decisions: Decisions
    accelerator: Any
    tokenizer: Any
    policy: Any                    # the Accelerate-prepared policy
    optimizer: Any
    lr_scheduler: Any
    loader: Any
    dataset: Any
    reward_model: Any              # the reward_model group's model (None: the `rewards` entries score alone)
    rollout: RolloutFromModel
    kl_controller: Any
    gather: Callable[[torch.Tensor], torch.Tensor]
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None

    @property
    def algorithm(self) -> Algorithm:
        return self.decisions.algorithm


def make_accelerator(cfg: DictConfig, decisions: Decisions):
    """Accelerate's ``Accelerator`` for this run (CPU when asked or when several CPU processes run)."""
    from accelerate.utils import DataLoaderConfiguration

    from accelerate import Accelerator
    from rlhf_train.infra.distributed import cpu_only_multiprocess
    from rlhf_train.infra.errors import ConfigError

    precision = ACCELERATE_NAMES[decisions.precision] if decisions.precision is not None else None
    accelerator = Accelerator(
        cpu=cfg.trainer.cpu or cpu_only_multiprocess(), mixed_precision=precision,
        gradient_accumulation_steps=decisions.update.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    if getattr(accelerator, "is_fsdp2", False):
        raise ConfigError("FSDP2 (fsdp_version: 2 in the accelerate config) is not supported: rollouts need the "
                          "full weights; use fsdp_version: 1 (accelerate/fsdp.yaml)")
    check_device_precision(accelerator)
    return accelerator


def build_run(cfg: DictConfig, accelerator=None, run_dir: str | Path | None = None,
              decisions: Decisions | None = None, tokenizer: Any = None) -> Run:
    """Steps 1-4 of the module docstring (the config checks too, unless ``decisions`` says they ran).
    ``tokenizer``: use this one instead of the ``tokenizer`` group's (benchmarks on random token ids)."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from rlhf_train.data.prompts import collate

    if decisions is None:  # 1. checks, decisions
        checks.check_config(cfg)
        decisions = decide(cfg)
    if accelerator is None:
        accelerator = make_accelerator(cfg, decisions)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device, algorithm = accelerator.device, decisions.algorithm
    # 2. the components (same initial weights on every process)
    checks.check_models_set(cfg)
    set_seed(cfg.trainer.seed)
    tokenizer = build_tokenizer(cfg) if tokenizer is None else tokenizer
    dataset = build_dataset(cfg, tokenizer)  # before the models: its errors come first (it draws no global RNG)
    policy = instantiate_or_config_error(cfg.policy, tokenizer=tokenizer, value_head=algorithm.needs_critic,
                                         gradient_checkpointing=decisions.update.gradient_checkpointing)
    ref_model = build_reference_model(cfg, policy, tokenizer, algorithm.needs_reference, device)
    for lm in (policy.lm, ref_model):  # trainer.fp32_lm_head, on the heads themselves (every pass reads it there)
        if lm is not None:
            set_fp32_lm_head(lm, cfg.trainer.fp32_lm_head)
    reward_model = build_reward_model(cfg, tokenizer, device)
    sources = build_sources(cfg, tokenizer, reward_model, device)
    for model in (policy, ref_model, *(getattr(s, "model", None) for s, _ in sources.values())):
        if isinstance(model, torch.nn.Module):  # trainer.shared_prompt, on the trunks (as the head's setting)
            set_shared_prompt(model, cfg.trainer.shared_prompt)
    kl_controller = instantiate_or_config_error(cfg.kl_controller)
    checks.check_built(cfg, tokenizer, policy, reward_model, sources, dataset)
    # 3. optimizer, schedule, data; Accelerate prepares them
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: adapter + value head only
    optimizer = instantiate_or_config_error(OmegaConf.to_container(cfg.optimizer, resolve=True), params=trainable)
    u = decisions.update
    updates_per_iter = u.num_epochs * (cfg.data.batch_size * decisions.group_size // u.minibatch_size)
    lr_scheduler = make_lr_scheduler(cfg, optimizer, updates_per_iter * cfg.trainer.num_iterations)
    loader = DataLoader(dataset, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True,
                        collate_fn=getattr(dataset, "collate", collate), num_workers=cfg.data.num_workers,
                        generator=torch.Generator().manual_seed(cfg.data.seed))
    # the LR scheduler is not prepared: Accelerate's wrapper steps it num_processes times per update
    # (it assumes the schedule counts single-process batches); ours counts optimizer updates
    prepared, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
    set_seed(cfg.trainer.seed + accelerator.process_index)  # each process samples differently
    # 4. reference, backend, shaping, the rollout
    unwrapped = accelerator.unwrap_model(prepared)
    reference = build_reference(cfg, unwrapped.lm, ref_model, decisions.sampling, accelerator, run_dir) \
        if algorithm.needs_reference else None
    eos, pad = special_ids(unwrapped.lm, tokenizer)
    # the backend records the sampler's log-probs (and values) as it samples: they are the rollout's π_old with no
    # second policy pass, unless the trainer's own no-grad pass gives π_old: under autocast (bf16 / fp16: the
    # decode steps and the update's forward round differently; that pass keeps the first ratio exact), with LoRA
    # (policy and reference log-probs from the same one-pass code: the first iteration's KL is exactly 0) and
    # with algorithm.is_correction (it weighs π_old against the sampler's log-probs)
    autocast = accelerator.autocast if accelerator.mixed_precision != "no" else None
    trainer_pass = (autocast is not None or (reference is not None and reference.kind == "adapter_off")
                    or algorithm.corrects_mismatch)
    backend = build_backend(cfg, prepared, eos, pad, decisions.sampling, True, accelerator.unwrap_model)
    shaping = build_shaping_for(cfg, eos)
    env, env_rewards = build_env(cfg, sources)  # env=<name>: episodes (MultiTurnRollout), their reward a source
    episodes = {"env": env, "tokenizer": tokenizer, "env_rewards": env_rewards} if env is not None else {}
    rollout_cls = MultiTurnRollout if env is not None else RolloutFromModel
    rollout = rollout_cls(prepared, backend, reference, sources, shaping, eos_token_ids=eos, pad_token_id=pad,
                          max_new_tokens=cfg.rollout.max_new_tokens, sampling=decisions.sampling,
                          num_samples=decisions.group_size, logprob_batch_size=cfg.rollout.logprob_batch_size,
                          unwrap_fn=accelerator.unwrap_model,
                          token_budget=decisions.update.token_budget if decisions.update.packing else None,
                          trainer_pass=trainer_pass, autocast=autocast, **episodes)
    multi = accelerator.num_processes > 1
    gather = (lambda t: accelerator.gather(t.to(accelerator.device)).cpu()) if multi else (lambda t: t)
    all_reduce_sum = (lambda t: accelerator.reduce(t.to(accelerator.device), "sum").to(t.device)) if multi else None
    return Run(cfg, decisions, accelerator, tokenizer, prepared, optimizer, lr_scheduler, loader, dataset,
               reward_model, rollout, kl_controller, gather, all_reduce_sum)


def build_shaping_for(cfg: DictConfig, eos_token_ids: tuple[int, ...]) -> dict:
    """The ``transforms`` dict built into the shaping stack, with the tokenizer's EOS ids."""
    from rlhf_train.rewards.shaping import build_shaping

    return build_shaping(cfg.transforms, eos_token_id=list(eos_token_ids))
