"""``rlhf_train.rollout.rollout_from_model.RolloutFromModel`` against torchrl's, and the guarantees it adds.

1. Same generated tokens, same reward model → the same ``reward_raw``, ``reward_kl``, ``reward``, ``done``
   and ``terminated`` as torchrl's own ``RolloutFromModel.create_rollout_td`` (a tiny random GPT-2 with
   GPT-2's vocabulary, where torchrl's constant ``EOS_TOKEN_ID = 50256`` applies). torchrl's
   ``generate`` / ``_log_ratio`` run under transformers 5: they call the model with ``return_dict=True``
   (it is torchrl's *example* scripts that pass ``return_dict=False``).

   Layouts differ, so the test converts: torchrl keeps a right-padded ``prompt + response`` of width
   ``L + T`` and per-token fields ``[B, T, 1]``; we keep a left-padded prompt ``[B, P]`` + response
   ``[B, T]`` and per-token fields ``[B, T]``.

   Deliberate differences, which the test pins down rather than compares:

   * torchrl's reward-model input masks every EOS (its pad *is* EOS), so the score is read at the
     last token before EOS; ours keeps the EOS as part of the response (N+ details: the reward is read
     at EOS). ``reward_raw`` is compared on responses without EOS only.
   * torchrl sets ``done`` at the last step of *every* row (its ``truncated`` flag is set for all rows),
     so a response that ends at an EOS mid-way is done twice and its score is paid twice; ours is done
     once, at the EOS. ``done`` is compared on steps ``< T-1``.
   * torchrl marks an EOS sampled exactly at the last step as truncated, not terminated; ours
     terminates there.
   * The KL term of the EOS token itself is the same in both: torchrl's KL mask is taken at the
     position that *predicts* a token, so the EOS's log-ratio is kept (only tokens after it are
     dropped), as ours does. ``reward_kl`` is compared on every row, EOS or not.

2. ``process_logits`` (the sampling distribution) equals transformers' Temperature/TopK/TopP warpers.
3. The first PPO ratio is exactly 1 (temperature 0.7, and with top-k 5 / top-p 0.9), through
   ``rlhf_train.algorithms.ppo.PPO.loss`` on the first minibatch of a rollout; the log-probs are those of
   the temperature alone (top-k / top-p pick the tokens, never the log-probs: TRL's and verl's rule).
4. The rollout's ``kl_coef`` is always the KL controller's coefficient, across ``step_scheduler`` calls;
   the adaptive update gets the per-sequence KLs (mean over sequences, ``n_steps`` = sequences).

Budget: ~10 s on 2 CPU cores.
"""
import pytest
import torch
from torchrl.envs.transforms import Compose
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from rlhf_train.core.advantages import gae
from rlhf_train.core.containers import left_pad
from rlhf_train.core.logprob_kernel import logprobs_of_labels
from rlhf_train.core.masked import masked_whiten
from rlhf_train.core.sampling import process_logits
from rlhf_train.models.policy import build_policy, build_reference
from rlhf_train.models.reward_model import RewardModel
from rlhf_train.rewards.kl_controllers import AdaptiveKLController, ConstantKLController
from rlhf_train.compat.torchrl_transforms import (
    KLDivergenceTransform,
    ReferenceModelLogProbTransform,
    RewardAdjustmentTransform,
)
from rlhf_train.compat.torchrl import RolloutFromModel

GPT2_EOS, GPT2_VOCAB = 50256, 50257


def gpt2_config(vocab_size, eos, pad=None, **kw):
    return GPT2Config(vocab_size=vocab_size, n_layer=1, n_embd=32, n_head=2, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, **kw)


def tiny_reward_model(vocab_size, eos, seed=2):
    torch.manual_seed(seed)
    return RewardModel(GPT2Model(gpt2_config(vocab_size, eos)), 32).eval()


def left_padded_prompts(B, P, vocab_size, low, pad, seed=0):
    """``input_ids`` / ``attention_mask`` ``[B, P]``: random tokens in ``[low, V)``, lengths 2..P, left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab_size, (B, P), generator=g)
    lengths = torch.randint(2, P + 1, (B,), generator=g)
    lengths[0] = P
    mask = torch.arange(P)[None] >= (P - lengths)[:, None]
    return {"input_ids": ids.masked_fill(~mask, pad), "attention_mask": mask.long()}


# --------------------------------------------------------------------------- 1. torchrl equivalence
def test_matches_torchrl_rollout_from_model():
    from torchrl.data.llm import PromptData
    from torchrl.data.llm import RolloutFromModel as TorchRLRollout

    EOS, T, B, L = GPT2_EOS, 6, 4, 12
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(gpt2_config(GPT2_VOCAB, EOS)).eval()
    ref = GPT2LMHeadModel(gpt2_config(GPT2_VOCAB, EOS)).eval()
    rm = tiny_reward_model(GPT2_VOCAB, EOS)

    # torchrl's PromptData: prompt + reference ('label') continuation, right-padded with EOS
    g = torch.Generator().manual_seed(0)
    rindex = torch.tensor([4, 7, 5, 8])               # prompt lengths
    label_len = torch.tensor([3, 2, 4, 4])
    pos = torch.arange(L)[None]
    attn = pos < (rindex + label_len)[:, None]
    ids = torch.randint(0, 50000, (B, L), generator=g).masked_fill(~attn, EOS)
    labels = torch.where((pos >= rindex[:, None]) & attn, ids, -100)
    batch = PromptData(input_ids=ids, attention_mask=attn.long(), prompt_rindex=rindex, labels=labels,
                       batch_size=[B])

    theirs = TorchRLRollout(policy, ref, rm, kl_coef=0.2, max_new_tokens=T, score_clip=10.0)
    torch.manual_seed(0)
    generated, log_probs, log_ratio = theirs.generate(batch)  # [B, L+T] right-padded
    assert generated.shape == (B, L + T) and log_ratio.shape == (B, T)

    # our layout: left-padded prompt [B, P] + response [B, T]
    def ours_full(generated_right):
        response = generated_right.gather(1, rindex[:, None] + torch.arange(T)[None])
        prompt, _ = left_pad(ids, pos < rindex[:, None], EOS)
        return torch.cat([prompt[:, L - int(rindex.max()):], response], 1), response

    full, response = ours_full(generated)
    assert not (response == EOS).any()  # 50257-way random sampling: no EOS in these 24 tokens

    def compare(clip, keys, rows=slice(None), steps=slice(None)):
        theirs.score_clip = clip
        ours = RolloutFromModel(policy, ref, rm, kl_coef=0.2, max_new_tokens=T, score_clip=clip, eos_token_id=EOS)
        td_t = theirs.create_rollout_td(batch, gen, log_probs, lr)
        td_o = ours.create_rollout_td(batch, full_o)  # recomputes log-probs and the reference pass itself
        for key in keys:
            a, b = td_t["next", key].squeeze(-1)[rows, steps], td_o["next", key][rows, steps]
            torch.testing.assert_close(b.float(), a.float(), atol=1e-5, rtol=0, msg=f"{key} (clip={clip})")
        return td_t, td_o

    # 1a. random responses, no EOS: everything matches, with and without score clipping
    gen, lr, full_o = generated, log_ratio, full
    for clip in (10.0, 0.05):
        td_t, td_o = compare(clip, ["reward_raw", "reward_kl", "reward", "done", "terminated"])
        assert td_o["next", "reward_raw"][:, -1].abs().min() > 0  # a score is paid at the last step
    assert td_o["next", "reward_raw"][:, -1].abs().max() == pytest.approx(0.05)  # clipped

    # 1b. EOS inserted by hand: mid-response (row 0, step 2) and at the last step (row 1)
    gen = generated.clone()
    for row, step in [(0, 2), (1, T - 1)]:
        gen[row, rindex[row] + step:] = EOS  # torchrl pads with EOS after EOS
    lr = theirs._log_ratio(gen, rindex)  # what torchrl's generate would have returned for these tokens
    full_o, _ = ours_full(gen)
    td_t, td_o = compare(10.0, ["reward_kl", "done", "terminated"], steps=slice(0, T - 1))
    compare(10.0, ["reward_kl", "terminated"], rows=[0, 2, 3])  # all steps, except the EOS-at-T−1 row
    compare(10.0, ["reward_raw", "reward", "done"], rows=[2, 3])  # responses without EOS: all of it
    # the documented differences, pinned down
    done_t = td_t["next", "done"].squeeze(-1)
    assert done_t[0, 2] and done_t[0, T - 1]  # torchrl: done at the EOS *and* at the last step
    assert td_o["next", "done"][0].nonzero().flatten().tolist() == [2]  # ours: once, at the EOS
    assert not td_t["next", "terminated"][1, T - 1] and td_o["next", "terminated"][1, T - 1]
    assert (td_o["next", "reward_kl"][0, 3:] == 0).all() and td_o["next", "reward_kl"][0, 2] != 0  # EOS has KL

    # 1c. our rollout takes torchrl's PromptData as is: the label continuation is the reward baseline
    ours = RolloutFromModel(policy, ref, rm, kl_coef=0.2, max_new_tokens=T, eos_token_id=EOS)
    td = ours.rollout_from_data(batch)
    assert td["tokens", "prompt"].shape == (B, int(rindex.max())) and td["action"].shape == (B, T)
    torch.testing.assert_close(td["next", "score_ref"], rm(ids, attn.long())[1])
    torch.testing.assert_close(td["masks", "prompt"].sum(-1), rindex)


# --------------------------------------------------------------------------- 2. the sampling distribution
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.7, 5, 0.9), (1.3, 10, 0.5), (0.7, 0, 0.3),
])
def test_process_logits_matches_hf_warpers(temperature, top_k, top_p):
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40) * 3
    warpers = LogitsProcessorList()  # the order generate() applies them in
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    flat = logits.reshape(-1, 40)
    hf = warpers(torch.zeros(flat.shape[0], 1, dtype=torch.long), flat.clone()).reshape(logits.shape)
    ours = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    torch.testing.assert_close(ours, hf)
    if top_k:
        assert (torch.isfinite(ours).sum(-1) <= top_k).all()


# --------------------------------------------------------------------------- 3. the first PPO ratio
V, EOS, PAD = 64, 0, 1


def small_policy(seed=0):
    torch.manual_seed(seed)
    policy = build_policy(config=dict(vocab_size=V, n_layer=2, n_embd=32, n_head=2, n_positions=64, eos_token_id=EOS,
                                      bos_token_id=EOS, pad_token_id=PAD))
    return policy.eval()  # dropout is 0 anyway; the trainer keeps the policy in eval mode


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (0.7, 5, 0.9)])
def test_first_ppo_ratio_is_exactly_one(temperature, top_k, top_p):
    from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
    from rlhf_train.algorithms.ppo import PPO
    from rlhf_train.algorithms.update import policy_forward
    from rlhf_train.core.containers import Rollout
    from rlhf_train.core.sampling import SamplingParams

    policy = small_policy()
    ref = build_reference(policy)
    rollout = RolloutFromModel(policy, ref, tiny_reward_model(V, EOS), max_new_tokens=10,
                               kl_scheduler=ConstantKLController(0.05), eos_token_id=EOS, pad_token_id=PAD,
                               temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(0)
    td = rollout.rollout_from_data(left_padded_prompts(8, 6, V, low=2, pad=PAD))
    mask = td["masks", "response"]
    assert torch.isfinite(td["sample_log_prob"]).all()  # every sampled token is inside the top-k / top-p set
    advantage, returns = gae(td["next", "reward"], td["values"], mask, 1.0, 0.95)
    td.set("advantage", masked_whiten(advantage, mask))
    td.set("returns", returns)

    mb = td[torch.randperm(8, generator=torch.Generator().manual_seed(0))[:4]]  # the first minibatch
    out = policy_forward(policy, Rollout.from_torchrl(mb), SamplingParams(temperature, top_k, top_p), with_entropy=True)
    loss, stats = PPO(AlgorithmConfig(clip_eps_value=0.2, vf_coef=0.1), UpdateConfig(clip_eps=0.2, ent_coef=0.0)).loss(out, Rollout.from_torchrl(mb))
    assert abs(float(stats["val/ratio"]) - 1.0) < 1e-5
    assert float(stats["policy/approx_kl"]) < 1e-8 and float(stats["policy/clipfrac"]) == 0.0
    assert torch.isfinite(loss)
    # per token, not only on average
    full, full_mask, m = mb["tokens", "full"], mb["masks", "full"], mb["masks", "response"]
    with torch.no_grad():
        logits, _ = policy(full, full_mask, full.shape[1] - m.shape[1])
    lp = logprobs_of_labels(process_logits(logits, temperature), mb["action"])  # the temperature alone
    assert ((lp - mb["sample_log_prob"]).abs() * m).max() < 1e-5


# --------------------------------------------------------------------------- 4. the KL coefficient
def test_kl_coef_is_always_the_controllers():
    policy, other = small_policy(0), small_policy(1)  # a reference that differs: a real KL
    controller = AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=10)
    rollout = RolloutFromModel(policy, build_reference(other), tiny_reward_model(V, EOS), max_new_tokens=6,
                               kl_scheduler=controller, eos_token_id=EOS, pad_token_id=PAD)
    # k3 (never negative) so that a target proportional to the batch's mean KL is positive
    rollout.transforms = Compose(ReferenceModelLogProbTransform(rollout.ref_log_prob_fn), KLDivergenceTransform("k3"),
                                 RewardAdjustmentTransform())
    prompts = left_padded_prompts(4, 5, V, low=2, pad=PAD)
    torch.manual_seed(0)
    coefs = []
    # per step: rollouts queued before it, and the KL target as a multiple of their mean KL (so the
    # error e is 0.1, −0.05 unclipped, then clipped at 0.2: a per-token mean would give other values)
    for n_rollouts, ratio, error in [(2, 1.1, 0.1), (1, 0.95, -0.05), (1, 100.0, 0.2)]:
        kls = []
        for _ in range(n_rollouts):  # rollouts queue their per-sequence KLs for the next scheduler step
            assert rollout.kl_coef == controller.coef
            td = rollout.rollout_from_data(prompts)
            assert (td["kl_coef"] == controller.coef).all()
            torch.testing.assert_close(td["next", "reward_kl"], -controller.coef * td["next", "kl"])
            kls.append(td["kl_per_sequence"])
        kls = torch.cat(kls).double()  # [4 · n_rollouts]: one KL per sequence (nats, summed over its response)
        assert kls.mean() > 0
        controller.target = float(kls.mean()) / ratio
        # Ziegler et al. §2.2: e = clip(mean KL / target − 1, ±0.2), β ← β (1 + e · n / horizon), n = sequences
        expected = controller.coef * (1 + error * kls.numel() / 10)
        assert rollout.step_scheduler() == pytest.approx(expected, rel=1e-6)
        assert controller.coef == pytest.approx(expected, rel=1e-6) and rollout.kl_coef == controller.coef
        assert len(rollout._kl_queue) == 0
        coefs.append(controller.coef)
    assert len(set(coefs)) == 3  # it moved every step
    rollout.kl_coef = 0.5  # setting it on the rollout sets the controller
    assert controller.coef == 0.5
    # a constant controller: the rollout follows it too
    constant = ConstantKLController(0.07)
    rollout = RolloutFromModel(policy, build_reference(other), tiny_reward_model(V, EOS), max_new_tokens=6,
                               kl_scheduler=constant, eos_token_id=EOS, pad_token_id=PAD)
    td = rollout.rollout_from_data(prompts)
    assert rollout.kl_coef == 0.07 and (td["kl_coef"] == 0.07).all()
    assert rollout.step_scheduler() == 0.07
