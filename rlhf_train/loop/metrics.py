"""What the loop logs from a rollout: the ``objective/``, ``response/``, ``completions/``, ``reward/`` and
``val/`` metrics (docs/metrics.md's glossary explains each), a few decoded samples, and the warning for a
reward source that gives every sample the same score (:class:`ConstantSourceWatch`)."""
from __future__ import annotations

import math

import torch

from rlhf_train.core.advantages import zero_std_groups
from rlhf_train.core.containers import Rollout
from rlhf_train.core.masked import masked_mean, masked_sum


def accuracy_thresholds(sources: dict, threshold: float = 1.0) -> dict[str, float]:
    """``{name: threshold}`` for the sources whose scores have a "correct" (every one but the reward models:
    functions, verifiers), each row correct when scored ``>= threshold``."""
    from rlhf_train.rewards.sources import RewardModelSource

    return {name: float(threshold) for name, (source, _) in sources.items()
            if not isinstance(source, RewardModelSource)}


def rollout_metrics(ro: Rollout, group_size: int = 1, accuracy: dict[str, float] | None = None) -> dict:
    """Scalar tensors, per process (the loop reduces them over processes). ``group_size`` > 1: the samples
    of a prompt are adjacent rows; their spread is logged (``reward/group_std``, ``reward/frac_zero_std_groups``).
    ``accuracy``: ``{source name: threshold}`` (:func:`accuracy_thresholds`): ``reward/<name>/accuracy``, the share
    of rows that source scored ``>= threshold`` (a row it did not score, None, counts as not correct)."""
    mask = ro.masks.response
    ended = ro.terminated.any(-1)  # [B]: the response emitted EOS (else it hit rollout.max_new_tokens)
    out = {
        "objective/reward_raw": ro.reward_raw.sum(-1).mean(),     # shaped score per sequence
        "objective/reward_kl": ro.reward_kl.sum(-1).mean(),       # KL penalty per sequence
        "objective/reward_total": ro.reward.sum(-1).mean(),       # the per-sequence reward the update maximises
        "objective/score": ro.score_raw.mean(),                   # weighted sum of the reward sources, unshaped
        "objective/entropy_sampled": -(ro.sample_log_prob.sum(-1)).mean(),
        "response/length": mask.sum(-1).float().mean(),
        "response/eos_rate": ended.float().mean(),
        "completions/mean_length": mask.sum(-1).float().mean(),   # TRL's names for the two above
        "completions/clipped_ratio": (~ended).float().mean(),
    }
    if ro.ref_log_prob is not None:  # no reference (critic-free, beta = 0): the KL is not measured
        out["objective/kl"] = ro.kl_per_sequence.mean()           # mean per-sequence KL (nats)
    if group_size > 1:
        seq = masked_sum(ro.reward, mask, dim=-1).view(-1, group_size)  # what the group estimators compare
        std = seq.std(-1)
        out["reward/group_std"] = std.mean()
        scored = None if ro.unscored is None else ~ro.unscored  # rows no source scored: in no group's spread
        out["reward/frac_zero_std_groups"] = zero_std_groups(seq.reshape(-1), group_size, scored).float().mean()
    actions = ro.masks.actions  # the sampled tokens (a multi-turn episode's assistant tokens)
    if ro.advantage_raw is not None:
        out["val/advantage_mean_raw"] = masked_mean(ro.advantage_raw, actions)  # before whitening
    if ro.values is not None and ro.returns is not None:
        out["val/value_mean"] = masked_mean(ro.values, actions)
        out["val/return_mean"] = masked_mean(ro.returns, actions)
    if ro.unscored is not None:  # every source returned None: score 0, advantage 0 (core/advantages.py)
        out["reward/frac_unscored"] = ro.unscored.float().mean()
    if ro.reward_sources is not None and len(ro.reward_sources.keys()) > 1:  # one source: objective/score is it
        for name in ro.reward_sources.keys():
            out[f"reward/{name}"] = ro.reward_sources[name].float().nanmean()
    for name, threshold in (accuracy or {}).items():
        if ro.reward_sources is not None and name in ro.reward_sources.keys():  # NaN >= t is False: not correct
            out[f"reward/{name}/accuracy"] = (ro.reward_sources[name].float() >= threshold).float().mean()
    return out


class ConstantSourceWatch:
    """Warns once per reward source that gave every sample of every batch the same score (or None to all)
    over the first ``iterations`` iterations it watched: a format reward that never fires, a column a function
    cannot read, a reward model that ignores its input. Call :meth:`observe` with each rollout's
    ``reward_sources`` (``{name: [B]}``); it returns the warning lines, each once, after the last watched one."""

    def __init__(self, iterations: int = 3):
        self.iterations, self.seen = int(iterations), 0
        self.value: dict[str, float | None] = {}  # name -> its one value so far (NaN: None), None: not constant

    def observe(self, sources) -> list[str]:
        if sources is None or self.seen >= self.iterations:
            return []
        self.seen += 1
        for name in sources.keys():
            x = sources[name].detach().float().reshape(-1).cpu()
            nan = torch.isnan(x)
            one = (float("nan") if bool(nan.all()) else float(x[0]) if x.numel() and not bool(nan.any())
                   and bool((x == x[0]).all()) else None)  # this batch's single value, else None
            before = self.value.get(name, one) if self.seen > 1 else one
            same = one is not None and before is not None and (one == before or math.isnan(one) and math.isnan(before))
            self.value[name] = one if same else None
        if self.seen < self.iterations:
            return []
        return [f"reward source '{name}' gave {'None (no score)' if math.isnan(v) else v} to every sample for "
                f"{self.iterations} iterations: check it (a format reward that never fires? a column it cannot read?)"
                for name, v in self.value.items() if v is not None]


def sample_rows(ro: Rollout, tokenizer, n: int = 4, episodes: list | None = None) -> list[dict]:
    """The first ``n`` rollouts decoded: prompt, response, raw score and total reward; with ``episodes`` (a multi-turn
    rollout's, :mod:`rlhf_train.rollout.multi_turn`) also ``episode``: the whole conversation, each message with its role."""
    from rlhf_train.rollout.multi_turn import episode_text

    rows = []
    for i in range(min(n, ro.batch_size[0])):
        prompt = ro.tokens.prompt[i][ro.masks.prompt[i]]
        response = ro.tokens.response[i][ro.masks.response[i]]
        rows.append({"prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response),
                     "score": float(ro.score_raw[i]), "reward": float(ro.reward[i].sum()),
                     **({"episode": episode_text(episodes[i])} if episodes else {})})
    return rows
