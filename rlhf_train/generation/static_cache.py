"""A decode loop over ``transformers``' ``StaticCache`` whose step can be compiled (``torch.compile``; on CUDA
with CUDA graphs, ``mode="reduce-overhead"``): ``generation=static_cache``, and what ``generation=auto``
picks on CUDA.

Why: on a GPU a decode step of a small policy is hundreds of tiny kernels (30 layers × ~15 ops for
SmolLM2-135M), and launching them from Python costs more than running them. A CUDA graph replays the
whole trunk step as one launch, which needs every tensor of the step at a fixed address and shape: the KV
cache is a ``StaticCache`` (``[B, heads, L, head_dim]`` per layer, written in place), the attention mask one
``[B, L]`` tensor made before the first step (prompt mask, then ones for the response; the causal mask
hides the positions not yet written), and ``L = P + T`` rounded up to ``cache_multiple`` so that batches
whose prompts differ a little in length reuse one compiled graph (and one cache, reset between calls).
Why not ``generate(cache_implementation="static")``: its mask grows by a column each step (a dynamic shape),
and its logits processors cannot hand back the hidden states the value head reads.

Everything around the trunk is :mod:`rlhf_train.generation.decode_loop`'s: positions from the left-padded
mask, the LM head vocabulary-major, :func:`~rlhf_train.generation.decode_loop.pick_next` (greedy, or
the inverse-CDF samplers recording each token's log-prob), padding after the first of any EOS id, the
hidden states for the values. So the tokens are the decode loop's: a test checks greedy tokens, sampled
log-probs against one scoring pass, and values, for GPT-2 and Llama configs on CPU (without compiling).
Differences: with ``num_samples > 1`` every row is prefilled (its prompt's samples do not share one
prefill: a static cache is allocated for all ``B`` rows), and whether all rows ended is read every
``check_every`` steps (each read waits for the GPU), so up to ``check_every - 1`` steps of padding may run.
Models whose forward the loop cannot drive, or that ``transformers`` does not mark compilable
(``_can_compile_fullgraph``), and ``generation_config`` calls go to the decode loop.
"""
from __future__ import annotations

import torch
from torch import nn

from rlhf_train.core.containers import is_eos, position_ids_from_mask
from rlhf_train.generation.base import Generation, finish, pad_steps
from rlhf_train.generation.decode_loop import DecodeLoopBackend, cache_argument, can_drive, pick_next
from rlhf_train.models.scoring import lm_trunk_and_head, vocab_major_logits


def supports_static_cache(lm: nn.Module) -> bool:
    """Whether this loop can run ``lm``: the decode loop can drive it and ``transformers`` marks its
    forward compilable with a static cache (``_can_compile_fullgraph``: Llama, GPT-2, Qwen2, Gemma, ...)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") and hasattr(lm, "peft_config") else lm
    return can_drive(lm) and bool(getattr(base, "_can_compile_fullgraph", False))


def trunk_step(trunk: nn.Module, cache_kw: str, cache, token: torch.Tensor, mask: torch.Tensor,
               position: torch.Tensor) -> torch.Tensor:
    """One decode step: ``token [B, 1]`` at ``position [B, 1]``, the whole ``mask [B, L]`` → the last
    hidden state ``[B, H]``; ``cache`` (a ``StaticCache``) is written in place. Fixed shapes: compiled once."""
    out = trunk(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True, **{cache_kw: cache})
    return out.last_hidden_state[:, -1]


class StaticCacheBackend:
    """:class:`~rlhf_train.generation.base.GenerationBackend` running the trunk on a ``StaticCache``.

    Args:
        model: the policy (see :class:`~rlhf_train.generation.hf_generate.HFGenerateBackend`).
        compile: ``torch.compile`` the decode step (``None``: on CUDA, where it runs as a CUDA graph, for
            models without sliding-window layers; on CPU compiling takes longer than it saves at these sizes).
        cache_multiple: the cache length ``P + T`` is rounded up to a multiple of this (one compiled graph
            for prompts of lengths that round alike).
        check_every: read whether every row has ended each this many steps (a GPU → CPU wait each time).
        settings: the rollout's settings (``eos_token_id``, ``pad_token_id``, ``max_new_tokens``,
            ``sampling``, ``do_sample``, ``with_scores``, ``unwrap_fn``), held by the decode loop this
            backend hands the calls it does not take to.
    """

    def __init__(self, model, *, compile: bool | None = None, cache_multiple: int = 64, check_every: int = 8,
                 **settings):
        if cache_multiple < 1 or check_every < 1:  # (the config's are checked at start: loop/checks.py)
            raise ValueError(f"cache_multiple={cache_multiple} and check_every={check_every} must be positive")
        self.fallback = DecodeLoopBackend(model, **settings)
        self.compile, self.cache_multiple, self.check_every = compile, cache_multiple, check_every
        self._cache, self._cache_key, self._compiled = None, None, None

    @property
    def with_scores(self) -> bool:
        return self.fallback.with_scores

    def drives(self) -> bool:
        """Whether this loop (not the decode loop it falls back to) samples for this policy."""
        return supports_static_cache(self.fallback._lm()[1])

    def _static_cache(self, lm: nn.Module, B: int, L: int, dtype: torch.dtype, device: torch.device):
        """A ``StaticCache`` of ``B`` rows × ``L`` positions, emptied; the previous call's when it fits (a
        compiled step is specialised to its cache's tensors)."""
        from transformers import StaticCache

        key = (id(lm), B, L, dtype, device)
        if self._cache_key != key:
            self._cache, self._cache_key = StaticCache(config=lm.config, max_cache_len=L), key
        else:
            self._cache.reset()
        return self._cache

    def _step_fn(self, cache, device: torch.device):
        # auto: on CUDA, unless a layer keeps a sliding window: its position is a Python int that the
        # compiled step would see change every step (a new CUDA graph each time)
        sliding = any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))
        compile = self.compile if self.compile is not None else device.type == "cuda" and not sliding
        if not compile:
            return trunk_step
        if self._compiled is None:
            mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs
            self._compiled = torch.compile(trunk_step, mode=mode)
        return self._compiled

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int = 1,
                 generation_config=None) -> Generation:
        """See :meth:`~rlhf_train.generation.base.GenerationBackend.generate`."""
        s, (base, lm) = self.fallback.fallback, self.fallback._lm()
        if generation_config is not None or not supports_static_cache(lm):
            return self.fallback.generate(prompt, prompt_mask, num_samples, generation_config=generation_config)
        T = s.max_new_tokens
        value_head = getattr(base, "value_head", None) if s.with_scores and s.do_sample else None
        response, log_probs, hidden = self.sample(lm, prompt, prompt_mask, num_samples, keep_hidden=value_head is not None)
        values = value_head(pad_steps(hidden, T)).float() if value_head is not None else None
        return finish(response, T, s.eos_token_id, s.pad_token_id, log_probs if s.with_scores else None, values)

    @torch.no_grad()
    def sample(self, lm: nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int = 1,
               keep_hidden: bool = False):
        """``(response [B, T'], log_probs [B, T'] or None, hidden [B, T', H] or None)`` as
        :func:`~rlhf_train.generation.decode_loop.sample_with_cache` returns them, ``B = N · num_samples``."""
        s = self.fallback.fallback
        T, sampling, do_sample = s.max_new_tokens, s.sampling, s.do_sample
        trunk, head = lm_trunk_and_head(lm)
        cache_kw = cache_argument(trunk)
        if num_samples > 1:  # samples of one prompt adjacent
            prompt, prompt_mask = prompt.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
        (B, P), device = prompt.shape, prompt.device
        L = -(-(P + T) // self.cache_multiple) * self.cache_multiple
        mask = torch.zeros(B, L, dtype=torch.long, device=device)   # fixed for every step: no new shapes
        mask[:, :P] = prompt_mask
        mask[:, P:P + T] = 1
        positions = position_ids_from_mask(prompt_mask)
        dtype = next(trunk.parameters()).dtype
        cache = self._static_cache(lm, B, L, dtype, device)
        out = trunk(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_kw: cache})                              # the prefill: eager, [B, P]
        h, position = out.last_hidden_state[:, -1], positions[:, -1:] + 1
        step = self._step_fn(cache, device)
        graphs = step is not trunk_step and device.type == "cuda"
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        tokens, log_probs, hidden, logits_buffer = [], [], [], None
        for t in range(T):
            if keep_hidden:
                hidden.append(h)
            logits_t = logits_buffer = vocab_major_logits(head, h, out=logits_buffer)
            token, log_prob = pick_next(logits_t, sampling, do_sample)
            token = token.masked_fill_(finished, s.pad_token_id)
            tokens.append(token)
            if log_prob is not None:
                log_probs.append(log_prob)
            finished |= is_eos(token, s.eos_token_id)
            if t == T - 1 or ((t + 1) % self.check_every == 0 and bool(finished.all())):
                break
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous replay's output is no longer read
            h = step(trunk, cache_kw, cache, token[:, None], mask, position)
            h = h.clone() if graphs else h  # a CUDA graph's output is overwritten by its next replay
            position = position + 1
        return (torch.stack(tokens, 1), torch.stack(log_probs, 1) if log_probs else None,
                torch.stack(hidden, 1) if keep_hidden else None)
