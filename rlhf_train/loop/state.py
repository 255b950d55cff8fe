"""The training state, one typed object: :class:`TrainState`. What a checkpoint saves besides the weights,
optimizer and scheduler, and what :func:`rlhf_train.loop.trainer.step` advances.

==================  ==============================================================================
field               meaning
==================  ==============================================================================
``iteration``       the last finished iteration (0 before the first)
``data_epoch``      passes over the prompt dataset begun (each process its shard)
``data_batch``      the batch index inside that pass of the last batch drawn
``faults``          :class:`~rlhf_train.infra.faults.Faults`: skipped updates, reward errors
``generator``       this process's minibatch-order generator (saved per process)
``kl_controller``   the KL controller (``coef``, ``update``, ``state_dict``)
``run_id``          the run's id (W&B run names; kept over resumes)
``wandb_id``        the W&B run id to resume logging into
``history``         every finished iteration's metrics, those before a resume included
==================  ==============================================================================

The checkpoint keys are the ones rlhf_train has always written (``data_epoch``, ``data_batch``,
``faults``, ``kl_controller``, ``run_id``, ``wandb_id``; per process ``ppo_generator``) plus ``history``,
so older checkpoints resume (with an empty history).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from rlhf_train.infra.faults import Faults


@dataclass
class TrainState:
    kl_controller: object
    generator: torch.Generator
    faults: Faults = field(default_factory=Faults)
    iteration: int = 0
    data_epoch: int = 0
    data_batch: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    wandb_id: str | None = None
    history: list = field(default_factory=list)  # every iteration's metrics (summary.json and plots read it)

    @classmethod
    def fresh(cls, kl_controller, seed: int, process_index: int, max_consecutive_faults: int) -> "TrainState":
        """Iteration 0; the minibatch generator seeded per process."""
        return cls(kl_controller, torch.Generator().manual_seed(seed * 1000 + process_index),
                   Faults(max_consecutive_faults))

    def state_dict(self) -> dict:
        """The run-wide part (written once, by the main process); :meth:`process_state_dict` is per process."""
        return {"run_id": self.run_id, "kl_controller": self.kl_controller.state_dict(),
                "data_epoch": self.data_epoch, "data_batch": self.data_batch + 1,  # the next batch to draw
                "faults": self.faults.state_dict(), "wandb_id": self.wandb_id,
                "history": self.history}

    def process_state_dict(self) -> dict:
        return {"ppo_generator": self.generator.get_state()}

    def load_state_dict(self, state: dict, seed: int, process_index: int) -> None:
        """Restore from a checkpoint's trainer state (and its ``"process"`` entry: this process's own)."""
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.iteration = state["iteration"]
        self.wandb_id, self.run_id = state.get("wandb_id"), state.get("run_id", self.run_id)
        self.data_epoch, self.data_batch = state["data_epoch"], state["data_batch"]
        self.faults.load_state_dict(state.get("faults", {}))
        self.history = list(state.get("history", []))  # (older checkpoints have none)
        self.generator = torch.Generator().manual_seed(seed * 1000 + process_index + self.iteration)
        if "ppo_generator" in state.get("process", {}):  # this process's minibatch order (its rng_rank{r}.pt)
            self.generator.set_state(state["process"]["ppo_generator"])
        elif "ppo_generator" in state:  # a checkpoint from before per-process states: rank 0's
            self.generator.set_state(torch.tensor(state["ppo_generator"], dtype=torch.uint8))
