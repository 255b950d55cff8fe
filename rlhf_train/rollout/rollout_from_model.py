"""``RolloutFromModel``: a drop-in for ``torchrl.data.llm.RolloutFromModel``, without its defects, as a
thin assembler over the seams.

One call of :meth:`RolloutFromModel.rollout_from_data` is:

  1. prompts (left-padded; torchrl's ``PromptData`` accepted, :mod:`rlhf_train.rollout.torchrl_compat`);
  2. generation through a :class:`~rlhf_train.generation.base.GenerationBackend` (default: HF ``generate``
     whose steps also give the policy's sampling log-probs and values; else one policy pass);
  3. the reward sources (:mod:`rlhf_train.rewards.sources`), a weighted dict keyed by name, score each
     sequence (and the batch's reference responses, when it has them, for the reward baseline);
  4. the reward-shaping transform stack (:mod:`rlhf_train.rewards.transforms`): score shaping, reference
     log-probs (one batched pass of the reference, under the sampling temperature only), per-token KL,
     the per-token reward with the KL coefficient given for this call.

Same constructor, methods and output keys as torchrl's; what differs (see ``anchors.md``): EOS and pad
ids come from the tokenizer / model config, never the constant 50256; tokens are stored once per
sequence (``Tokens.full [B, P+T]`` + ``Masks.response [B, T]``), never once per timestep, and per-token
fields are ``[B, T]`` (torchrl's trailing ``1`` dropped); ``sample_log_prob`` is the log-prob under the
distribution the token was sampled from (temperature, top-k, top-p), so the first PPO ratio is 1; the
controller is fed the **per-sequence** KL with ``n_steps`` = number of sequences (Ziegler et al. §2.2).
As in torchrl, the EOS token is an action like any other: it gets a log-prob, a KL term and the reward.

The KL coefficient: rlhf_train's loop owns the KL controller and passes its coefficient into every call
(``rollout_from_data(batch, kl_coef=β)``), then updates the controller itself. torchrl's way works too:
construct with ``kl_scheduler=...``; ``kl_coef`` then reads the controller and :meth:`step_scheduler`
updates it with the per-sequence KLs queued since the last step.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

import torch
from tensordict import TensorDict

from rlhf_train.core.containers import (
    LogProbs,
    Masks,
    Tokens,
    is_eos,
    response_mask_from_tokens,
)
from rlhf_train.core.logprob_kernel import logprobs_of_labels
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.generation.base import GenerationBackend
from rlhf_train.generation.hf_generate import HFGenerateBackend
from rlhf_train.models.scoring import sequence_logprobs
from rlhf_train.rewards.sources import (
    RewardModelSource,
    RewardSource,
    Sequences,
    has_threaded,
    score_sources,
    weighted_sum,
)
from rlhf_train.rewards.transforms import default_transform_stack
from rlhf_train.rollout.torchrl_compat import prompts_from_batch, reference_from_batch


def _special_ids(model, tokenizer, eos_token_id, pad_token_id) -> tuple[tuple[int, ...], int]:
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
    # several EOS ids (e.g. <|im_end|> and <|endoftext|>): the tokenizer's first, then the generation config's
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos] if gen_eos is not None else []):
        if int(e) not in eos:
            eos.append(int(e))
    return tuple(eos), int(pad_token_id)


class RolloutFromModel:
    """Roll out a causal LM on a batch of prompts and score it. See the module docstring.

    Args (torchrl's):
        model: the policy, a :class:`~rlhf_train.models.policy.PolicyWithValue` (log-probs and values in one
            pass) or any ``transformers`` causal LM (log-probs only).
        ref_model: the frozen reference causal LM (``None`` with a ``ref_log_prob_fn`` or no KL term).
        reward_model: ``forward(input_ids, attention_mask) -> (per-token rewards, end_scores)``; becomes the
            reward source ``"reward_model"`` (weight 1) unless ``reward_sources`` is given.
        kl_coef: the KL coefficient when neither a call nor a ``kl_scheduler`` gives one.
        max_new_tokens: response length T.
        score_clip: reward-model scores are clipped to ``(−score_clip, score_clip)`` (default stack only).
        kl_scheduler: a KL controller (``coef``, ``update(per_sequence_kls)``), torchrl style.
        num_steps: keep at most this many rollouts' KL values for the next scheduler step.

    Keyword Args:
        tokenizer: gives EOS / pad ids (or pass ``eos_token_id`` / ``pad_token_id``).
        temperature, top_k, top_p: the sampling distribution (and the one the policy's log-probs are taken
            under; the reference scores under the temperature alone).
        do_sample: ``False`` for greedy decoding (deterministic tests).
        transforms: the reward-shaping stack (a torchrl ``Compose``); default reproduces torchrl.
        ref_log_prob_fn: override how reference log-probs are computed (e.g. a Ray service).
        gather_fn: reduces per-sequence KLs across processes before a ``step_scheduler`` update.
        logprob_batch_size: rows per forward pass when scoring (bounds the ``[b, T, V]`` logits memory).
        unwrap_fn: unwraps a DDP / FSDP / Accelerate-prepared policy.
        logprobs_from_generate: take the policy's log-probs and values from ``generate``'s own steps instead
            of a second forward pass (they agree to float32 rounding). Turn off when the loss runs in another
            precision than ``generate`` (the trainer does under mixed precision), so the first ratio stays 1.
        reward_sources: ``{name: (RewardSource, weight)}``, scored and summed (replaces ``reward_model``).
        generation_backend: a :class:`~rlhf_train.generation.base.GenerationBackend` (default:
            :class:`~rlhf_train.generation.hf_generate.HFGenerateBackend`, rlhf_train's KV-cached loop).
        hf_generate: the default backend samples with ``transformers``' ``generate`` instead of its own loop.
        num_samples: responses per prompt; the samples of a prompt are adjacent rows.
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
        reward_sources: dict[str, tuple[RewardSource, float]] | None = None,
        generation_backend: GenerationBackend | None = None,
        num_samples: int = 1,
        hf_generate: bool = False,
    ):
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.model, self.ref_model, self.reward_model = model, ref_model, reward_model
        self.max_new_tokens, self.score_clip, self.num_samples = max_new_tokens, score_clip, num_samples
        self.kl_scheduler, self._kl_coef = kl_scheduler, kl_coef
        self.tokenizer, self.gather_fn, self.logprob_batch_size = tokenizer, gather_fn, logprob_batch_size
        self.unwrap_fn = unwrap_fn or (lambda m: m)
        base = self.unwrap_fn(model)
        self.eos_token_ids, self.pad_token_id = _special_ids(getattr(base, "lm", base), tokenizer, eos_token_id, pad_token_id)
        self.eos_token_id = self.eos_token_ids[0]  # the primary EOS; responses end at the first of any EOS id
        eos = self.eos_token_ids if len(self.eos_token_ids) > 1 else self.eos_token_id
        self.sampling = SamplingParams(temperature, top_k, top_p)
        self.backend = generation_backend or HFGenerateBackend(
            model, eos_token_id=eos, pad_token_id=self.pad_token_id, max_new_tokens=max_new_tokens,
            sampling=self.sampling, do_sample=do_sample, with_scores=logprobs_from_generate, unwrap_fn=self.unwrap_fn,
            decode_loop=not hf_generate)
        self.reward_sources = reward_sources if reward_sources is not None else {
            "reward_model": (RewardModelSource(reward_model, self.pad_token_id, logprob_batch_size), 1.0)}
        # no reference model and no function: no KL term (the rollout's kl is 0; a critic-free run with
        # beta = 0 and no KL in the reward builds and runs no reference at all)
        self.ref_log_prob_fn = ref_log_prob_fn or (self._ref_log_probs if ref_model is not None else None)
        # a PolicyWithValue built without a value head (a critic-free algorithm): the rollout has no values
        self.has_critic = getattr(base, "value_head", "plain LM") is not None
        self.transforms = transforms if transforms is not None else default_transform_stack(
            self.ref_log_prob_fn, kl_coef, score_clip, eos)
        # torchrl-style controller only: detached per-sequence KLs waiting for the next step_scheduler()
        self._kl_queue = collections.deque(maxlen=num_steps) if num_steps is not None else collections.deque()

    # ------------------------------------------------------------------ the KL coefficient (torchrl's API)
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
        """log π_ref of the response tokens, one batched pass, under the sampling **temperature only**:
        a top-k / top-p filter of the reference's own would give a sampled token outside it −inf."""
        device = next(self.ref_model.parameters()).device
        s = self.sampling.for_reference()
        return torch.cat([
            sequence_logprobs(self.ref_model, full[c].to(device), full_mask[c].to(device), prompt_len,
                              s.temperature, s.top_k, s.top_p).to(full.device)
            for c in self._chunks(full.shape[0])])

    @torch.no_grad()
    def _policy_log_probs_and_values(self, full, full_mask, prompt_len):
        """One pass of the policy over prompt + response: ``log_probs [B, T]`` and ``values [B, T]``."""
        base = self.unwrap_fn(self.model)
        response = full[:, prompt_len:]
        s = self.sampling
        log_probs, values = [], []
        for c in self._chunks(full.shape[0]):
            if hasattr(base, "value_head"):  # the same computation as the loss's (first ratio = 1)
                lp, _, v = base(full[c], full_mask[c], prompt_len, labels=response[c], temperature=s.temperature,
                                top_k=s.top_k, top_p=s.top_p, with_entropy=False)
                if v is not None:
                    values.append(v.float())
            else:
                lp = sequence_logprobs(base, full[c], full_mask[c], prompt_len, s.temperature, s.top_k, s.top_p)
            log_probs.append(lp)
        values = torch.cat(values) if values else torch.zeros_like(response, dtype=torch.float32)
        return torch.cat(log_probs), values

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, batch, generation_config=None):
        """Sample responses for a batch of prompts (torchrl's API).

        Returns ``generated [B, P+T]`` (left-padded prompt + response), ``log_probs_gen [B, T]``
        (under the sampling distribution) and ``log_ratio [B, T]`` (log π − log π_ref, 0 outside the
        response).
        """
        prompt, prompt_mask = self._repeat(*prompts_from_batch(batch, self.pad_token_id))
        response = self.backend.generate(prompt, prompt_mask, 1, generation_config=generation_config).response
        full = torch.cat([prompt, response], dim=1)
        response_mask = response_mask_from_tokens(response, self.eos_token_ids)
        full_mask = torch.cat([prompt_mask, response_mask], dim=1)
        log_probs, _ = self._policy_log_probs_and_values(full, full_mask, prompt.shape[1])
        ref = self.ref_log_prob_fn(full, full_mask, prompt.shape[1])
        log_ratio = (log_probs - ref).masked_fill(~response_mask, 0.0)
        return full, log_probs.masked_fill(~response_mask, 0.0), log_ratio

    def _ref_transform_key(self):
        """The out key of the stack's reference-log-prob transform (None: the stack has none, or no reference)."""
        from rlhf_train.rewards.transforms import ReferenceModelLogProbTransform

        if self.ref_log_prob_fn is None:
            return None
        found = [t for t in getattr(self.transforms, "transforms", []) if isinstance(t, ReferenceModelLogProbTransform)]
        return found[0].out_key if len(found) == 1 and found[0].ref_log_prob_fn is self.ref_log_prob_fn else None

    @staticmethod
    def _columns(batch, B: int) -> dict[str, list]:
        """``batch["columns"]`` (``{name: [b] values}``), each row repeated to the ``B`` rollouts (num_samples)."""
        cols = batch.get("columns") if isinstance(batch, dict) else None
        if not cols:
            return {}
        k = B // max(len(next(iter(cols.values()))), 1)
        return {name: [v for v in values for _ in range(k)] for name, values in cols.items()}

    def _repeat(self, *tensors: torch.Tensor):
        """Each prompt row ``num_samples`` times, the samples of a prompt adjacent."""
        return tuple(t.repeat_interleave(self.num_samples, 0) if self.num_samples > 1 else t for t in tensors)

    @torch.no_grad()
    def rollout_from_data(self, batch, generation_config=None, *, kl_coef: float | None = None) -> TensorDict:
        """Generate on ``batch`` and return the scored rollout TensorDict (see :meth:`create_rollout_td`).
        ``kl_coef``: the coefficient the reward is shaped with (default: :attr:`kl_coef`)."""
        prompt, prompt_mask = prompts_from_batch(batch, self.pad_token_id)
        extra = {} if generation_config is None else {"generation_config": generation_config}  # torchrl's API
        gen = self.backend.generate(prompt, prompt_mask, self.num_samples, **extra)
        prompt, prompt_mask = self._repeat(prompt, prompt_mask)
        full = torch.cat([prompt, gen.response], dim=1)
        return self.create_rollout_td(batch, full, gen.log_probs, None, prompt_len=prompt.shape[1],
                                      prompt_mask=prompt_mask, values=gen.values, kl_coef=kl_coef)

    # ------------------------------------------------------------------ the rollout TensorDict
    @torch.no_grad()
    def create_rollout_td(self, batch, generated, log_probs=None, log_ratio=None, *, prompt_len=None,
                          prompt_mask=None, values=None, kl_coef: float | None = None) -> TensorDict:
        """Wrap generated tokens in a rollout TensorDict with batch size ``[B]``.

        Args:
            batch: the prompt batch (for the reference response used as reward baseline).
            generated: ``[B, P+T]`` left-padded prompt + response (as returned by :meth:`generate`).
            log_probs: ``[B, T]`` sampling log-probs; recomputed (with values) when ``None``.
            log_ratio: ``[B, T]`` log π − log π_ref; the reference pass runs when ``None``.
            values: ``[B, T]`` V(s_t) going with ``log_probs`` (zeros when ``log_probs`` is given without them).
            kl_coef: the KL coefficient for this rollout (default: :attr:`kl_coef`).

        Returns torchrl's keys, the fields of :class:`~rlhf_train.core.containers.Rollout` (its
        docstring is the table of keys, shapes and meanings; ``Rollout.from_torchrl(td)`` is the typed view).
        """
        T = self.max_new_tokens
        prompt_len = generated.shape[1] - T if prompt_len is None else prompt_len
        prompt, response = generated[:, :prompt_len], generated[:, prompt_len:]
        if prompt_mask is None:
            prompt_mask = (self._repeat(prompts_from_batch(batch, self.pad_token_id)[1])[0] if batch is not None
                           else prompt != self.pad_token_id)
            prompt_mask = prompt_mask[:, -prompt_len:]
        response_mask = response_mask_from_tokens(response, self.eos_token_ids)
        full_mask = torch.cat([prompt_mask, response_mask], dim=1)
        B, device = generated.shape[0], generated.device

        if log_probs is None:  # one pass of the policy over prompt + response
            log_probs, values = self._policy_log_probs_and_values(generated, full_mask, prompt_len)
        elif values is None and self.has_critic:
            values = torch.zeros(B, T, device=device)
        log_probs = log_probs.reshape(B, T).float().masked_fill(~response_mask, 0.0)

        # done at the first EOS, or at the last position when the response was cut at T (truncated)
        lengths = response_mask.sum(-1)
        done = torch.zeros(B, T, dtype=torch.bool, device=device).scatter_(-1, (lengths - 1).clamp(min=0)[:, None], True)
        has_eos = (is_eos(response, self.eos_token_ids) & response_mask).any(-1)

        columns = self._columns(batch, B)  # the dataset's other columns (e.g. answer), one value per row
        # Python reward functions score in a worker thread; meanwhile the reference pass runs here (its
        # transform then finds the log-probs in place), so a slow function does not serialise the rollout
        ref_key = self._ref_transform_key() if log_ratio is None and has_threaded(self.reward_sources) else None
        during = (lambda: self.ref_log_prob_fn(generated, full_mask, prompt_len)) if ref_key is not None else None
        score, parts, ref_early = score_sources(self.reward_sources, Sequences(generated, full_mask, prompt_len, columns),
                                                during)
        coef = self.kl_coef if kl_coef is None else float(kl_coef)
        td = TensorDict(
            {
                "tokens": Tokens(prompt=prompt, response=response, full=generated, batch_size=[B]),
                "masks": Masks(prompt=prompt_mask, response=response_mask, full=full_mask, batch_size=[B]),
                "log_probs": LogProbs(response=log_probs, batch_size=[B]),
                "action": response,
                "sample_log_prob": log_probs,
                "kl_coef": torch.full((B,), coef, device=device),
                "reward_sources": parts,
                "next": {"done": done, "terminated": done & has_eos[:, None], "truncated": done & ~has_eos[:, None],
                         "score": score, "score_raw": score.clone()},
            },
            batch_size=[B],
            device=device,
        )
        if values is not None and self.has_critic:
            td.set("values", values.masked_fill(~response_mask, 0.0))
        if ref_early is not None:
            td.set(ref_key, ref_early.to(device).masked_fill(~response_mask, 0.0))
        if log_ratio is not None:
            td.set(("ref_log_probs", "response"), (log_probs - log_ratio.reshape(B, T)).masked_fill(~response_mask, 0.0))
        elif self.ref_log_prob_fn is None:  # no reference: no KL (the stack has no ref_logprob / kl entries)
            td.set(("next", "kl"), torch.zeros(B, T, device=device))
            td.set("kl_per_sequence", torch.zeros(B, device=device))
        reference = reference_from_batch(batch) if batch is not None else None
        if reference is not None:
            ids, mask = self._repeat(*reference) if reference[0].shape[0] != B else reference
            td.set(("next", "score_ref"), weighted_sum(self.reward_sources, Sequences(ids, mask, None, columns))[0])

        td = self.transforms(td)  # score shaping → reference log-prob → KL → per-token reward
        if self.kl_scheduler is not None:
            self._kl_queue.append(td.get("kl_per_sequence").detach().float().cpu())
        return td
