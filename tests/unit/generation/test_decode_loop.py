"""rlhf_train's own KV-cached sampling loop (``generation/decode_loop.py``) and its sampler.

1. Greedy tokens equal ``transformers``' ``generate`` for GPT-2, GPT-NeoX, Llama, Qwen2 and Gemma on
   left-padded prompts (same positions, mask and cache conventions), and the hidden states the value
   head reads equal those ``generate``'s steps produce.
2. Sampled tokens' log-probs equal one scoring pass over prompt + response (what the update computes:
   the first PPO ratio is 1), with temperature and with top-k: under the temperature alone, the tokens
   drawn from the top-k set.
3. ``sample_vocab_major`` draws from ``softmax(logits / τ)`` (chi-square over a vocabulary of several
   blocks and a tail), never draws a token of zero probability, and returns its draws' log-probs.
4. ``generation=hf_generate`` (and a ``generation_config``) go through ``generate``; ``generation=decode_loop``,
   the default, samples without it; the config group builds each.
5. ``num_samples``: one prefill per prompt, its KV cache repeated: the same greedy tokens and hidden states
   as prefilling every row, and sampled log-probs equal to one scoring pass.

Budget: < 10 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from rlhf_train.core.sampling import SamplingParams, sample_vocab_major
from rlhf_train.generation.decode_loop import can_drive, sample_with_cache
from rlhf_train.generation.decode_loop import DecodeLoopBackend
from rlhf_train.generation.hf_generate import HFGenerateBackend, last_hidden_per_step
from rlhf_train.models.scoring import lm_trunk_and_head, sequence_logprobs
from tests.helpers.byo import ARCHS, chat_tokenizer, tiny_config


def _tiny_lm(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, chat_tokenizer())).eval()


def _left_padded_prompts(vocab: int, pad: int):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, vocab, (3, 7), generator=g)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    mask[0, :3] = False  # left padding, as the data loaders pad prompts
    mask[2, :1] = False
    return prompt.masked_fill(~mask, pad), mask


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_tokens_and_hidden_states_equal_generate(arch):
    lm = _tiny_lm(arch)
    assert can_drive(lm)
    prompt, mask = _left_padded_prompts(lm.config.vocab_size, pad=1)
    kw = dict(eos_token_id=0, pad_token_id=1)
    ours, log_probs, hidden = sample_with_cache(lm, prompt, mask, max_new_tokens=8, do_sample=False,
                                                keep_hidden=True, **kw)
    trunk = lm_trunk_and_head(lm)[0]
    with torch.no_grad(), last_hidden_per_step(trunk) as steps:
        theirs = lm.generate(input_ids=prompt, attention_mask=mask.long(), max_new_tokens=8, do_sample=False, **kw)
    theirs = theirs[:, prompt.shape[1]:]
    assert log_probs is None
    assert torch.equal(ours, theirs[:, :ours.shape[1]])
    torch.testing.assert_close(hidden, torch.stack(steps, 1)[:, :hidden.shape[1]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sampling", [SamplingParams(0.7), SamplingParams(1.0, top_k=5)], ids=["temp", "top_k"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sampled_log_probs_equal_one_scoring_pass(arch, sampling):
    lm = _tiny_lm(arch)
    prompt, mask = _left_padded_prompts(lm.config.vocab_size, pad=1)
    torch.manual_seed(0)
    response, log_probs, _ = sample_with_cache(lm, prompt, mask, max_new_tokens=10, eos_token_id=-1,
                                               pad_token_id=1, sampling=sampling)
    assert response.shape == log_probs.shape == (3, 10)
    full = torch.cat([prompt, response], 1)
    full_mask = torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1)
    # the update scores under the temperature alone (top-k only picks the tokens that can be drawn)
    scored = sequence_logprobs(lm, full, full_mask, prompt.shape[1], sampling.temperature)
    torch.testing.assert_close(log_probs, scored, atol=2e-5, rtol=0)
    if sampling.top_k:  # every drawn token is inside the top-k set, and the log-probs are not the filter's
        filtered = sequence_logprobs(lm, full, full_mask, prompt.shape[1], sampling.temperature, sampling.top_k)
        assert torch.isfinite(filtered).all() and (filtered > log_probs + 1e-3).all()


def test_vocab_major_sampler_distribution_and_log_probs():
    torch.manual_seed(0)
    pattern = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0, -1e4, 1.5])  # -1e4: zero probability
    logits = pattern.repeat(100)                                       # V = 800: 3 blocks of 256 + a tail
    n = 20000
    tokens, log_probs = sample_vocab_major(logits[:, None].repeat(1, n).contiguous(), temperature=0.7)
    probs = torch.softmax(logits / 0.7, 0)
    assert (pattern[tokens % 8] > -1e4).all()                          # never a zero-probability token
    counts = torch.bincount(tokens % 8, minlength=8).double()[[0, 1, 2, 3, 4, 5, 7]]
    expected = n * probs.view(100, 8).sum(0).double()[[0, 1, 2, 3, 4, 5, 7]]
    assert (((counts - expected) ** 2) / expected).sum() < 30.0      # 6 degrees of freedom: p < 1e-4
    # each position within its block: a chi-square over the 800 ids of the likeliest class (id % 8 == 0)
    per_id = torch.bincount(tokens[tokens % 8 == 0] // 8, minlength=100).double()
    assert (((per_id - per_id.mean()) ** 2) / per_id.mean()).sum() < 170.0  # 99 dof: p < 1e-4
    torch.testing.assert_close(log_probs, torch.log(probs)[tokens], atol=1e-6, rtol=0)


def test_the_loop_is_the_default_and_hf_generate_stays_available():
    lm = _tiny_lm("llama")
    prompt, mask = _left_padded_prompts(lm.config.vocab_size, pad=1)
    calls = []
    original = lm.generate

    def counting_generate(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    lm.generate = counting_generate
    for backend_cls, expected_calls in ((DecodeLoopBackend, 0), (HFGenerateBackend, 1)):
        backend = backend_cls(lm, eos_token_id=0, pad_token_id=1, max_new_tokens=5)
        gen = backend.generate(prompt, mask, num_samples=2)
        assert gen.response.shape == gen.log_probs.shape == (6, 5)
        assert len(calls) == expected_calls


def test_the_generation_group_selects_the_backend(tiny_cfg):
    from rlhf_train.loop.build import build_run

    assert isinstance(build_run(tiny_cfg()).rollout.backend, DecodeLoopBackend)  # the default
    assert isinstance(build_run(tiny_cfg("generation=hf_generate")).rollout.backend, HFGenerateBackend)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_prefill_per_prompt_gives_each_sample_the_prompts_cache(arch):
    lm = _tiny_lm(arch)
    prompt, mask = _left_padded_prompts(lm.config.vocab_size, pad=1)
    kw = {"eos_token_id": -1, "pad_token_id": 1, "max_new_tokens": 6}
    greedy, _, hidden = sample_with_cache(lm, prompt, mask, do_sample=False, keep_hidden=True, **kw)
    shared, _, shared_hidden = sample_with_cache(lm, prompt, mask, do_sample=False, keep_hidden=True,
                                                 num_samples=3, **kw)
    assert torch.equal(shared, greedy.repeat_interleave(3, 0))
    torch.testing.assert_close(shared_hidden, hidden.repeat_interleave(3, 0), atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    sampled, log_probs, _ = sample_with_cache(lm, prompt, mask, num_samples=3, **kw)
    full = torch.cat([prompt.repeat_interleave(3, 0), sampled], 1)
    full_mask = torch.cat([mask.repeat_interleave(3, 0), torch.ones_like(sampled, dtype=torch.bool)], 1)
    torch.testing.assert_close(log_probs, sequence_logprobs(lm, full, full_mask, prompt.shape[1]), atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_kv_cache_is_sized_once(arch, num_samples):
    """6. The loop's KV cache is one ``StaticCache`` of prompt + ``max_new_tokens`` positions, repeated for the
    samples once after the prefill and written in place by every step (no per-step ``torch.cat``); a model
    without static-cache support grows a ``DynamicCache`` instead, with the same greedy tokens."""
    from transformers import StaticCache

    lm = _tiny_lm(arch)
    prompt, mask = _left_padded_prompts(lm.config.vocab_size, pad=1)
    seen = []

    def recording(module, args, kwargs, out):
        cache = out.get("cache", None) or out.past_key_values
        seen.append((cache, cache.layers[0].keys.data_ptr(), tuple(cache.layers[0].keys.shape)))

    lm_trunk_and_head(lm)[0].register_forward_hook(recording, with_kwargs=True)
    kw = {"eos_token_id": -1, "pad_token_id": 1, "max_new_tokens": 6, "do_sample": False, "num_samples": num_samples}
    static, _, _ = sample_with_cache(lm, prompt, mask, **kw)
    caches, pointers, shapes = zip(*seen)
    assert len(seen) == 6 and all(c is caches[0] for c in caches) and isinstance(caches[0], StaticCache)
    assert len(set(pointers[1:])) == 1                          # the decode steps write into one buffer
    assert set(shapes[1:]) == {(3 * num_samples, shapes[0][1], 7 + 6, shapes[0][3])}  # [B, heads, P + T, d]
    seen.clear()
    type(lm)._can_compile_fullgraph, saved = False, type(lm)._can_compile_fullgraph
    try:
        dynamic, _, _ = sample_with_cache(lm, prompt, mask, **kw)
    finally:
        type(lm)._can_compile_fullgraph = saved
    assert not isinstance(seen[-1][0], StaticCache) and seen[-1][2][2] == 7 + 5  # grown step by step
    assert torch.equal(static, dynamic)
