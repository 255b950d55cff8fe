"""The training loop. ``train(cfg)`` reads top to bottom in numbered steps:

  0. build: validate the config, the components (tokenizer, policy, reference, reward sources, KL
     controller, prompts), the algorithm, optimizer and data; Accelerate prepares them; resume
  then, each iteration:
  1. next prompt batch (each process its own shard)
  2. rollout (``RolloutFromModel``): generate, score with the reward sources, one pass of the
     reference, the transform stack shapes the reward with the KL controller's current coefficient
  3. advantages: the algorithm's estimator (PPO: GAE, whitened over all processes' tokens; GRPO / RLOO:
     group baselines over the ``rollout.num_samples`` samples of each prompt, on one process)
  4. update: epochs over minibatches of the algorithm's loss (:mod:`rlhf_train.algorithms.update`)
  5. KL controller: updated with the per-sequence KLs of all processes (the loop owns it)
  6. log metrics reduced over processes (main process only); checkpoint every N iterations

Where things live: the math in ``rlhf_train/core/``, the algorithm (loss, estimator) in
``rlhf_train/algorithms/``, component building and pre-flight checks in :mod:`rlhf_train.loop.components`,
multi-process helpers in :mod:`rlhf_train.infra.distributed`.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.algorithms.update import minibatch_update
from rlhf_train.core.containers import Rollout
from rlhf_train.infra.checkpoint import load_checkpoint, save_checkpoint
from rlhf_train.infra.distributed import (
    cpu_only_multiprocess,
    full_weights,
    infinite_batches,
    main_process_run_dir,
    max_abs_weight,
    reduce_metrics,
    weights_problem,
)
from rlhf_train.infra.errors import ConfigError
from rlhf_train.infra.logger import build_logger, redact, write_final_metrics
from rlhf_train.infra.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from rlhf_train.infra.run_dir import claim_run_dir
from rlhf_train.loop.components import (
    build_algorithm,
    build_components,
    build_rollout,
    make_lr_scheduler,
    validate_config,
)
from rlhf_train.loop.inputs import guarded_rollout
from rlhf_train.loop.metrics import rollout_metrics, sample_rows
from rlhf_train.models.export import export_policy

log = logging.getLogger(__name__)  # under the CLI: the console and the run dir's __main__.log (Hydra's job logging)


def train(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Train as configured; returns the last iteration's metrics and history. See the module docstring."""
    from accelerate.utils import DataLoaderConfiguration

    from accelerate import Accelerator

    # 0. build: validate, seed, components, algorithm; Accelerate prepares policy / optimizer / data
    validate_config(cfg)
    run_dir = Path(run_dir or os.getcwd())
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    algorithm, update_cfg, sampling = build_algorithm(cfg)
    accelerator = Accelerator(
        cpu=cfg.trainer.cpu or cpu_only_multiprocess(), mixed_precision=cfg.trainer.mixed_precision,
        gradient_accumulation_steps=update_cfg.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    run_dir = main_process_run_dir(run_dir, accelerator)  # every process uses rank 0's run dir
    if getattr(accelerator, "is_fsdp2", False):
        raise ConfigError("FSDP2 (fsdp_version: 2 in the accelerate config) is not supported: rollouts need the "
                          "full weights; use fsdp_version: 1 (accelerate/fsdp.yaml)")
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True))))
    # one run per run dir (rank 0 decides, before any model is built): writable, locked for this run, no
    # other run's checkpoints in it, and the checkpoint to resume from (verified, written with this config)
    resume_path, run_lock = claim_run_dir(run_dir, accelerator, cfg.trainer.resume, config_yaml)
    try:
        return _train(cfg, run_dir, accelerator, algorithm, update_cfg, sampling, resume_path, config_yaml)
    finally:
        run_lock.release()


def _train(cfg, run_dir, accelerator, algorithm, update_cfg, sampling, resume_path, config_yaml) -> dict:
    """:func:`train` once the run dir is claimed: steps 0 (from building the components) to 6."""
    from accelerate.utils import set_seed
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from rlhf_train.data.prompts import collate

    set_seed(cfg.trainer.seed)  # same initial weights on every process
    comps = build_components(cfg, accelerator.device)
    kl_controller = comps.kl_controller
    trainable = [p for p in comps.policy.parameters() if p.requires_grad]  # LoRA: adapter + value head only
    optimizer = instantiate(OmegaConf.to_container(cfg.optimizer, resolve=True), params=trainable)
    group_size = cfg.rollout.get("num_samples", 1)  # completions per prompt: a rollout batch has batch_size × this
    updates_per_iter = update_cfg.num_epochs * (cfg.data.batch_size * group_size // update_cfg.minibatch_size)
    lr_scheduler = make_lr_scheduler(cfg, optimizer, updates_per_iter * cfg.trainer.num_iterations)
    loader = DataLoader(comps.dataset, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True,
                        collate_fn=getattr(comps.dataset, "collate", collate), num_workers=cfg.data.num_workers,
                        generator=torch.Generator().manual_seed(cfg.data.seed))
    # the LR scheduler is not prepared: Accelerate's wrapper steps it num_processes times per update
    # (it assumes the schedule counts single-process batches); ours counts optimizer updates
    policy, optimizer, loader = accelerator.prepare(comps.policy, optimizer, loader)
    set_seed(cfg.trainer.seed + accelerator.process_index)  # each process samples differently
    rollout = build_rollout(cfg, comps, policy, accelerator, run_dir)
    multi = accelerator.num_processes > 1
    gather = (lambda t: accelerator.gather(t.to(accelerator.device)).cpu()) if multi else (lambda t: t)
    all_reduce_sum = (lambda t: accelerator.reduce(t.to(accelerator.device), "sum").to(t.device)) if multi else None

    start_iteration, epoch, batch_in_epoch, wandb_id, run_id = 0, 0, 0, None, uuid.uuid4().hex[:12]
    fault_state = {"skipped": 0, "consecutive": 0}
    state = {}
    if resume_path is not None:
        state = load_checkpoint(resume_path, accelerator=accelerator, policy=policy, optimizer=optimizer,
                                scheduler=lr_scheduler)
        kl_controller.load_state_dict(state["kl_controller"])
        start_iteration, wandb_id, run_id = state["iteration"], state.get("wandb_id"), state.get("run_id", run_id)
        epoch, batch_in_epoch = state["data_epoch"], state["data_batch"]
        fault_state = state.get("faults", fault_state)
        if accelerator.is_main_process:
            log.info("[rlhf_train] resumed from %s at iteration %d (run %s)", resume_path, start_iteration, run_id)
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1000 + accelerator.process_index + start_iteration)
    if "ppo_generator" in state.get("process", {}):  # this process's minibatch order (its rng_rank{r}.pt)
        gen.set_state(state["process"]["ppo_generator"])
    elif "ppo_generator" in state:  # a checkpoint from before per-process states: rank 0's
        gen.set_state(torch.tensor(state["ppo_generator"], dtype=torch.uint8))
    initial_max_abs = max_abs_weight(accelerator.unwrap_model(policy))  # the fault stop's divergence scale
    logger = None
    if accelerator.is_main_process:
        logger = build_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True),
                              resume_iteration=start_iteration if resume_path else None, resume_id=wandb_id)
    preempt = PreemptionHandler().install()
    batches = infinite_batches(loader, accelerator, epoch, batch_in_epoch)
    progress = None
    if accelerator.is_main_process and cfg.trainer.progress_bar:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.trainer.num_iterations, initial=start_iteration, desc="RL", dynamic_ncols=True)

    def checkpoint(iteration: int):
        st = {"run_id": run_id, "kl_controller": kl_controller.state_dict(), "data_epoch": epoch,
              "data_batch": batch_in_epoch + 1, "faults": fault_state,
              "wandb_id": getattr(logger, "run_id", None) if logger else None}
        return save_checkpoint(run_dir, iteration, accelerator=accelerator, policy=policy, optimizer=optimizer,
                               scheduler=lr_scheduler, trainer_state=st, config_yaml=config_yaml,
                               tokenizer=comps.tokenizer, keep=cfg.trainer.keep_checkpoints,
                               rank_state={"ppo_generator": gen.get_state()})  # each process's own

    metrics: dict = {}
    history: list[dict] = []
    iteration = start_iteration
    try:
        for iteration in range(start_iteration + 1, cfg.trainer.num_iterations + 1):
            t0 = time.perf_counter()
            # 1. next prompt batch (this process's shard)
            epoch, batch_in_epoch, batch = next(batches)
            # 2. rollout: generate, score, reference pass, reward shaping with the controller's β
            # (KL in the loss, e.g. GRPO: the reward is shaped with β = 0 and the controller stays idle)
            kl_coef = kl_controller.coef if algorithm.kl_in_reward else 0.0
            policy.eval()  # dropout stays off by design, in the update too
            with full_weights(policy, accelerator):  # FSDP / ZeRO-3: gather the shards for generate
                ro = guarded_rollout(lambda: Rollout.from_torchrl(rollout.rollout_from_data(batch, kl_coef=kl_coef)),
                                     fault_state, cfg.trainer.max_consecutive_faults, accelerator)
            if ro is None:  # a reward function raised: batch skipped, counted in faults/reward_errors
                continue
            t_rollout = time.perf_counter() - t0
            # 3. advantages (and the critic's targets) from the algorithm's estimator
            ro.advantage, ro.returns = algorithm.estimator(ro, all_reduce_sum)
            # 4. the update: epochs over minibatches of the algorithm's loss
            t1 = time.perf_counter()
            update_stats = minibatch_update(policy, optimizer, lr_scheduler, accelerator, ro, algorithm, sampling,
                                            update_cfg, gen, fault_state)
            t_update = time.perf_counter() - t1
            # 5. the KL controller steps with the per-sequence KLs of all processes
            if algorithm.kl_in_reward:
                kl_controller.update(gather(ro.kl_per_sequence.detach().float()).cpu())
            # 6. metrics reduced over processes, logged by the main process; checkpoints
            kl_next = float(kl_controller.coef) if algorithm.kl_in_reward else kl_coef
            if not algorithm.kl_in_reward and getattr(algorithm, "kl_in_loss", False):
                kl_coef = kl_next = algorithm.cfg.beta  # the KL's weight in the loss
            metrics = {**rollout_metrics(ro, group_size), **update_stats, "objective/kl_coef": kl_coef,
                       "objective/kl_coef_next": kl_next,
                       "faults/skipped_updates": fault_state["skipped"],
                       "faults/reward_errors": fault_state.get("reward_errors", 0),
                       "time/rollout_s": t_rollout, "time/update_s": t_update,
                       "time/iteration_s": time.perf_counter() - t0, "lr": lr_scheduler.get_last_lr()[0]}
            metrics = reduce_metrics(metrics, accelerator)
            samples = sample_rows(ro, comps.tokenizer) if iteration % cfg.trainer.samples_every == 0 else None
            if accelerator.is_main_process:
                logger.log(metrics, iteration)
                if samples:
                    logger.log_samples(samples, iteration)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{metrics['objective/score']:.3f}",
                                         kl=f"{metrics.get('objective/kl', 0.0):.2f}")
            history.append({"iteration": iteration, **metrics})
            stop = preempt.requested
            if multi:  # any process signalled: all stop together
                stop = bool(accelerator.reduce(torch.tensor(float(stop), device=accelerator.device), "sum").item() > 0)
            if iteration % cfg.trainer.checkpoint_every == 0 or iteration == cfg.trainer.num_iterations or stop:
                checkpoint(iteration)
            if stop and iteration < cfg.trainer.num_iterations:  # (a signal during the last iteration: done anyway)
                if accelerator.is_main_process:
                    log.warning("[rlhf_train] preempted: checkpoint written at iteration %d in %s/checkpoints; "
                                "resume with trainer.resume=auto", iteration, run_dir)
                raise SystemExit(PREEMPTED_EXIT_CODE)
    except FloatingPointError as err:
        # skipped updates never touch the weights: the current ones are the last good state. Checkpoint
        # them (with a fresh fault budget for whoever resumes) unless they are somehow non-finite too.
        problem = weights_problem(accelerator.unwrap_model(policy), initial_max_abs)  # not finite, or diverged
        if problem is None:
            fault_state["consecutive"] = 0
            where = f"the last good state is checkpointed in {checkpoint(iteration)}"
        else:
            where = (f"{problem}, so they are not checkpointed; resume from a checkpoint in {run_dir}/checkpoints "
                     f"written before they diverged (and lower optimizer.lr)")
        raise FloatingPointError(f"stopped at iteration {iteration}: {err}; {where}") from None
    finally:
        preempt.restore()
        if progress is not None:
            progress.close()
        if logger is not None:
            logger.finish()
    # the trained policy as a plain Hugging Face model dir (README "Where the trained model is")
    export_state = accelerator.get_state_dict(policy)  # collective: gathers FSDP / ZeRO-3 shards
    if accelerator.is_main_process:
        export_policy(accelerator.unwrap_model(policy), comps.tokenizer, run_dir / "policy", export_state)
        log.info("[rlhf_train] trained policy (plain Hugging Face model) in %s", run_dir / "policy")
    if accelerator.is_main_process:  # final_metrics.json: what a sweep report reads (rlhf_train/pipeline/sweep.py)
        write_final_metrics(run_dir, metrics, history)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"metrics": metrics, "history": history, "policy": accelerator.unwrap_model(policy),
            "components": comps, "rollout": rollout, "algorithm": algorithm}
