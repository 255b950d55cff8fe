"""Shared by the packing and gradient-checkpointing tests: tiny GPT-2 / Llama policies, a rollout of very
unequal lengths and the algorithm's loss and gradients on it."""
from __future__ import annotations

import functools
import math

import torch

from tests.helpers.reliability import make_cfg

V, P, T = 64, 20, 180
# (prompt tokens, response tokens) per row: sequences of 4 to 200 tokens
LENGTHS = [(4, 180), (20, 3), (1, 100), (10, 1), (3, 50), (15, 7), (2, 2)]
GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 256}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def policy_of(arch: dict, lora: dict | None = None):
    from rlhf_train.models.policy import build_policy

    torch.manual_seed(0)
    policy = build_policy(config={**arch, "vocab_size": V, "eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 1},
                          lora=lora)
    torch.nn.init.normal_(policy.value_head.summary.weight, std=0.1)  # non-zero values and value gradients
    return policy.eval()


def unequal_rollout(lengths=LENGTHS, groups=None):
    """Left-padded prompts, right-padded responses of the given lengths, every field the losses read.
    ``groups`` (one id per row): rows of one id get the prompt of its first row (their prompt lengths agree)."""
    from rlhf_train.core.containers import Masks, Rollout, Tokens

    B = len(lengths)
    g = torch.Generator().manual_seed(0)
    plen, rlen = torch.tensor([p for p, _ in lengths]), torch.tensor([r for _, r in lengths])
    prompt_mask = torch.arange(P)[None] >= (P - plen)[:, None]
    response_mask = torch.arange(T)[None] < rlen[:, None]
    full_mask = torch.cat([prompt_mask, response_mask], 1)
    full = torch.randint(2, V, (B, P + T), generator=g)
    for b, group in enumerate(groups or []):
        full[b, :P] = full[list(groups).index(group), :P]
    full = full.masked_fill(~full_mask, 1)
    noise = lambda: torch.randn(B, T, generator=g).masked_fill(~response_mask, 0.0)  # noqa: E731
    return Rollout(
        tokens=Tokens(prompt=full[:, :P], response=full[:, P:], full=full, batch_size=[B]),
        masks=Masks(prompt=prompt_mask, response=response_mask, full=full_mask, batch_size=[B]),
        sample_log_prob=(noise() * 0.1 - math.log(V)).masked_fill(~response_mask, 0.0),
        ref_log_prob=(noise() * 0.1 - math.log(V)).masked_fill(~response_mask, 0.0),
        values=noise(), advantage=noise(), returns=noise(), reward=noise(), batch_size=[B])


@functools.lru_cache(maxsize=None)
def algorithm(name: str):
    from rlhf_train.loop.build import decide

    extra = ["algorithm.kl_in_reward=false", "algorithm.beta=0.1", "rollout.num_samples=2",
             "algorithm.loss_agg=seq_mean_token_mean"] if name == "grpo" else []
    d = decide(make_cfg(f"algorithm={name}", "update.ent_coef=0.01", *extra))
    return d.algorithm, d.sampling


def loss_and_grads(policy, rollout, name: str, packed: bool):
    from rlhf_train.algorithms.update import policy_forward

    algo, sampling = algorithm(name)
    policy.zero_grad(set_to_none=True)
    out = policy_forward(policy, rollout, sampling, with_entropy=True, packed=packed)
    loss, _ = algo.loss(out, rollout)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def assert_same(reference, other):
    """``(loss, {name: grad})`` pairs agree: the loss and every parameter's gradient to 1e-5 relative."""
    (loss0, grads0), (loss1, grads1) = reference, other
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
    assert grads0.keys() == grads1.keys() and grads0
    for name, g0 in grads0.items():
        assert (grads1[name] - g0).norm() <= 1e-5 * g0.norm() + 1e-12, name
