"""rlhf_train's own KV-cached sampling loop: the trunk once per new token, the LM head vocabulary-major,
and a two-level inverse-CDF sampler that walks the vocabulary three times.

:class:`DecodeLoopBackend` is the default generation backend (``generation=decode_loop``); for a
``generation_config`` (torchrl's API) and for trunks this loop cannot drive it hands the call to
:class:`~rlhf_train.generation.hf_generate.HFGenerateBackend`. Why not ``transformers``' ``generate``: at RLHF's small widths a
decode step is the LM head and the sampling over ``V``, not the transformer. ``generate`` computes the head
as ``h @ Wᵀ`` (``[B, V]``), copies the logits, runs the logits processors (our sampler: softmax + a float64
cumulative sum over ``V``), then an argmax over ``V`` to read the token back, and concatenates its
``input_ids`` every step. Here: ``W @ hᵀ`` into one ``[V, B]`` buffer reused every step (2.7-2.9 vs
4.7-5.6 ms at width 128 on CPU), then :func:`~rlhf_train.core.sampling.sample_vocab_major` in those
logits' own memory. Positions and the
attention mask follow ``generate``'s conventions (positions from the left-padded mask), so the hidden states
are ``generate``'s: a test checks the greedy tokens against ``generate`` for GPT-2, GPT-NeoX, Llama, Qwen2 and
Gemma. The KV cache is sized once (:func:`preallocated_cache`: ``transformers``' ``StaticCache`` of prompt +
``max_new_tokens`` positions, written in place, with a ``[B, P+T]`` mask made before the first step) where
the model supports one; a ``DynamicCache`` grows by a ``torch.cat`` of every layer's keys and values each step
(SmolLM2-135M's shape, 32 rows: ~6 GB copied over 48 steps), so it is left for the models that do not.
Measured (``benchmarks/decode_loop.py``, 32 rows, 2 threads, interleaved in one process): 32 x 50 tokens of
a 2-layer width-128 GPT-2, 0.60 -> 0.42 s; docs/performance.md has the rest.
"""
from __future__ import annotations

import inspect
import torch
from torch import nn
from transformers import StaticCache

from rlhf_train.core.containers import is_eos, position_ids_from_mask
from rlhf_train.core.sampling import SamplingParams, sample_filtered, sample_vocab_major
from rlhf_train.generation.base import Generation, finish, pad_steps
from rlhf_train.generation.hf_generate import HFGenerateBackend
from rlhf_train.generation.weight_major import weight_major_linears
from rlhf_train.models.attention import cpu_attention
from rlhf_train.models.scoring import lm_trunk_and_head, vocab_major_logits
from rlhf_train.models.shared_prompt import cache_argument, cache_of


def can_drive(lm: nn.Module) -> bool:
    """Whether this loop can run ``lm``: a decoder-only trunk whose forward takes ``position_ids`` and a
    KV cache (every ``transformers`` causal LM of the Llama / GPT-2 families does)."""
    if getattr(getattr(lm, "config", None), "is_encoder_decoder", False):
        return False
    trunk, head = lm_trunk_and_head(lm)
    params = inspect.signature(trunk.forward).parameters
    return (head is not None and cache_argument(trunk) is not None
            and all(k in params for k in ("position_ids", "attention_mask")))


def preallocated_cache(lm: nn.Module, length: int):
    """A ``StaticCache`` of ``length`` positions for ``lm`` (its rows taken from the first write), or ``None``
    where ``transformers`` does not mark the model static-cache capable (``_can_compile_fullgraph``) or one
    of its layers keeps a sliding window (the loop then grows a ``DynamicCache``)."""
    from transformers import StaticCache

    base = lm.get_base_model() if hasattr(lm, "get_base_model") and hasattr(lm, "peft_config") else lm
    if not getattr(base, "_can_compile_fullgraph", False):
        return None
    try:
        cache = StaticCache(config=base.config, max_cache_len=length)
    except (TypeError, ValueError, AttributeError):  # a config StaticCache cannot read
        return None
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", [None])):
        return None
    return cache


def repeat_rows(cache, repeats: int) -> None:
    """Each row of a filled KV cache ``repeats`` times, adjacent: ``DynamicCache``'s own
    ``batch_repeat_interleave``; a ``StaticCache``'s layers (which lack it) get their ``[N, heads, L, d]``
    keys and values repeated once, after the prefill, and are written in place from then on."""
    if not isinstance(cache, StaticCache):
        cache.batch_repeat_interleave(repeats)
        return
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(repeats, 0)
        layer.values = layer.values.repeat_interleave(repeats, 0)


def pick_next(logits_t: torch.Tensor, sampling: SamplingParams, do_sample: bool):
    """Next tokens ``[B]`` (and their log-probs ``[B]`` under the temperature alone, or None when greedy)
    from vocabulary-major logits ``[V, B]`` (overwritten). top-k / top-p pick which tokens can be drawn
    (transformers' warpers); the log-prob is the update's, never the filter's (:func:`sample_filtered`)."""
    if not do_sample:
        return logits_t.argmax(0), None
    if sampling.top_k or sampling.top_p < 1.0:  # filtered distributions, [B, V]
        return sample_filtered(logits_t.T, sampling)
    return sample_vocab_major(logits_t.float() if logits_t.dtype != torch.float32 else logits_t, sampling.temperature)


@torch.no_grad()
def sample_with_cache(lm: nn.Module, prompt: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                      eos_token_id, pad_token_id: int, sampling: SamplingParams = SamplingParams(),
                      do_sample: bool = True, keep_hidden: bool = False, num_samples: int = 1):
    """Samples up to ``max_new_tokens`` tokens after left-padded ``prompt [N, P]`` (``prompt_mask [N, P]``),
    ``num_samples`` times each: ``B = N · num_samples`` rows, the samples of a prompt adjacent.

    The prompt is prefilled once and its KV cache repeated for its samples (GRPO's 4-16 samples per
    prompt share one prefill, as vLLM's prefix cache does).

    Returns ``(response [B, T'], log_probs [B, T'] or None, hidden [B, T', H] or None)`` with ``T' ≤
    max_new_tokens`` (fewer when every row ended early): the tokens (``pad_token_id`` after a row's
    first EOS, as ``generate`` pads them), their log-probs under the temperature alone (``None`` when
    greedy), and, with ``keep_hidden``, the trunk's last hidden state that predicted each token (what
    the value head reads). Randomness: one uniform per row and step from torch's global generator.
    """
    trunk, head = lm_trunk_and_head(lm)
    cache_kw = cache_argument(trunk)
    (N, P), B = prompt.shape, prompt.shape[0] * num_samples
    positions = position_ids_from_mask(prompt_mask.long())         # as generate gives left-padded prompts
    static = preallocated_cache(lm, P + max_new_tokens)
    if static is not None:  # one [N, P+T] mask for every step: the causal mask hides positions not yet written
        mask = torch.cat([prompt_mask.long(), prompt_mask.new_ones(N, max_new_tokens, dtype=torch.long)], 1)
        out = trunk(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_kw: static})
    else:
        mask = prompt_mask.long()
        out = trunk(input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, h = cache_of(out), out.last_hidden_state[:, -1]        # h [N, H] predicts the next token
    if num_samples > 1:                                            # one prefill per prompt, then B rows
        repeat_rows(cache, num_samples)
        h, mask, positions = (x.repeat_interleave(num_samples, 0) for x in (h, mask, positions))
    position = positions[:, -1:] + 1
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    tokens, log_probs, hidden = [], [], []
    logits_buffer = None  # [V, B], reused every step (the sampler overwrites it)
    # the decode steps' [B, H] matmuls weight-major and their attention as two batched matmuls (CPU)
    with weight_major_linears(trunk), cpu_attention():
        for t in range(max_new_tokens):
            if keep_hidden:
                hidden.append(h)
            logits_t = logits_buffer = vocab_major_logits(head, h, out=logits_buffer)
            token, log_prob = pick_next(logits_t, sampling, do_sample)
            token = token.masked_fill_(finished, pad_token_id)
            tokens.append(token)
            if log_prob is not None:
                log_probs.append(log_prob)
            finished |= is_eos(token, eos_token_id)
            if t == max_new_tokens - 1 or bool(finished.all()):
                break
            if static is None:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            out = trunk(input_ids=token[:, None], attention_mask=mask, position_ids=position, use_cache=True,
                        **{cache_kw: cache})
            cache, h = cache_of(out), out.last_hidden_state[:, -1]
            position = position + 1
    return (torch.stack(tokens, 1), torch.stack(log_probs, 1) if log_probs else None,
            torch.stack(hidden, 1) if keep_hidden else None)


class DecodeLoopBackend:
    """:class:`~rlhf_train.generation.base.GenerationBackend` running :func:`sample_with_cache` on the
    policy's causal LM. Its settings are those of :class:`~rlhf_train.generation.hf_generate.HFGenerateBackend`
    (``eos_token_id``, ``pad_token_id``, ``max_new_tokens``, ``sampling``, ``do_sample``, ``with_scores``,
    ``unwrap_fn``), held once, by that backend: it is the fallback this one hands a ``generation_config``
    call, or a model :func:`can_drive` rejects, to."""

    def __init__(self, model, **settings):
        self.fallback = HFGenerateBackend(model, **settings)

    @property
    def with_scores(self) -> bool:
        return self.fallback.with_scores

    def _lm(self):
        base = self.fallback.unwrap_fn(self.fallback.model)
        return base, getattr(base, "lm", base)

    def drives(self) -> bool:
        """Whether the loop (not the ``generate`` fallback) samples for this policy."""
        return can_drive(self._lm()[1])

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int = 1,
                 generation_config=None) -> Generation:
        """See :meth:`~rlhf_train.generation.base.GenerationBackend.generate`."""
        s, (base, lm) = self.fallback, self._lm()
        if generation_config is not None or not can_drive(lm):
            return s.generate(prompt, prompt_mask, num_samples, generation_config=generation_config)
        T = s.max_new_tokens
        value_head = getattr(base, "value_head", None) if s.with_scores and s.do_sample else None
        response, log_probs, hidden = sample_with_cache(  # samples of a prompt adjacent, one prefill each
            lm, prompt, prompt_mask, max_new_tokens=T, eos_token_id=s.eos_token_id, pad_token_id=s.pad_token_id,
            sampling=s.sampling, do_sample=s.do_sample, keep_hidden=value_head is not None, num_samples=num_samples)
        values = value_head(pad_steps(hidden, T)).float() if value_head is not None else None
        return finish(response, T, s.eos_token_id, s.pad_token_id, log_probs if s.with_scores else None, values)
