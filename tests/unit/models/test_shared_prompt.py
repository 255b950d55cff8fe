"""Shared-prompt passes (rlhf_train/models/shared_prompt.py, rlhf_train/core/prompt_groups.py): a prompt that
several rows share runs through the trunk once, and every result is the plain pass's to float rounding.

A batch of 8 rows with 3 distinct prompts (4, 20 and 9 tokens; G = 3, 3, 2 samples) and responses of 1 to 180
tokens, tiny GPT-2 (learned absolute positions) and Llama (rotary, grouped keys) models: the loss and every
parameter's gradient of the update's forward (PPO with values, GRPO), the reference's log-probs and three kinds of
reward model agree with ``trainer.shared_prompt=false`` to 1e-5 relative, while the trunk sees 3·20 + 8·180 tokens
instead of 8·200.

Budget: ~10 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.packing import GPT2, LLAMA, P, T, assert_same, loss_and_grads, policy_of, unequal_rollout

LENGTHS = [(4, 180), (4, 3), (4, 100), (20, 1), (20, 50), (20, 7), (9, 2), (9, 30)]
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2]
SHARED_TOKENS, PLAIN_TOKENS = [3 * P, 8 * T], [8 * (P + T)]  # the trunk's input sizes, pass by pass


def grouped_rollout():
    return unequal_rollout(LENGTHS, GROUPS)


def trunk_inputs(model):
    """A list that records the number of tokens of every trunk pass of ``model`` (its input embedding's calls)."""
    sizes: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: sizes.append(args[0].numel()))
    return sizes


def shared_and_plain(model, fn):
    """``(fn() shared, fn() plain)``, and that the trunk ran each prompt once, then every row whole."""
    from rlhf_train.models.shared_prompt import set_shared_prompt

    sizes = trunk_inputs(model)
    shared = fn()
    assert sizes == SHARED_TOKENS
    set_shared_prompt(model, False)
    sizes.clear()
    plain = fn()
    assert sizes == PLAIN_TOKENS
    set_shared_prompt(model, True)
    return shared, plain


def test_prompt_groups_by_hand():
    from rlhf_train.core.prompt_groups import prompt_groups

    # prompts a, a, b, b, a (P = 3; row 4's padding holds another token: the same prompt); row 5: a's tokens with
    # its first one padded away, a prompt of its own
    full = torch.tensor([[0, 5, 6, 9], [0, 5, 6, 8], [7, 7, 7, 9], [7, 7, 7, 9], [3, 5, 6, 1], [0, 5, 6, 2]])
    mask = torch.tensor([[0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2 + [[0, 1, 1, 1], [0, 0, 1, 1]]).bool()
    first, inverse = prompt_groups(full, mask, 3)
    assert first.tolist() == [0, 2, 5] and inverse.tolist() == [0, 0, 1, 1, 0, 2]
    assert inverse.argsort(stable=True).tolist() == [0, 1, 4, 2, 3, 5]  # the update's order: a prompt's rows adjacent
    assert prompt_groups(full[[0, 2, 5]], mask[[0, 2, 5]], 3) is None  # no two rows share a prompt
    assert prompt_groups(full, mask, 0) is None


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_shared_prompt_loss_and_gradients_equal_the_plain_pass(arch, name):
    policy, rollout = policy_of(arch), grouped_rollout()
    shared, plain = shared_and_plain(policy.lm, lambda: loss_and_grads(policy, rollout, name, packed=False))
    assert_same(plain, shared)


def test_shared_prompt_lora_gradients_equal_the_plain_pass():
    policy, rollout = policy_of(LLAMA, lora={"r": 4, "alpha": 8}), grouped_rollout()
    with torch.no_grad():  # B starts at 0: give the adapter a non-zero output
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    shared, plain = shared_and_plain(policy.lm, lambda: loss_and_grads(policy, rollout, "ppo", packed=False))
    assert any("lora_A" in n for n in plain[1])
    assert_same(plain, shared)


def test_reference_log_probs_equal_the_plain_pass():
    from rlhf_train.models.scoring import sequence_logprobs

    lm, ro = policy_of(LLAMA).lm, grouped_rollout()
    shared, plain = shared_and_plain(lm, lambda: sequence_logprobs(lm, ro.tokens.full, ro.masks.full, P))
    torch.testing.assert_close(shared * ro.masks.response, plain * ro.masks.response, rtol=1e-5, atol=1e-6)


def reward_models():
    from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from rlhf_train.models.hf_reward_model import SequenceClassifierRewardModel
    from rlhf_train.models.reward_model import build_reward_model

    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=1,
                        max_position_embeddings=256)
    gpt2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, num_labels=1, pad_token_id=1, n_positions=256,
                      bos_token_id=0, eos_token_id=0)
    return {"hf_llama": SequenceClassifierRewardModel(LlamaForSequenceClassification(llama).eval()),
            "hf_gpt2": SequenceClassifierRewardModel(GPT2ForSequenceClassification(gpt2).eval()),
            "rlhf_train": build_reward_model(config={"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64,
                                                     "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0})}


@pytest.mark.parametrize("kind", ["hf_llama", "hf_gpt2", "rlhf_train"])
def test_reward_model_scores_equal_the_right_padded_pass(kind):
    """The source scores the rollout's own layout with shared prompts; the plain path right-pads every row (what
    these models' forward expects) and runs it whole."""
    from rlhf_train.rewards.sources import RewardModelSource, Sequences

    rm, ro = reward_models()[kind], grouped_rollout()
    source = RewardModelSource(rm, pad_token_id=1)
    trunk = rm.trunk if kind == "rlhf_train" else rm.model
    sizes = trunk_inputs(trunk)
    shared = source(Sequences(ro.tokens.full, ro.masks.full, P, {}))
    assert sizes == SHARED_TOKENS
    sizes.clear()
    plain = source(Sequences(ro.tokens.full, ro.masks.full, None, {}))  # no prompt boundary: every row whole
    assert len(sizes) == 1
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-6)


def test_no_shared_prompt_without_repeats_or_with_checkpointing():
    from rlhf_train.models.policy import enable_checkpointing
    from rlhf_train.models.scoring import sequence_logprobs

    lm, ro = policy_of(LLAMA).lm, grouped_rollout()
    sizes = trunk_inputs(lm)
    rows = [0, 3, 6]  # one row of each prompt
    sequence_logprobs(lm, ro.tokens.full[rows], ro.masks.full[rows], P)
    assert sizes == [3 * (P + T)]
    sizes.clear()
    enable_checkpointing(lm)  # a checkpointed layer would write its keys into the shared cache again
    sequence_logprobs(lm, ro.tokens.full, ro.masks.full, P)
    assert sizes == PLAIN_TOKENS


def test_the_update_puts_a_prompts_samples_in_one_micro_batch():
    """GRPO's rows shuffled into minibatches are ordered by prompt before the split into micro-batches: with 2
    micro-batches of 4 rows for 2 prompts × 4 samples, each micro-batch runs one prompt (the trunk's first pass
    of each micro-batch has 1 row)."""
    from accelerate import Accelerator

    from rlhf_train.algorithms.update import minibatch_update
    from rlhf_train.infra.faults import Faults
    from rlhf_train.loop.build import decide
    from tests.helpers.reliability import make_cfg

    lengths = [(6, 10), (6, 3), (6, 7), (6, 1), (12, 9), (12, 2), (12, 10), (12, 5)]
    rollout = unequal_rollout(lengths, [0, 0, 0, 0, 1, 1, 1, 1])
    d = decide(make_cfg("algorithm=grpo", "rollout.num_samples=4", "update.minibatch_size=8", "update.num_epochs=1",
                        f"update.micro_batch_tokens={4 * (P + T)}"))
    policy = policy_of(GPT2)
    rows: list[int] = []
    policy.lm.get_input_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    minibatch_update(policy, optimizer, scheduler, Accelerator(cpu=True), rollout, d.algorithm, d.sampling, d.update,
                     torch.Generator().manual_seed(0), Faults(3))
    assert rows == [1, 4, 1, 4]  # per micro-batch: its one prompt, then its 4 responses


def test_the_micro_batch_budget_counts_the_tokens_the_trunk_sees():
    """``update.micro_batch_tokens`` bounds a pass's trunk tokens: with shared prompts ``U·P + rows·T``."""
    from types import SimpleNamespace

    from rlhf_train.algorithms.micro_batches import micro_batches
    from rlhf_train.loop.build import decide
    from tests.helpers.reliability import make_cfg

    cfg = decide(make_cfg("update.micro_batch_tokens=800")).update
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    mask, idx = torch.ones(8, P + T, dtype=torch.bool), torch.arange(8)
    assert len(micro_batches(mask, idx, cfg, accelerator)) == 2               # 8 x 200 padded tokens
    assert len(micro_batches(mask, idx, cfg, accelerator, (2, P))) == 2       # 2 x 20 + 8 x 180 = 1480
    assert len(micro_batches(mask, idx[:4], cfg, accelerator, (1, P))) == 1   # 20 + 4 x 180 = 740
    assert len(micro_batches(mask, idx[:5], cfg, accelerator)) == 2           # 5 x 200 = 1000
    assert len(micro_batches(mask, idx[:5], cfg, accelerator, (1, P))) == 2   # 20 + 5 x 180 = 920
