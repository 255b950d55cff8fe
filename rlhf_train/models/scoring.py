"""One forward pass over prompt + response: hidden states, log-probs and entropies of the response tokens.

Shapes: B = batch, P = prompt tokens (left-padded), T = response tokens, H = hidden size, V = vocabulary.
:func:`response_hidden` runs the trunk once over ``full [B, P+T]`` and keeps the ``[B, T, H]`` hidden
states that predict the response tokens (positions ``P-1 … P+T-2``), with position ids from the
attention mask so left-padded prompts see the positions ``generate`` gave them. :func:`response_logprobs`
applies the LM head at those positions only and returns log-probs and entropies ``[B, T]`` under the
sampling distribution (temperature, top-k, top-p); :func:`sequence_logprobs` is the no-grad version for
a whole LM (the reference's log-probs).

Why the head is not simply ``head(hidden)``: the ``[B, T, V]`` logits are the largest tensors of PPO.
Without top-k / top-p they are computed vocabulary-major (``W @ hᵀ``, 1.5x faster on CPU) and go through
the fused kernel :func:`rlhf_train.core.logprob_kernel.head_logprobs_and_entropy` (the head's matmuls
inside its blocks; :func:`~rlhf_train.core.logprob_kernel.logprobs_and_entropy` on the logits for other heads);
without gradients the head runs on blocks of about 512 tokens, so scoring memory never grows with B·T.

Precision of the head (``trainer.fp32_lm_head``, :func:`set_fp32_lm_head`): by default the head's matmul
runs in float32 whatever the trunk's precision (autocast off, hidden states and a bf16 weight cast up),
so logits and log-softmax are float32 in every pass that reaches the head through
:func:`lm_trunk_and_head` (the policy's, the reference's, the decode loop's sampler); the setting lives on
the head module, so all of them agree. Off, the matmul runs in the compute precision (autocast's bf16) and
only the log-softmax is float32 (the kernel casts each block of logits up).
"""
from __future__ import annotations

import torch
from torch import nn

from rlhf_train.core.containers import leading_padding, position_ids_from_mask
from rlhf_train.core.logprob_kernel import (
    entropy_from_logits,
    head_logprobs_and_entropy,
    logprobs_and_entropy,
    logprobs_of_labels,
)
from rlhf_train.core.sampling import process_logits
from rlhf_train.models.shared_prompt import trunk_hidden


def response_hidden(trunk: nn.Module, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` that predict each response token: positions ``P-1 … P+T-2``.

    One forward pass over ``full [B, P+T]`` (a prompt that several rows share runs once:
    :func:`rlhf_train.models.shared_prompt.trunk_hidden`); position ids follow the attention mask so
    left-padded prompts see the same positions as in ``generate``. Prompt columns that are padding in every row
    are dropped first (:func:`~rlhf_train.core.containers.leading_padding`: the trunk's work on them is masked
    out anyway); the update orders its micro-batches' rows by prompt length so that they have such columns.
    """
    lead = leading_padding(full_mask[:, :prompt_len])
    if lead:
        full, full_mask, prompt_len = full[:, lead:], full_mask[:, lead:], prompt_len - lead
    hidden = trunk_hidden(trunk, full, full_mask, prompt_len, position_ids_from_mask(full_mask))
    return hidden[:, prompt_len - 1 : -1]


def lm_trunk_and_head(lm: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(transformer trunk, LM head) of a ``transformers`` causal LM (of the model inside a peft model:
    its adapters stay in the trunk's layers, switched on or off by ``disable_adapter()``)."""
    if hasattr(lm, "get_base_model") and hasattr(lm, "peft_config"):
        lm = lm.get_base_model()
    return lm.base_model, lm.get_output_embeddings()


# The attribute of an LM head that says whether its matmul runs in float32 (absent: yes). On the module,
# not passed along: every path reaches the head through lm_trunk_and_head (policy, reference copy, the
# decode loop, packed passes), so one setting covers them all and a deep copy (the reference) keeps it.
FP32_HEAD_ATTR = "rlhf_train_fp32_head"


def set_fp32_lm_head(lm: nn.Module, enabled: bool) -> None:
    """``trainer.fp32_lm_head``: the LM head of ``lm`` computes its logits in float32 (``True``, the default)
    or in the compute precision (``False``); the log-softmax is float32 either way."""
    head = lm_trunk_and_head(lm)[1]
    if head is not None:
        setattr(head, FP32_HEAD_ATTR, bool(enabled))


def _autocast_on(t: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(t.device.type)


def _float32_head_dtype(head: nn.Module, hidden: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
    """The dtype (float32, or float64 in tests) the head's matmul runs in when it runs in full precision,
    by the head's setting or because everything already is (outside autocast); ``None``: the compute
    precision (``trainer.fp32_lm_head=false`` under autocast or with bf16 weights)."""
    f = torch.promote_types(torch.promote_types(hidden.dtype, w.dtype), torch.float32)
    if getattr(head, FP32_HEAD_ATTR, True):
        return f
    return f if w.dtype == hidden.dtype == f and not _autocast_on(hidden) else None


# Tokens per LM-head block when no gradient is needed: 512 x 50257 logits (100 MB) exist at once, not
# [B, T, V], so scoring memory does not grow with B·T. A multiple of 64: CPU GEMMs write [V, N] logits
# 1.5x slower when N is not a multiple of 8 (61 vs 41 GFLOP/s per core at N = 800 vs 801).
_NO_GRAD_HEAD_TOKENS = 512


def _whole_weight(head: nn.Module) -> torch.Tensor | None:
    """The ``[V, H]`` weight of a plain ``nn.Linear`` head that holds all of it, else None (e.g. a ZeRO-3
    partitioned head: it goes through its own forward)."""
    w = getattr(head, "weight", None)
    whole = isinstance(head, nn.Linear) and w is not None and tuple(w.shape) == (head.out_features, head.in_features)
    return w if whole else None


def vocab_major_logits(head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``head(hidden)`` transposed, ``[V, N]`` from ``hidden [N, H]``: ``W @ hiddenᵀ`` writes this layout
    1.5x faster than ``hidden @ Wᵀ`` on CPU (see :mod:`rlhf_train.core.logprob_kernel`). Heads that are not
    a plain ``nn.Linear`` with its whole weight (e.g. ZeRO-3 partitioned) go through their own forward.
    ``out``: a ``[V, N]`` buffer to write into (a decode loop reuses one: writing into memory already
    mapped is up to 1.5x faster than into a fresh 6 MB allocation, 2.8 vs 4.3 ms at N = 32, width 128).
    In float32 unless the head is set otherwise (:func:`set_fp32_lm_head`); a head that is not a plain
    ``nn.Linear`` runs in the compute precision (its own forward decides)."""
    w = _whole_weight(head)
    if w is None:
        return head(hidden).T.contiguous()
    f = _float32_head_dtype(head, hidden, w)
    if f is None or (w.dtype == hidden.dtype == f and not _autocast_on(hidden)):  # nothing to cast or turn off
        return _linear_t(w, head.bias, hidden, out)
    with torch.autocast(hidden.device.type, enabled=False):
        return _linear_t(w.to(f), head.bias.to(f) if head.bias is not None else None, hidden.to(f), out)


def _linear_t(w: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, out: torch.Tensor | None):
    if out is not None and out.shape == (w.shape[0], hidden.shape[0]) and out.dtype == w.dtype == hidden.dtype:
        logits_t = torch.mm(w, hidden.T, out=out)
        return logits_t.add_(bias[:, None]) if bias is not None else logits_t
    logits_t = w @ hidden.T
    return logits_t + bias[:, None] if bias is not None else logits_t


def _token_major_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` ``[N, V]``, in float32 unless the head is set otherwise (as :func:`vocab_major_logits`)."""
    w = _whole_weight(head)
    f = _float32_head_dtype(head, hidden, w) if w is not None else None
    if f is None:
        return head(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        return nn.functional.linear(hidden.to(f), w.to(f), head.bias.to(f) if head.bias is not None else None)


def _head_logprobs(hidden, head, labels, temperature, top_k, top_p, with_entropy):
    """(log π(label), entropy or None) from hidden states ``[N, H]`` under the sampling distribution."""
    if not top_k and top_p >= 1.0:  # one blockwise pass over V
        N, pad = hidden.shape[0], -hidden.shape[0] % 8  # N a multiple of 8: see _NO_GRAD_HEAD_TOKENS
        if pad:
            hidden, labels = nn.functional.pad(hidden, (0, 0, 0, pad)), nn.functional.pad(labels, (0, pad))
        w = _whole_weight(head)
        f = _float32_head_dtype(head, hidden, w) if w is not None else None
        if f is not None:  # the head's matmuls inside the blocks, in float32 (a bf16 weight cast up per block)
            log_probs, entropy = head_logprobs_and_entropy(hidden.to(f), w, head.bias, labels, temperature,
                                                           with_entropy)
        else:  # the kernel computes in its inputs' dtype, so with bf16 logits (fp32_lm_head off under autocast,
            # or a head that is not a plain Linear) the logits come first, each block cast up to float32
            # inside the kernel (the log-softmax stays float32); its gradient reuses their memory
            log_probs, entropy = logprobs_and_entropy(vocab_major_logits(head, hidden), labels, temperature,
                                                      overwrite_logits=True, with_entropy=with_entropy)
        return log_probs[:N], entropy[:N] if with_entropy else None
    # top-k / top-p: the filtered distribution, and (as without filtering) the entropy of logits / temperature
    logits = _token_major_logits(head, hidden)
    log_probs = logprobs_of_labels(process_logits(logits, temperature, top_k, top_p), labels)
    return log_probs, entropy_from_logits(logits.float() / temperature) if with_entropy else None


def response_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, T]`` of ``labels [B, T]`` and entropies ``[B, T]`` (``None`` unless ``with_entropy``)
    of the sampling distribution, from the hidden states ``[B, T, H]`` that predict them.

    The LM head (``2·H·V`` FLOPs per token) runs at these positions only. Without gradients it runs on
    blocks of tokens, so the ``[B, T, V]`` logits never exist at once: memory O(block·V), not O(B·T·V).
    """
    B, T, H = hidden.shape
    hidden, labels = hidden.reshape(B * T, H), labels.reshape(B * T)
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters())):
        lp, ent = _head_logprobs(hidden, head, labels, temperature, top_k, top_p, with_entropy)
    else:
        n_blocks = -(-B * T // _NO_GRAD_HEAD_TOKENS)
        step = (-(-B * T // n_blocks) + 7) // 8 * 8  # equal blocks of a multiple of 8 tokens (the last: the rest)
        parts = [_head_logprobs(hidden[a:a + step], head, labels[a:a + step], temperature, top_k, top_p, with_entropy)
                 for a in range(0, B * T, step)]
        lp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if with_entropy else None
    return lp.float().reshape(B, T), ent.float().reshape(B, T) if ent is not None else None


@torch.no_grad()
def sequence_logprobs(
    lm: nn.Module,
    full: torch.Tensor,
    full_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Log-probs ``[B, T]`` of the response tokens of ``full`` under ``lm`` (one pass, no grad)."""
    trunk, head = lm_trunk_and_head(lm)
    hidden = response_hidden(trunk, full, full_mask, prompt_len)
    return response_logprobs(hidden, head, full[:, prompt_len:], temperature, top_k, top_p, with_entropy=False)[0]
