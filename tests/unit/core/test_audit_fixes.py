"""Issue 12, item 7: the defects an audit against torchrl 0.14.1 and TRL found, one test (or more) each.

Every test here failed on the code before the fix (checked by running this file against that tree).

1. The reference scores under the temperature only, never under its own top-k / top-p filter (as TRL
   and torchrl do): a sampled token outside the reference's filtered set would get log π_ref = −inf.
2. The EOS penalty runs after the reference baseline: a response without EOS gets exactly ``penalty``.
3. Masked reductions ignore whatever sits outside the mask (−inf log-probs at padding gave NaN stats).
4. ``core.masked.global_masked_whiten``: a two-pass float64 variance (mean 300, std 0.1 gave std 1.23).
5. Reward models get right-padded sequences, as torchrl's ``GPT2RewardModel`` interface assumes.

Budget: ~10 s on 2 CPU cores.
"""
import copy
import math
import threading

import pytest
import torch
from tensordict import TensorDict
from transformers import GPT2Config, GPT2Model

from rlhf_train.core.losses import policy_loss
from rlhf_train.core.masked import (
    global_masked_whiten,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlhf_train.models.policy import build_policy
from rlhf_train.models.reward_model import RewardModel
from rlhf_train.models.scoring import sequence_logprobs
from rlhf_train.compat.torchrl_transforms import build_transform_stack
from rlhf_train.compat.torchrl import RolloutFromModel

V, EOS, PAD, H = 64, 0, 1, 32


def gpt2_config(**kw):
    return GPT2Config(vocab_size=V, n_layer=2, n_embd=H, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, **kw)


def tiny_policy(seed=0):
    torch.manual_seed(seed)  # initializer_range 0.1: logits spread enough for top-k / top-p to matter
    return build_policy(config=dict(vocab_size=V, n_layer=2, n_embd=H, n_head=2, n_positions=64, eos_token_id=EOS,
                                    bos_token_id=EOS, pad_token_id=PAD, initializer_range=0.1)).eval()


def drifted_copy(lm, rel=0.05, seed=1):
    """A frozen copy of ``lm`` with every weight moved by ``rel`` of itself (Gaussian): one "update" away."""
    ref = copy.deepcopy(lm).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(1 + rel * torch.randn(p.shape, generator=g))
    return ref


def left_padded_prompts(B, P, seed=0):
    """``input_ids`` / ``attention_mask`` ``[B, P]``: tokens in ``[2, V)`` (never EOS or PAD), lengths 2..P."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, P), generator=g)
    lengths = torch.randint(2, P + 1, (B,), generator=g)
    lengths[0], lengths[1] = P, 2
    mask = torch.arange(P)[None] >= (P - lengths)[:, None]
    return {"input_ids": ids.masked_fill(~mask, PAD), "attention_mask": mask.long()}


# --------------------------------------------------------------------------- 1. reference: temperature only
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 5, 1.0), (1.0, 0, 0.6), (0.7, 5, 0.9)])
def test_reference_logprobs_ignore_top_k_top_p(temperature, top_k, top_p):
    policy = tiny_policy()
    ref = drifted_copy(policy.lm)
    torch.manual_seed(2)
    rm = RewardModel(GPT2Model(gpt2_config()), H).eval()
    rollout = RolloutFromModel(policy, ref, rm, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD,
                               temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(0)
    td = rollout.rollout_from_data(left_padded_prompts(16, 6))
    full, full_mask, mask = td["tokens", "full"], td["masks", "full"], td["masks", "response"]
    P = full.shape[1] - mask.shape[1]
    # the defect's trigger is there: sampled tokens (a few of ~160) outside the reference's own filtered set
    filtered = sequence_logprobs(ref, full, full_mask, P, temperature, top_k, top_p)
    assert torch.isinf(filtered[mask]).any(), "no sampled token outside the reference's top-k / top-p: no test"

    ref_lp = td["ref_log_probs", "response"]
    assert torch.isfinite(ref_lp[mask]).all()
    expected = sequence_logprobs(ref, full, full_mask, P, temperature)  # top_k=0, top_p=1
    torch.testing.assert_close(ref_lp[mask], expected[mask], atol=1e-5, rtol=0)
    assert torch.isfinite(td["kl_per_sequence"]).all() and torch.isfinite(td["next", "reward"]).all()


# --------------------------------------------------------------------------- 2. EOS penalty after the baseline
@pytest.fixture(scope="module")
def default_transforms():
    from tests.helpers.config import compose

    cfg = compose(["transforms.eos_penalty.penalty=-1", "rollout.score_clip=5.0", "kl_controller=constant",
                   "kl_controller.kl_coef=0.1"])
    return cfg.transforms


def test_missing_eos_gets_exactly_the_penalty(default_transforms):
    # row 0: [5, EOS, pad] ends at EOS; row 1: [7, 8, 9] has no EOS. Reference scores 0.5 and −2.
    response = torch.tensor([[5, EOS, PAD], [7, 8, 9]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    prompt, prompt_mask = torch.tensor([[3, 4], [PAD, 6]]), torch.tensor([[True, True], [False, True]])
    done = torch.tensor([[False, True, False], [False, False, True]])
    td = TensorDict({
        "tokens": {"prompt": prompt, "response": response, "full": torch.cat([prompt, response], 1)},
        "masks": {"prompt": prompt_mask, "response": mask, "full": torch.cat([prompt_mask, mask], 1)},
        "log_probs": {"response": torch.full((2, 3), -1.0)}, "kl_coef": torch.full((2,), 0.1),
        "next": {"score": torch.tensor([2.0, 3.0]), "score_ref": torch.tensor([0.5, -2.0]), "done": done},
    }, batch_size=[2])
    stack = build_transform_stack(default_transforms, eos_token_id=EOS,
                                  ref_log_prob_fn=lambda full, full_mask, prompt_len: torch.full((2, 3), -1.0))
    td = stack(td)
    # row 0: clip(2 − 0.5) = 1.5; row 1: the penalty itself, not clip(−1 − (−2)) = +1
    assert td["next", "score"].tolist() == [1.5, -1.0]
    assert td["next", "reward_raw"][1].tolist() == [0.0, 0.0, -1.0]  # paid at the done step
    assert [type(getattr(t, "entry", t)).__name__ for t in stack.transforms][:3] == [
        "ReferenceBaseline", "MissingEOSPenalty", "ScoreClip"]


# --------------------------------------------------------------------------- 3. −inf outside the mask
def _ppo_inputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    old = (-torch.rand(3, 5, generator=g) * 3).masked_fill(~mask, 0.0)  # the rollout stores 0 there
    new = old + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g).masked_fill(~mask, 0.0)
    return new, old, adv, mask


@pytest.mark.parametrize("outside_old", [0.0, -math.inf])
def test_policy_loss_ignores_inf_outside_the_mask(outside_old):
    """Pad ≠ EOS with top-k: the pad token at padding positions is outside the top-k set, log π = −inf."""
    new, old, adv, mask = _ppo_inputs()
    stats_ref = {}
    losses, grads = [], []
    for outside_new, o_old, o_adv in [(0.0, 0.0, 0.0), (-math.inf, outside_old, math.nan)]:
        lp = new.masked_fill(~mask, outside_new).requires_grad_(True)
        loss, stats = policy_loss(lp, old.masked_fill(~mask, o_old), adv.masked_fill(~mask, o_adv), mask, 0.2)
        loss.backward()
        losses.append(loss.detach())
        grads.append(lp.grad)
        stats_ref = stats_ref or stats
        for name, value in stats.items():
            assert torch.isfinite(value), name
            assert torch.equal(value, stats_ref[name]), name
    assert torch.isfinite(losses[1]) and torch.equal(losses[0], losses[1])
    assert torch.isfinite(grads[1]).all() and torch.equal(grads[0], grads[1])
    assert (grads[1][~mask] == 0).all()


def _old_whiten(x, mf, shift_mean=True, eps=1e-8):
    """The reductions as they were, with ``x * mask``: the bits to keep where the inputs are finite."""
    def mean(v):
        return (v * mf).sum() / mf.sum().clamp(min=1)
    mu = mean(x)
    n = mf.sum()
    var = mean((x - mu) ** 2) * n / (n - 1).clamp(min=1)
    out = (x - mu) * torch.rsqrt(var + eps)
    return (out + mu if not shift_mean else out) * mf


def test_masked_reductions_ignore_non_finite_and_keep_finite_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g) * 5
    mask = torch.rand(6, 9, generator=g) > 0.3
    mask[3] = False  # an empty row
    k = int((~mask).sum())
    bad = x.clone()
    bad[~mask] = torch.tensor([math.inf, -math.inf, math.nan])[torch.arange(k) % 3]
    for m in (mask, mask.float()):
        mf = m.float()
        # bit for bit what x * mask gave on finite inputs
        assert torch.equal(masked_sum(x, m), (x * mf).sum())
        assert torch.equal(masked_sum(x, m, dim=1), (x * mf).sum(1))
        assert torch.equal(masked_mean(x, m, dim=1), (x * mf).sum(1) / mf.sum(1).clamp(min=1))
        for shift in (True, False):
            assert torch.equal(masked_whiten(x, m, shift), _old_whiten(x, mf, shift))
        # and the same values whatever sits outside the mask
        assert torch.equal(masked_sum(bad, m, dim=1), masked_sum(x, m, dim=1))
        assert torch.equal(masked_mean(bad, m), masked_mean(x, m))
        assert torch.equal(masked_var(bad, m), masked_var(x, m))
        for shift in (True, False):
            assert torch.equal(masked_whiten(bad, m, shift), masked_whiten(x, m, shift))


# --------------------------------------------------------------------------- 4. global whitening
def _whitened_stats(out, mask):
    v = out[mask].double()
    return float(v.mean()), float(v.std())  # unbiased, as the whitening


def test_global_whiten_large_mean_small_std():
    g = torch.Generator().manual_seed(0)
    x = 300.0 + 0.1 * torch.randn(64, 48, generator=g)
    mask = torch.rand(64, 48, generator=g) > 0.2
    out = global_masked_whiten(x, mask)
    assert out.dtype == torch.float32 and (out[~mask] == 0).all()
    mean, std = _whitened_stats(out, mask)
    assert abs(mean) < 1e-3 and abs(std - 1.0) < 1e-3, (mean, std)


def test_global_whiten_hand_worked_and_non_finite_outside():
    x = torch.tensor([[1.0, 2.0, 3.0, 999.0], [5.0, 9.0, math.nan, -math.inf]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    # masked entries 1, 2, 3, 5, 9: n = 5, mean 20 / 5 = 4; deviations −3, −2, −1, 1, 5;
    # Σ squares = 9 + 4 + 1 + 1 + 25 = 40; unbiased var = 40 / 4 = 10 → (x − 4) / √10, 0 outside
    s = math.sqrt(10.0)
    expected = torch.tensor([[-3 / s, -2 / s, -1 / s, 0.0], [1 / s, 5 / s, 0.0, 0.0]])
    torch.testing.assert_close(global_masked_whiten(x, mask), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(global_masked_whiten(x, mask.float()), expected, atol=1e-6, rtol=0)
    # nothing masked: all zeros, no NaN
    assert torch.equal(global_masked_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))


def _run_processes(xs, masks):
    """``global_masked_whiten`` on each (x, mask) in its own thread, as one process each: the
    ``all_reduce_sum`` of every "process" returns the sum of all of them (a barrier per call)."""
    n = len(xs)
    barrier, slots, outs, errors = threading.Barrier(n), [None] * n, [None] * n, []

    def all_reduce_sum_of(rank):
        def all_reduce_sum(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()  # everyone has read before a slot is written again
            return total
        return all_reduce_sum

    def work(rank):
        try:
            outs[rank] = global_masked_whiten(xs[rank], masks[rank], all_reduce_sum_of(rank))
        except BaseException as err:  # surfaced in the main thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return outs


def test_global_whiten_two_processes_equal_one():
    g = torch.Generator().manual_seed(1)
    x = 300.0 + 0.1 * torch.randn(16, 12, generator=g)
    mask = torch.rand(16, 12, generator=g) > 0.25
    x[~mask] = math.nan  # outside the mask: takes no part
    one = global_masked_whiten(x, mask)
    two = _run_processes([x[:10], x[10:]], [mask[:10], mask[10:]])
    torch.testing.assert_close(torch.cat(two), one, atol=1e-5, rtol=0)
    mean, std = _whitened_stats(torch.cat(two), mask)
    assert abs(mean) < 1e-3 and abs(std - 1.0) < 1e-3, (mean, std)


# --------------------------------------------------------------------------- 5. right-padded reward-model input
class EndOfMaskRewardModel(torch.nn.Module):
    """torchrl ``GPT2RewardModel``'s contract, written out: positions 0..L−1, the end score read at
    ``attention_mask.sum(-1) − 1`` (correct for right-padded input only)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.transformer = GPT2Model(gpt2_config())
        self.lm_head = torch.nn.Linear(H, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)[0]
        rewards = self.lm_head(hidden).squeeze(-1)
        return rewards, rewards.gather(1, (attention_mask.long().sum(-1) - 1)[:, None]).squeeze(1)


def torchrl_gpt2_reward_model():
    """torchrl 0.14.1's own ``GPT2RewardModel`` (its forward and end-score rule: the token before the first
    pad id) on a tiny GPT-2 trunk instead of the 124M one its constructor builds."""
    from torchrl.modules.models.llm import GPT2RewardModel

    class TinyGPT2RewardModel(GPT2RewardModel):
        def __init__(self):
            torch.nn.Module.__init__(self)
            torch.manual_seed(3)
            self.transformer = GPT2Model(gpt2_config())
            self.config = self.transformer.config
            self.lm_head = torch.nn.Linear(H, 1, bias=False)
            self.pad_id = PAD

    return TinyGPT2RewardModel()


def never_samples_pad(policy):
    """An untied LM head whose PAD logit is −1e4 (probability 0): PAD then only ever appears as padding,
    which the torchrl model needs (it finds a sequence's end at the first PAD)."""
    lm = policy.lm
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(lm.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[PAD] = -1e4
    lm.config.tie_word_embeddings = False
    lm.set_output_embeddings(head)
    return policy


@pytest.mark.parametrize("make_rm", [EndOfMaskRewardModel, torchrl_gpt2_reward_model])
def test_reward_model_sees_right_padded_sequences(make_rm):
    rm = make_rm().eval()
    policy = never_samples_pad(tiny_policy())
    rollout = RolloutFromModel(policy, drifted_copy(policy.lm), rm, max_new_tokens=8, score_clip=1e6,
                               eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    td = rollout.rollout_from_data(left_padded_prompts(6, 7))
    full, full_mask = td["tokens", "full"], td["masks", "full"]
    assert len(set(full_mask[:, :7].sum(-1).tolist())) > 1  # prompts of different lengths
    assert not (full[full_mask] == PAD).any()
    with torch.no_grad():  # each row's real tokens alone, no padding anywhere
        expected = torch.stack([rm(row[m][None], torch.ones(1, int(m.sum()), dtype=torch.long))[1].reshape(())
                                for row, m in zip(full, full_mask)])
    torch.testing.assert_close(td["next", "score"], expected, atol=1e-5, rtol=0)
