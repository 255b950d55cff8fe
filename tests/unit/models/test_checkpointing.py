"""``update.gradient_checkpointing`` (rlhf_train/models/policy.py): the policy's layers recompute their
activations in the backward pass, with the trainer's eval mode (dropout off), fully fine-tuned and under LoRA,
and the gradients equal the plain path's.

Budget: ~4 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.packing import GPT2, LLAMA, P, V, loss_and_grads, unequal_rollout


def build(arch: dict, checkpointing: bool, lora: dict | None = None):
    from rlhf_train.models.policy import build_policy

    torch.manual_seed(0)
    # dropout 0.1 in the config: the eval mode the trainer sets must keep it off, checkpointing or not
    policy = build_policy(config={**arch, "vocab_size": V, "eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 1},
                          dropout=0.1, lora=lora, gradient_checkpointing=checkpointing)
    torch.nn.init.normal_(policy.value_head.summary.weight, std=0.1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    return policy.eval()


def mlp_calls(policy) -> list[int]:
    """A counter of the first layer's MLP calls (a submodule: the recomputation in the backward calls it again)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layer = next(m for m in policy.lm.modules() if isinstance(m, GradientCheckpointingLayer))
    calls, forward = [0], layer.mlp.forward

    def counted(*args, **kwargs):  # (forward hooks do not fire in the recomputation)
        calls[0] += 1
        return forward(*args, **kwargs)

    layer.mlp.forward = counted
    return calls


@pytest.mark.parametrize("arch,lora", [(GPT2, None), (LLAMA, None), (LLAMA, {"r": 4, "alpha": 8})],
                         ids=["gpt2", "llama", "llama-lora"])
def test_checkpointing_recomputes_and_gives_the_plain_gradients(arch, lora):
    rollout = unequal_rollout()
    plain, ckpt = build(arch, False, lora), build(arch, True, lora)
    calls_plain, calls_ckpt = mlp_calls(plain), mlp_calls(ckpt)
    for packed in (False, True):
        (loss0, grads0), (loss1, grads1) = (loss_and_grads(p, rollout, "ppo", packed) for p in (plain, ckpt))
        assert torch.equal(loss0, loss1)
        assert grads0.keys() == grads1.keys() and grads0
        for name, g in grads0.items():  # to float32 rounding: on CPU the plain pass runs GQA on the kernel's own
            # enable_gqa (models/attention.py), the checkpointed one as transformers does, both in its recomputation
            torch.testing.assert_close(grads1[name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert calls_plain[0] == 2 and calls_ckpt[0] == 4  # one forward per pass; checkpointed: again in backward
    assert not any(m.training for m in ckpt.modules())  # the layers are back in eval mode
    with torch.no_grad():  # no backward, no recomputation (scoring and generation passes)
        ckpt(rollout.tokens.full, rollout.masks.full, P, labels=rollout.tokens.response)
    assert calls_ckpt[0] == 5
