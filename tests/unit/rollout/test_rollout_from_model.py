"""The product rollout: ``RolloutFromModel(batch, kl_coef=β)`` returns the typed ``Rollout`` directly, with
β carried to the shaping stack and the reference as one object (or none)."""
from __future__ import annotations

import torch

from rlhf_train.core.containers import Rollout
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.generation.decode_loop import DecodeLoopBackend
from rlhf_train.models.loading import build_causal_lm
from rlhf_train.models.policy import build_policy
from rlhf_train.models.reference import frozen_copy
from rlhf_train.rewards.shaping import KLDivergence, RewardAdjustment, build_shaping, stand_in_rollout
from rlhf_train.rewards.sources import FunctionRewardSource
from rlhf_train.rollout.rollout_from_model import RolloutFromModel
from tests.helpers.byo import chat_tokenizer

ARCH = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}


def _rollout(reference: bool, tok):
    torch.manual_seed(0)
    policy = build_policy(tok, config=ARCH)
    ref = frozen_copy(build_causal_lm(None, ARCH, tok), SamplingParams()) if reference else None
    length = FunctionRewardSource(lambda prompts, completions, **_: [float(len(c)) for c in completions], tok)
    backend = DecodeLoopBackend(policy, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=5)
    return RolloutFromModel(policy, backend, ref, {"length": (length, 1.0)},
                            {"kl": KLDivergence("k1"), "reward": RewardAdjustment()},
                            eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id, max_new_tokens=5,
                            num_samples=2)


def _batch(tok):
    ids = torch.randint(4, len(tok), (3, 4))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_the_rollout_is_typed_and_carries_beta_to_the_shaping_stack():
    tok = chat_tokenizer()
    ro = _rollout(True, tok)(_batch(tok), kl_coef=0.25)
    assert type(ro) is Rollout and ro.batch_size[0] == 6  # 3 prompts x 2 samples, adjacent
    assert torch.equal(ro.tokens.prompt[0], ro.tokens.prompt[1])
    mask = ro.masks.response
    assert torch.all(ro.kl_coef == 0.25)
    # k1 per token from the rollout's own log-probs, 0 outside the response; the reward's KL part is -β·kl
    torch.testing.assert_close(ro.kl, (ro.sample_log_prob - ro.ref_log_prob).masked_fill(~mask, 0.0))
    torch.testing.assert_close(ro.reward_kl, -0.25 * ro.kl)
    torch.testing.assert_close(ro.kl_per_sequence, ro.kl.sum(-1))
    # the score is paid once, at the done step
    torch.testing.assert_close(ro.reward_raw.sum(-1), ro.score)
    assert ro.values is not None and ro.values.shape == mask.shape  # a policy with a value head


def test_no_reference_means_no_kl():
    tok = chat_tokenizer()
    ro = _rollout(False, tok)(_batch(tok), kl_coef=0.25)
    assert ro.ref_log_prob is None
    assert torch.all(ro.kl == 0) and torch.all(ro.reward_kl == 0)


def test_default_shaping_stack_on_a_stand_in_rollout():
    """The YAML's default stack (baseline, EOS penalty off, clip 10, k1, reward, no whitening), worked by hand:
    row 0 ends at EOS at t=1, row 1 is cut at t=2; score 1, baseline 0; log p = -1, log q = -2 -> k1 = 1 per
    response token; β = 0.1 -> reward_kl = -0.1 per token; reward = score at the done step + reward_kl."""
    from tests.helpers.config import compose

    transforms = compose([]).transforms
    ro = stand_in_rollout()
    for entry in build_shaping(transforms, eos_token_id=0).values():
        ro = entry(ro)
    assert ro.kl.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    torch.testing.assert_close(ro.reward, torch.tensor([[-0.1, 0.9, 0.0], [-0.1, -0.1, 0.9]]))
