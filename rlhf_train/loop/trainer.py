"""The PPO loop. ``train(cfg)`` reads top to bottom; the math lives in :mod:`rlhf_train.core.logprob_kernel`, the
minibatch update in :mod:`rlhf_train.algorithms.update`, component building and pre-flight checks in
:mod:`rlhf_train.loop.components`, multi-process helpers in :mod:`rlhf_train.infra.distributed`.

Each iteration:
  1. next prompt batch (each process its own shard)
  2. ``RolloutFromModel``: generate, then one forward pass each of policy (log-probs, values),
     reference and reward model; the transform stack shapes the reward
  3. GAE over response tokens, advantages whitened over all processes' tokens
  4. PPO epochs over minibatches (gradient accumulation through Accelerate)
  5. step the KL controller with the mean per-sequence KL of all processes
  6. log metrics reduced over processes (main process only); checkpoint every N iterations
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.algorithms.update import finite_rows, global_masked_whiten, ppo_update
from rlhf_train.core.advantages import gae
from rlhf_train.core.masked import masked_mean
from rlhf_train.infra.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from rlhf_train.infra.distributed import (
    cpu_only_multiprocess,
    full_weights,
    in_policy_precision,
    infinite_batches,
    main_process_run_dir,
    reduce_metrics,
)
from rlhf_train.infra.errors import ConfigError
from rlhf_train.infra.logger import build_logger, redact
from rlhf_train.infra.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from rlhf_train.infra.run_dir import check_writable
from rlhf_train.loop.components import (
    build_components,
    make_lr_scheduler,
    validate_config,
)
from rlhf_train.pipeline.sweep import write_final_metrics
from rlhf_train.rewards.transforms import build_transform_stack
from rlhf_train.rollout.rollout_from_model import RolloutFromModel


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def _rollout_metrics(td) -> dict:
    mask = td["masks", "response"]
    nxt = td["next"]
    return {
        "objective/reward_raw": nxt["reward_raw"].sum(-1).mean(),   # shaped score per sequence
        "objective/reward_kl": nxt["reward_kl"].sum(-1).mean(),     # KL penalty per sequence
        "objective/reward_total": nxt["reward"].sum(-1).mean(),     # the sum PPO maximises
        "objective/score": nxt["score_raw"].mean(),                 # raw reward-model score
        "objective/kl": td["kl_per_sequence"].mean(),               # mean per-sequence KL (nats)
        "objective/kl_coef": td["kl_coef"][0],
        "objective/entropy_sampled": -(td["sample_log_prob"].sum(-1)).mean(),
        "response/length": mask.sum(-1).float().mean(),
        "response/eos_rate": nxt["terminated"].any(-1).float().mean(),
        "val/value_mean": masked_mean(td["values"], mask),
        "val/advantage_mean_raw": masked_mean(td["advantage_raw"], mask),
        "val/return_mean": masked_mean(td["returns"], mask),
    }


def _samples(td, tokenizer, n: int = 4) -> list[dict]:
    tok = td["tokens"]
    rows = []
    for i in range(min(n, td.batch_size[0])):
        prompt = tok.prompt[i][td["masks", "prompt"][i]]
        response = tok.response[i][td["masks", "response"][i]]
        rows.append({"prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response),
                     "score": float(td["next", "score_raw"][i]),
                     "reward": float(td["next", "reward"][i].sum())})
    return rows


def train(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Run PPO as configured; returns the last iteration's metrics. See the module docstring."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader

    from rlhf_train.data.prompts import collate

    # 0. set-up: validate, seed, build components, let Accelerate prepare model/optimizer/data
    validate_config(cfg)
    run_dir = Path(run_dir or os.getcwd())
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    accelerator = Accelerator(
        cpu=cfg.trainer.cpu or cpu_only_multiprocess(), mixed_precision=cfg.trainer.mixed_precision,
        gradient_accumulation_steps=cfg.ppo.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    run_dir = main_process_run_dir(run_dir, accelerator)  # every process uses rank 0's run dir
    if getattr(accelerator, "is_fsdp2", False):
        raise ConfigError("FSDP2 (fsdp_version: 2 in the accelerate config) is not supported: rollouts need the "
                          "full weights; use fsdp_version: 1 (conf/accelerate/fsdp.yaml)")
    if accelerator.is_main_process:
        check_writable(run_dir, "hydra.run.dir")  # probes with a temp file (os.access lies for root)
        run_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.trainer.seed)  # same initial weights on every process
    resume_path = resolve_resume(cfg.trainer.resume, run_dir)
    comps = build_components(cfg, accelerator.device)
    optimizer_cfg = OmegaConf.to_container(cfg.optimizer, resolve=True)
    from hydra.utils import instantiate

    optimizer = instantiate(optimizer_cfg, params=comps.policy.parameters())
    updates_per_iter = cfg.ppo.num_epochs * (cfg.data.batch_size // cfg.ppo.minibatch_size)
    lr_scheduler = make_lr_scheduler(cfg, optimizer, updates_per_iter * cfg.trainer.num_iterations)
    loader = DataLoader(comps.dataset, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True,
                        collate_fn=collate, num_workers=cfg.data.num_workers,
                        generator=torch.Generator().manual_seed(cfg.data.seed))
    # the LR scheduler is not prepared: Accelerate's wrapper steps it num_processes times per update
    # (it assumes the schedule counts single-process batches); ours counts optimizer updates
    policy, optimizer, loader = accelerator.prepare(comps.policy, optimizer, loader)
    # each process samples differently; the loop below re-seeds per process
    set_seed(cfg.trainer.seed + accelerator.process_index)

    gather = (lambda t: accelerator.gather(t.to(accelerator.device)).cpu()) if accelerator.num_processes > 1 else None
    ref_fn = None
    if cfg.transforms.get("ref_logprob") and cfg.transforms.ref_logprob.get("use_ray_service"):
        from rlhf_train.models.ray_reference import ray_ref_log_prob_fn

        ref_fn = ray_ref_log_prob_fn(cfg, comps.ref_model, run_dir)
        comps.ref_model.to("cpu")  # the actor holds the reference now; free the accelerator's memory
    rollout = RolloutFromModel(
        policy, comps.ref_model, comps.reward_model, max_new_tokens=cfg.rollout.max_new_tokens,
        score_clip=cfg.rollout.score_clip, kl_scheduler=comps.kl_controller, tokenizer=comps.tokenizer,
        temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        do_sample=cfg.rollout.do_sample, gather_fn=gather, logprob_batch_size=cfg.rollout.logprob_batch_size,
        unwrap_fn=accelerator.unwrap_model, ref_log_prob_fn=ref_fn,
        # log-probs and values straight from generate's steps (no second policy pass), unless the loss's
        # forward runs under autocast while generate does not: then one scoring pass keeps ratio 1 exact
        logprobs_from_generate=accelerator.mixed_precision == "no",
    )
    if ref_fn is None and accelerator.mixed_precision != "no":
        rollout.ref_log_prob_fn = in_policy_precision(rollout.ref_log_prob_fn, accelerator)
    rollout.transforms = build_transform_stack(
        cfg.transforms, ref_log_prob_fn=rollout.ref_log_prob_fn, eos_token_id=rollout.eos_token_id)

    start_iteration, epoch, batch_in_epoch, wandb_id = 0, 0, 0, None
    fault_state = {"skipped": 0, "consecutive": 0}
    if resume_path is not None:
        state = load_checkpoint(resume_path, accelerator=accelerator, policy=policy, optimizer=optimizer,
                                scheduler=lr_scheduler)
        comps.kl_controller.load_state_dict(state["kl_controller"])
        rollout._kl_queue.extend(torch.tensor(v) for v in state.get("kl_queue", []))
        start_iteration, wandb_id = state["iteration"], state.get("wandb_id")
        epoch, batch_in_epoch = state["data_epoch"], state["data_batch"]
        fault_state = state.get("faults", fault_state)
        if accelerator.is_main_process:
            print(f"[rlhf_train] resumed from {resume_path} at iteration {start_iteration}", flush=True)
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1000 + accelerator.process_index + start_iteration)
    if resume_path is not None and "ppo_generator" in state:
        gen.set_state(torch.tensor(state["ppo_generator"], dtype=torch.uint8))

    config_yaml = OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True))))
    logger = None
    if accelerator.is_main_process:
        logger = build_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True),
                              resume_iteration=start_iteration if resume_path else None, resume_id=wandb_id)
    preempt = PreemptionHandler().install()
    batches = infinite_batches(loader, accelerator, epoch, batch_in_epoch)
    progress = None
    if accelerator.is_main_process and cfg.trainer.progress_bar:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.trainer.num_iterations, initial=start_iteration, desc="PPO", dynamic_ncols=True)

    def checkpoint(iteration: int):
        st = {"kl_controller": comps.kl_controller.state_dict(),
              "kl_queue": [float(x) for q in rollout._kl_queue for x in q.reshape(-1)],
              "data_epoch": epoch, "data_batch": batch_in_epoch + 1, "faults": fault_state,
              "wandb_id": getattr(logger, "run_id", None) if logger else None,
              "ppo_generator": gen.get_state().tolist()}
        return save_checkpoint(run_dir, iteration, accelerator=accelerator, policy=policy, optimizer=optimizer,
                               scheduler=lr_scheduler, trainer_state=st, config_yaml=config_yaml,
                               tokenizer=comps.tokenizer, keep=cfg.trainer.keep_checkpoints)

    metrics: dict = {}
    history: list[dict] = []
    iteration = start_iteration
    try:
        for iteration in range(start_iteration + 1, cfg.trainer.num_iterations + 1):
            t0 = time.perf_counter()
            # 1. next prompt batch (this process's shard)
            epoch, batch_in_epoch, batch = next(batches)
            # 2. rollout: generate + one pass each of policy, reference, reward model; reward shaping
            policy.eval()
            with full_weights(policy, accelerator):  # FSDP / ZeRO-3: gather the shards for generate
                td = rollout.rollout_from_data(batch)
            t_rollout = time.perf_counter() - t0
            # 3. GAE over response tokens; advantages whitened over all processes' response tokens
            mask = td["masks", "response"]
            advantage, returns = gae(td["next", "reward"], td["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
            td.set("advantage_raw", advantage)
            td.set("returns", returns)
            if cfg.ppo.whiten_advantages:  # a faulty (non-finite) row must not poison the others' statistics
                advantage = global_masked_whiten(advantage, mask & finite_rows(td)[:, None], accelerator)
            td.set("advantage", advantage)
            # 4. PPO epochs over minibatches (policy stays in eval mode: dropout is off by design)
            t1 = time.perf_counter()
            ppo_stats = ppo_update(policy, optimizer, lr_scheduler, accelerator, td, cfg, gen, fault_state)
            t_update = time.perf_counter() - t1
            # 5. the KL controller steps with the mean per-sequence KL of all processes
            kl_coef_used = rollout.kl_coef
            rollout.step_scheduler()
            # 6. metrics reduced over processes, logged by the main process; checkpoints
            metrics = {**_rollout_metrics(td), **ppo_stats, "objective/kl_coef": kl_coef_used,
                       "objective/kl_coef_next": rollout.kl_coef,
                       "faults/skipped_updates": fault_state["skipped"],
                       "time/rollout_s": t_rollout, "time/update_s": t_update,
                       "time/iteration_s": time.perf_counter() - t0, "lr": lr_scheduler.get_last_lr()[0]}
            metrics = reduce_metrics(metrics, accelerator)
            samples = _samples(td, comps.tokenizer) if iteration % cfg.trainer.samples_every == 0 else None
            if accelerator.is_main_process:
                logger.log(metrics, iteration)
                if samples:
                    logger.log_samples(samples, iteration)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{metrics['objective/score']:.3f}", kl=f"{metrics['objective/kl']:.2f}")
            history.append({"iteration": iteration, **metrics})
            stop = preempt.requested
            if accelerator.num_processes > 1:
                flag = accelerator.reduce(torch.tensor(float(stop), device=accelerator.device), "sum")
                stop = bool(flag.item() > 0)  # any process signalled: all stop together
            if iteration % cfg.trainer.checkpoint_every == 0 or iteration == cfg.trainer.num_iterations or stop:
                checkpoint(iteration)
            if stop and iteration < cfg.trainer.num_iterations:  # (a signal during the last iteration: done anyway)
                if accelerator.is_main_process:
                    print(f"[rlhf_train] preempted: checkpoint written at iteration {iteration} in "
                          f"{run_dir}/checkpoints; resume with trainer.resume=auto", flush=True)
                raise SystemExit(PREEMPTED_EXIT_CODE)
    except FloatingPointError as err:
        # skipped updates never touch the weights: the current ones are the last good state. Checkpoint
        # them (with a fresh fault budget for whoever resumes) unless they are somehow non-finite too.
        weights_ok = all(torch.isfinite(p).all() for p in accelerator.unwrap_model(policy).parameters())
        if weights_ok:
            fault_state["consecutive"] = 0
            where = f"the last good state is checkpointed in {checkpoint(iteration)}"
        else:
            where = f"the weights are not finite; the newest checkpoint in {run_dir}/checkpoints is the last good state"
        raise FloatingPointError(f"stopped at iteration {iteration}: {err}; {where}") from None
    finally:
        preempt.restore()
        if progress is not None:
            progress.close()
        if logger is not None:
            logger.finish()
    if accelerator.is_main_process:  # final_metrics.json: what a sweep report reads (rlhf_train/sweep.py)
        write_final_metrics(run_dir, metrics, history)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"metrics": metrics, "history": history, "policy": accelerator.unwrap_model(policy),
            "components": comps, "rollout": rollout}
