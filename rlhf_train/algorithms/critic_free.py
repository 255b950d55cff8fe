"""Critic-free policy-gradient algorithms: GRPO (Shao et al. 2024), RLOO (Ahmadian et al. 2024),
REINFORCE++ and REINFORCE++-baseline (Hu 2025), with the loss variants of DAPO (clip-higher, token-mean
aggregation), Dr. GRPO (no std scaling, a constant length divisor) and GSPO (sequence-level ratio).

One :class:`PolicyGradient` algorithm serves them all: its estimator (one factory per ``algorithm.name``, at
the end of this file, named in :mod:`rlhf_train.algorithms.registry`) makes
the advantages, its loss is the clipped surrogate (:func:`~rlhf_train.core.losses.clipped_surrogate`)
aggregated per ``algorithm.loss_agg``, plus ``beta`` × k3 KL to the reference per token when the KL goes
in the loss (GRPO). No value head, value loss or returns. The math is in ``rlhf_train/core/``.

The sequence reward an estimator sees is the masked sum of the rollout's per-token ``reward``: the
shaped score, plus the KL penalty when it is in the reward (RLOO, REINFORCE++), or the score alone when
it is in the loss (the loop shapes with β = 0 then).
"""
from __future__ import annotations

import logging

import torch

from rlhf_train.algorithms.base import (
    AdvantageEstimator,
    AllReduceSum,
    PolicyOutput,
    finite_rows,
    is_correction_weights,
)
from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
from rlhf_train.core.advantages import (
    discounted_returns,
    group_mean_baseline,
    group_normalized_advantage,
    leave_one_out_advantage,
)
from rlhf_train.core.containers import Rollout
from rlhf_train.core.kl import k3_loss_term
from rlhf_train.core.losses import aggregate_loss, clipped_surrogate, loss_units
from rlhf_train.core.masked import global_masked_whiten, masked_mean, masked_sum
from rlhf_train.core.turns import over_actions


log = logging.getLogger(__name__)


def scored_rows(rollout: Rollout) -> torch.Tensor | None:
    """``[B]`` bool: the rows some reward source scored (``None``: every row; the rollout did not say). An
    unscored row takes no part in an estimator's statistics and gets advantage 0 (core/advantages.py)."""
    return None if rollout.unscored is None else ~rollout.unscored


def sequence_rewards(rollout: Rollout) -> torch.Tensor:
    """``[B]``: Σ_t reward over the sampled tokens (score + KL penalty, when the KL is in the reward)."""
    return masked_sum(rollout.reward, rollout.masks.actions, dim=-1)


class GroupNormalized:
    """GRPO: ``(r − group mean) / (group or batch std + ε)``, every token of a sequence the same value."""

    relative_to_group = True  # the advantage of a group whose rewards are all equal is 0 (the loop may skip it)

    def __init__(self, group_size: int, scale: str = "group", eps: float = 1e-6):
        self.group_size, self.scale, self.eps = group_size, scale, eps

    def __call__(self, rollout: Rollout, all_reduce_sum: AllReduceSum | None = None):
        mask = rollout.masks.actions
        r = sequence_rewards(rollout)
        scored = scored_rows(rollout)
        rollout.advantage_raw = group_mean_baseline(r, self.group_size, scored)[:, None] * mask
        adv = group_normalized_advantage(r, self.group_size, self.scale, self.eps, all_reduce_sum, scored)
        return adv[:, None] * mask, None


class LeaveOneOut:
    """RLOO: ``r_i − mean of the other samples' r``, every token of a sequence the same value."""

    relative_to_group = True

    def __init__(self, group_size: int):
        self.group_size = group_size

    def __call__(self, rollout: Rollout, all_reduce_sum: AllReduceSum | None = None):
        mask = rollout.masks.actions
        r = sequence_rewards(rollout)
        adv = leave_one_out_advantage(r, self.group_size, scored_rows(rollout))[:, None] * mask
        rollout.advantage_raw = adv
        return adv, None


class ReinforcePP:
    """REINFORCE++: the return-to-go of the per-token reward (KL at every token, score at the last),
    whitened over all processes' response tokens. With ``group_size`` (REINFORCE++-baseline) the group's
    mean score is subtracted from the score first: OpenRLHF's ``reinforce_baseline`` (mean-centred score,
    then the KL per token, return-to-go, batch whitening), not verl's ``reinforce_plus_plus_baseline``
    (which whitens the centred sequence reward broadcast over the tokens, no return-to-go). Unscored rows
    (``rollout.unscored``) are out of the group mean and the whitening, with advantage 0."""

    def __init__(self, gamma: float = 1.0, group_size: int | None = None):
        self.gamma, self.group_size = gamma, group_size

    def __call__(self, rollout: Rollout, all_reduce_sum: AllReduceSum | None = None):
        mask = rollout.masks.actions
        reward = rollout.reward
        scored = scored_rows(rollout)
        if self.group_size is not None:
            done_score = masked_sum(rollout.reward_raw, mask, dim=-1)  # the score each row was paid
            shift = done_score - group_mean_baseline(done_score, self.group_size, scored)  # its group's mean
            reward = reward - shift[:, None] * rollout.done.to(reward.dtype)
        if rollout.masks.assistant is None:
            returns = discounted_returns(reward, mask, self.gamma)
        else:  # multi-turn: environment tokens between the turns are no timesteps (no discount step)
            returns = over_actions(lambda r, m: (discounted_returns(r, m, self.gamma),), mask, reward)[0]
        rollout.advantage_raw = returns
        ok = finite_rows(rollout) & torch.isfinite(returns).all(-1) & (True if scored is None else scored)
        return global_masked_whiten(returns, mask & ok[:, None], all_reduce_sum), None


class PolicyGradient:
    """The critic-free algorithm: clipped surrogate (+ β·k3 KL in the loss, − entropy bonus), aggregated
    per ``loss_agg``, with the given estimator. ``update.clip_eps`` is the clip range unless
    ``clip_low`` / ``clip_high`` set it; ``update.ent_coef`` the entropy bonus; ``algorithm.is_correction``
    weighs each token's surrogate term (not the KL term) by π_old / π_sampler (TIS / MIS)."""

    needs_critic = False

    def __init__(self, cfg: AlgorithmConfig, update: UpdateConfig, max_new_tokens: int, estimator: AdvantageEstimator):
        self.cfg, self.update = cfg, update
        self.kl_in_reward = cfg.kl_in_reward
        self.kl_in_loss = cfg.beta > 0
        self.kl_weight = cfg.beta if self.kl_in_loss else 0.0
        self.needs_reference = cfg.kl_in_reward or self.kl_in_loss
        self.ent_coef = update.ent_coef
        self.needs_entropy = bool(update.ent_coef)
        self.corrects_mismatch = cfg.is_correction.enabled
        self.clip_low = update.clip_eps if cfg.clip_low is None else cfg.clip_low
        self.clip_high = update.clip_eps if cfg.clip_high is None else cfg.clip_high
        self.norm_length = cfg.norm_length or max_new_tokens
        self.estimator = estimator
        if cfg.ratio_level == "sequence" and cfg.loss_agg != "seq_mean_token_mean":  # as TRL warns
            log.warning("[rlhf_train] algorithm.ratio_level=sequence with algorithm.loss_agg=%s sums per-token terms, "
                        "which weighs each sequence by its length instead of GSPO's per-sequence objective; "
                        "set algorithm.loss_agg=seq_mean_token_mean to reproduce GSPO (Zheng et al. 2025)",
                        cfg.loss_agg)

    def loss_units(self, mask: torch.Tensor) -> torch.Tensor:
        """What the loss is a mean over: tokens (``token_mean``) or sequences (the ``seq_mean_*`` modes)."""
        return loss_units(mask, self.cfg.loss_agg)

    def loss(self, out: PolicyOutput, mb: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb.masks.actions

        def agg(x: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(x, mask, self.cfg.loss_agg, self.norm_length)

        weights, is_stats = is_correction_weights(mb, self.cfg.is_correction)
        pg, st = clipped_surrogate(out.log_probs, mb.sample_log_prob, mb.advantage, mask, self.clip_low,
                                   self.clip_high, self.cfg.ratio_level, weights)
        pg_loss = agg(pg)
        loss = pg_loss
        stats = {"loss/policy": pg_loss.detach(), "policy/clipfrac": st["clipfrac"],
                 "policy/clipfrac_low": st["clipfrac_low"], "policy/clipfrac_high": st["clipfrac_high"],
                 "policy/approx_kl": st["approx_kl"], "val/ratio": st["ratio_mean"], **is_stats}
        if self.kl_in_loss:  # k3, or (kl_ratio_weighted) π/π_old · k3: core/kl.py says which KL each follows
            kl = k3_loss_term(out.log_probs, mb.sample_log_prob, mb.ref_log_prob, mask, self.cfg.kl_ratio_weighted)
            kl_loss = agg(kl)
            loss = loss + self.cfg.beta * kl_loss
            stats["loss/kl"] = kl_loss.detach()
        if out.entropy is not None:
            entropy = agg(out.entropy)
            if self.ent_coef:
                loss = loss - self.ent_coef * entropy
            stats["policy/entropy"] = masked_mean(out.entropy, mask).detach()
        return loss, stats


# The registry's factories (rlhf_train/algorithms/registry.py): (algorithm cfg, update cfg, group size, T) -> Algorithm
def grpo(cfg: AlgorithmConfig, update: UpdateConfig, group_size: int, max_new_tokens: int) -> PolicyGradient:
    return PolicyGradient(cfg, update, max_new_tokens, GroupNormalized(group_size, cfg.scale_rewards, cfg.scale_eps))


def rloo(cfg: AlgorithmConfig, update: UpdateConfig, group_size: int, max_new_tokens: int) -> PolicyGradient:
    return PolicyGradient(cfg, update, max_new_tokens, LeaveOneOut(group_size))


def reinforce_pp(cfg: AlgorithmConfig, update: UpdateConfig, group_size: int, max_new_tokens: int) -> PolicyGradient:
    return PolicyGradient(cfg, update, max_new_tokens, ReinforcePP(cfg.gamma))


def reinforce_pp_baseline(cfg: AlgorithmConfig, update: UpdateConfig, group_size: int,
                          max_new_tokens: int) -> PolicyGradient:
    return PolicyGradient(cfg, update, max_new_tokens, ReinforcePP(cfg.gamma, group_size))
