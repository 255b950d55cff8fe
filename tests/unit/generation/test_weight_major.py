"""The decode loop's weight-major linears (rlhf_train/generation/weight_major.py): ``(W @ xᵀ)ᵀ`` gives
``nn.functional.linear``'s results (with and without a bias, for 2-D, 3-D and transposed inputs), narrow layers and
other dtypes are left as they are, nothing changes while gradients are recorded, the layers are restored
afterwards, and the decode loop samples the same tokens and log-probs with and without it.

Budget: ~2 s on 2 CPU cores.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from rlhf_train.generation.weight_major import weight_major_linears


@torch.no_grad()
def test_the_weight_major_product_equals_the_linear_and_the_layers_are_restored_afterwards():
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False), nn.Linear(64, 32))
    x3, x2 = torch.randn(3, 1, 64), torch.randn(64, 5).T          # [3, 1, 64]; [5, 64], transposed memory
    plain3, plain2 = trunk(x3), trunk(x2)
    calls = []
    real_mm = torch.mm
    with weight_major_linears(trunk):
        assert ["forward" in m.__dict__ for m in trunk] == [True, True, False]  # 32 wide: left plain
        torch.mm = lambda *a: calls.append(1) or real_mm(*a)
        try:
            out3, out2 = trunk(x3), trunk(x2)
        finally:
            torch.mm = real_mm
    assert len(calls) == 2  # the bias-free layer, twice (the others: addmm, and the plain 32-wide layer)
    assert out3.shape == plain3.shape and out2.shape == plain2.shape
    torch.testing.assert_close(out3, plain3, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out2, plain2, rtol=1e-6, atol=1e-6)
    assert not any("forward" in m.__dict__ for m in trunk)
    torch.testing.assert_close(trunk(x3), plain3, rtol=0, atol=0)


def test_nothing_changes_while_gradients_are_recorded_or_off_float32():
    trunk = nn.Sequential(nn.Linear(64, 64))
    with weight_major_linears(trunk):
        assert "forward" not in trunk[0].__dict__
    with torch.no_grad(), weight_major_linears(trunk.double()):
        assert "forward" not in trunk[0].__dict__


def test_the_decode_loop_samples_the_same_tokens_with_weight_major_linears(monkeypatch):
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

    swapped, real = [], decode_loop.weight_major_linears

    def counting(trunk):
        swapped.append(sum(1 for m in trunk.modules() if isinstance(m, nn.Linear) and min(m.weight.shape) >= 64))
        return real(trunk)

    monkeypatch.setattr(decode_loop, "weight_major_linears", counting)
    tokens, log_probs, _ = sample()
    assert swapped == [10]  # q, o, gate, up, down of each of the 2 layers (k and v: 2 heads x 16 = 32 wide)
    monkeypatch.setattr(decode_loop, "weight_major_linears", lambda trunk: contextlib.nullcontext())
    tokens0, log_probs0, _ = sample()
    assert torch.equal(tokens, tokens0)
    torch.testing.assert_close(log_probs, log_probs0, rtol=1e-5, atol=1e-6)
