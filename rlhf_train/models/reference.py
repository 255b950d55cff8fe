"""π_ref, the frozen reference policy, as ONE object: :class:`Reference`.

What the reference *is* is decided once, when the run is built (``rlhf_train/loop/components.py``,
``build_reference_for``), and nothing downstream asks again:

==================  ===========================================================================
kind                what runs
==================  ===========================================================================
``copy``            a frozen copy of the initial policy (``ref_model=copy_of_policy``) or a model dir
``adapter_off``     the policy itself with its LoRA adapter switched off: the initial policy, no copy
``ray``             a named Ray actor holding the reference (``ref_model.ray_service.enabled=true``)
==================  ===========================================================================

:meth:`Reference.log_probs` scores the response tokens of prompt + response in one batched forward pass
under the sampling **temperature only** (``SamplingParams.for_scoring``): a top-k / top-p filter of the
reference's own would give a sampled token outside it log π_ref = −inf (with ``update.packing``: in packed
micro-batches of at most ``update.token_budget`` tokens). Under mixed precision the local
kinds run in the policy's autocast (the first iteration's KL is then exactly 0). A new kind (e.g. a
vLLM server) is one more constructor here returning a :class:`Reference` over its ``log_probs`` function.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from rlhf_train.core.sampling import SamplingParams
from rlhf_train.models.packed import packed_sequence_logprobs, token_budget_chunks
from rlhf_train.models.scoring import sequence_logprobs

# (full [B, P+T], full_mask [B, P+T], prompt_len) -> log π_ref of the response tokens [B, T]
LogProbFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
KINDS = ("copy", "adapter_off", "ray")


class Reference:
    """The reference policy: ``log_probs(full, full_mask, prompt_len) -> [B, T]`` (float32, no grad).

    Build it with :func:`frozen_copy`, :func:`adapter_off` or :func:`remote`; ``model`` is the local
    module (``None`` for a remote one), ``kind`` one of :data:`KINDS`."""

    def __init__(self, fn: LogProbFn, kind: str, model: nn.Module | None = None):
        if kind not in KINDS:
            raise ValueError(f"reference kind {kind!r} is not one of {KINDS}")
        self.fn, self.kind, self.model = fn, kind, model

    @torch.no_grad()
    def log_probs(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        return self.fn(full, full_mask, prompt_len)

    __call__ = log_probs  # usable wherever a ``ref_log_prob_fn`` is expected (torchrl's API)

    def __repr__(self) -> str:
        return f"Reference(kind={self.kind!r})"


def _local_fn(lm: nn.Module, sampling: SamplingParams, batch_size: int | None,
              context: Callable[[], contextlib.AbstractContextManager], token_budget: int | None = None) -> LogProbFn:
    """One pass of ``lm`` over ``full`` in chunks of ``batch_size`` rows (bounds the ``[b, T, V]`` memory);
    with ``token_budget`` (``update.packing``) in packed micro-batches of at most that many tokens instead."""
    s = sampling.for_scoring()

    @torch.no_grad()
    def ref_log_probs(full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        device = next(lm.parameters()).device
        step = batch_size or full.shape[0]
        with context():
            if token_budget:
                out = torch.zeros(full.shape[0], full.shape[1] - prompt_len, device=full.device)
                for rows in token_budget_chunks(full_mask, token_budget):
                    out[rows] = packed_sequence_logprobs(lm, full[rows].to(device), full_mask[rows].to(device),
                                                         prompt_len, s.temperature, s.top_k, s.top_p).to(full.device)
                return out
            return torch.cat([
                sequence_logprobs(lm, full[i:i + step].to(device), full_mask[i:i + step].to(device), prompt_len,
                                  s.temperature, s.top_k, s.top_p).to(full.device)
                for i in range(0, full.shape[0], step)])

    return ref_log_probs


def _stack(*contexts: Callable[[], contextlib.AbstractContextManager] | None):
    """Enter the given context factories (``None`` skipped) together."""
    @contextlib.contextmanager
    def entered():
        with contextlib.ExitStack() as stack:
            for c in contexts:
                if c is not None:
                    stack.enter_context(c())
            yield
    return entered


def frozen_copy(model: nn.Module, sampling: SamplingParams, batch_size: int | None = None,
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                token_budget: int | None = None) -> Reference:
    """A frozen model of its own (a copy of the initial policy, or a pretrained dir)."""
    return Reference(_local_fn(model, sampling, batch_size, _stack(autocast), token_budget), "copy", model)


def adapter_off(lm: nn.Module, sampling: SamplingParams, batch_size: int | None = None,
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                token_budget: int | None = None) -> Reference:
    """The peft-wrapped policy LM with its adapter disabled during the pass: exactly the initial model."""
    return Reference(_local_fn(lm, sampling, batch_size, _stack(lm.disable_adapter, autocast), token_budget),
                     "adapter_off", lm)


def remote(fn: LogProbFn, kind: str = "ray") -> Reference:
    """A reference served elsewhere (the Ray actor of :mod:`rlhf_train.models.ray_reference`)."""
    return Reference(fn, kind)
