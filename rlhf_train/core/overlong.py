"""DAPO's soft overlong punishment: a length-aware penalty for responses near or past the length limit.

Reference:
  Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476),
  eq. 13, with L_max the longest response allowed and L_cache the punishment interval before it:

      R_length(y) = 0                                  if |y| ≤ L_max − L_cache
                  = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                  = −1                                 if L_max < |y|

  added to the rule-based (correctness) reward. Lengths are in tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor


def soft_overlong_punishment(lengths: Tensor, max_length: int, cache_length: int) -> Tensor:
    """``R_length`` of DAPO eq. 13 for each response: ``lengths [B]`` (tokens) -> ``[B]`` float in [−1, 0].

    0 up to ``max_length − cache_length`` tokens, then linear down to −1 at ``max_length``, −1 beyond.
    ``0 < cache_length ≤ max_length``."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length ({cache_length}) <= max_length ({max_length})")
    expected = float(max_length - cache_length)
    penalty = (expected - lengths.float()) / float(cache_length)  # 0 at L_max − L_cache, −1 at L_max
    return penalty.clamp(min=-1.0, max=0.0)
