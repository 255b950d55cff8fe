"""torchrl compatibility, in one place: what ``RolloutFromModel`` accepts and offers only because
torchrl's does.

* Prompt batches in torchrl's ``PromptData`` form (``input_ids`` holding prompt + reference response,
  ``prompt_rindex`` marking where the prompt ends): :func:`prompts_from_batch`, :func:`reference_from_batch`.
  rlhf_train's own batches are dicts of left-padded ``input_ids`` / ``attention_mask`` (+ optional
  ``reference_input_ids`` / ``reference_attention_mask``).
* torchrl's composite KL transforms: :class:`KLConstrainedTransform` (reference log-prob → KL → reward
  adjustment as one transform) and :class:`KLRewardTransform` (the one-step form, ``reward ← reward − β·KL``).
"""
from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDictBase
from torchrl.envs.transforms import Compose

from rlhf_train.core.containers import left_pad
from rlhf_train.rewards.transforms import (
    Key,
    KLDivergenceTransform,
    ReferenceModelLogProbTransform,
    RewardAdjustmentTransform,
    _key,
    _RolloutTransform,
)


def _is_prompt_data(batch) -> bool:
    return getattr(batch, "prompt_rindex", None) is not None


def prompts_from_batch(batch, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask ``[B, P]`` (what ``generate`` needs) from either batch form."""
    if _is_prompt_data(batch):
        ids = batch.input_ids
        mask = torch.arange(ids.shape[-1], device=ids.device)[None] < batch.prompt_rindex[:, None]
        ids, mask = left_pad(ids, mask, pad_token_id)
        width = int(mask.sum(-1).max())
        return ids[:, ids.shape[-1] - width:], mask[:, ids.shape[-1] - width:]
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if (mask[:, -1] == 0).any():  # right padded: move to the left, as generate needs
        ids, mask = left_pad(ids, mask, pad_token_id)
    return ids, mask


def reference_from_batch(batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Prompt + reference response (e.g. the TL;DR human summary, the reward baseline) and its mask, if any."""
    if _is_prompt_data(batch):
        return batch.input_ids, batch.attention_mask.bool()
    getter = batch.get if hasattr(batch, "get") else (lambda k, d=None: getattr(batch, k, d))
    ids = getter("reference_input_ids", None)
    return (ids, getter("reference_attention_mask").bool()) if ids is not None else None


class KLConstrainedTransform(Compose):
    """The three KL transforms composed: reference log-prob → KL estimate → reward adjustment."""

    def __init__(self, ref_log_prob_fn: Callable | None = None, coef: float = 0.1, estimator: str = "k1",
                 **reward_kwargs):
        super().__init__(
            ReferenceModelLogProbTransform(ref_log_prob_fn),
            KLDivergenceTransform(estimator),
            RewardAdjustmentTransform(coef, **reward_kwargs),
        )


class KLRewardTransform(_RolloutTransform):
    """The one-step form: ``reward ← reward − coef · KL`` with the reference log-probs computed inline.

    Adds ``reward_kl``, ``kl`` and ``ref_log_probs`` like torchrl's ``KLRewardTransform``. Expects a
    ``reward`` (e.g. ``reward_raw`` copied in) and overwrites it.
    """

    def __init__(self, ref_log_prob_fn: Callable | None = None, coef: float = 0.1, estimator: str = "k1",
                 reward_key: Key = ("next", "reward")):
        super().__init__(in_keys=[_key(reward_key)], out_keys=[_key(reward_key)])
        self.ref = ReferenceModelLogProbTransform(ref_log_prob_fn)
        self.kl = KLDivergenceTransform(estimator)
        self.coef, self.reward_key = coef, _key(reward_key)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        td = self.kl(self.ref(td))
        coef = td.get("kl_coef", None)
        coef = torch.full(td.batch_size[:1], float(self.coef)) if coef is None else coef
        reward_kl = -coef[:, None] * td.get(("next", "kl"))
        td.set(("next", "reward_kl"), reward_kl)
        td.set(self.reward_key, td.get(self.reward_key) + reward_kl)
        return td


