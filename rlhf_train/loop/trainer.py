"""The training loop: ``train(cfg)`` = :func:`~rlhf_train.loop.build.build_run` + a loop over
:func:`step`. One iteration, :func:`step`, reads top to bottom in numbered steps:

  1. the rollout: ``RolloutFromModel`` generates on the prompt batch, scores with the reward sources and
     the reference, and shapes the reward with β (the KL controller's when the KL is in the reward, 0 when
     the algorithm puts it in its loss); a ``Rollout`` comes back;
  2. advantages: the algorithm's estimator (PPO: GAE, whitened over all processes' tokens; GRPO / RLOO:
     group baselines over the ``rollout.num_samples`` samples of each prompt);
  3. the update: epochs over minibatches of the algorithm's loss (:mod:`rlhf_train.algorithms.update`), on the
     rows with something to learn (:mod:`rlhf_train.algorithms.selection`; none left: no update);
  4. the KL controller steps with the per-sequence KLs of all processes (the loop owns it);
  5. the metrics, reduced over processes.

Around it :func:`train` claims the run dir, resumes, logs, checkpoints every ``trainer.checkpoint_every``
iterations, stops on SIGTERM (exit 143 after a checkpoint) and exports the trained policy.
Benchmarks (``benchmarks/ppo_iteration.py``) call :func:`build_run` and :func:`step` themselves.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.algorithms.update import minibatch_update
from rlhf_train.core.containers import Rollout
from rlhf_train.infra.checkpoint import save_checkpoint
from rlhf_train.infra.distributed import end_training, full_weights, infinite_batches, main_process_run_dir, \
    max_abs_weight, reduce_metrics, weights_problem
from rlhf_train.infra.fingerprint import model_fingerprint
from rlhf_train.infra.logger import build_logger, redact, write_final_metrics
from rlhf_train.infra.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from rlhf_train.infra.resume import load_checkpoint
from rlhf_train.infra.run_dir import claim_run_dir
from rlhf_train.loop import checks
from rlhf_train.loop.build import Run, build_run, decide, make_accelerator
from rlhf_train.loop.evaluation import HeldOutEval
from rlhf_train.loop.metrics import ConstantSourceWatch, accuracy_thresholds, rollout_metrics, sample_rows
from rlhf_train.loop.state import TrainState
from rlhf_train.models.export import export_policy
from rlhf_train.rewards.sources import close_sources

log = logging.getLogger(__name__)  # under the CLI: the console and the run dir's __main__.log (Hydra's job logging)


def guarded_rollout(run: Run, state: TrainState, batch, kl_coef: float) -> Rollout | None:
    """``run.rollout(batch, kl_coef)``, except that a reward function that raises skips this batch: ``None``,
    counted in ``state.faults`` (``faults/reward_errors``); ``trainer.max_consecutive_faults`` such batches
    in a row stop the run (``FloatingPointError``). With several processes one failing makes all skip."""
    from rlhf_train.rewards.sources import RewardFunctionError

    accelerator, err, ro = run.accelerator, None, None
    try:
        ro = run.rollout(batch, kl_coef=kl_coef)
    except RewardFunctionError as e:
        err = e
    report = getattr(run.rollout, "reward_report", None)  # rows a reward timeout / dead worker left None
    state.faults.reward_rows_lost(report.lost if report is not None else 0)
    failed = err is not None
    if accelerator.num_processes > 1:
        failed = bool(accelerator.reduce(torch.tensor(float(failed), device=accelerator.device), "sum").item() > 0)
    if not failed:
        state.faults.reward_ok()
        return ro
    log.warning("[rlhf_train] batch skipped: %s", err or "a reward function failed on another process")
    if state.faults.reward_failed():
        raise FloatingPointError(f"{state.faults.reward_consecutive} batches in a row were skipped because a reward "
                                 f"function failed (trainer.max_consecutive_faults={state.faults.max_consecutive}); "
                                 f"last: {err or 'on another process'}")
    return None


def step(run: Run, state: TrainState, batch) -> tuple[dict, Rollout] | None:
    """One iteration on ``batch`` (this process's prompts): steps 1-5 of the module docstring. Returns the
    metrics (reduced over processes) and the rollout, or ``None`` when a reward function failed and the
    batch was skipped."""
    t0 = time.perf_counter()
    algorithm, policy, accelerator = run.algorithm, run.policy, run.accelerator
    # 1. rollout: generate, score, reference pass, shaping with β (0 when the KL is in the loss)
    kl_coef = float(run.kl_controller.coef) if algorithm.kl_in_reward else 0.0
    policy.eval()  # dropout stays off by design, in the update too
    with full_weights(policy, accelerator):  # FSDP / ZeRO-3: gather the shards for generation
        ro = guarded_rollout(run, state, batch, kl_coef)
    if ro is None:
        return None
    t_rollout = time.perf_counter() - t0
    # 2. advantages (and the critic's targets) from the algorithm's estimator
    ro.advantage, ro.returns = algorithm.estimator(ro, run.all_reduce_sum)
    # 3. the update: epochs over minibatches of the algorithm's loss, on the rows with something to learn
    t1 = time.perf_counter()
    chosen, dropped = run.decisions.rows(ro, run.gather) if run.decisions.rows is not None else (ro, 0)
    if chosen is None:  # no row of any process has a learning signal: no pass, no optimizer or LR step
        state.faults.no_signal_update()
        if accelerator.is_main_process:
            log.warning("[rlhf_train] iteration %d: update skipped, no sample had anything to learn (every group's "
                        "rewards equal, or every response left out of the loss); faults/no_signal_updates=%d",
                        state.iteration + 1, state.faults.no_signal)
        update_stats = {}
    else:
        update_stats = minibatch_update(policy, run.optimizer, run.lr_scheduler, accelerator, chosen, algorithm,
                                        run.decisions.sampling, run.decisions.update, state.generator, state.faults)
    t_update = time.perf_counter() - t1
    # 4. the KL controller steps with the per-sequence KLs of all processes
    if algorithm.kl_in_reward:
        run.kl_controller.update(run.gather(ro.kl_per_sequence.detach().float()).cpu())
        kl_next = float(run.kl_controller.coef)
    else:  # the KL's weight in the loss (0: none), what the rollout was not shaped with
        kl_coef = kl_next = algorithm.kl_weight if algorithm.kl_in_loss else kl_coef
    # 5. metrics, reduced over processes
    evaluation = run.cfg.get("evaluation") or {}  # reward/<name>/accuracy: the evaluation's threshold (default 1)
    accuracy = accuracy_thresholds(run.rollout.reward_sources, evaluation.get("accuracy_threshold", 1.0))
    metrics = {**rollout_metrics(ro, run.decisions.group_size, accuracy), **update_stats, "objective/kl_coef": kl_coef,
               "objective/kl_coef_next": kl_next, "faults/skipped_updates": state.faults.skipped,
               "faults/reward_errors": state.faults.reward_errors, "faults/no_signal_updates": state.faults.no_signal,
               "update/dropped_rows": float(dropped), "time/rollout_s": t_rollout,
               "time/update_s": t_update, "time/iteration_s": time.perf_counter() - t0,
               "lr": run.lr_scheduler.get_last_lr()[0]}
    report = getattr(run.rollout, "reward_report", None)  # the reward sources' time, rows left unscored
    metrics.update({"faults/reward_timeouts": state.faults.reward_timeouts,
                    "time/reward_s": report.seconds if report is not None else 0.0})
    metrics.update(getattr(run.rollout, "env_metrics", {}))  # env=<name>: env/... (rollout/multi_turn.py)
    return reduce_metrics(metrics, accelerator), ro


def train(cfg: DictConfig, run_dir: str | Path | None = None, teardown_exit_code: int = 0) -> dict:
    """Train as configured; returns the last iteration's metrics, the history, the policy and the run.
    ``teardown_exit_code``: the process's exit status should the process group's teardown hang once everything
    is written (:func:`~rlhf_train.infra.distributed.end_training`): 0 where the RL loop is the whole run, non-zero
    where later stages were to run in this process."""
    checks.check_config(cfg)
    decisions = decide(cfg)
    accelerator = make_accelerator(cfg, decisions)
    run_dir = main_process_run_dir(Path(run_dir or os.getcwd()), accelerator)  # every process: rank 0's dir
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True))))
    # one run per run dir (rank 0 decides, before any model is built): writable, locked for this run, no
    # other run's checkpoints in it, and the checkpoint to resume from (verified, written with this config)
    resume_path, run_lock = claim_run_dir(run_dir, accelerator, cfg.trainer.resume, config_yaml)
    run = None
    try:
        run = build_run(cfg, accelerator, run_dir, decisions)
        return _loop(run, run_dir, resume_path, config_yaml, teardown_exit_code)
    finally:
        if run is not None:  # reward functions' worker processes (a later call starts new ones)
            close_sources(run.rollout.reward_sources)
        run_lock.release()


def _last_checkpoint_line(run_dir: Path) -> str:
    """What a preemption that gave up its iteration keeps (said by the watchdog thread)."""
    from rlhf_train.infra.checkpoint_files import list_checkpoints

    done = list_checkpoints(run_dir)
    return (f"the last complete checkpoint, {done[-1]}, is kept: resume with trainer.resume=auto" if done
            else f"no checkpoint was written yet in {run_dir}")


def _loop(run: Run, run_dir: Path, resume_path, config_yaml: str, teardown_exit_code: int = 0) -> dict:
    """:func:`train` once the run is built: resume, then iterate, log, checkpoint, export."""
    cfg, accelerator, policy = run.cfg, run.accelerator, run.policy
    t = cfg.trainer
    state = TrainState.fresh(run.kl_controller, t.seed, accelerator.process_index, t.max_consecutive_faults)
    # the base model as it was loaded (policy.pretrained): a resume refuses another (rlhf_train/infra/fingerprint.py)
    base = model_fingerprint(None if OmegaConf.is_missing(cfg.policy, "pretrained") else cfg.policy.get("pretrained"))
    if resume_path is not None:
        loaded = load_checkpoint(resume_path, accelerator=accelerator, policy=policy, optimizer=run.optimizer,
                                 scheduler=run.lr_scheduler, config_yaml=config_yaml)
        state.load_state_dict(loaded, t.seed, accelerator.process_index)
        if accelerator.is_main_process:
            log.info("[rlhf_train] resumed from %s at iteration %d (run %s)", resume_path, state.iteration, state.run_id)
    start = state.iteration
    initial_max_abs = max_abs_weight(accelerator.unwrap_model(policy))  # the fault stop's divergence scale
    held_out = HeldOutEval.build(run)  # evaluation set: eval/... at 0, every evaluation.every and the last
    logger = None
    if accelerator.is_main_process:
        logger = build_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True),
                              resume_iteration=start if resume_path else None, resume_id=state.wandb_id)
        state.wandb_id = getattr(logger, "run_id", None)
    preempt = PreemptionHandler(t.get("preempt_grace_s"), lambda: _last_checkpoint_line(run_dir)).install()
    batches = infinite_batches(run.loader, accelerator, state.data_epoch, state.data_batch)
    progress = None
    if accelerator.is_main_process and t.progress_bar:
        from tqdm.auto import tqdm

        progress = tqdm(total=t.num_iterations, initial=start, desc="RL", dynamic_ncols=True)

    def checkpoint(iteration: int):
        return save_checkpoint(run_dir, iteration, accelerator=accelerator, policy=policy, optimizer=run.optimizer,
                               scheduler=run.lr_scheduler, trainer_state={**state.state_dict(), "base_model": base},
                               config_yaml=config_yaml, tokenizer=run.tokenizer, keep=t.keep_checkpoints,
                               rank_state=state.process_state_dict())  # each process's own

    constant = ConstantSourceWatch(3)  # warns once per reward source that scores every sample the same
    metrics: dict = {}
    history = state.history  # every iteration's metrics, those before a resume included (checkpointed)
    iteration = start
    try:
        if held_out is not None and start == 0:  # the initial policy, logged as iteration 0
            initial = held_out.run_at(0)
            if accelerator.is_main_process:
                logger.log(initial, 0)
        while iteration < t.num_iterations:
            state.data_epoch, state.data_batch, batch = next(batches)  # this process's shard
            out = step(run, state, batch)
            if out is not None:
                iteration = state.iteration = iteration + 1
                metrics, ro = out
                for line in constant.observe(ro.reward_sources):
                    if accelerator.is_main_process:
                        log.warning("[rlhf_train] %s", line)
                if held_out is not None and held_out.due(iteration):  # its own RNG: training unchanged
                    metrics = {**metrics, **held_out.run_at(iteration)}
                samples = (sample_rows(ro, run.tokenizer, episodes=getattr(run.rollout, "episodes", None))
                           if iteration % t.samples_every == 0 else None)
                if accelerator.is_main_process:
                    logger.log(metrics, iteration)
                    if samples:
                        logger.log_samples(samples, iteration)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(score=f"{metrics['objective/score']:.3f}",
                                             kl=f"{metrics.get('objective/kl', 0.0):.2f}")
                history.append({"iteration": iteration, **metrics})
            # else: a reward function raised, the batch was skipped (faults/reward_errors): the same iteration
            # runs on the next batch, so the run never ends short (max_consecutive_faults in a row stop it)
            stop = preempt.requested
            if accelerator.num_processes > 1:  # any process signalled: all stop together
                stop = bool(accelerator.reduce(torch.tensor(float(stop), device=accelerator.device), "sum").item() > 0)
            if stop or (out is not None and (iteration % t.checkpoint_every == 0 or iteration == t.num_iterations)):
                checkpoint(iteration)
            if stop and iteration < t.num_iterations:  # (a signal during the last iteration: done anyway)
                if accelerator.is_main_process:
                    log.warning("[rlhf_train] preempted: checkpoint written at iteration %d in %s/checkpoints; "
                                "resume with trainer.resume=auto", iteration, run_dir)
                raise SystemExit(PREEMPTED_EXIT_CODE)
    except FloatingPointError as err:
        # skipped updates never touch the weights: the current ones are the last good state. Checkpoint
        # them (with a fresh fault budget for whoever resumes) unless they are somehow non-finite too.
        problem = weights_problem(accelerator.unwrap_model(policy), initial_max_abs)  # not finite, or diverged
        if problem is None:
            state.faults.fresh_budget()
            where = f"the last good state is checkpointed in {checkpoint(iteration)}"
        else:
            where = (f"{problem}, so they are not checkpointed; resume from a checkpoint in {run_dir}/checkpoints "
                     f"written before they diverged (and lower optimizer.lr)")
        raise FloatingPointError(f"stopped in iteration {iteration + 1}: {err}; {where}") from None
    finally:
        preempt.restore()
        if progress is not None:
            progress.close()
        if logger is not None:
            logger.finish()
    # the trained policy as a plain Hugging Face model dir (docs/resume-and-faults.md "Where the trained model is")
    export_state = accelerator.get_state_dict(policy)  # collective: gathers FSDP / ZeRO-3 shards
    if accelerator.is_main_process:
        export_policy(accelerator.unwrap_model(policy), run.tokenizer, run_dir / "policy", export_state,
                      run_dir=run_dir)  # a failed write (disk full): one line, the checkpoints intact
        log.info("[rlhf_train] trained policy (plain Hugging Face model) in %s", run_dir / "policy")
        write_final_metrics(run_dir, metrics, history)  # final_metrics.json: what a sweep report reads
    accelerator.wait_for_everyone()
    end_training(accelerator, exit_code=teardown_exit_code)  # a hang in torch.distributed's teardown: exits
    return {"metrics": metrics, "history": history, "policy": accelerator.unwrap_model(policy), "run": run,
            "rollout": run.rollout, "algorithm": run.algorithm}
