"""The algorithms' config sections as plain dataclasses, free of torch so the command line's config
schemas (rlhf_train/config/schema.py registers them with Hydra) can import them without loading torch.
A new algorithm with keys of its own adds them to :class:`AlgorithmConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class UpdateConfig:
    """The ``update`` config section (conf/update/default.yaml explains each key): the minibatch update's
    keys, shared by every algorithm; also its Hydra schema (``update_schema``), so the two cannot drift."""

    num_epochs: int = 4
    minibatch_size: int = 16
    gradient_accumulation_steps: int = 1
    clip_eps: float = 0.2
    ent_coef: float = 0.0
    max_grad_norm: Optional[float] = 1.0  # Optional[...], not `| None`: OmegaConf reads this as a schema
    packing: bool = False                # micro-batches of sequences packed without padding (models/packed.py)
    token_budget: int = 4096             # with packing: the most real tokens in one micro-batch
    gradient_checkpointing: bool = False  # recompute the policy trunk's activations in the backward pass
    micro_batch_tokens: Optional[int] = None  # without packing: the most padded tokens per micro-batch (null: auto)


# the keys of the former `ppo` section and where each lives now (a `ppo.*` override is refused with this)
MOVED_PPO_KEYS = {"num_epochs": "update", "minibatch_size": "update", "gradient_accumulation_steps": "update",
                  "clip_eps": "update", "ent_coef": "update", "max_grad_norm": "update", "clip_eps_value": "algorithm",
                  "vf_coef": "algorithm", "gamma": "algorithm", "lam": "algorithm", "whiten_advantages": "algorithm"}


@dataclass
class ISCorrectionConfig:
    """``algorithm.is_correction``: the importance-sampling correction of the sampler / trainer mismatch
    (:func:`rlhf_train.core.mismatch.importance_weights`; conf/algorithm/ppo.yaml explains each key)."""

    level: Optional[str] = None          # null = off | token (per-token weight) | sequence (one per response)
    mode: str = "clip"                   # clip (truncated IS: w clamped to the threshold) | mask (w outside: 0)
    threshold: List[float] = field(default_factory=lambda: [0.0, 2.0])  # [low, high] of w = π_old / π_sampler

    @property
    def enabled(self) -> bool:
        return self.level is not None


@dataclass
class AlgorithmConfig:
    """The ``algorithm`` config group (conf/algorithm/<name>.yaml explains each key; also its Hydra schema,
    ``algorithm_schema``). It picks the advantage estimator, the policy loss's variants and where the KL
    term goes; the update's shared keys (epochs, minibatch size, clip_eps, ...) are ``update``'s. Keys marked
    [ppo] are read by PPO only; ``gamma`` by PPO and REINFORCE++."""

    name: str = "ppo"                    # ppo | grpo | rloo | reinforce_pp | reinforce_pp_baseline
    scale_rewards: str = "group"         # grpo: group | batch | none (Dr. GRPO)
    loss_agg: str = "token_mean"         # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    norm_length: Optional[int] = None    # seq_mean_token_sum_norm's divisor (null = rollout.max_new_tokens)
    clip_low: Optional[float] = None     # ratio clipped below at 1 - clip_low (null = update.clip_eps)
    clip_high: Optional[float] = None    # ratio clipped above at 1 + clip_high (null = update.clip_eps)
    ratio_level: str = "token"           # token | sequence (GSPO)
    kl_in_reward: bool = True            # the KL penalty is shaped into the reward (shaping stack + controller)
    beta: float = 0.0                    # weight of the k3 KL to the reference in the loss (needs kl_in_reward false)
    gamma: float = 1.0                   # [ppo, reinforce_pp] discount of the returns
    lam: float = 0.95                    # [ppo] GAE lambda
    vf_coef: float = 0.1                 # [ppo] weight of the value loss
    clip_eps_value: float = 0.2          # [ppo] value clip epsilon (around the rollout's values)
    whiten_advantages: bool = True       # [ppo] normalise advantages over the batch's response tokens
    scale_eps: float = 1e-6              # grpo: the ε added to the std (verl's 1e-6; TRL's GRPOTrainer: 1e-4)
    score_clip: Optional[float] = 10.0   # this algorithm's default of rollout.score_clip (null = no clip)
    kl_ratio_weighted: bool = False      # beta's k3 term times π/π_old (the reverse KL's gradient; core/kl.py)
    filter_zero_std_groups: bool = False  # grpo, rloo: groups whose rewards are all equal leave the update (DAPO)
    mask_truncated_completions: bool = False  # responses cut at rollout.max_new_tokens: out of the loss
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)  # sampler/trainer mismatch

    def __post_init__(self):  # from a plain dict (OmegaConf.to_container of the config)
        if isinstance(self.is_correction, dict):
            self.is_correction = ISCorrectionConfig(**self.is_correction)
