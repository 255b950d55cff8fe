"""Evaluation of the pipeline: the policy before the RL stage (the SFT model) against the policy after it.

``evaluate_policy`` samples ``evaluation.num_samples`` continuations per held-out prompt with the rollout's
sampling settings (``rollout.max_new_tokens``, ``temperature``, ``top_k``, ``top_p``) and the same seed for both
policies, through :class:`~rlhf_train.rollout.rollout_from_model.RolloutFromModel` (one ``generate``, then one
forward pass each of policy, reference and the reward sources), and (``evaluation.greedy``) decodes each prompt
greedily once more (:mod:`rlhf_train.loop.evaluation`). It measures:

* ``reward``: the weighted sum of the run's reward sources (``reward_model`` and the ``rewards`` functions, their
  raw scores: what the RL stage maximised), over every sampled continuation;
* ``eval``: the held-out metrics of every source (:func:`rlhf_train.loop.evaluation.held_out_metrics`: each
  source's mean; for reward functions accuracy, pass@k and mean@k; the completion length), sampled and greedy;
* ``judge_positive_rate``: the fraction of continuations an **independent judge** calls positive: the
  task's judge (``evaluation.judge_fn``; the movie reviews': a bag-of-words logistic regression trained on
  ``judge_train`` reviews, which the reward model never saw). The judge reads the **continuation only** (the
  prompt is the opening of a real review, the same before and after; reading it would only dilute what the
  RL stage changed).
  ``judge_positive_rate_full`` is the same on prompt + continuation, for reference;
* ``kl_per_sequence``: ``sum_t log pi(y_t|.) - log pi_ref(y_t|.)`` over the response tokens (nats, the
  k1 estimate of the KL penalty), averaged over sequences; 0 before the RL stage (pi = pi_ref).

``plot_rl_history`` draws ``rl_curves.png``: the score, the shaped score and the total reward, and the
per-sequence KL, over the RL stage's iterations (labelled with the algorithm's name), each curve named by
the metric it plots.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig


@torch.no_grad()
def evaluate_policy(lm, ref_lm, sources: dict, tokenizer, prompts, cfg: DictConfig, judge=None) -> dict[str, Any]:
    """Sample on every prompt of ``prompts`` (a :class:`~rlhf_train.data.prompts.PromptDataset`) and score with
    ``sources`` (``{name: (RewardSource, weight)}``).

    Returns the means above, ``eval`` (the ``eval/...`` metrics) and per-row lists (``num_samples`` rows per
    prompt, adjacent): ``prompt``, ``continuation``, ``score``, ``kl``, ``parts`` (each source's score) and
    (with a judge) ``judge_prob``.
    """
    from torch.utils.data import DataLoader

    from rlhf_train.core.sampling import SamplingParams
    from rlhf_train.data.prompts import collate
    from rlhf_train.loop.components import build_backend
    from rlhf_train.loop.evaluation import build_backends, evaluate_held_out, function_sources, held_out_metrics
    from rlhf_train.models.reference import frozen_copy
    from rlhf_train.rewards.shaping import KLDivergence
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel, special_ids

    r, e = cfg.rollout, cfg.evaluation
    # the product rollout with β = 0 and only the KL entry of the shaping stack: the score is the sources' raw
    # weighted sum, the KL to the reference (k1, per sequence) is only measured
    sampling = SamplingParams(r.temperature, r.top_k, r.top_p)
    eos, pad = special_ids(lm, tokenizer)
    backend = build_backend(cfg, lm, eos, pad, sampling, with_scores=True, unwrap_fn=None)  # the `generation` group's
    rollout = RolloutFromModel(lm, backend, frozen_copy(ref_lm, sampling, r.logprob_batch_size), sources,
                               {"kl": KLDivergence("k1")}, eos_token_ids=eos, pad_token_id=pad,
                               max_new_tokens=r.max_new_tokens, sampling=sampling, num_samples=e.num_samples,
                               logprob_batch_size=r.logprob_batch_size)
    was_training = lm.training
    lm.eval()
    torch.manual_seed(e.seed)  # the same sampling noise for every policy evaluated
    out: dict[str, Any] = {"prompt": [], "continuation": [], "score": [], "kl": [], "ref_logprob": [], "length": [],
                           "parts": {name: [] for name in sources}}
    for batch in DataLoader(prompts, batch_size=e.batch_size, shuffle=False, collate_fn=getattr(prompts, "collate", collate)):
        ro = rollout(batch, kl_coef=0.0)
        tokens, masks = ro.tokens, ro.masks
        response = tokens.response.masked_fill(~masks.response, tokenizer.pad_token_id)
        prompt = tokens.prompt.masked_fill(~masks.prompt, tokenizer.pad_token_id)
        out["continuation"] += tokenizer.batch_decode(response.tolist(), skip_special_tokens=True)
        out["prompt"] += tokenizer.batch_decode(prompt.tolist(), skip_special_tokens=True)
        out["score"] += ro.score_raw.float().tolist()
        out["kl"] += ro.kl_per_sequence.float().tolist()
        out["ref_logprob"] += ro.ref_log_prob.float().masked_fill(~masks.response, 0.0).sum(-1).tolist()
        out["length"] += masks.response.sum(-1).tolist()
        for name in sources:
            out["parts"][name] += ro.reward_sources[name].float().tolist()
    n = len(out["score"])
    scores = torch.tensor(out["score"])
    parts = {name: torch.tensor(v, dtype=torch.float32) for name, v in out["parts"].items()}
    metrics = held_out_metrics("sampled", parts, torch.tensor(out["length"]), e.num_samples, function_sources(sources),
                               e.accuracy_threshold, list(e.pass_k))
    if e.greedy:  # one greedy decode per prompt through the same backend group
        greedy = build_backends(cfg, lm, eos, pad, sampling, None, modes=("greedy",))
        metrics.update(evaluate_held_out(greedy, sources, prompts, e, eos, pad)[0])
    lm.train(was_training)
    res: dict[str, Any] = {"num_prompts": n // e.num_samples, "num_samples": e.num_samples,
                           "reward": float(scores.mean()), "reward_std": float(scores.std()),
                           "kl_per_sequence": sum(out["kl"]) / n,
                           "fluency_logprob": sum(out["ref_logprob"]) / max(sum(out["length"]), 1),
                           "repetition_rate": repetition_rate(out["continuation"]), "eval": metrics}
    if judge is not None:
        probs = judge.positive_prob(out["continuation"]).tolist()
        out["judge_prob"] = probs
        res["judge_positive_rate"] = sum(p > 0.5 for p in probs) / n
        res["judge_positive_rate_full"] = judge.positive_rate([p + c for p, c in zip(out["prompt"], out["continuation"])])
    res["per_prompt"] = out
    return res


def repetition_rate(texts: list[str], n: int = 3) -> float:
    """The fraction of word ``n``-grams of each text that repeat an earlier ``n``-gram of the same text,
    averaged over texts (0: no repeated phrase; degenerate "great great great ..." text tends to 1)."""
    rates = []
    for text in texts:
        words = text.split()
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates) if rates else 0.0


def samples_table(before: dict, after: dict, n: int) -> list[dict]:
    """The first ``n`` prompts with their (first) continuations before and after the RL stage and their scores
    (with several reward sources, each source's score too)."""
    rows, k = [], before.get("num_samples", 1)
    for i in range(min(n, before["num_prompts"])):
        j = i * k  # the prompt's first sample
        row = {"prompt": before["per_prompt"]["prompt"][j]}
        for name, res in (("before", before), ("after", after)):
            pp = res["per_prompt"]
            row[name] = pp["continuation"][j]
            row[f"reward_{name}"] = round(pp["score"][j], 3)
            if len(pp.get("parts", {})) > 1:
                row[f"sources_{name}"] = {src: round(v[j], 3) for src, v in pp["parts"].items()}
            if "judge_prob" in pp:
                row[f"judge_prob_{name}"] = round(pp["judge_prob"][j], 3)
        rows.append(row)
    return rows


def format_table(summary: dict, initial: str = "SFT", algorithm: str = "PPO") -> str:
    """The short before/after table the pipeline prints (``initial``: what the policy started from)."""
    w = max(14, len(initial) + 10, len(algorithm) + 9)  # column width: the headers fit
    lines = [f"{'':34s}{f'before ({initial})':>{w}s}{f'after ({algorithm})':>{w}s}"]

    def row(label, before, after, fmt="{:.3f}"):
        b = "-" if before is None else fmt.format(before)
        a = "-" if after is None else fmt.format(after)
        lines.append(f"{label:34s}{b:>{w}s}{a:>{w}s}")

    sources = summary.get("reward_sources", ["reward_model"])
    row("reward-model score" if sources == ["reward_model"] else "score (weighted sum of sources)",
        summary["reward_before"], summary["reward_after"])
    before_eval, after_eval = summary.get("eval_before", {}), summary.get("eval_after", {})
    for key in after_eval:  # eval/<mode>/<name>/<metric> and eval/<mode>/completion_length
        mode, rest = key.split("/", 2)[1:]
        if rest.startswith("reward_model/"):  # the reward model's mean is the score above
            continue
        label = f"{rest.replace('/', ': ', 1).replace('_', ' ')} ({mode})"
        row(label if len(label) <= 33 else label[:32] + "…", before_eval.get(key), after_eval[key])
    if "judge_positive_rate_before" in summary:
        row("judge positive rate (continuation)", summary["judge_positive_rate_before"],
            summary["judge_positive_rate_after"])
        row("judge positive rate (prompt+cont.)", summary["judge_positive_rate_full_before"],
            summary["judge_positive_rate_full_after"])
    row(f"KL per sequence vs {initial} (nats)", summary["kl_per_sequence_before"], summary["kl_per_sequence"])
    if "fluency_logprob_before" in summary:
        row("log-lik./token under initial model", summary["fluency_logprob_before"], summary["fluency_logprob_after"])
        row("repeated 3-gram rate", summary["repetition_rate_before"], summary["repetition_rate_after"])
    if summary.get("kl_target") is not None:
        lines.append(f"{'KL target (adaptive controller)':34s}{'':>{w}s}{summary['kl_target']:>{w}.3f}")
    lines.append(f"({summary['num_prompts']} held-out prompts from the '{summary['eval_split']}' split)")
    return "\n".join(lines)


# what each curve of rl_curves.png is (docs/metrics.md's glossary; rlhf_train/loop/metrics.py)
RL_CURVES = (
    ("objective/score", "objective/score: reward-source score, unshaped"),
    ("objective/reward_raw", "objective/reward_raw: shaped score (baseline, EOS penalty, clip)"),
    ("objective/reward_total", "objective/reward_total: shaped score − β·KL"),
)


def plot_rl_history(history: list[dict], path: str | Path, kl_target: float | None = None, algorithm: str = "PPO",
                    reference: str = "the SFT model") -> Path:
    """PNG: the score, shaped score and total reward (left) and the KL (right) per sequence over the RL
    stage's iterations (x axis: "``algorithm`` iteration"), means over each iteration's batch; the KL target
    of an adaptive controller, if any.

    Each curve is labelled with the metric it plots (``objective/...``), so the picture reads against
    ``metrics.csv`` and docs/metrics.md's glossary. Readable with near-constant values
    (:mod:`rlhf_train.pipeline.plots`).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: never touches the user's backend

    from rlhf_train.pipeline.plots import curve_style, declutter, readable_axis

    it = [h["iteration"] for h in history]
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    rewards = []
    for i, (key, label) in enumerate(k for k in RL_CURVES if any(k[0] in h for h in history)):
        ys = [h.get(key, math.nan) for h in history]
        rewards += ys
        ax1.plot(it, ys, label=label, **curve_style(i, points=len(it)))
    ax1.set(xlabel=f"{algorithm} iteration", ylabel="per sequence (batch mean)", title="score and reward")
    kls = [h.get("objective/kl", math.nan) for h in history]
    red = dict(curve_style(0, points=len(it)), color="tab:red", markeredgecolor="tab:red")
    ax2.plot(it, kls, label="objective/kl: KL(π‖π_ref) per sequence", **red)
    if kl_target is not None:
        ax2.axhline(kl_target, color="gray", ls="--", label=f"KL target {kl_target:g}")
        ax2.axhline(2 * kl_target, color="gray", ls=":", label="2 × KL target")
        kls += [kl_target, 2 * kl_target]
    ax2.set(xlabel=f"{algorithm} iteration", ylabel="nats per sequence (batch mean)",
            title=f"KL to the reference policy (π_ref: {reference})")
    readable_axis(ax1.yaxis, rewards)
    readable_axis(ax2.yaxis, kls)
    for ax in (ax1, ax2):
        readable_axis(ax.xaxis, it, margin=0.05, integer=True)
        ax.grid(alpha=0.3)
    (h1, l1), (h2, l2) = ax1.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    handles, labels = h1 + h2, l1 + l2
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8, handlelength=3.5)  # off the curves
    declutter(fig)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
