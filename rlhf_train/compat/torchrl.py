"""torchrl compatibility, in one place: the drop-in for ``torchrl.data.llm.RolloutFromModel`` and what it
accepts and offers only because torchrl's does. Imported by nothing in the package: tests/compat (parity
with torchrl 0.14) and benchmarks/torchrl_* use it.

* :class:`RolloutFromModel`: torchrl's constructor (``model, ref_model, reward_model, kl_coef,
  max_new_tokens, score_clip, kl_scheduler, num_steps``), methods (``rollout_from_data``,
  ``create_rollout_td``, ``generate``, ``step_scheduler``, ``kl_coef``) and string-keyed output
  TensorDict, as an adapter over rlhf_train's :class:`rlhf_train.rollout.RolloutFromModel` (which returns
  the typed ``Rollout``; :data:`~rlhf_train.core.containers.TORCHRL_KEYS` maps its fields to the keys).
  torchrl's controller path is here too: construct with ``kl_scheduler=...``; ``kl_coef`` then reads it
  and :meth:`RolloutFromModel.step_scheduler` updates it with the per-sequence KLs queued since the last
  step (rlhf_train's loop owns its controller and passes β per call instead).
* Prompt batches in torchrl's ``PromptData`` form (``input_ids`` holding prompt + reference response,
  ``prompt_rindex`` marking where the prompt ends): :func:`prompts_from_batch`, :func:`reference_from_batch`.
* torchrl's composite KL transforms: :class:`KLConstrainedTransform` (reference log-prob → KL → reward
  adjustment as one transform) and :class:`KLRewardTransform` (the one-step form); the single transforms are
  in :mod:`rlhf_train.compat.torchrl_transforms`.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs.transforms import Compose

from rlhf_train.core.containers import TORCHRL_KEYS, LogProbs, Rollout, left_pad, response_mask_from_tokens
from rlhf_train.core.logprob_kernel import logprobs_of_labels
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.generation.decode_loop import DecodeLoopBackend
from rlhf_train.generation.hf_generate import HFGenerateBackend
from rlhf_train.models.reference import frozen_copy
from rlhf_train.rewards.sources import RewardModelSource
from rlhf_train.rollout.rollout_from_model import RolloutFromModel as Rollouts
from rlhf_train.rollout.rollout_from_model import special_ids
from rlhf_train.compat.torchrl_transforms import (
    Key,
    default_transform_stack,
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


def to_torchrl(ro: Rollout) -> TensorDict:
    """The torchrl-style rollout TensorDict of a typed ``Rollout`` (shares its tensors): its fields under
    :data:`~rlhf_train.core.containers.TORCHRL_KEYS`, plus torchrl's ``action`` and ``log_probs`` entries."""
    B = ro.batch_size[0]
    td = TensorDict({}, batch_size=[B], device=ro.device)
    for name, key in TORCHRL_KEYS.items():
        value = getattr(ro, name)
        if value is not None:
            td.set(key, value)
    td.set("action", ro.tokens.response)
    td.set("log_probs", LogProbs(response=ro.sample_log_prob, batch_size=[B]))
    return td


def _batch_dict(batch) -> dict:
    """What the product rollout reads from a batch of either form: its ``columns`` and reference responses."""
    out = {"columns": batch.get("columns")} if isinstance(batch, dict) else {}
    reference = reference_from_batch(batch) if batch is not None else None
    if reference is not None:
        out["reference_input_ids"], out["reference_attention_mask"] = reference
    return out


class RolloutFromModel:
    """torchrl's ``RolloutFromModel``: same constructor, methods and output keys, over rlhf_train's rollout.

    Args (torchrl's): ``model`` (a :class:`~rlhf_train.models.policy.PolicyWithValue` or a causal LM),
    ``ref_model`` (``None``: no KL term, unless ``ref_log_prob_fn``), ``reward_model`` (becomes the reward
    source ``"reward_model"`` unless ``reward_sources`` is given), ``kl_coef``, ``max_new_tokens``,
    ``score_clip`` (default stack only), ``kl_scheduler``, ``num_steps``.
    Keyword args: ``tokenizer`` / ``eos_token_id`` / ``pad_token_id``, ``temperature`` / ``top_k`` /
    ``top_p`` / ``do_sample``, ``transforms`` (a torchrl ``Compose``; default reproduces torchrl's),
    ``ref_log_prob_fn``, ``gather_fn`` (reduces per-sequence KLs across processes before a scheduler step),
    ``logprob_batch_size``, ``unwrap_fn``, ``logprobs_from_generate``, ``reward_sources``,
    ``generation_backend``, ``num_samples``, ``hf_generate`` (``generate`` instead of the decode loop).
    """

    def __init__(self, model, ref_model, reward_model, kl_coef: float = 0.1, max_new_tokens: int = 50,
                 score_clip: float = 10.0, kl_scheduler=None, num_steps: int | None = None, *,
                 tokenizer: Any = None, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, do_sample: bool = True,
                 transforms=None, ref_log_prob_fn: Callable | None = None, gather_fn: Callable | None = None,
                 logprob_batch_size: int | None = None, unwrap_fn: Callable | None = None,
                 logprobs_from_generate: bool = True, reward_sources: dict | None = None,
                 generation_backend=None, num_samples: int = 1, hf_generate: bool = False):
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.model, self.ref_model, self.reward_model = model, ref_model, reward_model
        self.max_new_tokens, self.score_clip, self.num_samples = max_new_tokens, score_clip, num_samples
        self.kl_scheduler, self._kl_coef, self.gather_fn = kl_scheduler, kl_coef, gather_fn
        self.tokenizer, self.logprob_batch_size = tokenizer, logprob_batch_size
        self.unwrap_fn = unwrap_fn or (lambda m: m)
        base = self.unwrap_fn(model)
        self.eos_token_ids, self.pad_token_id = special_ids(getattr(base, "lm", base), tokenizer, eos_token_id,
                                                            pad_token_id)
        self.eos_token_id = self.eos_token_ids[0]  # the primary EOS; responses end at the first of any EOS id
        eos = self.eos_token_ids if len(self.eos_token_ids) > 1 else self.eos_token_id
        self.sampling = SamplingParams(temperature, top_k, top_p)
        backend_cls = HFGenerateBackend if hf_generate else DecodeLoopBackend
        self.backend = generation_backend or backend_cls(
            model, eos_token_id=eos, pad_token_id=self.pad_token_id, max_new_tokens=max_new_tokens,
            sampling=self.sampling, do_sample=do_sample, with_scores=logprobs_from_generate, unwrap_fn=self.unwrap_fn)
        self.reward_sources = reward_sources if reward_sources is not None else {
            "reward_model": (RewardModelSource(reward_model, self.pad_token_id, logprob_batch_size), 1.0)}
        reference = frozen_copy(ref_model, self.sampling, logprob_batch_size) if ref_model is not None else None
        self.ref_log_prob_fn = ref_log_prob_fn or reference
        self.transforms = transforms if transforms is not None else default_transform_stack(
            self.ref_log_prob_fn, kl_coef, score_clip, eos)
        # the product rollout: generation and scoring; the reference pass and shaping are the torchrl stack's
        self.rollouts = Rollouts(model, self.backend, None, self.reward_sources, {}, eos_token_ids=self.eos_token_ids,
                                 pad_token_id=self.pad_token_id, max_new_tokens=max_new_tokens, sampling=self.sampling,
                                 num_samples=num_samples, logprob_batch_size=logprob_batch_size, unwrap_fn=self.unwrap_fn)
        self.has_critic = self.rollouts.has_critic
        # torchrl-style controller only: detached per-sequence KLs waiting for the next step_scheduler()
        self._kl_queue = collections.deque(maxlen=num_steps) if num_steps is not None else collections.deque()

    @property
    def kl_coef(self) -> float:
        """The controller's coefficient when constructed with a ``kl_scheduler``, else the fixed ``kl_coef``."""
        return float(self.kl_scheduler.coef) if self.kl_scheduler is not None else float(self._kl_coef)

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        if self.kl_scheduler is not None:
            self.kl_scheduler.coef = float(value)
        self._kl_coef = float(value)

    def step_scheduler(self) -> float:
        """Update the ``kl_scheduler`` with the queued per-sequence KLs (all processes), then clear them."""
        if self.kl_scheduler is None:
            self._kl_queue.clear()
            return self.kl_coef
        kls = torch.cat(list(self._kl_queue)) if self._kl_queue else torch.zeros(0)
        if self.gather_fn is not None:
            kls = self.gather_fn(kls)
        self.kl_scheduler.update(kls.float().cpu())
        self._kl_queue.clear()
        return self.kl_coef

    @staticmethod
    def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``log softmax(logits)[labels]``: ``[B, T, V]``, ``[B, T]`` → ``[B, T]`` (float32)."""
        return logprobs_of_labels(logits, labels)

    @torch.no_grad()
    def generate(self, batch, generation_config=None):
        """Sample responses (torchrl's API): ``generated [B, P+T]``, ``log_probs_gen [B, T]`` (sampling
        distribution) and ``log_ratio [B, T]`` (log π − log π_ref, 0 outside the response)."""
        prompt, prompt_mask = self.rollouts.repeat(*prompts_from_batch(batch, self.pad_token_id))
        response = self.backend.generate(prompt, prompt_mask, 1, generation_config=generation_config).response
        full = torch.cat([prompt, response], dim=1)
        response_mask = response_mask_from_tokens(response, self.eos_token_ids)
        full_mask = torch.cat([prompt_mask, response_mask], dim=1)
        log_probs, _ = self.rollouts.policy_log_probs_and_values(full, full_mask, prompt.shape[1])
        ref = self.ref_log_prob_fn(full, full_mask, prompt.shape[1])
        log_ratio = (log_probs - ref).masked_fill(~response_mask, 0.0)
        return full, log_probs.masked_fill(~response_mask, 0.0), log_ratio

    @torch.no_grad()
    def rollout_from_data(self, batch, generation_config=None, *, kl_coef: float | None = None) -> TensorDict:
        """Generate on ``batch`` and return the scored rollout TensorDict (see :meth:`create_rollout_td`)."""
        prompt, prompt_mask = prompts_from_batch(batch, self.pad_token_id)
        extra = {} if generation_config is None else {"generation_config": generation_config}
        gen = self.backend.generate(prompt, prompt_mask, self.num_samples, **extra)
        prompt, prompt_mask = self.rollouts.repeat(prompt, prompt_mask)
        full = torch.cat([prompt, gen.response], dim=1)
        return self.create_rollout_td(batch, full, gen.log_probs, None, prompt_len=prompt.shape[1],
                                      prompt_mask=prompt_mask, values=gen.values, kl_coef=kl_coef)

    @torch.no_grad()
    def create_rollout_td(self, batch, generated, log_probs=None, log_ratio=None, *, prompt_len=None,
                          prompt_mask=None, values=None, kl_coef: float | None = None) -> TensorDict:
        """Wrap generated tokens ``[B, P+T]`` (left-padded prompt + response) in a rollout TensorDict with
        batch size ``[B]``: ``log_probs`` recomputed (with values) when ``None``; the reference pass runs in
        the transform stack unless ``log_ratio`` (log π − log π_ref) is given; ``kl_coef`` defaults to
        :attr:`kl_coef`. Keys: :data:`~rlhf_train.core.containers.TORCHRL_KEYS` (+ ``action``, ``log_probs``)."""
        T = self.max_new_tokens
        prompt_len = generated.shape[1] - T if prompt_len is None else prompt_len
        if prompt_mask is None:
            prompt_mask = (self.rollouts.repeat(prompts_from_batch(batch, self.pad_token_id)[1])[0]
                           if batch is not None else generated[:, :prompt_len] != self.pad_token_id)
            prompt_mask = prompt_mask[:, -prompt_len:]
        if log_probs is None:  # one policy pass, as the product rollout does it
            response_mask = response_mask_from_tokens(generated[:, prompt_len:], self.eos_token_ids)
            log_probs, values = self.rollouts.policy_log_probs_and_values(
                generated, torch.cat([prompt_mask, response_mask], 1), prompt_len)
        B = generated.shape[0]
        ref = None if log_ratio is None else log_probs.reshape(B, T).float() - log_ratio.reshape(B, T)
        coef = self.kl_coef if kl_coef is None else float(kl_coef)
        ro = self.rollouts.score(_batch_dict(batch), generated[:, -(prompt_len + T):], prompt_mask, log_probs,
                                 values, ref, kl_coef=coef, shape=False)
        td = to_torchrl(ro)
        if self.ref_log_prob_fn is not None and ref is None:  # the stack's reference pass fills these
            td.exclude(("next", "kl"), "kl_per_sequence", inplace=True)
        td = self.transforms(td)  # score shaping → reference log-prob → KL → per-token reward
        if self.kl_scheduler is not None:
            self._kl_queue.append(td.get("kl_per_sequence").detach().float().cpu())
        return td
