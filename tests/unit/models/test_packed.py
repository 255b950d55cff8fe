"""Packing (rlhf_train/models/packed.py): the packed pass gives the padded pass's loss and gradients.

A batch of very unequal lengths (prompt + response from 4 to 200 tokens), tiny GPT-2 (learned absolute
positions) and Llama (rotary) policies: the algorithm's loss and every parameter's gradient agree to 1e-5
relative (the gradient's norm-wise relative error, ||g_packed - g_padded|| / ||g_padded||, per parameter).

Budget: ~6 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.packing import GPT2, LENGTHS, LLAMA, P, assert_same, loss_and_grads, policy_of, unequal_rollout


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_packed_loss_and_gradients_equal_the_padded_path(arch, name):
    policy, rollout = policy_of(arch), unequal_rollout()
    padded = loss_and_grads(policy, rollout, name, packed=False)
    assert_same(padded, loss_and_grads(policy, rollout, name, packed=True))


def test_packed_lora_gradients_equal_the_padded_path():
    policy, rollout = policy_of(LLAMA, lora={"r": 4, "alpha": 8}), unequal_rollout()
    with torch.no_grad():  # B starts at 0: give the adapter a non-zero output
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    padded = loss_and_grads(policy, rollout, "ppo", packed=False)
    assert any("lora_A" in n for n in padded[1])
    assert_same(padded, loss_and_grads(policy, rollout, "ppo", packed=True))


def test_packed_scoring_equals_the_padded_scoring():
    from rlhf_train.models.packed import packed_sequence_logprobs, token_budget_chunks
    from rlhf_train.models.scoring import sequence_logprobs

    lm, ro = policy_of(GPT2).lm, unequal_rollout()
    full, mask = ro.tokens.full, ro.masks.full
    padded = sequence_logprobs(lm, full, mask, P) * ro.masks.response
    chunks = token_budget_chunks(mask, 210)
    assert sorted(torch.cat(chunks).tolist()) == list(range(len(LENGTHS))) and len(chunks) > 1
    assert all(mask[c].sum() <= 210 for c in chunks)
    packed = torch.zeros_like(padded)
    for rows in chunks:
        packed[rows] = packed_sequence_logprobs(lm, full[rows], mask[rows], P)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert (packed[~ro.masks.response] == 0).all()


def test_check_packing_refuses_a_model_that_mixes_packed_sequences(monkeypatch):
    import transformers.masking_utils as masking_utils

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.models.packed import check_packing

    lm = policy_of(GPT2).lm
    check_packing(lm)  # transformers' masking keeps them apart
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)  # as if it did not
    with pytest.raises(ConfigError, match=r"update.packing=true: the policy \(GPT2LMHeadModel\) lets packed"):
        check_packing(lm)
