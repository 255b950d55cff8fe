"""The generation seam: prompt tokens in, response tokens (and, where the backend has them for free,
their sampling log-probs and the critic's values) out.

A new backend (vLLM, SGLang, ...) goes in ``rlhf_train/generation/<name>.py``
as a class with :meth:`GenerationBackend.generate` and a constructor taking the policy and the rollout's
settings (``eos_token_id``, ``pad_token_id``, ``max_new_tokens``, ``sampling``, ``do_sample``, ``with_scores``,
``unwrap_fn``) plus its YAML keys, and ``conf/generation/<name>.yaml`` naming it by ``_target_``:
``generation=<name>`` then selects it (``rlhf_train/loop/components.py`` builds it with the policy and these
settings). Implementations: :class:`rlhf_train.generation.decode_loop.DecodeLoopBackend` (the default:
rlhf_train's KV-cached loop), :class:`rlhf_train.generation.static_cache.StaticCacheBackend` (that loop over a
static KV cache, its step compiled; ``generation=auto`` picks it on CUDA) and
:class:`rlhf_train.generation.hf_generate.HFGenerateBackend` (``transformers``' ``generate``). ``_target_``
may also name a factory returning a backend (``rlhf_train.generation.auto.auto_backend``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_train.core.containers import response_mask_from_tokens


@dataclass
class Generation:
    """What a backend returns for ``B = prompts × num_samples`` rows (the samples of a prompt adjacent).

    ``response [B, T]``: token ids, the pad id after the first EOS (and up to ``T`` when generation
    stopped early). ``log_probs [B, T]``: log π(a_t | s_t) of each sampled token under the sampling
    distribution, or ``None`` when the backend cannot give them (the rollout then scores the policy in
    one forward pass). ``values [B, T]``: the critic's V(s_t), or ``None``.
    """

    response: torch.Tensor
    log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None


class GenerationBackend(Protocol):
    """Samples responses for a batch of left-padded prompts."""

    def generate(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int = 1) -> Generation:
        """``prompt [N, P]`` token ids, left-padded; ``prompt_mask [N, P]`` bool → :class:`Generation`
        for ``N · num_samples`` rows (row ``i · num_samples + j`` is sample ``j`` of prompt ``i``)."""
        ...


def pad_steps(steps: torch.Tensor, T: int, value=0) -> torch.Tensor:
    """``[B, T', ...]`` → ``[B, T, ...]``: the first ``T`` steps, filled with ``value`` if generation stopped early."""
    steps = steps[:, :T]
    if steps.shape[1] < T:
        steps = torch.cat([steps, steps.new_full((steps.shape[0], T - steps.shape[1], *steps.shape[2:]), value)], 1)
    return steps


def finish(response: torch.Tensor, T: int, eos_token_id, pad_token_id: int, log_probs: torch.Tensor | None = None,
           values: torch.Tensor | None = None) -> Generation:
    """``[B, T' ≤ T]`` steps → a :class:`Generation` of ``T`` steps (pad tokens, zero log-probs after the
    last step); anything after a row's first EOS is padding, whatever the sampler put there."""
    response = pad_steps(response, T, pad_token_id)
    response = response.masked_fill(~response_mask_from_tokens(response, eos_token_id), pad_token_id)
    return Generation(response, pad_steps(log_probs, T).float() if log_probs is not None else None, values)
