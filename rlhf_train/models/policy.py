"""The PPO actor-critic (the policy LM with a value head on its trunk) and the frozen reference π_ref.

:class:`PolicyWithValue` puts a :class:`ValueHead` (hidden states ``[B, T, H]`` -> values ``[B, T]``,
zero-initialised by default, so every initial value is 0) on the causal LM's own transformer trunk: one
trunk pass over prompt + response gives both the response log-probs (:mod:`rlhf_train.models.scoring`)
and the values, and both go through ``forward`` so that DDP / FSDP wrappers see them. :func:`build_policy`
builds it from a causal LM (:func:`rlhf_train.models.loading.build_causal_lm`); :func:`build_reference`
makes π_ref, against which the KL penalty is measured: a frozen copy of the initial policy's LM, or a
model loaded from ``ref_model.pretrained``.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from rlhf_train.infra.errors import ConfigError
from rlhf_train.models.loading import build_causal_lm
from rlhf_train.models.lora import apply_lora
from rlhf_train.models.packed import packed_forward
from rlhf_train.models.scoring import (
    lm_trunk_and_head,
    response_hidden,
    response_logprobs,
)


class ValueHead(nn.Module):
    """``V(s_t)``: a linear map from the trunk's hidden state ``[B, T, H]`` to a scalar ``[B, T]``."""

    def __init__(self, hidden_size: int, init_std: float = 0.0):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=init_std) if init_std > 0 else nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(hidden.device.type):  # float32 under autocast too (trainer.precision)
            with torch.autocast(hidden.device.type, enabled=False):
                return self.summary(hidden.float()).squeeze(-1)
        return self.summary(hidden.float()).squeeze(-1)


class PolicyWithValue(nn.Module):
    """The PPO actor-critic: a causal LM and a value head sharing its transformer trunk.

    ``forward(full, full_mask, prompt_len)`` returns ``logits [B, T, V]`` (raw, at response positions
    only) and ``values [B, T]`` from one pass; ``generate`` is the LM's own KV-cached ``generate``.
    """

    def __init__(self, lm: nn.Module, value_head: ValueHead | None):
        super().__init__()
        self.lm = lm
        self.value_head = value_head

    @property
    def config(self):
        return self.lm.config

    def forward(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int, labels: torch.Tensor | None = None,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, with_entropy: bool = True,
                packed: bool = False):
        """``(logits [B, T, V], values [B, T])``; with ``labels [B, T]`` (the response tokens) instead
        ``(log_probs [B, T], entropy [B, T] or None, values [B, T])`` under the sampling distribution
        (temperature, top-k, top-p), without keeping more than one ``[B, T, V]`` tensor (see
        :func:`response_logprobs`). Both go through ``forward``, so DDP/FSDP wrappers see them.
        ``packed`` (with ``labels``): the rows' real tokens as one row without padding
        (:func:`rlhf_train.models.packed.packed_forward`); the same results, 0 at padding."""
        with checkpointing_active(self.lm):
            return self._forward(full, full_mask, prompt_len, labels, temperature, top_k, top_p, with_entropy, packed)

    def _forward(self, full, full_mask, prompt_len, labels, temperature, top_k, top_p, with_entropy, packed):
        trunk, head = lm_trunk_and_head(self.lm)
        if packed:
            if labels is None:
                raise ValueError("PolicyWithValue: packed=True needs labels (packed logits are not returned)")
            return packed_forward(trunk, head, self.value_head, full, full_mask, prompt_len, labels, temperature,
                                  top_k, top_p, with_entropy)
        hidden = response_hidden(trunk, full, full_mask, prompt_len)
        values = self.value_head(hidden) if self.value_head is not None else None  # None: no critic
        if labels is None:
            return head(hidden), values
        log_probs, entropy = response_logprobs(hidden, head, labels, temperature, top_k, top_p, with_entropy)
        return log_probs, entropy, values

    def generate(self, *args, **kwargs):
        return self.lm.generate(*args, **kwargs)


def enable_checkpointing(lm: nn.Module) -> None:
    """``update.gradient_checkpointing``: transformers' activation checkpointing on every layer of ``lm``'s
    trunk (``use_reentrant=False``: torch's recommended variant, which needs no input that requires grad)."""
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x (gradient_checkpointing_enable: deprecated)
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@contextlib.contextmanager
def checkpointing_active(lm: nn.Module):
    """While gradients are recorded: ``lm``'s checkpointed layers in training mode, the rest as it is.

    transformers checkpoints a layer only in training mode (``GradientCheckpointingLayer``: ``gradient_checkpointing
    and training``), but the trainer keeps the policy in eval mode so that dropout stays off; so for the pass only
    the layers' own flag is switched on: their submodules (attention, dropout) stay in eval mode, the outputs
    are unchanged. A no-op without checkpointing or without gradients."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [] if not torch.is_grad_enabled() else [
        m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and not m.training]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m in layers:
            m.training = False


def build_policy(
    tokenizer: Any = None,
    pretrained: str | None = None,
    config: dict | None = None,
    trust_remote_code: bool = False,
    dropout: float | None = 0.0,
    value_head_init_std: float = 0.0,
    gradient_checkpointing: bool = False,
    lora: dict | None = None,
    value_head: bool = True,
    dtype: str = "float32",
) -> PolicyWithValue:
    """The policy: a causal LM (see :func:`build_causal_lm`) plus a value head on its trunk.

    ``lora`` (``policy.lora``): with ``r > 0`` the LM becomes a peft LoRA model (:mod:`rlhf_train.models.lora`):
    only the adapter and the value head train."""
    # dtype (policy.dtype): float32 | bfloat16 weights; the value head computes in float32 (ValueHead.forward)
    lm = build_causal_lm(pretrained, config, tokenizer, trust_remote_code, dropout, "policy.pretrained", dtype)
    if gradient_checkpointing:  # update.gradient_checkpointing (the run passes it)
        enable_checkpointing(lm)
    lm = apply_lora(lm, lora, gradient_checkpointing)
    # value_head=False (a critic-free algorithm; the trainer passes it): no value-head parameters at all
    return PolicyWithValue(lm, ValueHead(lm.config.hidden_size, value_head_init_std) if value_head else None)


def build_reference(
    policy: PolicyWithValue | None = None,
    tokenizer: Any = None,
    pretrained: str | None = None,
    copy_policy: bool = True,
    trust_remote_code: bool = False,
    device: str | None = None,
    ray_service: dict | None = None,
) -> nn.Module:
    """The frozen reference policy π_ref: a copy of the initial policy LM, or loaded from ``pretrained``.

    ``device`` is where it will run (placed by the trainer; ``None`` = the policy's device); ``ray_service``
    is read where the run is built (:mod:`rlhf_train.models.reference` says which kind of reference runs).
    """
    if pretrained:
        ref = build_causal_lm(pretrained, None, tokenizer, trust_remote_code, 0.0, "ref_model.pretrained")
    elif copy_policy and policy is not None:
        ref = copy.deepcopy(policy.lm)
    else:
        raise ConfigError("ref_model: set ref_model.copy_policy=true or ref_model.pretrained=<path>")
    ref.eval().requires_grad_(False)
    return ref
