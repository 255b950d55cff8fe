"""CPU attention for the two shapes where ``transformers``' ``sdpa`` attention does avoidable work.

1. **A decode step** (one query per row and head, no gradient). ``sdpa`` hands it to
   ``torch.nn.functional.scaled_dot_product_attention``, whose CPU flash kernel tiles the keys in blocks, keeps a
   running max and sum per block and splits its work by (row, head, query block): at one query per head, a few
   hundred tiny tasks with their bookkeeping for ~100 keys each. With the query heads grouped by their key/value
   head (``[B, H_kv, G, d]``, GQA's ``G = H / H_kv``) the same attention is ``softmax(q kᵀ · scale + mask) v``
   in two batched GEMMs over ``B · H_kv`` problems of ``[G, d] × [d, L]`` and ``[G, L] × [L, d]`` and one softmax.
2. **GQA with a mask** (several queries; every scoring pass and the update's forward, where the mask is the
   padding's and the shared prompts'). ``transformers`` repeats each key/value head ``G`` times in memory
   (``repeat_kv``) before the kernel, and the backward sums the copies again: the kernel's own ``enable_gqa``
   reads the heads in place (``transformers`` passes it only without a mask, for the GPU kernels' sake).

Measured (``benchmarks/attention.py --shape smollm2``, 2 threads, 2026-11-29): a decode step's call (32 rows, 9 / 3
heads of 64) 0.10 against 0.20 ms at 64 cached positions, 0.17 against 0.26 ms at 112, the decode loop's 48 tokens
for 8 prompts × 4 samples 5.32 against 5.71 s; a GRPO micro-batch's response pass (16 rows × 48 queries against
112 positions) forward + backward 5.3 against 6.6 ms a layer. The results equal ``sdpa``'s to float rounding
(``tests/unit/models/test_attention.py``).

:func:`cpu_attention` replaces ``transformers``' ``"sdpa"`` attention function (its ``AttentionInterface``, the
registry every model's attention layers look the function up in at each call) for the duration of a block: the
decode loop's steps (``rlhf_train/generation/decode_loop.py``) and the trunk passes of
:func:`rlhf_train.models.shared_prompt.trunk_hidden`. It takes only calls it computes as ``sdpa`` would: CPU, no
dropout, soft-capping or position bias; every other call goes to ``transformers``' own function unchanged.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

_KEY = "sdpa"


def _attention(sdpa, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs):
    """``transformers``' attention-function signature: ``query [B, H, Q, d]``, ``key``/``value [B, H_kv, L, d]``,
    ``attention_mask [B or 1, 1, Q, L]`` (bool: attend where True; or additive float; or None) → ``(out [B, Q, H,
    d], None)``; a call it does not take goes to ``sdpa``."""
    B, H, q_len, d = query.shape
    H_kv, L = key.shape[1], key.shape[2]
    plain = (query.device.type != "cpu" or dropout or H % H_kv or value.shape[-1] != d
             or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
             or kwargs.get("output_attentions"))
    if not plain and q_len == 1 and not torch.is_grad_enabled() and (
            attention_mask is None or attention_mask.shape[1:] == (1, 1, L)):   # 1. a decode step
        scale = scaling if scaling is not None else d ** -0.5
        q = query.reshape(B, H_kv, H // H_kv, d)                   # the query heads of each KV head, [B, H_kv, G, d]
        scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)     # [B, H_kv, G, L]
        if attention_mask is not None:                             # [B or 1, 1, 1, L]: every head alike
            if attention_mask.dtype == torch.bool:
                scores.masked_fill_(~attention_mask, float("-inf"))
            else:
                scores.add_(attention_mask)
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)
        return out.reshape(B, 1, H, d), None
    if not plain and H_kv < H and attention_mask is not None:   # 2. GQA with a mask: no repeated keys and values
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                **kwargs)


@contextlib.contextmanager
def cpu_attention() -> Iterator[None]:
    """Within the block, ``transformers`` models whose attention is ``"sdpa"`` run a decode step's attention and
    masked GQA attention on CPU as the module says; as before when it exits."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = local.get(_KEY)
    sdpa = ALL_ATTENTION_FUNCTIONS[_KEY]
    if getattr(sdpa, "rlhf_train_cpu_attention", False):  # already inside such a block
        yield
        return

    def attention(module, query, key, value, attention_mask, **kwargs):
        return _attention(sdpa, module, query, key, value, attention_mask, **kwargs)

    attention.rlhf_train_cpu_attention = True
    ALL_ATTENTION_FUNCTIONS[_KEY] = attention
    try:
        yield
    finally:
        if previous is None:
            local.pop(_KEY, None)
        else:
            local[_KEY] = previous
