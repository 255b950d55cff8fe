"""What the loop logs from a rollout: the ``objective/``, ``response/``, ``reward/`` and ``val/`` metrics
(docs/metrics.md's glossary explains each) and a few decoded samples."""
from __future__ import annotations

from rlhf_train.core.containers import Rollout
from rlhf_train.core.masked import masked_mean, masked_sum


def rollout_metrics(ro: Rollout, group_size: int = 1) -> dict:
    """Scalar tensors, per process (the loop reduces them over processes). ``group_size`` > 1: the samples
    of a prompt are adjacent rows; their spread is logged (``reward/group_std``, ``reward/frac_zero_std_groups``)."""
    mask = ro.masks.response
    out = {
        "objective/reward_raw": ro.reward_raw.sum(-1).mean(),     # shaped score per sequence
        "objective/reward_kl": ro.reward_kl.sum(-1).mean(),       # KL penalty per sequence
        "objective/reward_total": ro.reward.sum(-1).mean(),       # the per-sequence reward the update maximises
        "objective/score": ro.score_raw.mean(),                   # weighted sum of the reward sources, unshaped
        "objective/entropy_sampled": -(ro.sample_log_prob.sum(-1)).mean(),
        "response/length": mask.sum(-1).float().mean(),
        "response/eos_rate": ro.terminated.any(-1).float().mean(),
    }
    if ro.ref_log_prob is not None:  # no reference (critic-free, beta = 0): the KL is not measured
        out["objective/kl"] = ro.kl_per_sequence.mean()           # mean per-sequence KL (nats)
    if group_size > 1:
        seq = masked_sum(ro.reward, mask, dim=-1).view(-1, group_size)  # what the group estimators compare
        std = seq.std(-1)
        out["reward/group_std"] = std.mean()
        out["reward/frac_zero_std_groups"] = (std <= 1e-6 * seq.abs().amax(-1).clamp(min=1)).float().mean()
    if ro.advantage_raw is not None:
        out["val/advantage_mean_raw"] = masked_mean(ro.advantage_raw, mask)  # before whitening
    if ro.values is not None and ro.returns is not None:
        out["val/value_mean"] = masked_mean(ro.values, mask)
        out["val/return_mean"] = masked_mean(ro.returns, mask)
    if ro.reward_sources is not None and len(ro.reward_sources.keys()) > 1:  # one source: objective/score is it
        for name in ro.reward_sources.keys():
            out[f"reward/{name}"] = ro.reward_sources[name].float().nanmean()
    return out


def sample_rows(ro: Rollout, tokenizer, n: int = 4) -> list[dict]:
    """The first ``n`` rollouts decoded: prompt, response, raw score and total reward."""
    rows = []
    for i in range(min(n, ro.batch_size[0])):
        prompt = ro.tokens.prompt[i][ro.masks.prompt[i]]
        response = ro.tokens.response[i][ro.masks.response[i]]
        rows.append({"prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response),
                     "score": float(ro.score_raw[i]), "reward": float(ro.reward[i].sum())})
    return rows
