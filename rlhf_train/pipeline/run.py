"""The offline RLHF pipelines: (SFT ->) reward model -> RL (PPO, GRPO, ...) -> evaluation.

    python -m rlhf_train                          # stage=pipeline: the embedded default (SmolLM2: RM -> GRPO)
    python -m rlhf_train +recipe=sentiment_scratch  # stage=pipeline: SFT -> RM -> PPO from scratch
    python -m rlhf_train +recipe=sentiment_sft    # stage=sft: the SFT stage only (sentiment_rm: stage=rm)

``run(cfg, run_dir)`` (``stage`` in ``pipeline | sft | rm``; ``rl`` alone is :func:`rlhf_train.loop.trainer.train`;
a task's code only through the paths its config names: ``sft.examples``, ``rm.pairs``, ``evaluation.judge_fn``):

  0. pre-flight: every value a stage will need is checked before any work (bad keys, models and datasets that
     cannot load offline, a pipeline-only group ``sft`` / ``rm`` / ``evaluation`` left null): one ``ConfigError`` line;
  1. tokenizer (cached by its own config) and the task's independent judge, if any (``evaluation.judge_fn``);
  2. SFT stage (:mod:`rlhf_train.pipeline.sft`) -> the RL stage's initial policy and reference. Skipped when
     ``policy.pretrained`` is set: the RL stage then starts from that model;
  3. reward-model stage (:mod:`rlhf_train.pipeline.reward_training`). Skipped when ``reward_model.pretrained`` is set;
  4. RL stage (``algorithm``: PPO, GRPO, ...; :func:`rlhf_train.loop.trainer.train`, logs and checkpoints in the run dir);
  5. evaluation (:mod:`rlhf_train.pipeline.evaluate`): the policy before and after the RL stage on held-out
     prompts; ``summary.json``, a printed table, samples, ``rl_curves.png`` and ``report.md`` in the run dir.

Stages 2-4 are cached (:mod:`rlhf_train.pipeline.cache`): :func:`sft_key`, :func:`rm_key` and :func:`rl_key`
say what each stage's output depends on. A stage's key includes the keys of the stages it consumes, so changing
the SFT config re-runs SFT, RL and (when built on the SFT trunk) the RM; changing only the RL keys re-runs RL.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.infra.memory import release_freed_memory
from rlhf_train.loop.components import build_tokenizer
from rlhf_train.pipeline.cache import Timer, cached_stage
from rlhf_train.pipeline.plan import algorithm_name, make_plan, preflight, reward_model_dir, rl_config
from rlhf_train.pipeline.sft import task_hook

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The stages
# --------------------------------------------------------------------------------------------
def _strip_history(info: dict) -> dict:
    return {k: v for k, v in info.items() if k != "history"}


def _stage_config(node) -> dict:
    """A stage's config as its cache entry records it: resolved, secrets redacted."""
    from rlhf_train.infra.secrets import redact

    return redact(OmegaConf.to_container(node, resolve=True))


def run_sft_stage(cfg, tokenizer, plan, timer) -> dict:
    from rlhf_train.pipeline.sft import train_sft

    with timer("sft") as row:
        def build(tmp: Path) -> dict:
            return {**train_sft(cfg, tokenizer, tmp), "config": _stage_config(cfg.sft)}

        info, row["reused"] = cached_stage(plan["sft_dir"], build)
    log.info("[sft] validation loss %.3f nats/token (perplexity %.1f); model in %s", info["sft/val_loss"],
             info["sft/val_perplexity"], plan["sft_dir"])
    return info


def run_rm_stage(cfg, tokenizer, plan, timer) -> dict:
    from rlhf_train.pipeline.reward_training import train_reward_model

    sft_dir = str(plan["sft_dir"]) if cfg.rm.backbone == "sft" else None
    with timer("rm") as row:
        def build(tmp: Path) -> dict:
            return {**train_reward_model(cfg, tokenizer, tmp, sft_dir),
                    "config": _stage_config(cfg.rm)}

        info, row["reused"] = cached_stage(plan["rm_dir"], build)
    log.info("[rm] validation pairwise accuracy %.3f; reward model in %s", info["rm/val_accuracy"], plan["rm_dir"])
    return info


def run_rl_stage(cfg, run_dir: Path, plan, policy_dir: str, rm_dir: str, timer) -> dict:
    from rlhf_train.loop.trainer import train

    with timer(algorithm_name(cfg)) as row:  # the timings row reads e.g. "GRPO"
        def build(tmp: Path) -> dict:
            out = train(rl_config(cfg, policy_dir, rm_dir), run_dir, teardown_exit_code=1)  # evaluation follows
            # the run's export (train writes it): a plain HF model dir; with LoRA merged, adapter in policy/adapter/
            shutil.copytree(run_dir / "policy", tmp / "policy")
            return {"metrics": out["metrics"], "history": out["history"]}

        info, row["reused"] = cached_stage(plan["rl_dir"], build)
    return info


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
def eval_sources(cfg, tokenizer, rm_dir: str | None) -> dict:
    """The RL stage's reward sources for the evaluation: its reward model (``rm_dir``; ``None``: none) and the
    ``rewards`` entries, with their weights."""
    from rlhf_train.models.reward_model import build_reward_model
    from rlhf_train.rewards.sources import build_reward_sources

    rm = build_reward_model(tokenizer=tokenizer, pretrained=rm_dir) if rm_dir else None
    entries = OmegaConf.to_container(cfg.rewards, resolve=True) if cfg.get("rewards") else {}
    return build_reward_sources(rm, entries, tokenizer, tokenizer.pad_token_id, cfg.rollout.get("logprob_batch_size"),
                                cfg.reward_model.get("weight", 1.0) if rm is not None else 1.0)


def run_evaluation(cfg, run_dir: Path, tokenizer, judge, policy_dir: str, rm_dir: str | None, rl_dir: str,
                   rl_info: dict, timer) -> dict:
    """Before (``policy_dir``, also the KL reference) vs after (``rl_dir/policy``) on held-out prompts."""
    from transformers import AutoModelForCausalLM

    from rlhf_train.loop.evaluation import eval_prompts
    from rlhf_train.pipeline.evaluate import (
        evaluate_policy,
        format_table,
        plot_rl_history,
        samples_table,
    )

    with timer("evaluate"):
        prompts = eval_prompts(cfg, tokenizer)
        ref = AutoModelForCausalLM.from_pretrained(policy_dir).eval().requires_grad_(False)
        after_lm = AutoModelForCausalLM.from_pretrained(str(Path(rl_dir) / "policy")).eval().requires_grad_(False)
        sources = eval_sources(cfg, tokenizer, rm_dir)
        try:
            before = evaluate_policy(ref, ref, sources, tokenizer, prompts, cfg, judge)
            after = evaluate_policy(after_lm, ref, sources, tokenizer, prompts, cfg, judge)
        finally:
            for source, _ in sources.values():  # a reward function's worker processes, if it has them
                getattr(source, "close", lambda: None)()
    kl_target, algorithm = cfg.kl_controller.get("target"), algorithm_name(cfg)
    summary = {
        "reward_before": before["reward"], "reward_after": after["reward"],
        "reward_std_before": before["reward_std"], "reward_std_after": after["reward_std"],
        "kl_per_sequence": after["kl_per_sequence"], "kl_per_sequence_before": before["kl_per_sequence"],
        "kl_target": kl_target, "num_prompts": before["num_prompts"], "eval_split": cfg.evaluation.split,
        "fluency_logprob_before": before["fluency_logprob"], "fluency_logprob_after": after["fluency_logprob"],
        "repetition_rate_before": before["repetition_rate"], "repetition_rate_after": after["repetition_rate"],
        "fluency_max_drop": cfg.evaluation.fluency_max_drop,
        "fluency_within_bound": before["fluency_logprob"] - after["fluency_logprob"] <= cfg.evaluation.fluency_max_drop,
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
        "algorithm": algorithm, "rl_iterations": len(rl_info.get("history", [])),
        "reward_sources": list(sources), "num_samples": cfg.evaluation.num_samples,
        "eval_before": before["eval"], "eval_after": after["eval"],  # the eval/... metrics (docs/metrics.md)
    }
    if judge is not None:
        summary.update(judge_positive_rate_before=before["judge_positive_rate"],
                       judge_positive_rate_after=after["judge_positive_rate"],
                       judge_positive_rate_full_before=before["judge_positive_rate_full"],
                       judge_positive_rate_full_after=after["judge_positive_rate_full"],
                       judge_reads="continuation")
    summary["samples"] = samples_table(before, after, cfg.evaluation.num_samples_shown)
    if cfg.evaluation.plot and rl_info.get("history"):
        summary["plot"] = str(plot_rl_history(rl_info["history"], run_dir / "rl_curves.png", kl_target, algorithm,
                                              "the initial model" if cfg.policy.pretrained else "the SFT model"))
    summary["table"] = format_table(summary, "initial" if cfg.policy.pretrained else "SFT", algorithm)
    return summary


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------
def _write_json(path: Path, obj: dict) -> None:
    """Valid JSON: a NaN / inf (e.g. a diverged metric) is written as null, as final_metrics.json does."""
    def finite(x):
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        if getattr(x, "ndim", None) == 0:  # a 0-d tensor / numpy number
            x = float(x)
        return None if isinstance(x, float) and not math.isfinite(x) else x

    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(obj), indent=1, default=float, allow_nan=False))
    os.replace(tmp, path)


def run(cfg: DictConfig, run_dir: str | Path) -> float | None:
    """Run ``cfg.stage`` (``pipeline``, ``sft`` or ``rm``) as described in the module docstring.

    Returns the number a sweep optimises: the judge's positive rate after the RL stage (or the RM score after
    it without a judge), the SFT validation loss for ``stage=sft``, the RM validation accuracy for ``stage=rm``.
    """
    from hydra.utils import instantiate

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    timer = Timer()
    t_start = time.perf_counter()
    # 0. pre-flight: which stages run, and can they (before any work)
    plan = make_plan(cfg)
    preflight(cfg, plan)
    # 1. tokenizer (and, below, the judge)
    with timer("tokenizer"):
        # tokenizer.pretrained=null: the policy's own (SmolLM2's)
        follows = "pretrained" in cfg.tokenizer and not cfg.tokenizer.pretrained and cfg.policy.pretrained
        tokenizer = build_tokenizer(cfg) if follows else instantiate(cfg.tokenizer)
    summary: dict[str, Any] = {"stage": cfg.stage}
    # 2. SFT
    sft_info = run_sft_stage(cfg, tokenizer, plan, timer) if plan["sft_key"] else None
    if cfg.stage == "sft":
        summary.update(_strip_history(sft_info), stage_dir=str(plan["sft_dir"]))
        return _finish(cfg, run_dir, summary, timer, t_start, summary["sft/val_loss"])
    # 3. reward model
    rm_info = run_rm_stage(cfg, tokenizer, plan, timer) if plan["rm_key"] else None
    if cfg.stage == "rm":
        summary.update(_strip_history(rm_info), stage_dir=str(plan["rm_dir"]))
        return _finish(cfg, run_dir, summary, timer, t_start, summary["rm/val_accuracy"])
    judge, make_judge = None, task_hook(cfg, "evaluation.judge_fn") if cfg.evaluation.judge else None
    if cfg.evaluation.enabled and make_judge is not None:  # the task's judge (None where it does not apply)
        with timer("judge"):
            judge = make_judge(cfg)
    # 4. RL (the algorithm's)
    if cfg.policy.pretrained:  # a local dir (a GGUF file or pkg:// path: its converted dir in the cache)
        from rlhf_train.models.loading import check_loadable

        policy_dir = check_loadable(cfg.policy.pretrained, "policy.pretrained", "policy")
    else:
        policy_dir = str(plan["sft_dir"])
    rm_dir = reward_model_dir(cfg, plan)  # None: no reward model (the `rewards` functions score)
    rl_info = run_rl_stage(cfg, run_dir, plan, policy_dir, rm_dir, timer)
    summary.update({"sft": _strip_history(sft_info) if sft_info else {"from": policy_dir},
                    "rm": _strip_history(rm_info) if rm_info else {"from": rm_dir},
                    "rl_final_metrics": rl_info.get("metrics", {}),
                    "stage_dirs": {"sft": policy_dir, "rm": rm_dir, "rl": str(plan["rl_dir"])}})
    # 5. evaluation
    if not cfg.evaluation.enabled:
        return _finish(cfg, run_dir, summary, timer, t_start, rl_info["metrics"].get("objective/score"))
    release_freed_memory()  # the RL stage's freed activations and models, before the evaluation loads two models
    ev = run_evaluation(cfg, run_dir, tokenizer, judge, policy_dir, rm_dir, str(plan["rl_dir"]), rl_info, timer)
    table = ev.pop("table")
    summary = {**ev, **summary}
    print("\n" + table, flush=True)
    for i, s in enumerate(summary["samples"]):
        print(f"\n[{i}] prompt: {s['prompt']!r}\n    before: {s['before']!r}\n    after:  {s['after']!r}", flush=True)
    value = summary.get("judge_positive_rate_after", summary["reward_after"])
    return _finish(cfg, run_dir, summary, timer, t_start, value, table)


def _finish(cfg, run_dir: Path, summary: dict, timer: Timer, t_start: float, value, table: str | None = None):
    summary["timings"] = {**timer.rows, "total": {"wall_s": round(time.perf_counter() - t_start, 2),
                                                  "cpu_s": round(time.process_time(), 2)}}
    name = "summary.json" if cfg.stage == "pipeline" else f"{cfg.stage}_summary.json"
    _write_json(run_dir / name, summary)
    if table is not None:  # report.md: the table, the plot and 10 before/after samples
        from rlhf_train.pipeline.report import write_report

        write_report(run_dir, {**summary, "table": table}, title=f"{cfg.task_name}: before / after")
    t = summary["timings"]["total"]
    print(f"\n[pipeline] stage={cfg.stage} done in {t['wall_s']:.0f} s wall ({t['cpu_s']:.0f} s CPU); "
          f"{name} in {run_dir}", flush=True)
    return value
