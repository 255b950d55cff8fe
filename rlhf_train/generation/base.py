"""The generation seam: prompt tokens in, response tokens (and, where the backend has them for free,
their sampling log-probs and the critic's values) out.

A new backend (vLLM, SGLang, a static-cache decode loop, ...) goes in ``rlhf_train/generation/<name>.py``
as a class with :meth:`GenerationBackend.generate`; ``RolloutFromModel(..., generation_backend=...)``
takes it. Today's implementation: :class:`rlhf_train.generation.hf_generate.HFGenerateBackend`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
