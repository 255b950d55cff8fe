"""``RolloutFromModel``: the class the training loop calls each iteration. A thin assembler: a prompt
batch and the current β in, a typed :class:`~rlhf_train.core.containers.Rollout` out.

One call ``rollout(batch, kl_coef=β)`` is:

  1. the prompts, left-padded ``[N, P]`` (each repeated ``num_samples`` times: the samples of a prompt
     are adjacent rows);
  2. generation through the :class:`~rlhf_train.generation.base.GenerationBackend` (which also gives the
     policy's sampling log-probs and values where it can; else, or with ``trainer_pass``, one policy pass
     over prompt + response gives them, and the sampler's are kept as ``sampler_log_prob``);
  3. the reward sources (:mod:`rlhf_train.rewards.sources`, a weighted dict keyed by name) score each
     sequence, while the reference (:class:`~rlhf_train.models.reference.Reference`, one object) scores
     the response tokens in one batched pass; the batch's reference responses, when it has them, are
     scored too (the reward baseline);
  4. the fields are written into the ``Rollout`` and the shaping stack (:mod:`rlhf_train.rewards.shaping`)
     runs in order with ``kl_coef`` = β: score shaping, per-token KL, the per-token reward.

β has one path: the loop passes it in, the rollout carries it (``kl_coef``) to the shaping stack, and the
loop reads ``kl_per_sequence`` back for its KL controller. The torchrl-compatible surface (torchrl's
constructor, ``rollout_from_data``, ``create_rollout_td``, ``generate``, ``step_scheduler``, string keys)
is the adapter :class:`rlhf_train.compat.torchrl.RolloutFromModel` over this class.

Conventions (see ``anchors.md``): EOS and pad ids come from the tokenizer / model config; tokens are stored
once per sequence (``Tokens.full [B, P+T]`` + ``Masks.response [B, T]``); ``sample_log_prob`` is the
log-prob under the sampling temperature alone (top-k / top-p only pick which tokens can be drawn), the
distribution the update scores under, so the first PPO ratio is 1; the EOS token is an action like any
other (a log-prob, a KL term and the reward). With
``autocast`` (``trainer.precision`` bf16 / fp16) every pass of a call runs under it: generation, the policy's
pass, the reference and the reward models.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from rlhf_train.core.containers import (
    Masks,
    Rollout,
    Tokens,
    is_eos,
    left_pad,
    response_mask_from_tokens,
)
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.generation.base import GenerationBackend
from rlhf_train.models.packed import token_budget_chunks
from rlhf_train.models.reference import Reference
from rlhf_train.models.scoring import sequence_logprobs
from rlhf_train.rewards.shaping import Shaping, apply_shaping
from rlhf_train.rewards.sources import RewardReport, RewardSource, Sequences, has_threaded, score_sources, \
    weighted_sum


def special_ids(model, tokenizer, eos_token_id=None, pad_token_id=None) -> tuple[tuple[int, ...], int]:
    """``(EOS ids, pad id)``: given ones first, then the tokenizer's, then the model config's; several EOS
    ids (e.g. ``<|im_end|>`` and ``<|endoftext|>``): the tokenizer's first, then the generation config's."""
    cfg = getattr(model, "config", None)
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        eos_token_id = eos_token_id if eos_token_id is not None else getattr(cfg, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        pad_token_id = pad_token_id if pad_token_id is not None else getattr(cfg, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else eos_token_id
    if eos_token_id is None:
        raise ValueError("RolloutFromModel: no EOS token id in the tokenizer or model config; pass eos_token_id")
    eos = [int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos] if gen_eos is not None else []):
        if int(e) not in eos:
            eos.append(int(e))
    return tuple(eos), int(pad_token_id)


def prompt_tensors(batch: dict, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask ``[N, P]`` (what generation needs) from a batch dict of
    ``input_ids`` / ``attention_mask`` (right-padded rows are moved to the left)."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if (mask[:, -1] == 0).any():
        ids, mask = left_pad(ids, mask, pad_token_id)
    return ids, mask


class RolloutFromModel:
    """Roll out the policy on a batch of prompts and score it. See the module docstring.

    Args:
        policy: the (possibly Accelerate-wrapped) policy: a :class:`~rlhf_train.models.policy.PolicyWithValue`
            (log-probs and values in one pass) or any ``transformers`` causal LM (log-probs only).
        backend: the generation backend (``generation=...``), built over the same policy.
        reference: π_ref (:class:`~rlhf_train.models.reference.Reference`), or ``None``: no KL term (the
            rollout's ``kl`` is 0 and its ``ref_log_prob`` is ``None``).
        reward_sources: ``{name: (RewardSource, weight)}``, scored and summed.
        shaping: the shaping stack, ``{name: Shaping}`` in order (:func:`~rlhf_train.rewards.shaping.build_shaping`).
        eos_token_ids, pad_token_id: responses end at the first of any EOS id; padding id.
        max_new_tokens: response length ``T``.
        sampling: the sampling distribution; log-probs are taken under its temperature alone (the update's).
        num_samples: responses per prompt (GRPO / RLOO groups), adjacent rows.
        logprob_batch_size: rows per scoring forward pass (bounds the ``[b, T, V]`` memory).
        token_budget: ``update.token_budget`` with ``update.packing`` (else None): the policy's scoring pass
            runs on packed micro-batches of at most this many tokens instead (:mod:`rlhf_train.models.packed`).
        unwrap_fn: unwraps a DDP / FSDP / Accelerate-prepared policy.
        trainer_pass: ``sample_log_prob`` (π_old) and ``values`` always from the policy's own no-grad pass,
            the generation's log-probs kept as ``sampler_log_prob`` (precision, LoRA, ``algorithm.is_correction``:
            :mod:`rlhf_train.loop.build` decides); else the generation's are π_old when it has them.
        autocast: a context factory every pass of a call runs under (Accelerate's autocast), or ``None``.
    """

    def __init__(self, policy, backend: GenerationBackend, reference: Reference | None,
                 reward_sources: dict[str, tuple[RewardSource, float]], shaping: dict[str, Shaping], *,
                 eos_token_ids: tuple[int, ...], pad_token_id: int, max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), num_samples: int = 1,
                 logprob_batch_size: int | None = None, unwrap_fn: Callable | None = None,
                 token_budget: int | None = None, trainer_pass: bool = False,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None):
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.policy, self.backend, self.reference = policy, backend, reference
        self.reward_sources, self.shaping = reward_sources, shaping
        self.reward_report = RewardReport()  # the last call's reward time and rows lost to reward timeouts
        self.eos_token_ids, self.pad_token_id = tuple(eos_token_ids), int(pad_token_id)
        self.max_new_tokens, self.sampling, self.num_samples = max_new_tokens, sampling, num_samples
        self.logprob_batch_size, self.unwrap_fn = logprob_batch_size, unwrap_fn or (lambda m: m)
        self.token_budget = token_budget
        self.trainer_pass, self.autocast = trainer_pass, autocast or contextlib.nullcontext
        # a PolicyWithValue built without a value head (a critic-free algorithm): the rollout has no values
        base = self.unwrap_fn(policy)
        self.has_critic = getattr(base, "value_head", "plain LM") is not None

    @torch.no_grad()
    def __call__(self, batch: dict, kl_coef: float = 0.0, *, generation_config=None) -> Rollout:
        """Generate on ``batch`` (a dict of ``input_ids`` / ``attention_mask`` [+ ``reference_input_ids`` /
        ``reference_attention_mask``, ``columns``]) and return the scored, shaped :class:`Rollout`."""
        prompt, prompt_mask = prompt_tensors(batch, self.pad_token_id)
        extra = {} if generation_config is None else {"generation_config": generation_config}
        with self.autocast():
            gen = self.backend.generate(prompt, prompt_mask, self.num_samples, **extra)
            prompt, prompt_mask = self.repeat(prompt, prompt_mask)
            full = torch.cat([prompt, gen.response], dim=1)
            return self.score(batch, full, prompt_mask, gen.log_probs, gen.values, kl_coef=kl_coef)

    def repeat(self, *tensors: torch.Tensor):
        """Each prompt row ``num_samples`` times, the samples of a prompt adjacent."""
        return tuple(t.repeat_interleave(self.num_samples, 0) if self.num_samples > 1 else t for t in tensors)

    def columns(self, batch, B: int) -> dict[str, list]:
        """``batch["columns"]`` (``{name: [N] values}``), each row repeated to the ``B`` rollouts."""
        cols = batch.get("columns") if isinstance(batch, dict) else None
        if not cols:
            return {}
        k = B // max(len(next(iter(cols.values()))), 1)
        return {name: [v for v in values for _ in range(k)] for name, values in cols.items()}

    @torch.no_grad()
    def policy_log_probs_and_values(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int):
        """One pass of the policy over prompt + response: ``log_probs [B, T]`` and ``values [B, T]`` (or None)."""
        base = self.unwrap_fn(self.policy)
        response, s = full[:, prompt_len:], self.sampling
        if self.token_budget and hasattr(base, "value_head"):  # packed micro-batches (update.packing)
            return self.packed_log_probs_and_values(base, full, full_mask, prompt_len)
        step = self.logprob_batch_size or full.shape[0]
        log_probs, values = [], []
        for i in range(0, full.shape[0], step):
            c = slice(i, i + step)
            if hasattr(base, "value_head"):  # the same computation as the loss's (first ratio = 1)
                lp, _, v = base(full[c], full_mask[c], prompt_len, labels=response[c], temperature=s.temperature,
                                with_entropy=False)
                if v is not None:
                    values.append(v.float())
            else:
                lp = sequence_logprobs(base, full[c], full_mask[c], prompt_len, s.temperature)
            log_probs.append(lp)
        return torch.cat(log_probs), (torch.cat(values) if values else None)

    def packed_log_probs_and_values(self, base, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int):
        """:meth:`policy_log_probs_and_values` on packed micro-batches of at most ``token_budget`` tokens."""
        B, T, s = full.shape[0], full.shape[1] - prompt_len, self.sampling
        log_probs = torch.zeros(B, T, device=full.device)
        values = torch.zeros(B, T, device=full.device) if base.value_head is not None else None
        for rows in token_budget_chunks(full_mask, self.token_budget):
            lp, _, v = base(full[rows], full_mask[rows], prompt_len, labels=full[rows, prompt_len:],
                            temperature=s.temperature, with_entropy=False, packed=True)
            log_probs[rows] = lp.float()
            if values is not None:
                values[rows] = v.float()
        return log_probs, values

    @torch.no_grad()
    def score(self, batch, full: torch.Tensor, prompt_mask: torch.Tensor, log_probs: torch.Tensor | None = None,
              values: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None, *,
              kl_coef: float = 0.0, shape: bool = True, response_mask: torch.Tensor | None = None,
              assistant_mask: torch.Tensor | None = None, ended: torch.Tensor | None = None) -> Rollout:
        """Score generated sequences ``full [B, P+T]`` (left-padded prompt + response; ``prompt_mask [B, P]``).

        ``log_probs`` / ``values [B, T]``: from generation (kept as ``sampler_log_prob``; with
        ``trainer_pass`` the policy's pass still gives π_old), or ``None`` for one policy pass here;
        ``ref_log_probs [B, T]``: given, or ``None`` for the reference pass; ``shape=False`` leaves the
        shaping stack to the caller (the torchrl adapter runs a torchrl ``Compose`` instead). A multi-turn episode
        (:mod:`rlhf_train.rollout.multi_turn`) gives its masks: ``response_mask [B, T]`` (every token after the
        first prompt), ``assistant_mask [B, T]`` (the sampled ones: log-probs, values and the reference's are kept
        there only, and π_old and the values come from the policy's one pass over the episode) and ``ended [B]``
        (the episode ended by itself, not by a limit)."""
        T = self.max_new_tokens if response_mask is None else response_mask.shape[1]
        prompt_len = full.shape[1] - T
        prompt, response = full[:, :prompt_len], full[:, prompt_len:]
        if response_mask is None:
            response_mask = response_mask_from_tokens(response, self.eos_token_ids)
        actions = response_mask if assistant_mask is None else assistant_mask
        full_mask = torch.cat([prompt_mask, response_mask], dim=1)
        B, device = full.shape[0], full.device
        sampler = log_probs.reshape(B, T).float().masked_fill(~actions, 0.0) if log_probs is not None else None
        if log_probs is None or self.trainer_pass or assistant_mask is not None:
            log_probs, values = self.policy_log_probs_and_values(full, full_mask, prompt_len)
        elif values is None and self.has_critic:
            values = torch.zeros(B, T, device=device)
        log_probs = log_probs.reshape(B, T).float().masked_fill(~actions, 0.0)

        # done at the first EOS, or at the last position when the response was cut at T (truncated)
        lengths = response_mask.sum(-1)
        done = torch.zeros(B, T, dtype=torch.bool, device=device).scatter_(-1, (lengths - 1).clamp(min=0)[:, None], True)
        has_eos = (is_eos(response, self.eos_token_ids) & response_mask).any(-1) if ended is None else ended

        columns = self.columns(batch, B)  # the dataset's other columns (e.g. answer), one value per row
        # Python reward functions score in their workers / threads; meanwhile the reference pass runs here
        reference = self.reference if ref_log_probs is None else None
        ref_pass = (lambda: reference.log_probs(full, full_mask, prompt_len)) if reference is not None else None
        overlap = ref_pass is not None and has_threaded(self.reward_sources)
        self.reward_report = report = RewardReport()  # time/reward_s, faults/reward_timeouts (the loop reads it)
        score, parts, ref_early = score_sources(self.reward_sources, Sequences(full, full_mask, prompt_len, columns),
                                                ref_pass if overlap else None, report)
        if ref_log_probs is None and ref_pass is not None:
            ref_log_probs = ref_early if overlap else ref_pass()
        score_ref = None
        reference_batch = reference_sequences(batch)
        if reference_batch is not None:
            ids, mask = self.repeat(*reference_batch) if reference_batch[0].shape[0] != B else reference_batch
            score_ref = weighted_sum(self.reward_sources, Sequences(ids, mask, None, columns), report)[0]

        ro = Rollout(
            tokens=Tokens(prompt=prompt, response=response, full=full, batch_size=[B]),
            masks=Masks(prompt=prompt_mask, response=response_mask, full=full_mask, assistant=assistant_mask,
                        batch_size=[B]),
            sample_log_prob=log_probs, sampler_log_prob=sampler,
            values=values.masked_fill(~actions, 0.0) if values is not None and self.has_critic else None,
            ref_log_prob=(ref_log_probs.to(device).reshape(B, T).float().masked_fill(~actions, 0.0)
                          if ref_log_probs is not None else None),
            # no reference: no KL (0); with one, the shaping stack's `kl` entry writes it (dropping that entry
            # leaves the reward entry without its input: an error at start, not a silent KL-free run)
            kl=torch.zeros(B, T, device=device) if ref_log_probs is None else None,
            kl_per_sequence=torch.zeros(B, device=device) if ref_log_probs is None else None,
            kl_coef=torch.full((B,), float(kl_coef), device=device),
            score_raw=score, score=score.clone(), score_ref=score_ref, reward_sources=parts,
            unscored=unscored_rows(parts, score),
            done=done, terminated=done & has_eos[:, None], truncated=done & ~has_eos[:, None],
            batch_size=[B], device=device,
        )
        return apply_shaping(self.shaping, ro) if shape else ro


def unscored_rows(parts, score: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows every reward source left unscored (each returned None: NaN in ``parts``) whose total
    is finite (a reward model's NaN makes the total NaN: a fault, never "unscored"). The weighted sum gives
    them 0; the critic-free estimators leave them out of their statistics with advantage 0 (TRL's rule)."""
    names = list(parts.keys())
    if not names:
        return torch.zeros_like(score, dtype=torch.bool)
    return torch.stack([parts[n].isnan() for n in names]).all(0) & torch.isfinite(score)


def reference_sequences(batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Prompt + reference response (e.g. the TL;DR human summary, the reward baseline) and its mask, if any."""
    getter = batch.get if hasattr(batch, "get") else (lambda k, d=None: getattr(batch, k, d))
    ids = getter("reference_input_ids", None)
    return (ids, getter("reference_attention_mask").bool()) if ids is not None else None
