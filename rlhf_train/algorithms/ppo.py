"""PPO (Schulman et al. 2017) with GAE (Schulman et al. 2016) over response tokens, KL in the reward.

The math is in ``rlhf_train/core/`` (:func:`~rlhf_train.core.advantages.gae`,
:func:`~rlhf_train.core.losses.policy_loss`, :func:`~rlhf_train.core.losses.value_loss`,
:func:`~rlhf_train.core.masked.global_masked_whiten`); this module only wires it to a :class:`Rollout`.
"""
from __future__ import annotations

import torch

from rlhf_train.algorithms.base import AllReduceSum, PolicyOutput, finite_rows, is_correction_weights
from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
from rlhf_train.core.advantages import gae
from rlhf_train.core.containers import Rollout
from rlhf_train.core.losses import policy_loss, value_loss
from rlhf_train.core.masked import global_masked_whiten, masked_mean
from rlhf_train.core.turns import over_actions


class GAE:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over the per-token reward,
    whitened over all processes' response tokens (rows that are not finite take no part). In a multi-turn
    episode it steps over the policy's sampled tokens only, values read at those positions
    (:func:`rlhf_train.core.turns.over_actions`)."""

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True):
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __call__(self, rollout: Rollout, all_reduce_sum: AllReduceSum | None = None):
        mask = rollout.masks.actions
        if rollout.masks.assistant is None:
            advantages, returns = gae(rollout.reward, rollout.values, mask, self.gamma, self.lam)
        else:  # environment tokens between the turns are no timesteps
            advantages, returns = over_actions(lambda r, v, m: gae(r, v, m, self.gamma, self.lam), mask,
                                               rollout.reward, rollout.values)
        rollout.advantage_raw = advantages  # logged as val/advantage_mean_raw
        if self.whiten:
            ok = finite_rows(rollout) & torch.isfinite(returns).all(-1)
            advantages = global_masked_whiten(advantages, mask & ok[:, None], all_reduce_sum)
        return advantages, returns


class PPO:
    """Clipped surrogate (``update.clip_eps``) + clipped value loss (``algorithm.vf_coef``,
    ``algorithm.clip_eps_value``) (+ optional entropy bonus, ``update.ent_coef``); KL penalty in the reward.
    With ``algorithm.is_correction`` each token's surrogate term is weighed by π_old / π_sampler (TIS / MIS)."""

    needs_critic = True
    kl_in_reward = True
    kl_in_loss = False
    kl_weight = 0.0         # no KL in the loss: β is the KL controller's
    needs_reference = True

    def __init__(self, cfg: AlgorithmConfig, update: UpdateConfig):
        self.cfg, self.update = cfg, update
        self.clip_eps, self.ent_coef = update.clip_eps, update.ent_coef
        self.needs_entropy = bool(update.ent_coef)
        self.corrects_mismatch = cfg.is_correction.enabled
        self.estimator = GAE(cfg.gamma, cfg.lam, cfg.whiten_advantages)

    @staticmethod
    def loss_units(mask: torch.Tensor) -> torch.Tensor:
        """The loss is a mean over response tokens."""
        return mask.sum()

    def loss(self, out: PolicyOutput, mb: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb.masks.actions
        weights, is_stats = is_correction_weights(mb, self.cfg.is_correction)
        pg_loss, pg_stats = policy_loss(out.log_probs, mb.sample_log_prob, mb.advantage, mask, self.clip_eps, weights)
        vf_loss, vf_stats = value_loss(out.values, mb.values, mb.returns, mask, self.cfg.clip_eps_value)
        loss = pg_loss + self.cfg.vf_coef * vf_loss
        stats = {
            "loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(),
            "policy/clipfrac": pg_stats["clipfrac"], "policy/approx_kl": pg_stats["approx_kl"],
            "val/ratio": pg_stats["ratio_mean"], "val/clipfrac": vf_stats["clipfrac"], **is_stats,
        }
        if out.entropy is not None:
            entropy = masked_mean(out.entropy, mask)
            if self.ent_coef:  # with no bonus the entropy is only logged: no backward pass through it
                loss = loss - self.ent_coef * entropy
            stats["policy/entropy"] = entropy.detach()
        return loss, stats


def build(cfg: AlgorithmConfig, update: UpdateConfig, group_size: int, max_new_tokens: int) -> PPO:
    """The registry's factory (:mod:`rlhf_train.algorithms.registry`)."""
    return PPO(cfg, update)
