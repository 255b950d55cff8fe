"""The reward-shaping stack: score shaping → per-token KL → the per-token reward, over a typed
:class:`~rlhf_train.core.containers.Rollout`.

Each entry is a callable ``Rollout -> Rollout`` (:class:`Shaping`) that fills or rewrites fields in place.
The stack is assembled from YAML as an ordered dict keyed by name (``conf/transforms/default.yaml``:
``baseline``, ``eos_penalty``, ``score_clip``, ``kl``, ``reward``, ``whiten``), so a recipe or the command
line overrides (``transforms.kl.estimator=k3``) or drops (``~transforms.eos_penalty``) one entry. A new
entry is a class here (or anywhere importable) with ``__call__(rollout) -> rollout``, named by
``_target_`` in that dict. The reference log-probs are not an entry: the rollout computes them
(:mod:`rlhf_train.models.reference`) before the stack runs.

The tensor math of each entry is a plain function (:func:`missing_eos_scores`, :func:`kl_terms`,
:func:`per_token_reward`), shared with the torchrl ``Transform`` adapters of :mod:`rlhf_train.compat`.
"""
from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch

from rlhf_train.core.containers import Rollout, is_eos
from rlhf_train.core.kl import KL_ESTIMATORS, kl_estimate
from rlhf_train.core.masked import masked_sum, masked_whiten
from rlhf_train.infra.errors import ConfigError


class Shaping(Protocol):
    """One entry of the stack: rewrites fields of the rollout (``score``, ``kl``, ``reward``, ...)."""

    def __call__(self, rollout: Rollout) -> Rollout: ...


# ------------------------------------------------------------------ the math, on tensors
def missing_eos_scores(score: torch.Tensor, response: torch.Tensor, mask: torch.Tensor, eos_token_id,
                       penalty: float) -> torch.Tensor:
    """``[B]``: ``penalty`` where the masked ``response [B, T]`` holds no EOS id, ``score`` elsewhere."""
    has_eos = (is_eos(response, eos_token_id) & mask).any(-1)
    return torch.where(has_eos, score, torch.full_like(score, float(penalty)))


def kl_terms(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str = "k1"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL estimate ``[B, T]`` (0 outside ``mask``) and its sum per sequence ``[B]`` (nats).
    ``k1`` = log p − log q, ``k2`` = ½(log p − log q)², ``k3`` = (r − 1) − log r with r = q/p (Schulman 2020)."""
    kl = kl_estimate(log_probs, ref_log_probs, estimator).masked_fill(~mask, 0.0)
    return kl, masked_sum(kl, mask, dim=-1)


def per_token_reward(score: torch.Tensor, done: torch.Tensor, kl: torch.Tensor, coef: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ziegler et al. 2019 §2.2: ``reward_raw[b, t] = score[b]·done[b, t]``, ``reward_kl = −β[b]·kl``,
    ``reward = reward_raw + reward_kl`` (each ``[B, T]``; ``coef`` is β per row ``[B]``)."""
    reward_raw = score[:, None] * done.float()
    reward_kl = -coef[:, None] * kl
    return reward_raw, reward_kl, reward_raw + reward_kl


# ------------------------------------------------------------------ score shaping (before the KL term)
class ReferenceBaseline:
    """``score ← score − score_ref``: the reward of the batch's reference response (TL;DR's human summary)
    is the baseline, as in torchrl / trlX. A no-op when the batch has none. First in the default stack:
    :class:`MissingEOSPenalty` after it gives a response without EOS exactly its penalty."""

    def __call__(self, ro: Rollout) -> Rollout:
        if ro.score_ref is not None:
            ro.score = ro.score - ro.score_ref
        return ro


class MissingEOSPenalty:
    """Responses that never emit EOS get the fixed score ``penalty`` (N+ implementation details);
    ``penalty: null`` leaves scores untouched. Runs after :class:`ReferenceBaseline` (else a response
    without EOS would get ``penalty − score_ref``, which can reward not stopping)."""

    def __init__(self, penalty: float | None = None, eos_token_id: int | list[int] | None = None):
        self.penalty, self.eos_token_id = penalty, eos_token_id

    def __call__(self, ro: Rollout) -> Rollout:
        if self.penalty is None:
            return ro
        if self.eos_token_id is None:
            raise ConfigError("transforms.eos_penalty needs the tokenizer's EOS id (eos_token_id)")
        ro.score = missing_eos_scores(ro.score, ro.tokens.response, ro.masks.response, self.eos_token_id, self.penalty)
        return ro


class ScoreClip:
    """``score ← clip(score, −clip, clip)`` (torchrl's ``score_clip``; ``clip: null`` disables)."""

    def __init__(self, clip: float | None = 10.0):
        self.clip = clip

    def __call__(self, ro: Rollout) -> Rollout:
        if self.clip is not None:
            ro.score = ro.score.clamp(-self.clip, self.clip)
        return ro


# ------------------------------------------------------------------ the KL term and the reward
class KLDivergence:
    """Per-token KL between the policy (its sampling log-probs) and the reference over the response:
    ``kl [B, T]`` and ``kl_per_sequence [B]`` (what the KL controller sees). A rollout without a reference
    keeps the zeros the rollout wrote there."""

    def __init__(self, estimator: str = "k1"):
        if estimator not in KL_ESTIMATORS:
            raise ConfigError(f"transforms.kl.estimator='{estimator}' is not valid; choose one of: "
                              f"{', '.join(KL_ESTIMATORS)}")
        self.estimator = estimator

    def __call__(self, ro: Rollout) -> Rollout:
        if ro.ref_log_prob is not None:
            ro.kl, ro.kl_per_sequence = kl_terms(ro.sample_log_prob, ro.ref_log_prob, ro.masks.actions,
                                                 self.estimator)
        return ro


class RewardAdjustment:
    """The per-token reward (:func:`per_token_reward`) with the rollout's ``kl_coef`` (β, given by the loop's
    KL controller, so the two can never disagree); ``coef`` is used only by a rollout that carries none."""

    def __init__(self, coef: float | None = None):
        self.coef = coef

    def __call__(self, ro: Rollout) -> Rollout:
        coef = ro.kl_coef
        if coef is None:
            if self.coef is None:
                raise ConfigError("transforms.reward: the rollout carries no kl_coef and no transforms.reward.coef "
                                  "is set")
            coef = torch.full(ro.kl.shape[:1], float(self.coef), device=ro.kl.device)
        ro.reward_raw, ro.reward_kl, ro.reward = per_token_reward(ro.score, ro.done, ro.kl, coef)
        return ro


class RewardWhitening:
    """Optionally whitens the per-token reward over the batch's response tokens (TRL ``whiten_rewards``)."""

    def __init__(self, enabled: bool = False, shift_mean: bool = False):
        self.enabled, self.shift_mean = enabled, shift_mean

    def __call__(self, ro: Rollout) -> Rollout:
        if self.enabled:
            ro.reward = masked_whiten(ro.reward, ro.masks.actions, self.shift_mean)
        return ro


# ------------------------------------------------------------------ assembly from YAML
def build_shaping(entries: dict | None, **runtime: Any) -> dict[str, Shaping]:
    """The ordered dict of entry configs (``_target_`` + keys; ``None`` drops an entry) instantiated, by name.
    ``runtime`` holds what is known only at run time (``eos_token_id``): each entry gets the ones its
    constructor accepts, unless the config sets them. A bad entry: one :class:`ConfigError` line."""
    from hydra.utils import get_class, instantiate

    stack = {}
    for name, cfg in (entries or {}).items():
        if cfg is None:
            continue
        try:
            target = get_class(cfg["_target_"])
            params = inspect.signature(target.__init__).parameters
            extra = {k: v for k, v in runtime.items() if k in params and (k not in cfg or cfg[k] is None)}
            stack[name] = instantiate(cfg, **extra)
        except Exception as err:  # hydra wraps constructor errors; surface ours as the one line
            cause = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if isinstance(cause, ConfigError):
                raise cause from None
            raise ConfigError(f"transforms.{name}: {cause}") from err
    return stack


def apply_shaping(stack: dict[str, Shaping], ro: Rollout) -> Rollout:
    """Run the entries in order."""
    for entry in stack.values():
        ro = entry(ro)
    return ro


def stand_in_rollout() -> Rollout:
    """2 sequences (P=2, T=3; row 0 ends at EOS id 0, row 1 is truncated) with what the rollout writes
    before the stack runs: what :func:`check_shaping` dry-runs the stack on."""
    from rlhf_train.core.containers import Masks, Tokens

    response = torch.tensor([[5, 0, 1], [5, 6, 7]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    prompt, prompt_mask = torch.tensor([[1, 3], [2, 3]]), torch.tensor([[False, True], [True, True]])
    done = torch.tensor([[False, True, False], [False, False, True]])
    return Rollout(
        tokens=Tokens(prompt=prompt, response=response, full=torch.cat([prompt, response], 1), batch_size=[2]),
        masks=Masks(prompt=prompt_mask, response=mask, full=torch.cat([prompt_mask, mask], 1), batch_size=[2]),
        sample_log_prob=torch.full((2, 3), -1.0), values=torch.zeros(2, 3), ref_log_prob=torch.full((2, 3), -2.0),
        kl_coef=torch.full((2,), 0.1),
        score=torch.ones(2), score_raw=torch.ones(2), score_ref=torch.zeros(2), done=done,
        terminated=done & torch.tensor([[True], [False]]), truncated=done & torch.tensor([[False], [True]]),
        batch_size=[2])


def check_shaping(entries: dict | None) -> None:
    """Build the stack and run it on :func:`stand_in_rollout`, at start: a bad entry fails here with one line
    naming it, and the stack must end with the per-token ``reward`` every algorithm reads."""
    ro = stand_in_rollout()
    for name, entry in build_shaping(entries, eos_token_id=0).items():
        try:
            ro = entry(ro)
        except Exception as err:
            raise ConfigError(f"transforms.{name} ({type(entry).__name__}) fails on a stand-in rollout "
                              f"({type(err).__name__}: {err}): an entry it reads from was dropped, or a key "
                              f"is misspelled") from None
    if ro.reward is None:
        raise ConfigError("the transforms stack writes no per-token reward: keep transforms.reward "
                          "(or add an entry that writes it)")
