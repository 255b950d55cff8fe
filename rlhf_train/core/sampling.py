"""The sampling distribution, shared by generation and the loss: temperature, then top-k, then top-p.

The log-probs PPO computes must be those of the distribution tokens were sampled from, or the first
PPO ratio is not 1; so the rollout and the update both go through :func:`process_logits`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled (the ``rollout`` config's ``temperature`` / ``top_k`` / ``top_p``).

    The policy's log-probs are taken under this distribution; the reference model scores under the
    ``temperature`` alone (:meth:`for_reference`), as TRL and torchrl do: a filter of its own would
    give log π_ref = −inf (an infinite KL) to a sampled token outside it.
    """

    temperature: float = 1.0
    top_k: int = 0        # 0 = off
    top_p: float = 1.0    # 1.0 = off

    def for_reference(self) -> "SamplingParams":
        return SamplingParams(self.temperature, 0, 1.0)


# --------------------------------------------------------------------------------------------
# The sampling distribution, shared by rollout and loss
# --------------------------------------------------------------------------------------------
def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits ``[..., V]`` of the distribution tokens are *sampled from*: temperature, then top-k, top-p.

    Mirrors ``transformers``' TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper (the order
    ``generate`` applies them), so the log-probs PPO computes are those of the sampling distribution and
    the first PPO ratio is exactly 1. Computed in float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits
