"""The static-cache backend (``generation=static_cache``, ``generation/static_cache.py``) and ``generation=auto``.

1. Greedy tokens equal the decode loop's for tiny GPT-2 and Llama configs (random weights, left-padded
   prompts of different lengths, two EOS ids, one and several samples per prompt), and so do the values
   the value head reads; a second call reuses the cache (reset) and still agrees, for another prompt length.
2. A sampled run (temperature, top-k, top-p): ``[B, T]`` tokens, padding after the first EOS, log-probs
   equal to one scoring pass of the policy under the temperature alone (what the update computes).
3. ``generation_config`` calls and models ``transformers`` does not mark compilable go to the decode loop;
   ``generation.cache_multiple`` / ``check_every`` below 1 stop the run at start in one line.
4. ``generation=auto`` builds the decode loop on CPU and the static-cache backend on CUDA (the device
   check stubbed); the config group builds each backend by name.
5. (slow) With ``compile=true`` on CPU (``torch.compile`` of the decode step) the greedy tokens are the same.

Budget: ~5 s on 2 CPU cores, plus ~20-30 s for the slow compile test.
"""
from __future__ import annotations

import pytest
import torch

from rlhf_train.core.sampling import SamplingParams
from rlhf_train.generation.decode_loop import DecodeLoopBackend
from rlhf_train.generation.static_cache import StaticCacheBackend, supports_static_cache
from rlhf_train.models.scoring import sequence_logprobs
from tests.helpers.byo import chat_tokenizer, tiny_config

EOS = [0, 3]  # <|endoftext|> and <|im_end|>
PAD = 1


def _tiny_lm(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, chat_tokenizer())).eval()


def _prompts(vocab: int, length: int = 7, seed: int = 1):
    """Three left-padded prompts of ``length``, ``length - 3`` and ``length - 1`` tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, vocab, (3, length), generator=g)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, :1] = False
    return prompt.masked_fill(~mask, PAD), mask


def _backends(model, **kw):
    settings = dict(eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=12, **kw)
    return DecodeLoopBackend(model, **settings), StaticCacheBackend(model, compile=False, **settings)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("num_samples", [1, 2])
def test_greedy_tokens_equal_the_decode_loops(arch, num_samples):
    lm = _tiny_lm(arch)
    assert supports_static_cache(lm)
    loop, static = _backends(lm, do_sample=False)
    for length in (7, 10):  # the second call reuses the first's cache (L = 64 for both)
        prompt, mask = _prompts(lm.config.vocab_size, length, seed=length)
        expected = loop.generate(prompt, mask, num_samples).response
        got = static.generate(prompt, mask, num_samples).response
        assert got.shape == (3 * num_samples, 12)
        assert torch.equal(got, expected)
    assert static._cache is not None and static._cache_key[1:3] == (3 * num_samples, 64)


def test_several_eos_ids_end_a_row_and_pad_it():
    lm = _tiny_lm("llama")
    prompt, mask = _prompts(lm.config.vocab_size)
    with torch.no_grad():  # make <|im_end|> (3), the second EOS id, likely: rows end at either id
        lm.get_output_embeddings().weight[3] += 5 * lm.get_output_embeddings().weight.std()
    loop, static = _backends(lm, do_sample=False)
    response = static.generate(prompt, mask).response
    assert torch.equal(response, loop.generate(prompt, mask).response)
    is_eos = torch.isin(response, torch.tensor(EOS))
    assert is_eos.any(1).all() and set(response[is_eos].tolist()) == set(EOS)  # each id ended a row
    after_first = (is_eos.int().cumsum(1) - is_eos.int()) > 0
    assert (response[after_first] == PAD).all() and after_first.any()


def test_values_equal_the_decode_loops():
    from tests.helpers.reliability import tiny_policy

    policy = tiny_policy().eval()
    prompt, mask = _prompts(32)
    settings = dict(eos_token_id=0, pad_token_id=PAD, max_new_tokens=6)
    torch.manual_seed(0)
    expected = DecodeLoopBackend(policy, **settings).generate(prompt, mask, 2)
    torch.manual_seed(0)
    got = StaticCacheBackend(policy, compile=False, **settings).generate(prompt, mask, 2)
    assert torch.equal(got.response, expected.response)  # same seed, same sampler, same logits
    torch.testing.assert_close(got.log_probs, expected.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.values, expected.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sampling", [SamplingParams(0.7), SamplingParams(1.0, top_k=5), SamplingParams(0.9, top_p=0.8)],
                         ids=["temp", "top_k", "top_p"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sampled_tokens_and_log_probs(arch, sampling):
    lm = _tiny_lm(arch)
    prompt, mask = _prompts(lm.config.vocab_size)
    static = StaticCacheBackend(lm, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=10, sampling=sampling,
                                compile=False)
    torch.manual_seed(0)
    gen = static.generate(prompt, mask, num_samples=2)
    assert gen.response.shape == gen.log_probs.shape == (6, 10) and gen.values is None
    ended = torch.isin(gen.response, torch.tensor(EOS)).int().cumsum(1)
    assert (gen.response[(ended - torch.isin(gen.response, torch.tensor(EOS)).int()) > 0] == PAD).all()
    full = torch.cat([prompt.repeat_interleave(2, 0), gen.response], 1)
    full_mask = torch.cat([mask.repeat_interleave(2, 0), ended - torch.isin(gen.response, torch.tensor(EOS)).int() == 0], 1)
    scored = sequence_logprobs(lm, full, full_mask, prompt.shape[1], sampling.temperature)  # the temperature alone
    live = full_mask[:, prompt.shape[1]:]
    torch.testing.assert_close(gen.log_probs[live], scored[live], atol=2e-5, rtol=0)


def test_what_it_does_not_take_goes_to_the_decode_loop():
    from transformers import GenerationConfig

    lm = _tiny_lm("llama")
    prompt, mask = _prompts(lm.config.vocab_size)
    static = StaticCacheBackend(lm, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=4, compile=False)
    out = static.generate(prompt, mask, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False))
    assert out.response.shape == (3, 4) and static._cache is None  # generate's own decoding, no cache made
    type(lm)._can_compile_fullgraph, original = False, type(lm)._can_compile_fullgraph
    try:
        assert not static.drives()
        assert static.generate(prompt, mask).response.shape == (3, 4) and static._cache is None
    finally:
        type(lm)._can_compile_fullgraph = original


def test_auto_picks_the_decode_loop_on_cpu_and_the_static_cache_on_cuda(tiny_cfg, monkeypatch):
    from rlhf_train.generation import auto
    from rlhf_train.generation.hf_generate import HFGenerateBackend
    from rlhf_train.loop.build import build_run

    lm = _tiny_lm("llama")
    assert type(auto.auto_backend(lm, eos_token_id=0, pad_token_id=1, max_new_tokens=4)) is DecodeLoopBackend

    monkeypatch.setattr(auto, "device_type", lambda model: "cuda")  # as if the policy were on a GPU
    on_cuda = auto.auto_backend(lm, eos_token_id=0, pad_token_id=1, max_new_tokens=4)
    monkeypatch.undo()
    assert type(on_cuda) is StaticCacheBackend
    for name, cls in (("auto", DecodeLoopBackend), ("static_cache", StaticCacheBackend),
                      ("decode_loop", DecodeLoopBackend), ("hf_generate", HFGenerateBackend)):
        assert type(build_run(tiny_cfg(f"generation={name}")).rollout.backend) is cls


@pytest.mark.parametrize("key", ["cache_multiple", "check_every"])
def test_a_non_positive_setting_stops_at_start(tiny_cfg, key):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=rf"^generation\.{key}=0 must be positive$"):
        check_config(tiny_cfg("generation=static_cache", f"generation.{key}=0"))


@pytest.mark.slow
def test_compiled_step_gives_the_same_greedy_tokens():
    lm = _tiny_lm("llama")
    prompt, mask = _prompts(lm.config.vocab_size)
    loop, _ = _backends(lm, do_sample=False)
    static = StaticCacheBackend(lm, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=12, do_sample=False,
                                compile=True)
    expected = loop.generate(prompt, mask, 2).response
    assert torch.equal(static.generate(prompt, mask, 2).response, expected)
    assert static._compiled is not None
    assert torch.equal(static.generate(prompt, mask, 2).response, expected)  # the compiled step, reused
