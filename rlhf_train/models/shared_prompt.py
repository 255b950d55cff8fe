"""Shared-prompt passes: each distinct prompt of a batch through a model once, its KV cache shared by its samples.

With ``rollout.num_samples = G > 1`` (GRPO, RLOO, …) a batch of ``B`` rows holds ``B / G`` distinct prompts, and a
plain pass over ``full [B, P+T]`` runs each prompt's ``P`` tokens through the trunk ``G`` times. At SmolLM2-135M's
benchmark shape (``P = 64``, ``T = 48``, ``G = 4``) that is 43 % of the trunk tokens of the reference's pass, the
reward model's and the update's forward and backward. :func:`trunk_hidden` runs the ``U`` distinct prompts once
(``[U, P]``, filling a ``transformers`` ``DynamicCache``), gives every row its prompt's keys and values
(``batch_select_indices``: an index, so autograd sums the ``G`` rows' gradients into the prompt's), then runs the
``[B, T]`` responses against that cache: the hidden states ``[B, P+T, H]`` of the plain pass, to float rounding
(``tests/unit/models/test_shared_prompt.py``: log-probs, values, reward scores and every gradient, GPT-2 and
Llama, LoRA), from ``U·P + B·T`` trunk tokens instead of ``B·(P+T)``. The same sharing as PrefixGrouper
(arXiv 2506.05433), which builds it as one packed row with a custom mask; here it is transformers' own cache.

Where it does not apply, the plain pass runs: no two rows share a prompt (PPO's one sample per prompt), the trunk
takes no KV cache, it has sliding-window layers (their cache keeps only the window), gradient checkpointing is on
(a checkpointed layer would write into the cache again when it recomputes), or ``trainer.shared_prompt=false``
(:func:`set_shared_prompt`).
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from rlhf_train.core.prompt_groups import prompt_groups
from rlhf_train.models.attention import cpu_attention

# The attribute (on every transformers model inside a policy, reference or reward model) that says whether its
# passes may share prompts; absent: yes. On the modules, as trainer.fp32_lm_head is: a deep copy (the
# reference) keeps it, and every path reaches the trunk without another argument.
SHARED_PROMPT_ATTR = "rlhf_train_shared_prompt"


def set_shared_prompt(model: nn.Module, enabled: bool) -> None:
    """``trainer.shared_prompt``: whether the ``transformers`` models inside ``model`` run each distinct prompt of
    a batch once (``True``, the default) or every row's whole prompt (``False``)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            setattr(m, SHARED_PROMPT_ATTR, bool(enabled))


def cache_argument(trunk: nn.Module) -> str | None:
    """The name the trunk's forward takes its KV cache by: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (older releases; deprecated since), or ``None``."""
    params = inspect.signature(trunk.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def cache_of(out):
    """The KV cache a trunk's output carries (``cache`` in transformers >= 5.24, ``past_key_values`` before)."""
    cache = out.get("cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _checkpointed(trunk: nn.Module) -> bool:
    """Whether ``trunk`` has layers under gradient checkpointing (they run their forward again in the backward)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in trunk.modules())


def _prompt_cache(trunk: nn.Module):
    """An empty ``DynamicCache`` for ``trunk``, or ``None`` where a shared prompt does not apply (see the module)."""
    from transformers import DynamicCache

    if not getattr(trunk, SHARED_PROMPT_ATTR, True) or cache_argument(trunk) is None:
        return None
    config = getattr(trunk, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if _checkpointed(trunk):
        return None
    try:
        cache = DynamicCache(config=config)
    except (TypeError, ValueError, AttributeError):  # a config DynamicCache cannot read
        return None
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", [])):
        return None
    return cache


def shares_prompts(trunk: nn.Module) -> bool:
    """Whether passes of ``trunk`` (a causal LM's transformer, ``lm_trunk_and_head(lm)[0]``) run a prompt that
    several rows share once (see the module)."""
    return _prompt_cache(trunk) is not None


def trunk_hidden(trunk: nn.Module, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int,
                 position_ids: torch.Tensor) -> torch.Tensor:
    """The trunk's last hidden states ``[B, P+T, H]`` over ``full [B, P+T]`` (left-padded prompts of ``P =
    prompt_len`` columns, then the responses), with ``full_mask`` and ``position_ids [B, P+T]``; the prompts that
    several rows share run once (see the module). Gradients flow as through the plain pass."""
    groups = prompt_groups(full, full_mask, prompt_len)
    cache = _prompt_cache(trunk) if groups is not None and prompt_len < full.shape[1] else None
    # GQA's keys and values read in place on CPU (models/attention.py); not where layers recompute their forward
    # in the backward (gradient checkpointing), which must give the tensors it saved the first time
    with contextlib.nullcontext() if torch.is_grad_enabled() and _checkpointed(trunk) else cpu_attention():
        if cache is None:
            return _hidden(trunk(input_ids=full, attention_mask=full_mask.long(), position_ids=position_ids,
                                 use_cache=False))
        first, inverse = groups
        P, key = prompt_len, cache_argument(trunk)
        prompt_out = trunk(input_ids=full[first, :P], attention_mask=full_mask[first, :P].long(),
                           position_ids=position_ids[first, :P], use_cache=True, **{key: cache})
        cache.batch_select_indices(inverse)  # every row its prompt's keys and values
        response_out = trunk(input_ids=full[:, P:], attention_mask=full_mask.long(),
                             position_ids=position_ids[:, P:], use_cache=True, **{key: cache})
    return torch.cat([_hidden(prompt_out)[inverse], _hidden(response_out)], 1)
