"""Generation with Hugging Face ``generate`` (KV-cached), an inverse-CDF sampler and a value hook.

Per call: one ``generate``. :class:`InverseCDFSampler` draws each token inside it and records the
token's log-prob under the sampling distribution; a forward hook on the trunk keeps the hidden state
the value head reads. So the policy's log-probs and values come with the tokens, and the rollout needs
no second policy pass over prompt + response (they agree with that pass to float32 rounding, ~1e-6).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rlhf_train.core.containers import response_mask_from_tokens
from rlhf_train.core.sampling import SamplingParams, process_logits
from rlhf_train.generation.base import Generation
from rlhf_train.models.scoring import lm_trunk_and_head


class InverseCDFSampler(LogitsProcessor):
    """Draws each next token inside ``generate`` from ``process_logits(scores)`` (temperature, top-k,
    top-p: transformers' warpers) and marks it with score +inf, so ``generate``'s greedy step
    (``do_sample=False``) returns it.

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
        # few, whole-row ops: on a shared CPU each multi-threaded op waits for every thread to be scheduled
        probs = torch.softmax(process_logits(scores, self.temperature, self.top_k, self.top_p), -1)  # [B, V]
        cdf_dtype = torch.float32 if scores.device.type == "mps" else torch.float64  # MPS has no float64
        cdf = probs.cumsum(-1, dtype=cdf_dtype)
        u = torch.rand(scores.shape[0], 1, dtype=cdf_dtype, device=scores.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)  # first cdf > u
        self.log_probs.append(probs.gather(-1, tokens).squeeze(-1).log())
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


def _stack_steps(steps: list[torch.Tensor], T: int) -> torch.Tensor:
    """Per-step ``[B, ...]`` tensors → ``[B, T, ...]`` (first T steps; zero-padded if generation stopped early)."""
    out = torch.stack(steps[:T], dim=1)
    if out.shape[1] < T:
        out = torch.cat([out, out.new_zeros(out.shape[0], T - out.shape[1], *out.shape[2:])], dim=1)
    return out


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
        if num_samples > 1:  # samples of one prompt stay adjacent (the advantage estimators' groups)
            prompt, prompt_mask = prompt.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
        base = self.unwrap_fn(self.model)
        lm = getattr(base, "lm", base)
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
        T = self.max_new_tokens
        response = out[:, prompt.shape[1]:]
        if response.shape[1] < T:
            pad = response.new_full((response.shape[0], T - response.shape[1]), self.pad_token_id)
            response = torch.cat([response, pad], dim=1)
        # anything after the first EOS is padding, whatever generate put there
        response = response.masked_fill(~response_mask_from_tokens(response, self.eos_token_id), self.pad_token_id)
        if not with_scores:
            return Generation(response)
        log_probs = _stack_steps(sampler.log_probs, T).float()
        values = value_head(_stack_steps(hidden, T)).float() if value_head is not None else None
        return Generation(response, log_probs, values)
