"""The algorithm seam: how advantages are estimated, what the loss is, whether there is a critic, and
where the KL term goes.

A new algorithm (or a new advantage estimator for the critic-free one) is ONE file
``rlhf_train/algorithms/<name>.py`` holding a class with the attributes and methods of :class:`Algorithm`
(or an :class:`AdvantageEstimator` handed to :class:`~rlhf_train.algorithms.critic_free.PolicyGradient`) and
a factory ``(algorithm cfg, update cfg, group_size, max_new_tokens) -> Algorithm``; plus ONE line naming the
factory in :data:`rlhf_train.algorithms.registry.ALGORITHMS` and its ``conf/algorithm/<name>.yaml``. Its
math goes in ``rlhf_train/core/`` as pure functions. The loop (``rlhf_train/loop/trainer.py``) and the
minibatch update (:mod:`rlhf_train.algorithms.update`) stay as they are. Implementations: :class:`rlhf_train.algorithms.ppo.PPO` with
:class:`rlhf_train.algorithms.ppo.GAE`; :class:`rlhf_train.algorithms.critic_free.PolicyGradient` (GRPO,
RLOO, REINFORCE++) with its estimators.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from rlhf_train.algorithms.configs import ISCorrectionConfig
from rlhf_train.core.containers import Rollout
from rlhf_train.core.mismatch import importance_weights

# sums a tensor over all processes (None: one process); what the estimators' batch statistics use
AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


def finite_rows(rollout: Rollout) -> torch.Tensor:
    """``[B]``: True where the row's rewards, sampling log-probs (π_old's and the sampler's), values, advantages
    and returns (those present) are all finite. A faulty row must not poison the others' statistics or gradients."""
    ok = torch.ones(rollout.batch_size[0], dtype=torch.bool, device=rollout.device)
    for x in (rollout.reward, rollout.sample_log_prob, rollout.sampler_log_prob, rollout.values, rollout.advantage,
              rollout.returns):
        if x is not None:
            ok &= torch.isfinite(x).flatten(1).all(-1)
    return ok


class AdvantageEstimator(Protocol):
    """``rollout -> (advantages [B, T], returns [B, T] or None)``, 0 outside ``rollout.masks.actions`` (the
    sampled tokens: the response, or a multi-turn episode's assistant tokens).

    ``returns`` are the critic's targets (``None`` without a critic). An estimator that normalises may
    set ``rollout.advantage_raw`` (before normalisation; logged as ``val/advantage_mean_raw``). Batch statistics (whitening, group
    baselines across the batch) go over all processes through ``all_reduce_sum``."""

    def __call__(self, rollout: Rollout, all_reduce_sum: AllReduceSum | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class PolicyOutput:
    """The update's one forward pass of the policy over a minibatch's prompt + response.

    ``log_probs [b, T]`` of the rollout's tokens under the sampling temperature (no top-k / top-p);
    ``entropy [b, T]`` of that distribution (``None`` when not asked for); ``values [b, T]`` (``None``
    without a critic)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None


class Algorithm(Protocol):
    """An RL algorithm as the loop sees it."""

    needs_critic: bool      # a value head is built, trained (value loss) and read during rollouts
    kl_in_reward: bool      # True: the KL penalty is shaped into the per-token reward (the shaping stack, with
                            # the KL controller's β); False: the rollout is shaped with β = 0
    kl_in_loss: bool        # the algorithm's loss holds a KL term to the reference (GRPO's β·k3)
    kl_weight: float        # that term's weight (0 when kl_in_loss is False): what the loop logs as β
    needs_reference: bool   # a reference model is built and run (KL in the reward or in the loss)
    needs_entropy: bool     # the loss uses the policy entropy (an entropy bonus): computed every epoch
    corrects_mismatch: bool  # algorithm.is_correction: the policy loss weighs each token by π_old / π_sampler
                            # (:func:`is_correction_weights`), so the rollout runs the trainer's own pass for π_old
    estimator: AdvantageEstimator

    def loss_units(self, mask: torch.Tensor) -> torch.Tensor:
        """How many units (response tokens, or sequences) the loss of a micro-batch with response
        ``mask [b, T]`` is a mean over; the update weights micro-batches and processes by it."""
        ...

    def loss(self, out: PolicyOutput, mb: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, stats)`` of one micro-batch ``mb``: the loss a **mean over its** :meth:`loss_units` (the
        update rescales it to a mean over all processes' units); stats are detached scalars named as in
        docs/metrics.md's glossary (``loss/policy``, ``policy/clipfrac``, ...)."""
        ...


def is_correction_weights(mb: Rollout, cfg: ISCorrectionConfig) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """``algorithm.is_correction`` on a micro-batch: the importance-sampling weights ``[b, T]`` of its tokens
    (:func:`rlhf_train.core.mismatch.importance_weights` of π_old, ``sample_log_prob``, against the sampler's
    ``sampler_log_prob``) and the stat ``objective/is_filtered_frac``; ``(None, {})`` when the correction is off."""
    if not cfg.enabled:
        return None, {}
    if mb.sampler_log_prob is None:
        raise RuntimeError("algorithm.is_correction: the generation backend recorded no log-probs of its samples, so "
                           "there is nothing to correct against; use a backend that records them "
                           "(generation=decode_loop) or set algorithm.is_correction.level=null")
    low, high = cfg.threshold
    w, frac = importance_weights(mb.sample_log_prob, mb.sampler_log_prob, mb.masks.actions, cfg.level, cfg.mode,
                                 float(low), float(high))
    return w, {"objective/is_filtered_frac": frac}
