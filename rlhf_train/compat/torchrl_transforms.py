"""torchrl compatibility: the seeds' reward-shaping ``Transform``s (reference log-prob → KL → reward
adjustment, + score shaping) over string-keyed rollout TensorDicts, as adapters over the product code.

rlhf_train's own shaping stack is :mod:`rlhf_train.rewards.shaping` (plain callables over the typed
``Rollout``); the math here is its functions (:func:`~rlhf_train.rewards.shaping.kl_terms`,
:func:`~rlhf_train.rewards.shaping.per_token_reward`, :func:`~rlhf_train.rewards.shaping.missing_eos_scores`).
Each transform maps a rollout TensorDict (batch ``[B]``, written by
:class:`rlhf_train.compat.torchrl.RolloutFromModel`) to itself with new keys, and is a torchrl
:class:`~torchrl.envs.Transform`, so the same objects compose with torchrl environments.
:func:`build_transform_stack` assembles a torchrl ``Compose`` from the same YAML dict; a product shaping
entry in it is wrapped in :class:`ShapingTransform`.

Keys read and written (each configurable per transform): the torchrl keys of the rollout TensorDict, whose
shapes and meanings are declared once, in the table of :class:`rlhf_train.core.containers.Rollout`
(``TORCHRL_KEYS`` maps its fields to these keys). Score shaping reads and writes ``("next", "score")``;
the KL trio reads ``("tokens", "full")``, ``("masks", ...)``, ``("log_probs", "response")`` and
``kl_coef`` and writes ``("ref_log_probs", "response")``, ``("next", "kl")``, ``kl_per_sequence`` and
``("next", "reward_raw" | "reward_kl" | "reward")``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from tensordict import TensorDictBase
from torchrl.envs.transforms import Compose, Transform

from rlhf_train.core.containers import TORCHRL_KEYS, Rollout
from rlhf_train.core.kl import KL_ESTIMATORS
from rlhf_train.core.masked import masked_whiten
from rlhf_train.infra.errors import ConfigError
from rlhf_train.rewards.shaping import KLDivergence, kl_terms, missing_eos_scores, per_token_reward

Key = str | tuple


def _key(k: Any) -> Key:
    """YAML gives lists for nested keys; TensorDict wants tuples."""
    if isinstance(k, (list, tuple)) or (hasattr(k, "__iter__") and not isinstance(k, str)):
        return tuple(k)
    return k


class ShapingTransform(Transform):
    """A product shaping entry (``Rollout -> Rollout``, :mod:`rlhf_train.rewards.shaping`) as a torchrl
    transform: the TensorDict's torchrl keys are viewed as a ``Rollout`` (no copy), the entry runs, the
    fields it wrote go back under their keys."""

    def __init__(self, entry):
        super().__init__(in_keys=[], out_keys=[])
        self.entry = entry

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        ro = Rollout.from_torchrl(td)
        if ro.sample_log_prob is None:  # torchrl's own key for the policy's log-probs
            ro.sample_log_prob = td.get(("log_probs", "response"), None)
        ro = self.entry(ro)
        for name, key in TORCHRL_KEYS.items():
            value = getattr(ro, name)
            if value is not None:
                td.set(key, value)
        return td

    _call = forward


class _RolloutTransform(Transform):
    """Shared plumbing: ``forward(td)`` transforms a whole rollout; ``_step`` works inside an env."""

    def _call(self, td: TensorDictBase) -> TensorDictBase:
        return self.forward(td)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        tensordict = tensordict.set("next", next_tensordict)
        return self.forward(tensordict).get("next")

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset


# --------------------------------------------------------------------------------------------
# Score shaping (before the KL term)
# --------------------------------------------------------------------------------------------
class MissingEOSPenalty(_RolloutTransform):
    """Responses that never emit EOS get the fixed score ``penalty`` (N+ implementation details).

    It must run *after* :class:`ReferenceBaseline` (as ``conf/transforms/default.yaml`` orders them): run
    before it, a response without EOS would get ``penalty − score_ref`` instead (penalty −1 with a
    reference score of −2 gives +1, a reward for not stopping). Only a :class:`ScoreClip` after it can
    change the penalty (when ``|penalty| > clip``). ``penalty: null`` leaves scores untouched (the
    torchrl-compatible default).
    """

    def __init__(self, penalty: float | None = None, score_key: Key = ("next", "score"),
                 tokens_key: Key = ("tokens", "response"), mask_key: Key = ("masks", "response"),
                 eos_token_id: int | None = None):
        super().__init__(in_keys=[_key(score_key), _key(tokens_key)], out_keys=[_key(score_key)])
        self.penalty, self.score_key, self.tokens_key = penalty, _key(score_key), _key(tokens_key)
        self.mask_key, self.eos_token_id = _key(mask_key), eos_token_id

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if self.penalty is None:
            return td
        if self.eos_token_id is None:
            raise ConfigError("transforms.eos_penalty needs the tokenizer's EOS id (eos_token_id)")
        td.set(self.score_key, missing_eos_scores(td.get(self.score_key), td.get(self.tokens_key),
                                                  td.get(self.mask_key), self.eos_token_id, self.penalty))
        return td


class ReferenceBaseline(_RolloutTransform):
    """``score ← score − score_ref``: the reward model's score of the reference response (TL;DR's
    human summary) is the baseline, as in torchrl / trlX. A no-op when the batch has no reference.

    The first entry of the default stack: :class:`MissingEOSPenalty` comes after it, so that a
    response without EOS gets the fixed penalty and not the penalty minus the baseline."""

    def __init__(self, score_key: Key = ("next", "score"), baseline_key: Key = ("next", "score_ref")):
        super().__init__(in_keys=[_key(score_key), _key(baseline_key)], out_keys=[_key(score_key)])
        self.score_key, self.baseline_key = _key(score_key), _key(baseline_key)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        baseline = td.get(self.baseline_key, None)
        if baseline is not None:
            td.set(self.score_key, td.get(self.score_key) - baseline)
        return td


class ScoreClip(_RolloutTransform):
    """``score ← clip(score, −clip, clip)`` (torchrl's ``score_clip``; ``clip: null`` disables)."""

    def __init__(self, clip: float | None = 10.0, score_key: Key = ("next", "score")):
        super().__init__(in_keys=[_key(score_key)], out_keys=[_key(score_key)])
        self.clip, self.score_key = clip, _key(score_key)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if self.clip is not None:
            td.set(self.score_key, td.get(self.score_key).clamp(-self.clip, self.clip))
        return td


# --------------------------------------------------------------------------------------------
# The KL trio
# --------------------------------------------------------------------------------------------
class ReferenceModelLogProbTransform(_RolloutTransform):
    """Log-probs of the response tokens under the frozen reference model, one batched forward pass.

    ``ref_log_prob_fn(full, full_mask, prompt_len) -> [B, T]`` does the work (built by the rollout
    from the reference model with the policy's temperature/filtering, or a Ray service's remote call).
    Skips rows already filled (e.g. when a caller passes ``log_ratio`` as torchrl's API allows).
    """

    def __init__(self, ref_log_prob_fn: Callable | None = None,
                 tokens_key: Key = ("tokens", "full"), mask_key: Key = ("masks", "full"),
                 response_mask_key: Key = ("masks", "response"),
                 out_key: Key = ("ref_log_probs", "response"), use_ray_service: bool = False,
                 actor_name: str | None = None, ray: dict | None = None):
        super().__init__(in_keys=[_key(tokens_key), _key(mask_key)], out_keys=[_key(out_key)])
        self.ref_log_prob_fn = ref_log_prob_fn
        self.tokens_key, self.mask_key = _key(tokens_key), _key(mask_key)
        self.response_mask_key, self.out_key = _key(response_mask_key), _key(out_key)
        # the Ray service settings are read by rlhf_train.models.ray_reference, which builds ref_log_prob_fn
        self.use_ray_service, self.actor_name, self.ray = use_ray_service, actor_name, ray

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if td.get(self.out_key, None) is not None:
            return td
        if self.ref_log_prob_fn is None:
            raise RuntimeError("ReferenceModelLogProbTransform has no reference model bound")
        response_mask = td.get(self.response_mask_key)
        full, full_mask = td.get(self.tokens_key), td.get(self.mask_key)
        prompt_len = full.shape[-1] - response_mask.shape[-1]
        ref = self.ref_log_prob_fn(full, full_mask, prompt_len)
        td.set(self.out_key, ref.to(response_mask.device).masked_fill(~response_mask, 0.0))
        return td


class KLDivergenceTransform(_RolloutTransform):
    """Per-token KL estimate between policy p and reference q over response tokens.

    ``estimator``: ``k1`` = log p − log q, ``k2`` = ½(log p − log q)², ``k3`` = (r − 1) − log r with
    r = q/p (Schulman). Writes ``kl [B, T]`` (0 outside the response) and its masked sum per sequence.
    """

    def __init__(self, estimator: str = "k1", log_prob_key: Key = ("log_probs", "response"),
                 ref_log_prob_key: Key = ("ref_log_probs", "response"),
                 mask_key: Key = ("masks", "response"), kl_key: Key = ("next", "kl"),
                 kl_per_sequence_key: Key = "kl_per_sequence"):
        if estimator not in KL_ESTIMATORS:
            raise ConfigError(f"transforms.kl.estimator='{estimator}' is not valid; choose one of: "
                              f"{', '.join(KL_ESTIMATORS)}")
        super().__init__(in_keys=[_key(log_prob_key), _key(ref_log_prob_key)], out_keys=[_key(kl_key)])
        self.estimator = estimator
        self.log_prob_key, self.ref_log_prob_key = _key(log_prob_key), _key(ref_log_prob_key)
        self.mask_key, self.kl_key, self.kl_per_sequence_key = _key(mask_key), _key(kl_key), _key(kl_per_sequence_key)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        kl, kl_per_sequence = kl_terms(td.get(self.log_prob_key), td.get(self.ref_log_prob_key),
                                       td.get(self.mask_key), self.estimator)
        td.set(self.kl_key, kl)
        td.set(self.kl_per_sequence_key, kl_per_sequence)
        return td


class RewardAdjustmentTransform(_RolloutTransform):
    """Builds the per-token PPO reward: the score at the done step minus ``kl_coef`` × KL per token.

    ``reward_raw[b, t] = score[b]·done[b, t]``, ``reward_kl = −kl_coef·kl``, ``reward = reward_raw +
    reward_kl``. The coefficient is read from the rollout's ``kl_coef`` entry (written by
    ``RolloutFromModel`` from the KL controller, so the two can never disagree); ``coef`` is the
    fallback when that entry is absent (e.g. inside a torchrl env).
    """

    def __init__(self, coef: float | None = None, coef_key: Key = "kl_coef", score_key: Key = ("next", "score"),
                 kl_key: Key = ("next", "kl"), done_key: Key = ("next", "done"),
                 reward_key: Key = ("next", "reward"), reward_raw_key: Key = ("next", "reward_raw"),
                 reward_kl_key: Key = ("next", "reward_kl")):
        super().__init__(in_keys=[_key(score_key), _key(kl_key)],
                         out_keys=[_key(reward_key), _key(reward_raw_key), _key(reward_kl_key)])
        self.coef, self.coef_key, self.score_key, self.kl_key = coef, _key(coef_key), _key(score_key), _key(kl_key)
        self.done_key, self.reward_key = _key(done_key), _key(reward_key)
        self.reward_raw_key, self.reward_kl_key = _key(reward_raw_key), _key(reward_kl_key)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        kl = td.get(self.kl_key)
        coef = td.get(self.coef_key, None)
        if coef is None:
            if self.coef is None:
                raise ConfigError(f"transforms.reward: the rollout carries no {self.coef_key!r} entry and no "
                                  f"transforms.reward.coef is set")
            coef = torch.full(kl.shape[:1], float(self.coef), device=kl.device)
        reward_raw, reward_kl, reward = per_token_reward(td.get(self.score_key), td.get(self.done_key), kl, coef)
        td.set(self.reward_raw_key, reward_raw)
        td.set(self.reward_kl_key, reward_kl)
        td.set(self.reward_key, reward)
        return td


class RewardWhitening(_RolloutTransform):
    """Optionally whitens the per-token reward over the batch's response tokens (TRL ``whiten_rewards``)."""

    def __init__(self, enabled: bool = False, reward_key: Key = ("next", "reward"),
                 mask_key: Key = ("masks", "response"), shift_mean: bool = False):
        super().__init__(in_keys=[_key(reward_key)], out_keys=[_key(reward_key)])
        self.enabled, self.reward_key, self.mask_key, self.shift_mean = enabled, _key(reward_key), _key(mask_key), shift_mean

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if self.enabled:
            td.set(self.reward_key, masked_whiten(td.get(self.reward_key), td.get(self.mask_key), self.shift_mean))
        return td


# --------------------------------------------------------------------------------------------
# Assembly from YAML
# --------------------------------------------------------------------------------------------
def build_transform_stack(entries: dict | None, **runtime: Any) -> Compose:
    """Instantiate the ordered dict of transform configs into one torchrl :class:`Compose` (product shaping
    entries, e.g. ``conf/transforms/default.yaml``'s, wrapped in :class:`ShapingTransform`).

    ``entries`` maps a name to a config with ``_target_`` (or ``None`` to drop the entry). ``runtime``
    holds objects only known at run time (``ref_log_prob_fn``, ``eos_token_id``); each transform gets
    the ones its constructor accepts, unless the config sets them.
    """
    from hydra.utils import get_class, instantiate

    transforms = []
    for name, cfg in (entries or {}).items():
        if cfg is None or (hasattr(cfg, "get") and cfg.get("enabled_in_stack", True) is False):
            continue
        try:
            target = get_class(cfg["_target_"])
            params = inspect.signature(target.__init__).parameters
            extra = {k: v for k, v in runtime.items() if k in params and (k not in cfg or cfg[k] is None)}
            made = instantiate(cfg, **extra)
            transforms.append(made if isinstance(made, Transform) else ShapingTransform(made))
        except Exception as err:  # hydra wraps constructor errors; surface ours as the one line
            cause = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if isinstance(cause, ConfigError):
                raise cause
            raise ConfigError(f"transforms.{name}: {cause}") from err
    ref_fn = runtime.get("ref_log_prob_fn")
    kl_at = [i for i, t in enumerate(transforms) if isinstance(t, KLDivergenceTransform)
             or isinstance(getattr(t, "entry", None), KLDivergence)]
    if ref_fn is not None and kl_at and not any(isinstance(t, ReferenceModelLogProbTransform) for t in transforms):
        # the product stack has no reference entry (its rollout computes π_ref's log-probs before the stack
        # runs): this torchrl stack runs the reference pass itself, right before the KL entry
        transforms.insert(kl_at[0], ReferenceModelLogProbTransform(ref_fn))
    return Compose(*transforms)


def default_transform_stack(ref_log_prob_fn: Callable | None, kl_coef: float, score_clip: float | None,
                            eos_token_id: int | None = None) -> Compose:
    """The stack that reproduces torchrl's ``RolloutFromModel`` reward exactly (k1, clip, baseline)."""
    return Compose(
        ReferenceBaseline(),
        ScoreClip(score_clip),
        ReferenceModelLogProbTransform(ref_log_prob_fn),
        KLDivergenceTransform("k1"),
        RewardAdjustmentTransform(kl_coef),
    )
