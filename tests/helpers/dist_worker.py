"""``python -m rlhf_train <overrides>``, exactly, with read-only probes for the distributed tests.

Run it as ``[accelerate launch ...] tests/helpers/dist_worker.py <hydra overrides>`` with ``RLHF_TEST_DUMP_DIR``
set. Each process then writes ``rank<r>.pt`` there, holding:

* ``prompts``: the dataset indices of each iteration's prompt batch (``[B]`` per iteration)
* ``local_metrics`` / ``reduced_metrics``: what ``rlhf_train.infra.distributed.reduce_metrics`` got and returned
* ``first_grad``: the gradients at the first optimizer step (after DDP's all-reduce), in parameter order
* ``params``: the policy's parameters after training
* ``num_processes``: the process count the trainer's Accelerator saw
"""
from __future__ import annotations

import os
import runpy
from pathlib import Path

import torch


def install_probes(dump_dir: Path) -> None:
    from accelerate.optimizer import AcceleratedOptimizer

    from rlhf_train.loop import trainer
    from rlhf_train.rollout.multi_turn import MultiTurnRollout
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    record: dict = {"prompts": [], "local_metrics": [], "reduced_metrics": [], "first_grad": None}

    def probed_call(call):
        def probed_rollout(self, batch, *args, **kwargs):
            record["prompts"].append(batch["index"].detach().cpu().clone())
            return call(self, batch, *args, **kwargs)
        return probed_rollout

    reduce_metrics = trainer.reduce_metrics

    def probed_reduce(metrics, accelerator):
        out = reduce_metrics(metrics, accelerator)
        record["local_metrics"].append({k: float(torch.as_tensor(v).float()) for k, v in metrics.items()})
        record["reduced_metrics"].append(dict(out))
        record["num_processes"] = accelerator.num_processes
        return out

    optimizer_step = AcceleratedOptimizer.step

    def probed_step(self, *args, **kwargs):
        if record["first_grad"] is None:
            record["first_grad"] = [None if p.grad is None else p.grad.detach().cpu().clone()
                                    for group in self.optimizer.param_groups for p in group["params"]]
        return optimizer_step(self, *args, **kwargs)

    train = trainer.train

    def probed_train(cfg, run_dir=None):
        out = train(cfg, run_dir)
        record["params"] = [p.detach().cpu().clone() for p in out["policy"].parameters()]
        rank = int(os.environ.get("RANK", "0"))
        torch.save(record, dump_dir / f"rank{rank}.pt")
        return out

    for cls in (RolloutFromModel, MultiTurnRollout):  # (MultiTurnRollout's own __call__: episodes)
        cls.__call__ = probed_call(cls.__call__)
    trainer.reduce_metrics = probed_reduce  # the name train() calls
    AcceleratedOptimizer.step = probed_step
    trainer.train = probed_train  # rlhf_train.pipeline.stages imports it at call time


if __name__ == "__main__":
    dump = Path(os.environ["RLHF_TEST_DUMP_DIR"])
    dump.mkdir(parents=True, exist_ok=True)
    install_probes(dump)
    runpy.run_module("rlhf_train", run_name="__main__", alter_sys=True)
