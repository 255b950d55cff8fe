"""CPU attention (rlhf_train/models/attention.py): one query per row against its cache, and masked GQA attention
with several queries (forward and gradients), give ``transformers``' ``sdpa`` results for every mask form; the
calls it does not take reach ``sdpa`` unchanged, the registry is as before when the block exits (nested blocks
too), and the decode loop samples the same tokens with and without it.

Budget: ~2 s on 2 CPU cores.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rlhf_train.models.attention import cpu_attention


class _Layer(nn.Module):  # what transformers' attention functions read off the attention layer
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(B=5, H=6, H_kv=2, L=11, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, d, generator=g).transpose(1, 2)  # [B, H, 1, d], strided as a layer's view
    k, v = torch.randn(B, H_kv, L, d, generator=g), torch.randn(B, H_kv, L, d, generator=g)
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., :4] = False  # left padding
    keep[3, ..., 7:] = False  # cache positions not written yet
    return q, k, v, keep


@pytest.mark.parametrize("H,H_kv", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("mask", ["bool", "additive", "none"])
@torch.no_grad()
def test_one_query_attention_equals_sdpa(H, H_kv, mask):
    q, k, v, keep = _inputs(H=H, H_kv=H_kv)
    m = {"bool": keep, "additive": torch.zeros(keep.shape).masked_fill_(~keep, float("-inf")), "none": None}[mask]
    layer = _Layer(H // H_kv)
    expected, _ = sdpa_attention_forward(layer, q, k, v, m, scaling=0.3)
    with cpu_attention():
        got, weights = ALL_ATTENTION_FUNCTIONS["sdpa"](layer, q, k, v, m, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (5, 1, H, 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_calls_it_does_not_take_go_to_sdpa_and_the_registry_is_restored(monkeypatch):
    seen = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa",
                        lambda *a, **kw: seen.append(a[1].shape[2]) or sdpa_attention_forward(*a, **kw))
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    q, k, v, keep = _inputs()
    prefill = torch.randn(5, 6, 3, 8)  # 3 queries
    with cpu_attention():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before
        with torch.no_grad():
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(3), q, k, v, keep)            # taken: not seen
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(3), prefill, k, v, None)     # no mask: sdpa's own GQA
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(3), q, k, v, keep, dropout=0.1)  # dropout: sdpa's
            with cpu_attention():  # nested: the outer block's function stays
                ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(3), q, k, v, keep)
        with torch.enable_grad():
            ALL_ATTENTION_FUNCTIONS["sdpa"](_Layer(1), q.requires_grad_(), k[:, :1].expand(5, 6, 11, 8).clone(), v[
                :, :1].expand(5, 6, 11, 8).clone(), keep)  # one query with a gradient, no GQA: sdpa's
    assert seen == [3, 1, 1]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_masked_gqa_with_several_queries_equals_sdpa_with_its_gradients(mask):
    g = torch.Generator().manual_seed(2)
    B, H, H_kv, Q, L, d = 3, 6, 2, 4, 9, 8
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((B, H, Q, d), (B, H_kv, L, d), (B, H_kv, L, d)))
    keep = torch.ones(B, 1, Q, L, dtype=torch.bool).tril(diagonal=L - Q)  # causal, the prompt in the cache
    keep[0, ..., :3] = False  # left padding
    m = keep if mask == "bool" else torch.zeros(keep.shape, dtype=torch.float64).masked_fill_(~keep, float("-inf"))
    layer, grad_out = _Layer(H // H_kv), torch.randn(B, Q, H, d, generator=g, dtype=torch.float64)
    expected, _ = sdpa_attention_forward(layer, q, k, v, m)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    with cpu_attention():
        got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](layer, q, k, v, m)
    torch.testing.assert_close(got, expected)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad_out), expected_grads):
        torch.testing.assert_close(a, b)


def test_the_decode_loop_samples_the_same_tokens_with_grouped_attention(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_train.generation import decode_loop

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=1, attn_implementation="sdpa")).eval()
    prompt = torch.tensor([[1, 1, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompt != 1).long()

    def sample():
        torch.manual_seed(1)
        return decode_loop.sample_with_cache(lm, prompt, mask, max_new_tokens=6, eos_token_id=0, pad_token_id=1,
                                             num_samples=2, keep_hidden=True)

    tokens, log_probs, hidden = sample()
    monkeypatch.setattr(decode_loop, "cpu_attention", contextlib.nullcontext)
    tokens0, log_probs0, hidden0 = sample()
    assert torch.equal(tokens, tokens0)
    torch.testing.assert_close(log_probs, log_probs0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden, hidden0, rtol=1e-5, atol=1e-5)
