"""The generation backend over Hugging Face ``generate`` (``generation=hf_generate``; the default
:mod:`rlhf_train.generation.decode_loop` also falls back to it for a ``generation_config`` and for models its
loop cannot drive).

The policy's log-probs (under the sampling temperature alone, as the update scores) and the hidden states
the value head reads come with the tokens, so the rollout needs no second policy pass over prompt +
response (they agree with that pass to float32 rounding, ~1e-6): :class:`InverseCDFSampler` draws each
token inside ``generate`` and records its log-prob; a forward hook on the trunk keeps the hidden states.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rlhf_train.core.sampling import SamplingParams, inverse_cdf_sample, process_logits, sample_filtered
from rlhf_train.generation.base import Generation, finish, pad_steps
from rlhf_train.models.scoring import lm_trunk_and_head


class InverseCDFSampler(LogitsProcessor):
    """Draws each next token inside ``generate`` from ``process_logits(scores)`` (temperature, top-k,
    top-p: transformers' warpers) and marks it with score +inf, so ``generate``'s greedy step
    (``do_sample=False``) returns it. It records the token's log-prob under the temperature alone
    (:func:`~rlhf_train.core.sampling.sample_filtered`), the one the update computes.

    Why not ``generate(do_sample=True)``: its step is ``torch.multinomial(softmax(scores), 1)``, which on
    CPU draws one exponential variate per vocabulary entry (32 x 50257 per step): 38 ms of CPU per step
    on one core, more than the model's forward pass. Inverse-CDF sampling draws one uniform per row
    (cumulative sum, then a binary search): 5 ms. Same distribution (the cumulative sum is in float64, so
    no token's interval loses mass to rounding; filtered tokens have empty intervals), same seeding
    (torch's global generator). Measured on a 2-layer, width-128 GPT-2, 32 prompts x 50 new tokens, one
    thread: ``generate`` 2.78 s -> 1.15 s of CPU (greedy decoding alone: 0.88 s).
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.log_probs: list[torch.Tensor] = []  # per step: log π(sampled token) [B], nearly free here

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.top_k or self.top_p < 1.0:  # drawn from the filtered distribution, log-prob under the temperature
            tokens, log_probs = sample_filtered(scores, SamplingParams(self.temperature, self.top_k, self.top_p))
            tokens = tokens[:, None]
        else:
            probs = torch.softmax(process_logits(scores, self.temperature), -1)  # [B, V]
            tokens = inverse_cdf_sample(probs)[:, None]
            log_probs = probs.gather(-1, tokens).squeeze(-1).log()
        self.log_probs.append(log_probs)
        return scores.scatter_(-1, tokens, float("inf"))


@contextlib.contextmanager
def last_hidden_per_step(trunk: torch.nn.Module):
    """Collects, for every forward call of ``trunk`` (one per ``generate`` step), the last position's
    final hidden state ``[B, H]``: the state that predicts the token sampled at that step."""
    steps: list[torch.Tensor] = []

    def hook(module, args, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        steps.append(hidden[:, -1])

    handle = trunk.register_forward_hook(hook)
    try:
        yield steps
    finally:
        handle.remove()


class HFGenerateBackend:
    """:class:`~rlhf_train.generation.base.GenerationBackend` over a ``transformers`` causal LM's ``generate``.

    Args:
        model: the policy: a :class:`~rlhf_train.models.policy.PolicyWithValue` (its ``lm`` generates, its
            ``value_head`` gives values) or a plain causal LM (no values).
        eos_token_id, pad_token_id: generation stops at EOS (one id, or a list: the first of any, e.g.
            ``<|im_end|>`` and ``<|endoftext|>``); the response is padded with ``pad_token_id``.
        max_new_tokens: response length ``T``.
        sampling: the sampling distribution (:class:`~rlhf_train.core.sampling.SamplingParams`).
        do_sample: ``False`` = greedy decoding (deterministic tests; no log-probs from the steps).
        with_scores: return the sampling log-probs (and values) read off ``generate``'s steps.
        unwrap_fn: unwraps a DDP / FSDP / Accelerate-prepared model.
    """

    def __init__(self, model, *, eos_token_id: int | list[int] | tuple[int, ...], pad_token_id: int, max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), do_sample: bool = True, with_scores: bool = True,
                 unwrap_fn: Callable | None = None):
        self.model, self.eos_token_id, self.pad_token_id = model, eos_token_id, pad_token_id
        self.max_new_tokens, self.sampling, self.do_sample = max_new_tokens, sampling, do_sample
        self.with_scores, self.unwrap_fn = with_scores, unwrap_fn or (lambda m: m)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int = 1,
                 generation_config=None) -> Generation:
        """See :meth:`GenerationBackend.generate`. ``generation_config`` (torchrl's API) replaces the
        sampler with ``generate``'s own decoding; no log-probs or values are returned then."""
        base = self.unwrap_fn(self.model)
        lm = getattr(base, "lm", base)
        if num_samples > 1:  # samples of one prompt stay adjacent (the advantage estimators' groups)
            prompt, prompt_mask = prompt.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
        kwargs = dict(max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_id,
                      pad_token_id=self.pad_token_id, use_cache=True)
        sampler = None
        if generation_config is None:
            # sampling happens in InverseCDFSampler; generate's own step is then greedy (picks its token)
            kwargs.update(do_sample=False)
            if self.do_sample:
                s = self.sampling
                sampler = InverseCDFSampler(s.temperature, s.top_k, s.top_p)
                kwargs["logits_processor"] = LogitsProcessorList([sampler])
        else:
            kwargs["generation_config"] = generation_config
        with_scores = self.with_scores and sampler is not None
        value_head = getattr(base, "value_head", None) if with_scores else None
        trunk = lm_trunk_and_head(lm)[0]  # (a peft model's too)
        with last_hidden_per_step(trunk) if value_head is not None else contextlib.nullcontext() as hidden:
            out = lm.generate(input_ids=prompt, attention_mask=prompt_mask.long(), **kwargs)
        if not with_scores:
            return self._finish(out[:, prompt.shape[1]:])
        values = value_head(pad_steps(torch.stack(hidden, 1), self.max_new_tokens)).float() if value_head is not None \
            else None
        return self._finish(out[:, prompt.shape[1]:], torch.stack(sampler.log_probs, 1), values)

    def _finish(self, response: torch.Tensor, log_probs: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> Generation:
        return finish(response, self.max_new_tokens, self.eos_token_id, self.pad_token_id, log_probs, values)
