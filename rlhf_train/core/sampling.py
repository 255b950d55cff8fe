"""The three models of RLHF: the policy (with its value head), the frozen reference, the reward model.

All three are ordinary ``transformers`` models. rlhf_train adds two small heads on top of a
transformer trunk and one rule: every per-token quantity (log-probs, values, reference log-probs,
rewards) comes from **one forward pass over prompt + response**, with logits computed only at the
response positions (the LM head is the most expensive matmul for small models with big vocabularies).
"""
from __future__ import annotations

import torch


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
