"""``RolloutFromModel``: a drop-in for ``torchrl.data.llm.RolloutFromModel``, without its defects.

Same constructor, methods and output keys as torchrl's; what differs (see ``anchors.md``):

* EOS and pad ids come from the tokenizer / model config, never the constant 50256;
* tokens are stored once per sequence (``Tokens.full [B, P+T]`` + ``Masks.response [B, T]``), never
  once per timestep (``[B, T, L]``); per-token fields are ``[B, T]`` (torchrl's trailing ``1`` dropped);
* ``sample_log_prob`` is the log-prob under the distribution the token was sampled from (temperature,
  top-k, top-p applied: ``process_logits``, which the PPO loss applies too), so the first PPO ratio is 1
  (to float32 rounding when it is read off ``generate``'s steps, see ``logprobs_from_generate``);
* ``kl_coef`` is a property reading the KL controller, so the rollout and the controller never disagree;
* the controller is fed the mean **per-sequence** KL with ``n_steps`` = number of sequences (Ziegler §2.2);
* reward shaping is delegated to the transform stack (:mod:`rlhf_train.rewards.transforms`);
* the EOS token is an action like any other: it gets a log-prob, a KL term and the reward (N+).

Per iteration the cost is one KV-cached ``generate``, whose steps also give the policy's log-probs and
values (:class:`InverseCDFSampler` draws each token and records its log-prob; a forward hook on the
trunk keeps the hidden state the value head reads), plus one batched forward pass over prompt + response
for each of the reference and the reward model. With ``logprobs_from_generate=False`` (the trainer's
choice under mixed precision) the policy gets its own scoring pass as well.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable

import torch
from tensordict import TensorDict
from transformers import LogitsProcessorList

from rlhf_train.core.containers import (
    LogProbs,
    Masks,
    Tokens,
    left_pad,
    response_mask_from_tokens,
)
from rlhf_train.core.logprob_kernel import logprobs_of_labels
from rlhf_train.generation.hf_generate import (
    InverseCDFSampler,
    _stack_steps,
    last_hidden_per_step,
)
from rlhf_train.models.scoring import sequence_logprobs
from rlhf_train.rewards.transforms import default_transform_stack


def _special_ids(model, tokenizer, eos_token_id, pad_token_id) -> tuple[int, int]:
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
    if isinstance(eos_token_id, (list, tuple)):
        eos_token_id = eos_token_id[0]
    return int(eos_token_id), int(pad_token_id)


class RolloutFromModel:
    """Roll out a causal LM on a batch of prompts and score it. See the module docstring.

    Args:
        model: the policy, a :class:`~rlhf_train.models.policy.PolicyWithValue` (log-probs and values in one
            pass) or any ``transformers`` causal LM (log-probs only).
        ref_model: the frozen reference causal LM.
        reward_model: ``forward(input_ids, attention_mask) -> (per-token rewards, end_scores)``.
        kl_coef: initial KL coefficient, used when there is no ``kl_scheduler``.
        max_new_tokens: response length T.
        score_clip: reward-model scores are clipped to ``(−score_clip, score_clip)``.
        kl_scheduler: a KL controller (``coef``, ``update(per_sequence_kls)``).
        num_steps: keep at most this many rollouts' KL values for the next scheduler step.

    Keyword Args:
        tokenizer: gives EOS / pad ids (or pass ``eos_token_id`` / ``pad_token_id``).
        temperature, top_k, top_p: the sampling distribution (and the one log-probs are taken under).
        do_sample: ``False`` for greedy decoding (deterministic tests).
        transforms: the reward-shaping stack (a torchrl ``Compose``); default reproduces torchrl.
        ref_log_prob_fn: override how reference log-probs are computed (e.g. a Ray service).
        gather_fn: reduces per-sequence KLs across processes before the scheduler update.
        logprob_batch_size: rows per forward pass when scoring (bounds the ``[b, T, V]`` logits memory).
        logprobs_from_generate: when sampling, take the policy's log-probs (and values) from ``generate``'s
            own steps instead of a second forward pass over prompt + response (the two agree to float32
            rounding, ~1e-6). Turn off when the loss's forward pass runs in another precision than
            ``generate`` (the trainer does under ``mixed_precision``), so the first PPO ratio stays 1.
    """

    def __init__(
        self,
        model,
        ref_model,
        reward_model,
        kl_coef: float = 0.1,
        max_new_tokens: int = 50,
        score_clip: float = 10.0,
        kl_scheduler=None,
        num_steps: int | None = None,
        *,
        tokenizer: Any = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        do_sample: bool = True,
        transforms=None,
        ref_log_prob_fn: Callable | None = None,
        gather_fn: Callable | None = None,
        logprob_batch_size: int | None = None,
        unwrap_fn: Callable | None = None,
        logprobs_from_generate: bool = True,
    ):
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.model, self.ref_model, self.reward_model = model, ref_model, reward_model
        self.max_new_tokens, self.score_clip = max_new_tokens, score_clip
        self.kl_scheduler = kl_scheduler
        self._kl_coef = kl_coef
        self.tokenizer = tokenizer
        base = unwrap_fn(model) if unwrap_fn else model
        self.eos_token_id, self.pad_token_id = _special_ids(getattr(base, "lm", base), tokenizer, eos_token_id, pad_token_id)
        self.temperature, self.top_k, self.top_p, self.do_sample = temperature, top_k, top_p, do_sample
        self.gather_fn = gather_fn
        self.logprob_batch_size = logprob_batch_size
        self.logprobs_from_generate = logprobs_from_generate
        self.unwrap_fn = unwrap_fn or (lambda m: m)
        self.ref_log_prob_fn = ref_log_prob_fn or self._ref_log_probs
        self.transforms = transforms if transforms is not None else default_transform_stack(
            self.ref_log_prob_fn, kl_coef, score_clip, self.eos_token_id)
        # detached per-sequence KL values waiting for the next scheduler step (cheap scalars)
        self._kl_queue = collections.deque(maxlen=num_steps) if num_steps is not None else collections.deque()

    # ------------------------------------------------------------------ the KL coefficient
    @property
    def kl_coef(self) -> float:
        """The KL coefficient in force: always the controller's current one when there is a controller."""
        return float(self.kl_scheduler.coef) if self.kl_scheduler is not None else float(self._kl_coef)

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        if self.kl_scheduler is not None:
            self.kl_scheduler.coef = float(value)
        self._kl_coef = float(value)

    def step_scheduler(self) -> float:
        """Update the KL controller with the queued per-sequence KLs (all processes), then clear them."""
        if self.kl_scheduler is None:
            self._kl_queue.clear()
            return self.kl_coef
        kls = torch.cat(list(self._kl_queue)) if self._kl_queue else torch.zeros(0)
        if self.gather_fn is not None:
            kls = self.gather_fn(kls)
        self.kl_scheduler.update(kls.float().cpu())
        self._kl_queue.clear()
        return self.kl_coef

    # ------------------------------------------------------------------ log-probs
    @staticmethod
    def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``log softmax(logits)[labels]``: ``[B, T, V]``, ``[B, T]`` → ``[B, T]`` (float32)."""
        return logprobs_of_labels(logits, labels)

    def _chunks(self, n: int):
        step = self.logprob_batch_size or n
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    @torch.no_grad()
    def _ref_log_probs(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        device = next(self.ref_model.parameters()).device
        out = [
            sequence_logprobs(self.ref_model, full[s].to(device), full_mask[s].to(device), prompt_len,
                              self.temperature, self.top_k, self.top_p).to(full.device)
            for s in self._chunks(full.shape[0])
        ]
        return torch.cat(out)

    @torch.no_grad()
    def _policy_log_probs_and_values(self, full, full_mask, prompt_len):
        """One pass of the policy over prompt + response: ``log_probs [B, T]`` and ``values [B, T]``."""
        base = self.unwrap_fn(self.model)
        response = full[:, prompt_len:]
        log_probs, values = [], []
        for s in self._chunks(full.shape[0]):
            if hasattr(base, "value_head"):  # the same computation as the PPO loss's (first ratio = 1)
                lp, _, v = base(full[s], full_mask[s], prompt_len, labels=response[s], temperature=self.temperature,
                                top_k=self.top_k, top_p=self.top_p, with_entropy=False)
                values.append(v.float())
            else:
                lp = sequence_logprobs(base, full[s], full_mask[s], prompt_len, self.temperature, self.top_k, self.top_p)
            log_probs.append(lp)
        values = torch.cat(values) if values else torch.zeros_like(response, dtype=torch.float32)
        return torch.cat(log_probs), values

    # ------------------------------------------------------------------ generation
    def _prompts(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask ``[B, P]`` from our batches or torchrl's ``PromptData``."""
        if hasattr(batch, "prompt_rindex") and getattr(batch, "prompt_rindex", None) is not None:
            ids = batch.input_ids
            mask = torch.arange(ids.shape[-1], device=ids.device)[None] < batch.prompt_rindex[:, None]
            ids, mask = left_pad(ids, mask, self.pad_token_id)
            width = int(mask.sum(-1).max())
            return ids[:, ids.shape[-1] - width:], mask[:, ids.shape[-1] - width:]
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        if (mask[:, -1] == 0).any():  # right padded: move to the left, as generate needs
            ids, mask = left_pad(ids, mask, self.pad_token_id)
        return ids, mask

    def _reference(self, batch):
        """Prompt + reference response (e.g. the TL;DR human summary) for the reward baseline, if any."""
        if hasattr(batch, "prompt_rindex") and getattr(batch, "prompt_rindex", None) is not None:
            return batch.input_ids, batch.attention_mask.bool()
        getter = batch.get if hasattr(batch, "get") else (lambda k, d=None: getattr(batch, k, d))
        ids = getter("reference_input_ids", None)
        return (ids, getter("reference_attention_mask").bool()) if ids is not None else None

    @torch.no_grad()
    def _sample(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, generation_config=None,
                with_scores: bool = False):
        """KV-cached ``generate``: response tokens ``[B, T]``, pad after EOS (and to T).

        ``with_scores`` (sampling with our sampler only) also returns ``(log_probs [B, T], values [B, T])``
        of the sampled tokens, read off ``generate``'s steps; otherwise ``None`` in their place.
        """
        base = self.unwrap_fn(self.model)
        lm = getattr(base, "lm", base)
        kwargs = dict(max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_id,
                      pad_token_id=self.pad_token_id, use_cache=True)
        sampler = None
        if generation_config is None:
            # sampling happens in InverseCDFSampler; generate's own step is then greedy (picks its token)
            kwargs.update(do_sample=False)
            if self.do_sample:
                sampler = InverseCDFSampler(self.temperature, self.top_k, self.top_p)
                kwargs["logits_processor"] = LogitsProcessorList([sampler])
        else:
            kwargs["generation_config"] = generation_config
        with_scores = with_scores and sampler is not None
        value_head = getattr(base, "value_head", None) if with_scores else None
        with last_hidden_per_step(lm.base_model) if value_head is not None else contextlib.nullcontext() as hidden:
            out = lm.generate(input_ids=prompt, attention_mask=prompt_mask.long(), **kwargs)
        T = self.max_new_tokens
        response = out[:, prompt.shape[1]:]
        if response.shape[1] < T:
            pad = response.new_full((response.shape[0], T - response.shape[1]), self.pad_token_id)
            response = torch.cat([response, pad], dim=1)
        # anything after the first EOS is padding, whatever generate put there
        mask = response_mask_from_tokens(response, self.eos_token_id)
        response = response.masked_fill(~mask, self.pad_token_id)
        if not with_scores:
            return response, None
        log_probs = _stack_steps(sampler.log_probs, T).float()
        values = (value_head(_stack_steps(hidden, T)).float() if value_head is not None
                  else torch.zeros_like(log_probs))
        return response, (log_probs, values)

    @torch.no_grad()
    def generate(self, batch, generation_config=None):
        """Sample responses for a batch of prompts (torchrl's API).

        Returns ``generated [B, P+T]`` (left-padded prompt + response), ``log_probs_gen [B, T]``
        (under the sampling distribution) and ``log_ratio [B, T]`` (log π − log π_ref, 0 outside the
        response).
        """
        prompt, prompt_mask = self._prompts(batch)
        response, _ = self._sample(prompt, prompt_mask, generation_config)
        full = torch.cat([prompt, response], dim=1)
        response_mask = response_mask_from_tokens(response, self.eos_token_id)
        full_mask = torch.cat([prompt_mask, response_mask], dim=1)
        log_probs, _ = self._policy_log_probs_and_values(full, full_mask, prompt.shape[1])
        ref = self.ref_log_prob_fn(full, full_mask, prompt.shape[1])
        log_ratio = (log_probs - ref).masked_fill(~response_mask, 0.0)
        return full, log_probs.masked_fill(~response_mask, 0.0), log_ratio

    @torch.no_grad()
    def rollout_from_data(self, batch, generation_config=None) -> TensorDict:
        """Generate on ``batch`` and return the scored rollout TensorDict (see :meth:`create_rollout_td`)."""
        prompt, prompt_mask = self._prompts(batch)
        response, scores = self._sample(prompt, prompt_mask, generation_config, self.logprobs_from_generate)
        log_probs, values = scores if scores is not None else (None, None)
        full = torch.cat([prompt, response], dim=1)
        return self.create_rollout_td(batch, full, log_probs, None, prompt_len=prompt.shape[1],
                                      prompt_mask=prompt_mask, values=values)

    # ------------------------------------------------------------------ the rollout TensorDict
    @torch.no_grad()
    def create_rollout_td(self, batch, generated, log_probs=None, log_ratio=None, *, prompt_len=None,
                          prompt_mask=None, values=None) -> TensorDict:
        """Wrap generated tokens in a rollout TensorDict with batch size ``[B]``.

        Args:
            batch: the prompt batch (for the reference response used as reward baseline).
            generated: ``[B, P+T]`` left-padded prompt + response (as returned by :meth:`generate`).
            log_probs: ``[B, T]`` sampling log-probs; recomputed (with values) when ``None``.
            log_ratio: ``[B, T]`` log π − log π_ref; the reference pass runs when ``None``.
            values: ``[B, T]`` V(s_t) going with ``log_probs`` (zeros when ``log_probs`` is given without them).

        Returns keys ``action [B, T]``, ``sample_log_prob [B, T]``, ``values [B, T]``, ``tokens``,
        ``masks``, ``log_probs``, ``ref_log_probs`` (typed containers), ``kl_coef [B]``,
        ``kl_per_sequence [B]`` and ``next``: ``reward``, ``reward_raw``, ``reward_kl``, ``kl``,
        ``done``, ``terminated`` (all ``[B, T]``), ``score``, ``score_ref`` (``[B]``).
        """
        T = self.max_new_tokens
        prompt_len = generated.shape[1] - T if prompt_len is None else prompt_len
        prompt, response = generated[:, :prompt_len], generated[:, prompt_len:]
        if prompt_mask is None:
            prompt_mask = self._prompts(batch)[1] if batch is not None else prompt != self.pad_token_id
            prompt_mask = prompt_mask[:, -prompt_len:]
        response_mask = response_mask_from_tokens(response, self.eos_token_id)
        full_mask = torch.cat([prompt_mask, response_mask], dim=1)
        B, device = generated.shape[0], generated.device

        if log_probs is None:  # one pass of the policy over prompt + response
            log_probs, values = self._policy_log_probs_and_values(generated, full_mask, prompt_len)
        elif values is None:
            values = torch.zeros(B, T, device=device)
        log_probs = log_probs.reshape(B, T).float().masked_fill(~response_mask, 0.0)

        # done at the first EOS, or at the last position when the response was cut at T (truncated)
        lengths = response_mask.sum(-1)
        done_idx = (lengths - 1).clamp(min=0)
        done = torch.zeros(B, T, dtype=torch.bool, device=device).scatter_(-1, done_idx[:, None], True)
        has_eos = ((response == self.eos_token_id) & response_mask).any(-1)
        terminated = done & has_eos[:, None]

        score = self._score(generated, full_mask)
        td = TensorDict(
            {
                "tokens": Tokens(prompt=prompt, response=response, full=generated, batch_size=[B]),
                "masks": Masks(prompt=prompt_mask, response=response_mask, full=full_mask, batch_size=[B]),
                "log_probs": LogProbs(response=log_probs, batch_size=[B]),
                "action": response,
                "sample_log_prob": log_probs,
                "values": values.masked_fill(~response_mask, 0.0),
                "kl_coef": torch.full((B,), self.kl_coef, device=device),
                "next": {"done": done, "terminated": terminated, "truncated": done & ~has_eos[:, None],
                         "score": score},
            },
            batch_size=[B],
            device=device,
        )
        if log_ratio is not None:
            td.set(("ref_log_probs", "response"), (log_probs - log_ratio.reshape(B, T)).masked_fill(~response_mask, 0.0))
        reference = self._reference(batch) if batch is not None else None
        if reference is not None:
            td.set(("next", "score_ref"), self._score(*reference))
        td.set(("next", "score_raw"), score.clone())

        td = self.transforms(td)  # reference log-prob → KL → reward adjustment (+ score shaping)
        self._kl_queue.append(td.get("kl_per_sequence").detach().float().cpu())
        return td

    @torch.no_grad()
    def _score(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Reward-model end score ``[B]`` of each sequence (batched)."""
        device = next(self.reward_model.parameters()).device
        out = []
        for s in self._chunks(ids.shape[0]):
            _, end_scores = self.reward_model(input_ids=ids[s].to(device), attention_mask=mask[s].to(device))
            out.append(end_scores.reshape(-1).float().to(ids.device))
        return torch.cat(out)
