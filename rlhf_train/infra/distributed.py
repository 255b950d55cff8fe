"""What the PPO loop needs to run the same way on one process or many (DDP, FSDP, DeepSpeed, gloo on CPU)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


def reduce_metrics(metrics: dict, accelerator) -> dict:
    names = sorted(metrics)
    # each value onto the accelerator's device first: on a GPU the metrics mix CUDA tensors and CPU floats
    vals = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32, device=accelerator.device).reshape(())
                        for k in names])
    if accelerator.num_processes > 1:
        vals = accelerator.reduce(vals, "mean")
    return {k: float(v) for k, v in zip(names, vals.cpu())}


def infinite_batches(loader, accelerator, start_epoch: int = 0, skip: int = 0):
    """Yield ``(epoch, index_in_epoch, batch)`` forever; resumes mid-epoch by skipping consumed batches."""
    epoch = start_epoch
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        it = accelerator.skip_first_batches(loader, skip) if skip else loader
        for i, batch in enumerate(it, start=skip):
            yield epoch, i, batch
        epoch, skip = epoch + 1, 0


def all_processes(accelerator, value, gather: bool):
    """``gather``: the list of every process's ``value`` (on every process); else rank 0's ``value``
    (any picklable object; collective: call on every process)."""
    if accelerator.num_processes == 1:
        return [value] if gather else value
    from accelerate.utils import broadcast_object_list, gather_object

    return gather_object([value]) if gather else broadcast_object_list([value], from_process=0)[0]


def cpu_only_multiprocess() -> bool:
    """Launched as several processes (``accelerate launch --multi_gpu``/torchrun) on a machine without
    GPUs: Accelerate only forms the process group (gloo) when told ``cpu=True``; otherwise each process
    would silently train alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.cuda.is_available():
        return False
    from accelerate.utils import is_mlu_available, is_npu_available, is_xpu_available

    return not (is_xpu_available() or is_npu_available() or is_mlu_available())


@contextlib.contextmanager
def full_weights(policy, accelerator):
    """Rollouts call the unwrapped policy (``generate`` + one scoring pass), which needs whole weights.

    FSDP gathers them with ``summon_full_params`` and DeepSpeed ZeRO-3 with ``GatheredParameters``
    (every process then holds the full weights for the rollout); DDP and ZeRO-1/2 already do.
    Collective under FSDP / ZeRO-3: every process enters it.
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(policy, writeback=False, recurse=True):
            yield
    elif kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
            yield
    else:
        yield


def in_policy_precision(ref_log_prob_fn, accelerator):
    """Run the reference under the policy's autocast (bf16/fp16), as the policy's own pass is: π_ref is a
    copy of the initial policy, so the first iteration's KL is then exactly 0. Log-probs stay fp32."""

    def ref_log_probs(full, full_mask, prompt_len):
        with accelerator.autocast():
            return ref_log_prob_fn(full, full_mask, prompt_len)

    return ref_log_probs


def main_process_run_dir(run_dir: Path, accelerator) -> Path:
    """Rank 0's run dir, on every process (Hydra's timestamped default could differ by a second)."""
    if accelerator.num_processes == 1:
        return run_dir
    from accelerate.utils import broadcast_object_list

    return Path(broadcast_object_list([str(run_dir)], from_process=0)[0])


def max_abs_weight(model) -> float:
    """The largest ``|w|`` over the model's parameters (``nan`` if any is NaN)."""
    values = [p.detach().abs().max().float() for p in model.parameters() if p.numel()]
    return float(torch.stack(values).max()) if values else 0.0


DIVERGED_FACTOR = 100.0  # weights this many times larger than at the start (and than 1) count as diverged


def weights_problem(model, initial_max_abs: float, factor: float = DIVERGED_FACTOR) -> str | None:
    """Why the weights are not a good state to keep (the fault stop checkpoints them otherwise): not
    finite, or diverged (``max |w|`` over ``factor`` × the start's, e.g. after ``optimizer.lr=1e6``)."""
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return "the weights are not finite"
    now, limit = max_abs_weight(model), factor * max(1.0, initial_max_abs)
    if now > limit:
        return f"the weights have diverged (max |w| = {now:.3g}, {now / max(1.0, initial_max_abs):.3g}x the start's)"
    return None


# How long a finished run's process waits for ``accelerator.end_training()`` (trackers, then
# ``torch.distributed.destroy_process_group``), whose teardown can hang in the communication library
# (pytorch/pytorch#75097; on this project's CI one worker of a finished 2-process gloo run never exited after
# rank 0 had, once in six runs of the suite; a bare accelerate + gloo script aborted at exit in 6 of 55
# launches, "terminate called without an active exception"). Everything is written before (rank 0 writes,
# then every rank passes the final barrier), so past this deadline waiting only holds the machine: the
# process says so, prints every thread's stack and exits.
TEARDOWN_DEADLINE_S = 60.0


def end_training(accelerator, exit_code: int, seconds: float = TEARDOWN_DEADLINE_S) -> None:
    """``accelerator.end_training()`` in at most ``seconds``; past them (a hang in the process group's
    teardown) every thread's stack goes to stderr with one line saying what happened, and the process exits
    with ``exit_code`` at once (``os._exit``: the stuck native call cannot be interrupted). Call it after the
    final barrier, when nothing is left to write."""
    import faulthandler
    import logging
    import sys
    import threading

    done = threading.Event()

    def expire():
        if done.wait(seconds):
            return
        print(f"[rlhf_train] the process group's teardown (accelerator.end_training) did not return in "
              f"{seconds:.0f} s after the run finished; everything was written before it. Exiting with status "
              f"{exit_code}; the threads' stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        logging.shutdown()  # the run's log handlers, flushed and closed
        os._exit(exit_code)

    if accelerator.num_processes > 1:
        threading.Thread(target=expire, name="teardown-deadline", daemon=True).start()
    try:
        accelerator.end_training()
    finally:
        done.set()
