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


ALGORITHM_NAMES = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


@dataclass
class AlgorithmConfig:
    """The ``algorithm`` config group (conf/algorithm/<name>.yaml explains each key; also its Hydra schema,
    ``algorithm_schema``). It picks the advantage estimator, the policy loss's variants and where the KL
    term goes; the update's shared keys (epochs, minibatch size, clip_eps, ...) stay in ``ppo``."""

    name: str = "ppo"                    # ppo | grpo | rloo | reinforce_pp | reinforce_pp_baseline
    scale_rewards: str = "group"         # grpo: group | batch | none (Dr. GRPO)
    loss_agg: str = "token_mean"         # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    norm_length: Optional[int] = None    # seq_mean_token_sum_norm's divisor (null = rollout.max_new_tokens)
    clip_low: Optional[float] = None     # ratio clipped below at 1 - clip_low (null = ppo.clip_eps)
    clip_high: Optional[float] = None    # ratio clipped above at 1 + clip_high (null = ppo.clip_eps)
    ratio_level: str = "token"           # token | sequence (GSPO)
    kl_in_reward: bool = True            # the KL penalty is shaped into the reward (transform stack + controller)
    beta: float = 0.0                    # weight of the k3 KL to the reference in the loss (needs kl_in_reward false)
