"""A decode step's attention as two batched matmuls (CPU): one query per row against its KV cache.

In a decode step every row has one new query token, and ``transformers``' ``sdpa`` attention hands it to
``torch.nn.functional.scaled_dot_product_attention``, whose CPU flash kernel tiles the keys in blocks, keeps a
running max and sum per block and splits its work by (row, head, query block): at one query per head that is a
few hundred tiny tasks with their bookkeeping for ~100 keys each. With the query heads grouped by their
key/value head (``[B, H_kv, G, d]``, GQA's ``G = H / H_kv``) the same attention is ``softmax(q kᵀ · scale +
mask) v`` in two batched GEMMs over ``B · H_kv`` problems of ``[G, d] × [d, L]`` and ``[G, L] × [L, d]`` and one
softmax over ``[B, H_kv, G, L]``. Measured (``benchmarks/decode_attention.py --shape smollm2``: 32 rows, 9 / 3
heads of 64, 2 threads): 0.10 against 0.20 ms a call at 64 cached positions, 0.17 against 0.26 ms at 112; the
decode loop's 48 tokens for 8 prompts × 4 samples 5.32 against 5.71 s. The result equals the kernel's to float
rounding (``tests/unit/generation/test_decode_attention.py``).

:func:`grouped_decode_attention` replaces ``transformers``' ``"sdpa"`` attention function (its
``AttentionInterface``, the registry every model's attention layers look the function up in at each call) for
the duration of the decode loop's steps, and only takes calls it can compute exactly as the kernel would: one
query token, no gradient, CPU, no dropout, no soft-capping or position bias; every other call (the prefill, any
pass with a gradient, any other device) goes to ``transformers``' own function unchanged.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_KEY = "sdpa"


def _decode_attention(sdpa, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """``transformers``' attention-function signature: ``query [B, H, 1, d]``, ``key``/``value [B, H_kv, L, d]``,
    ``attention_mask [B, 1, 1, L]`` (bool: attend where True; or additive float; or None) → ``(out [B, 1, H, d],
    None)``; any call it does not take goes to ``sdpa``."""
    B, H, q_len, d = query.shape
    H_kv, L = key.shape[1], key.shape[2]
    if (q_len != 1 or torch.is_grad_enabled() or dropout or query.device.type != "cpu" or H % H_kv
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions") or value.shape[-1] != d
            or (attention_mask is not None and attention_mask.shape[1:] != (1, 1, L))):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(B, H_kv, H // H_kv, d)                       # the query heads of each KV head, [B, H_kv, G, d]
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)     # [B, H_kv, G, L]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:                     # [B or 1, 1, 1, L]: every head alike
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores.add_(attention_mask)
    out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)  # [B, H_kv, G, d]
    return out.reshape(B, 1, H, d), None


@contextlib.contextmanager
def grouped_decode_attention() -> Iterator[None]:
    """Within the block, ``transformers`` models whose attention is ``"sdpa"`` compute one-query, no-gradient CPU
    attention as two batched matmuls (see the module); as before when it exits."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = local.get(_KEY)
    sdpa = ALL_ATTENTION_FUNCTIONS[_KEY]

    def attention(module, query, key, value, attention_mask, **kwargs):
        return _decode_attention(sdpa, module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[_KEY] = attention
    try:
        yield
    finally:
        if previous is None:
            local.pop(_KEY, None)
        else:
            local[_KEY] = previous
