"""MKL-packed weights in the decode loop (rlhf_train/generation/packed_weights.py): the packed GEMM gives
``nn.functional.linear``'s results, other row counts take the plain path, the layers are restored afterwards,
a frozen trunk's packed copies are kept between calls (one trunk at a time) and the heap is trimmed when they are
dropped, a trainable trunk's are packed anew every call and freed into the heap untrimmed, and the decode loop
samples the same tokens and log-probs with and without it.

Budget: ~3 s on 2 CPU cores.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from rlhf_train.generation import packed_weights
from rlhf_train.generation.packed_weights import packed_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed linear")


@torch.no_grad()
def test_packed_linear_equals_the_plain_linear_and_is_removed_afterwards():
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    x3, x5 = torch.randn(3, 1, 64), torch.randn(5, 64)
    plain3, plain5 = trunk(x3), trunk(x5)
    with packed_linears(trunk, rows=3):
        assert all("forward" in m.__dict__ for m in trunk)
        torch.testing.assert_close(trunk(x3), plain3, rtol=1e-6, atol=1e-6)  # packed: 3 rows
        torch.testing.assert_close(trunk(x5), plain5, rtol=0, atol=0)         # 5 rows: the plain path
    assert not any("forward" in m.__dict__ for m in trunk)
    torch.testing.assert_close(trunk(x3), plain3, rtol=0, atol=0)


@torch.no_grad()
def test_a_frozen_trunk_keeps_its_packed_weights_until_they_change_or_another_trunk_is_packed(monkeypatch):
    trims = []
    monkeypatch.setattr(packed_weights, "_trim_heap", lambda: trims.append(1))
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).requires_grad_(False)  # 8 wide: a LoRA factor

    def packs(trunk):
        with packed_linears(trunk, rows=2):
            return [m.forward.packed if "forward" in m.__dict__ else None for m in trunk]

    first = packs(frozen)
    assert first[1] is None                                   # narrower than _MIN_WIDTH: left plain
    assert packs(frozen)[0] is first[0] and trims == []       # kept: the same packed tensor, nothing freed
    frozen[0].weight.mul_(2)                                  # an in-place change bumps the version counter
    again = packs(frozen)[0]
    assert again is not first[0] and trims == [1]             # packed anew; the stale copy freed, heap trimmed
    x = torch.randn(2, 64)
    with packed_linears(frozen, rows=2):
        torch.testing.assert_close(frozen[0](x), nn.functional.linear(x, frozen[0].weight, frozen[0].bias))
    other = nn.Sequential(nn.Linear(64, 64)).requires_grad_(False)
    packs(other)
    assert list(packed_weights._KEPT) == [other] and trims == [1, 1]  # one trunk's copies kept at a time


@torch.no_grad()
def test_a_trainable_trunk_is_packed_anew_every_call_and_the_heap_left_as_it_is(monkeypatch):
    trims = []
    monkeypatch.setattr(packed_weights, "_trim_heap", lambda: trims.append(1))
    trunk = nn.Sequential(nn.Linear(64, 64))
    with packed_linears(trunk, rows=2):
        first = trunk[0].forward.packed
    with packed_linears(trunk, rows=2):
        assert trunk[0].forward.packed is not first
    # the freed copies' memory is what the update's activations reuse next: no trim (faults it in again)
    assert trims == [] and packed_weights._KEPT[trunk] == {}
    frozen_then_trained = nn.Sequential(nn.Linear(64, 64)).requires_grad_(False)
    with packed_linears(frozen_then_trained, rows=2):
        pass
    frozen_then_trained.requires_grad_(True)
    frozen_then_trained[0].weight.mul_(2)  # a training step
    with packed_linears(frozen_then_trained, rows=2):  # packed anew, its stale kept copy dropped: trimmed
        pass
    assert trims == [1] and packed_weights._KEPT[frozen_then_trained] == {}


def test_nothing_is_packed_while_gradients_are_recorded():
    trunk = nn.Sequential(nn.Linear(64, 64))
    with packed_linears(trunk, rows=2):
        assert "forward" not in trunk[0].__dict__


def test_the_decode_loop_samples_the_same_tokens_with_packed_weights(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_train.generation import decode_loop

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=1)).eval()
    prompt = torch.tensor([[1, 1, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (prompt != 1).long()

    def sample():
        torch.manual_seed(1)
        return decode_loop.sample_with_cache(lm, prompt, mask, max_new_tokens=6, eos_token_id=0, pad_token_id=1,
                                             num_samples=2)

    rows, real = [], decode_loop.packed_linears
    monkeypatch.setattr(decode_loop, "packed_linears", lambda trunk, n: rows.append(n) or real(trunk, n))
    tokens, log_probs, _ = sample()
    assert rows == [4]  # the decode steps of 2 prompts x 2 samples
    monkeypatch.setattr(decode_loop, "packed_linears", lambda trunk, n: contextlib.nullcontext())
    tokens0, log_probs0, _ = sample()
    assert torch.equal(tokens, tokens0)
    torch.testing.assert_close(log_probs, log_probs0, rtol=1e-5, atol=1e-6)
