"""The reward-shaping stack (rlhf_train/rewards/transforms.py, conf/transforms/default.yaml).

1. each transform against tensors worked out by hand (numbers in the comments);
2. the YAML default stack gives torchrl's ``RolloutFromModel`` reward on the same inputs:
   ``reward_raw = clip(score − score_ref, ±clip)·done``, ``reward_kl = −kl_coef·(log p − log q)``;
3. ``KLConstrainedTransform`` equals the three KL transforms in sequence, and the one-step
   ``KLRewardTransform`` gives the same reward;
4. the transforms are torchrl ``Transform``s: they run inside a ``Compose`` and a ``TransformedEnv``;
5. on two tiny random GPT-2s, the k1 and k3 per-sequence KL estimates agree with the exact KL
   (summed over the vocabulary at every response step) within Monte-Carlo error, and k3 is never < 0.

Budget: ~5 s on 2 CPU cores (the Monte-Carlo test is most of it).
"""
import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs.transforms import Compose, Transform

from rlhf_train.infra.errors import ConfigError
from rlhf_train.compat.torchrl_transforms import (
    KLDivergenceTransform,
    MissingEOSPenalty,
    ReferenceBaseline,
    ReferenceModelLogProbTransform,
    RewardAdjustmentTransform,
    RewardWhitening,
    ScoreClip,
    build_transform_stack,
)
from rlhf_train.compat.torchrl import KLConstrainedTransform, KLRewardTransform

EOS = 0


def close(a, b, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=atol, rtol=0)


def rollout_td():
    """A hand-made rollout of B=2 sequences, P=2 prompt tokens, T=3 response tokens.

    row 0: response [5, EOS, pad] — ends at t=1 (EOS), done at t=1
    row 1: response [7, 8, 9]     — no EOS, truncated at t=2, done at t=2
    """
    response = torch.tensor([[5, EOS, 1], [7, 8, 9]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    prompt = torch.tensor([[3, 4], [1, 6]])
    prompt_mask = torch.tensor([[1, 1], [0, 1]], dtype=torch.bool)
    done = torch.tensor([[0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    return TensorDict({
        "tokens": {"prompt": prompt, "response": response, "full": torch.cat([prompt, response], 1)},
        "masks": {"prompt": prompt_mask, "response": mask, "full": torch.cat([prompt_mask, mask], 1)},
        "log_probs": {"response": torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0]])},
        "kl_coef": torch.tensor([0.1, 0.1]),
        "next": {"score": torch.tensor([2.0, -13.0]), "score_ref": torch.tensor([0.5, -1.0]), "done": done},
    }, batch_size=[2])


# log q of the response tokens, as a reference model would give them (rows × T); 0 past the mask is
# the transform's job
REF = torch.tensor([[-1.5, -1.0, -7.0], [-0.5, -2.0, -1.0]])


def ref_fn(full, full_mask, prompt_len):
    assert full.shape == (2, 5) and full_mask.shape == (2, 5) and prompt_len == 2
    return REF.clone()


# --------------------------------------------------------------------------- 1. one transform at a time
def test_missing_eos_penalty():
    td = MissingEOSPenalty(penalty=-1.0, eos_token_id=EOS)(rollout_td())
    close(td["next", "score"], [2.0, -1.0])  # row 0 has an EOS (kept), row 1 none (→ −1)
    td = MissingEOSPenalty(penalty=None, eos_token_id=EOS)(rollout_td())
    close(td["next", "score"], [2.0, -13.0])  # null penalty: a no-op
    # an EOS id *after* the response mask does not count as an EOS
    td = rollout_td()
    td["tokens", "response"][1, 2] = EOS
    td["masks", "response"][1, 2] = False
    close(MissingEOSPenalty(-1.0, eos_token_id=EOS)(td)["next", "score"], [2.0, -1.0])
    with pytest.raises(ConfigError, match="eos_penalty"):
        MissingEOSPenalty(-1.0)(rollout_td())


def test_reference_baseline_and_score_clip():
    td = ReferenceBaseline()(rollout_td())
    close(td["next", "score"], [1.5, -12.0])  # 2 − 0.5, −13 − (−1)
    td = rollout_td()
    del td["next", "score_ref"]
    close(ReferenceBaseline()(td)["next", "score"], [2.0, -13.0])  # no reference: a no-op
    close(ScoreClip(10.0)(rollout_td())["next", "score"], [2.0, -10.0])
    close(ScoreClip(1.0)(rollout_td())["next", "score"], [1.0, -1.0])
    close(ScoreClip(None)(rollout_td())["next", "score"], [2.0, -13.0])


def test_reference_log_prob_transform():
    td = ReferenceModelLogProbTransform(ref_fn)(rollout_td())
    close(td["ref_log_probs", "response"], [[-1.5, -1.0, 0.0], [-0.5, -2.0, -1.0]])  # 0 past the mask
    # already filled (torchrl's API lets a caller pass log_ratio): left as is, the model is not called
    td = rollout_td()
    td["ref_log_probs", "response"] = torch.zeros(2, 3)
    close(ReferenceModelLogProbTransform(None)(td)["ref_log_probs", "response"], torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="no reference model"):
        ReferenceModelLogProbTransform(None)(rollout_td())


@pytest.mark.parametrize("estimator, expected", [
    # log p − log q on the masked tokens: row 0: (−1 + 1.5, −2 + 1) = (0.5, −1); row 1: (0, 1, −2)
    ("k1", [[0.5, -1.0, 0.0], [0.0, 1.0, -2.0]]),
    # ½ (log p − log q)²
    ("k2", [[0.125, 0.5, 0.0], [0.0, 0.5, 2.0]]),
    # (r − 1) − log r with log r = −(log p − log q): e^{−x} − 1 + x
    ("k3", [[math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, 0.0],
            [0.0, math.exp(-1.0), math.exp(2.0) - 3.0]]),
])
def test_kl_divergence_transform(estimator, expected):
    td = rollout_td()
    td["ref_log_probs", "response"] = REF.masked_fill(~td["masks", "response"], 0.0)
    td = KLDivergenceTransform(estimator)(td)
    close(td["next", "kl"], expected, atol=1e-5)
    close(td["kl_per_sequence"], torch.tensor(expected).sum(-1), atol=1e-5)


def test_kl_divergence_transform_rejects_unknown_estimator():
    with pytest.raises(ConfigError, match="k1, k2, k3"):
        KLDivergenceTransform("k4")


def test_reward_adjustment():
    td = rollout_td()
    td["next", "kl"] = torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, -2.0]])
    td["kl_coef"] = torch.tensor([0.1, 0.2])  # per-row coefficient, read from the rollout
    td = RewardAdjustmentTransform(coef=99.0)(td)  # coef is only the fallback: not used here
    close(td["next", "reward_raw"], [[0.0, 2.0, 0.0], [0.0, 0.0, -13.0]])  # score at the done step
    close(td["next", "reward_kl"], [[-0.05, 0.1, 0.0], [0.0, -0.2, 0.4]])  # −coef · kl
    close(td["next", "reward"], [[-0.05, 2.1, 0.0], [0.0, -0.2, -12.6]])
    del td["kl_coef"]  # inside an env there is no kl_coef entry: the constructor's coef is used
    td = RewardAdjustmentTransform(coef=1.0)(td)
    close(td["next", "reward_kl"], [[-0.5, 1.0, 0.0], [0.0, -1.0, 2.0]])


def test_reward_whitening():
    td = rollout_td()
    td["next", "reward"] = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    close(RewardWhitening(enabled=False)(td.clone())["next", "reward"], td["next", "reward"])
    out = RewardWhitening(enabled=True, shift_mean=True)(td.clone())["next", "reward"]
    # masked entries 1, 2, 3, 4, 5: mean 3, unbiased var 2.5 → (x − 3)/√2.5; 0 outside the mask
    s = math.sqrt(2.5)
    close(out, [[-2 / s, -1 / s, 0.0], [0.0, 1 / s, 2 / s]], atol=1e-5)


def test_configurable_keys():
    """Every transform reads and writes the keys it is given (a TensorDict with other names works)."""
    td = TensorDict({"my_score": torch.tensor([3.0, -3.0]), "lp": torch.tensor([[-1.0, -1.0]] * 2),
                     "lq": torch.tensor([[-2.0, -1.0]] * 2), "m": torch.ones(2, 2, dtype=torch.bool),
                     "d": torch.tensor([[0, 1], [0, 1]], dtype=torch.bool)}, batch_size=[2])
    stack = Compose(
        ScoreClip(2.0, score_key="my_score"),
        KLDivergenceTransform("k1", log_prob_key="lp", ref_log_prob_key="lq", mask_key="m", kl_key="my_kl",
                              kl_per_sequence_key="my_kl_seq"),
        RewardAdjustmentTransform(0.5, score_key="my_score", kl_key="my_kl", done_key="d", reward_key="r",
                                  reward_raw_key="r_raw", reward_kl_key="r_kl"),
    )
    td = stack(td)
    close(td["my_score"], [2.0, -2.0])
    close(td["my_kl"], [[1.0, 0.0]] * 2)
    close(td["my_kl_seq"], [1.0, 1.0])
    close(td["r"], [[-0.5, 2.0], [-0.5, -2.0]])
    assert "next" not in td.keys()


# --------------------------------------------------------------------------- 2. the default stack
def seed_reward(td, clip, coef):
    """torchrl's ``RolloutFromModel.create_rollout_td`` reward, written from its definition."""
    mask = td["masks", "response"]
    score = (td["next", "score"] - td["next", "score_ref"]).clamp(-clip, clip)
    reward_raw = score[:, None] * td["next", "done"]
    log_ratio = (td["log_probs", "response"] - REF).masked_fill(~mask, 0.0)
    reward_kl = -coef * log_ratio
    return reward_raw, reward_kl, reward_raw + reward_kl


@pytest.fixture(scope="module")
def default_cfg():
    from tests.helpers.config import compose

    return compose(["rollout.score_clip=5.0", "kl_controller=constant", "kl_controller.kl_coef=0.1"])


def test_default_yaml_stack_equals_seed_reward(default_cfg):
    stack = build_transform_stack(default_cfg.transforms, ref_log_prob_fn=ref_fn, eos_token_id=EOS)
    # the YAML's product entries (rlhf_train.rewards.shaping), each wrapped as a torchrl transform; the torchrl
    # stack runs the reference pass itself, before the KL entry (the product rollout does it before the stack)
    names = [type(getattr(t, "entry", t)).__name__ for t in stack.transforms]
    assert names == ["ReferenceBaseline", "MissingEOSPenalty", "ScoreClip", "ReferenceModelLogProbTransform",
                     "KLDivergence", "RewardAdjustment", "RewardWhitening"]
    td = stack(rollout_td())
    raw, kl, reward = seed_reward(rollout_td(), clip=5.0, coef=0.1)
    close(td["next", "reward_raw"], raw)   # [[0, 1.5, 0], [0, 0, −5]]
    close(td["next", "reward_kl"], kl)
    close(td["next", "reward"], reward)


def test_yaml_stack_overrides_and_drops(default_cfg):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(default_cfg.transforms, resolve=True)
    cfg["kl"]["estimator"] = "k3"
    cfg["eos_penalty"]["penalty"] = -1.0
    del cfg["whiten"]
    stack = build_transform_stack(cfg, ref_log_prob_fn=ref_fn, eos_token_id=EOS)
    assert type(stack.transforms[-1].entry).__name__ == "RewardAdjustment"
    td = stack(rollout_td())
    close(td["next", "reward_raw"], [[0.0, 1.5, 0.0], [0.0, 0.0, -1.0]])  # row 1: no EOS → the penalty, −1
    assert (td["next", "kl"] >= 0).all()
    cfg["eos_penalty"] = None  # `None` drops an entry, as `~transforms.eos_penalty` does
    assert len(build_transform_stack(cfg).transforms) == 4  # baseline, score_clip, kl, reward
    with pytest.raises(ConfigError, match=r"transforms\.reward"):
        build_transform_stack({"reward": {"_target_": "rlhf_train.compat.torchrl_transforms.RewardAdjustmentTransform",
                                          "coeff": 0.1}})


# --------------------------------------------------------------------------- 3. composite forms
def test_kl_constrained_equals_the_trio_and_kl_reward_transform():
    td = rollout_td()
    td = Compose(ReferenceBaseline(), ScoreClip(10.0))(td)
    trio = Compose(ReferenceModelLogProbTransform(ref_fn), KLDivergenceTransform("k3"),
                   RewardAdjustmentTransform(0.3))(td.clone())
    composite = KLConstrainedTransform(ref_fn, coef=0.3, estimator="k3")(td.clone())
    for key in [("ref_log_probs", "response"), ("next", "kl"), "kl_per_sequence", ("next", "reward_raw"),
                ("next", "reward_kl"), ("next", "reward")]:
        close(composite[key], trio[key])
    # one step: reward ← reward − coef·KL, starting from the score at the done step
    one = td.clone()
    one["next", "reward"] = one["next", "score"][:, None] * one["next", "done"]
    one = KLRewardTransform(ref_fn, coef=0.3, estimator="k3")(one)
    close(one["next", "reward"], trio["next", "reward"])
    close(one["next", "reward_kl"], trio["next", "reward_kl"])
    assert all(isinstance(t, Transform) for t in (KLConstrainedTransform(ref_fn), KLRewardTransform(ref_fn)))


def test_transform_inside_a_torchrl_env():
    """A shaping transform on the env's ``("next", "reward")``, inside torchrl's ``TransformedEnv``."""
    from torchrl.envs import PendulumEnv, TransformedEnv

    torch.manual_seed(0)
    base = PendulumEnv().rollout(5)["next", "reward"]
    torch.manual_seed(0)
    env = TransformedEnv(PendulumEnv(), Compose(ScoreClip(0.5, score_key=("next", "reward"))))
    shaped = env.rollout(5)["next", "reward"]
    assert (base < -0.5).any()
    close(shaped, base.clamp(-0.5, 0.5))


# --------------------------------------------------------------------------- 5. k1 / k3 vs the exact KL
def test_k1_k3_match_exact_kl_on_tiny_models():
    """Sequences x ~ p from the rollout; exact per-sequence KL = Σ_t KL(p(·|x<t) ‖ q(·|x<t)) summed over
    the vocabulary at every response step (one pass of each model). For each t, E[k_t | x<t] = KL_t for
    k1 and k3, so the paired difference (estimate − exact) has mean 0: checked within 4 standard errors."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_train.compat.torchrl import RolloutFromModel

    V, P, T, N, eos = 50, 4, 8, 1000, 3

    def lm(seed):
        torch.manual_seed(seed)
        cfg = GPT2Config(vocab_size=V, n_layer=1, n_embd=32, n_head=2, n_positions=32, initializer_range=0.15,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos)
        return GPT2LMHeadModel(cfg).eval()

    class ZeroRM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask):
            return torch.zeros(input_ids.shape), torch.zeros(input_ids.shape[0])

    p, q = lm(0), lm(1)
    rollout = RolloutFromModel(p, q, ZeroRM(), kl_coef=0.1, max_new_tokens=T, eos_token_id=eos)
    prompt = torch.randint(eos + 1, V, (N, P), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    td = rollout.rollout_from_data({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)})
    td = KLDivergenceTransform("k3", kl_key=("next", "kl3"), kl_per_sequence_key="kl3_per_sequence")(td)
    mask = td["masks", "response"]
    assert (~mask).any() and mask[:, -1].any()  # some responses end at EOS, some run to T

    full, full_mask = td["tokens", "full"], td["masks", "full"]
    with torch.no_grad():
        lp = p(full, attention_mask=full_mask.long()).logits[:, P - 1:-1].log_softmax(-1)
        lq = q(full, attention_mask=full_mask.long()).logits[:, P - 1:-1].log_softmax(-1)
    exact = ((lp.exp() * (lp - lq)).sum(-1) * mask).sum(-1)  # [N]
    assert 1.0 < exact.mean() < 20.0  # a moderate KL (nats per sequence)

    assert (td["next", "kl3"] >= 0).all()
    for est in (td["kl_per_sequence"], td["kl3_per_sequence"]):
        diff = est - exact
        se = diff.std() / math.sqrt(N)
        assert diff.mean().abs() < 4 * se, (est.mean(), exact.mean(), se)
