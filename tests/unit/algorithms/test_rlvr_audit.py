"""The critic-free audit against TRL and verl (the RLVR issue, deliverable 5), one test or more per defect.
Each test here failed on the code before its fix.

1. top-k / top-p: every log-prob (the sampler's, π_old, the update's π) is under the temperature alone, so
   ``algorithm=grpo algorithm.beta>0 rollout.top_k=...`` trains (it stopped at iteration 1: a sampled token
   left the top-k set after one step, log π = −inf, k3 = NaN, every minibatch skipped) and the first ratio is 1.
2. GRPO's KL term: plain k3 (verl) or weighted by π / π_old (``algorithm.kl_ratio_weighted``: DeepSeek-V3.2,
   TRL's ``use_bias_correction_kl``), by hand (which KL each one's gradient follows: tests/unit/core/test_rlvr_math.py).
3. ``rollout.score_clip`` defaults to the algorithm's (TRL's GRPO and RLOO clip nothing; PPO and REINFORCE++
   clip at 10, as torchrl and OpenRLHF), the reward-model recipes keep the 10 they were measured with; GSPO's
   sequence ratio with a loss that sums token terms warns in one line, as TRL does.
4. The estimators (GRPO, RLOO, REINFORCE++-baseline) read ``Rollout.unscored``: a row no source scored is out of
   its group's statistics with advantage 0, by hand (the functions: tests/unit/core/test_rlvr_math.py).

Budget: ~15 s on 2 CPU cores.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from rlhf_train.core.sampling import SamplingParams, inverse_cdf_sample, process_logits
from tests.helpers.reliability import make_cfg


# --------------------------------------------------------------------------- 1. top-k / top-p: the temperature alone
def test_sample_filtered_draws_inside_the_filter_and_records_the_temperature_log_prob():
    from rlhf_train.core.sampling import sample_filtered

    # logits (2, 1, 0, -1) at temperature 0.5: z = (4, 2, 0, -2); top-k 2 keeps tokens 0 and 1
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    torch.manual_seed(0)
    tokens, log_probs = sample_filtered(logits, SamplingParams(0.5, top_k=2))
    assert set(tokens.tolist()) == {0, 1}
    # log softmax(z) = z − log(e⁴ + e² + 1 + e⁻²): token 0 → 4 − 4.1451 = −0.1451, token 1 → −2.1451
    lse = math.log(math.exp(4) + math.exp(2) + 1 + math.exp(-2))
    want = torch.where(tokens == 0, 4 - lse, 2 - lse)
    torch.testing.assert_close(log_probs, want.float(), atol=1e-6, rtol=0)
    # the draws are those of the filtered distribution, e⁴ / (e⁴ + e²) = 0.8808 for token 0
    assert (tokens == 0).float().mean().item() == pytest.approx(0.8808, abs=0.02)
    # and the same tokens as before the fix (the same uniforms), only the recorded log-prob changed
    torch.manual_seed(0)
    assert torch.equal(inverse_cdf_sample(torch.softmax(process_logits(logits, 0.5, 2), -1)), tokens)


def test_hf_generate_sampler_records_the_temperature_log_prob():
    from rlhf_train.generation.hf_generate import InverseCDFSampler

    scores = torch.tensor([[3.0, 1.0, 0.5, 0.0, -2.0]]).repeat(64, 1)
    sampler = InverseCDFSampler(temperature=0.7, top_p=0.5)
    torch.manual_seed(0)
    out = sampler(None, scores.clone())
    tokens = out.argmax(-1)
    assert set(tokens.tolist()) == {0}  # top-p 0.5: the likeliest token alone (p = 0.92 at τ = 0.7)
    want = torch.log_softmax(scores / 0.7, -1)[:, 0]
    torch.testing.assert_close(sampler.log_probs[0], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("sampling", ["rollout.top_k=20", "rollout.top_p=0.7"])
def test_grpo_with_kl_in_the_loss_and_a_sampling_filter_trains(tmp_path, sampling):
    from rlhf_train.loop.trainer import train

    # the defect's command: every minibatch skipped (NaN k3), the run stopped in iteration 1
    cfg = make_cfg("algorithm=grpo", "rollout.num_samples=4", "update.minibatch_size=8", "algorithm.beta=0.04",
                   sampling, "optimizer.lr=1e-3", "trainer.num_iterations=3", "trainer.checkpoint_every=100",
                   "trainer.samples_every=100")
    out = train(cfg, tmp_path)
    for h in out["history"]:
        assert h["faults/skipped_updates"] == 0
        assert math.isfinite(h["policy/approx_kl"]) and math.isfinite(h["loss/kl"])
        assert h["val/first_ratio"] == pytest.approx(1.0, abs=1e-5)  # the sampler's log-probs: the update's


# --------------------------------------------------------------------------- 2. the KL term: plain or ratio-weighted
@pytest.mark.parametrize("weighted", [False, True])
def test_grpo_kl_term_plain_or_weighted_by_the_ratio(weighted):
    from rlhf_train.algorithms import critic_free
    from rlhf_train.algorithms.base import PolicyOutput
    from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
    from rlhf_train.core.containers import Masks, Rollout

    cfg = AlgorithmConfig(name="grpo", loss_agg="seq_mean_token_mean", kl_in_reward=False, beta=0.5,
                          kl_ratio_weighted=weighted)
    algo = critic_free.grpo(cfg, UpdateConfig(), group_size=2, max_new_tokens=2)
    mask = torch.tensor([[True, True], [True, False]])
    mb = Rollout(masks=Masks(response=mask, batch_size=[2]), advantage=torch.zeros(2, 2),
                 sample_log_prob=torch.tensor([[-math.log(2.0), 0.0], [0.0, 0.0]]),  # π_old(0, 0) = 1/2
                 ref_log_prob=torch.tensor([[-math.log(2.0), 0.0], [0.0, 0.0]]), batch_size=[2])
    loss, stats = algo.loss(PolicyOutput(torch.zeros(2, 2), None, None), mb)  # π = 1 everywhere
    # token (0, 0): k3 with log π − log π_ref = log 2: 1/2 − 1 + log 2 = 0.193147, and π/π_old = 2 there;
    # per sequence (0.193147 [× 2]) / 2 and 0 -> mean over the 2 sequences: 0.048287 (plain), 0.096574 (weighted)
    k3 = (0.5 - 1 + math.log(2.0)) * (2 if weighted else 1)
    assert stats["loss/kl"].item() == pytest.approx(k3 / 4, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3 / 4, rel=1e-6)  # the policy term is 0 (advantage 0)


# --------------------------------------------------------------------------- 3. defaults per algorithm, warnings
@pytest.mark.parametrize("algorithm, clip", [("ppo", 10.0), ("grpo", None), ("rloo", None), ("reinforce_pp", 10.0),
                                             ("reinforce_pp_baseline", 10.0)])
def test_score_clip_default_is_the_algorithms(algorithm, clip):
    from tests.helpers.config import compose

    cfg = compose([f"algorithm={algorithm}"])
    assert cfg.rollout.score_clip == clip and cfg.transforms.score_clip.clip == clip  # TRL's GRPO / RLOO: no clip
    assert compose([f"algorithm={algorithm}", "rollout.score_clip=3"]).transforms.score_clip.clip == 3


@pytest.mark.parametrize("recipe", ["default", "sentiment_grpo", "sentiment_rloo"])
def test_the_reward_model_recipes_keep_the_clip_they_were_measured_with(recipe):
    from tests.helpers.config import compose

    assert compose([f"+recipe={recipe}"]).rollout.score_clip == 10.0


@pytest.mark.parametrize("loss_agg, warns", [("token_mean", True), ("seq_mean_token_sum_norm", True),
                                             ("seq_mean_token_mean", False)])
def test_gspo_with_a_token_sum_aggregation_warns(loss_agg, warns, caplog):
    from rlhf_train.algorithms import critic_free
    from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig

    cfg = AlgorithmConfig(name="grpo", kl_in_reward=False, ratio_level="sequence", loss_agg=loss_agg)
    with caplog.at_level(logging.WARNING, logger="rlhf_train.algorithms.critic_free"):
        critic_free.grpo(cfg, UpdateConfig(), group_size=2, max_new_tokens=4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == int(warns)
    if warns:
        assert f"algorithm.ratio_level=sequence with algorithm.loss_agg={loss_agg}" in lines[0]
        assert "set algorithm.loss_agg=seq_mean_token_mean" in lines[0]


# --------------------------------------------------------------------------- 4. rows no source scored
def test_the_estimators_read_the_rollouts_unscored_rows():
    from rlhf_train.algorithms.critic_free import GroupNormalized, LeaveOneOut, ReinforcePP
    from rlhf_train.core.containers import Masks, Rollout

    # one group of three, responses of 2 tokens, the score at the last; row 1 unscored
    mask = torch.ones(3, 2, dtype=torch.bool)
    done = torch.tensor([[False, True]] * 3)
    score = torch.tensor([1.0, 0.0, 3.0])
    reward = torch.zeros(3, 2).masked_scatter(done, score)
    ro = Rollout(masks=Masks(response=mask, batch_size=[3]), reward=reward, reward_raw=reward.clone(),
                 done=done, score=score, sample_log_prob=torch.zeros(3, 2), unscored=torch.tensor([False, True, False]),
                 batch_size=[3])
    s = 1 / math.sqrt(2)
    adv, _ = GroupNormalized(3)(ro)
    torch.testing.assert_close(adv, torch.tensor([[-s, -s], [0, 0], [s, s]]), atol=1e-5, rtol=0)
    adv, _ = LeaveOneOut(3)(ro)
    torch.testing.assert_close(adv, torch.tensor([[-2.0, -2.0], [0, 0], [2, 2]]))
    # REINFORCE++-baseline: scores centred on the scored mean 2 -> returns-to-go (-1, -1) and (1, 1); whitened
    # over the 4 tokens of the scored rows: mean 0, unbiased variance 4 / 3 -> ∓0.866025; the unscored row 0
    adv, _ = ReinforcePP(1.0, group_size=3)(ro)
    w = 1 / math.sqrt(4 / 3)
    torch.testing.assert_close(adv, torch.tensor([[-w, -w], [0, 0], [w, w]]), atol=1e-5, rtol=0)
