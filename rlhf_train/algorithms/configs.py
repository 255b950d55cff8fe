"""The algorithms' config sections as plain dataclasses, free of torch so the command line's config
schemas (rlhf_train/config/schema.py registers them with Hydra) can import them without loading torch.
A new algorithm with its own section adds its dataclass here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PPOConfig:
    """The ``ppo`` config section (conf/ppo/default.yaml explains each key); also its Hydra schema
    (``ppo_schema``, registered in rlhf_train/config/schema.py), so the two cannot drift."""

    num_epochs: int = 4
    minibatch_size: int = 16
    gradient_accumulation_steps: int = 1
    clip_eps: float = 0.2
    clip_eps_value: float = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    max_grad_norm: Optional[float] = 1.0  # Optional[...], not `| None`: OmegaConf reads this as a schema
