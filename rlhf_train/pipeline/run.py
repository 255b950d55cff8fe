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
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from rlhf_train.infra.errors import ConfigError
from rlhf_train.loop.components import build_tokenizer
from rlhf_train.pipeline.cache import (
    Timer,
    _plain,
    cached_stage,
    is_complete,
    stage_dir,
    stage_key,
)
from rlhf_train.pipeline.sft import task_hook

log = logging.getLogger(__name__)


PIPELINE_STAGES = ("pipeline", "sft", "rm")


# --------------------------------------------------------------------------------------------
# Keys of the stages and what they depend on
# --------------------------------------------------------------------------------------------
def algorithm_name(cfg: DictConfig) -> str:
    """The RL stage's name for a reader (timings, table, plot, report): the algorithm's, e.g. ``GRPO``."""
    return cfg.algorithm.name.upper() if cfg.get("algorithm") is not None else "PPO"


def sft_key(cfg: DictConfig) -> str:
    return stage_key("sft", {"tokenizer": cfg.tokenizer, "policy_config": cfg.policy.config, "sft": cfg.sft,
                             "split_seed": cfg.data.seed})


def rm_key(cfg: DictConfig, sft: str | None) -> str:
    return stage_key("rm", {"tokenizer": cfg.tokenizer, "rm": cfg.rm, "sft": sft if cfg.rm.backbone == "sft" else None,
                            "split_seed": cfg.data.seed})


def rl_key(cfg: DictConfig, policy: str, reward: str) -> str:
    parts = {k: cfg.get(k) for k in ("tokenizer", "ref_model", "kl_controller", "transforms", "data", "rollout",
                                     "generation", "update", "optimizer", "scheduler", "trainer")}
    if cfg.get("algorithm") is not None and cfg.algorithm.name != "ppo":  # (PPO's keys as before the group existed)
        parts["algorithm"] = cfg.algorithm
    parts["policy"] = {k: v for k, v in _plain(cfg.policy).items() if k != "pretrained"}
    parts["reward_model"] = {k: v for k, v in _plain(cfg.reward_model).items() if k != "pretrained"}
    return stage_key("rl", {**parts, "policy_from": policy, "reward_from": reward})


# --------------------------------------------------------------------------------------------
# 0. pre-flight
# --------------------------------------------------------------------------------------------
def preflight(cfg: DictConfig, plan: dict) -> None:
    """Check every input of the stages that will run (``plan``); one ConfigError naming the key to set."""
    from rlhf_train.models.loading import check_loadable
    from rlhf_train.pipeline.sft import check_positive, load_text_dataset

    require_groups(cfg)
    if cfg.tokenizer.get("pretrained"):
        check_loadable(cfg.tokenizer.pretrained, "tokenizer.pretrained", "tokenizer")
    if plan["run_sft"]:
        task_hook(cfg, "sft.examples")  # the task's function imports (or one line naming the key)
        check_positive("sft", cfg.sft, ("max_len", "batch_size", "max_steps", "lr", "eval_every", "eval_batch_size"))
        if cfg.sft.init:
            try:
                check_loadable(cfg.sft.init, "sft.init", "SFT initial model")
            except ConfigError as err:
                if cfg.stage != "pipeline":
                    raise
                if cfg.policy.pretrained:  # RL starts from the given policy: the SFT stage runs for the RM's trunk
                    raise ConfigError(f"{err} (the SFT stage runs only to give the reward model its trunk: or set "
                                      f"reward_model.pretrained=<a reward model dir> to skip the SFT and RM "
                                      f"stages)") from None
                raise ConfigError(f"{err} (or set policy.pretrained=<an SFT model dir> to skip the SFT stage)") from None
        if cfg.sft.get("dataset"):  # a dataset-reading sft.examples (TL;DR)
            load_text_dataset(cfg.sft.dataset, cfg.sft.train_split, "sft.dataset")
    if plan["run_rm"]:
        task_hook(cfg, "rm.pairs")
        check_positive("rm", cfg.rm, ("max_len", "batch_size", "max_steps", "lr", "eval_every", "eval_batch_size"))
        if cfg.rm.backbone not in ("sft", "minilm"):
            check_loadable(cfg.rm.backbone, "rm.backbone", "reward-model backbone")
        if cfg.rm.backbone == "minilm":
            from rlhf_train.models.reward_model import minilm_path

            minilm_path()
        if cfg.rm.get("dataset"):  # a dataset-reading rm.pairs (TL;DR)
            load_text_dataset(cfg.rm.dataset, cfg.rm.train_split, "rm.dataset")
    if plan["run_rl"]:  # the loop's checks, on the config with the models the stages will give it
        from rlhf_train.loop.checks import check_config

        check_config(rl_config(cfg, str(cfg.policy.pretrained or plan["sft_dir"]),
                               str(cfg.reward_model.pretrained or plan["rm_dir"])))
        if cfg.policy.pretrained:
            check_loadable(cfg.policy.pretrained, "policy.pretrained", "policy")
        if cfg.reward_model.pretrained:
            check_loadable(cfg.reward_model.pretrained, "reward_model.pretrained", "reward model")
        if cfg.data.get("dataset"):
            load_text_dataset(cfg.data.dataset, cfg.data.split, "data.dataset")
        check = task_hook(cfg, "evaluation.task_check") if cfg.get("evaluation") is not None else None
        if check is not None:  # the task's data options (movie reviews: data.split / data.sentiment)
            check(cfg)
    if cfg.stage == "pipeline" and cfg.evaluation.enabled:
        check_positive("evaluation", cfg.evaluation, ("num_prompts", "batch_size"))
        if cfg.evaluation.judge:
            task_hook(cfg, "evaluation.judge_fn")
        if cfg.data.get("dataset"):
            load_text_dataset(cfg.data.dataset, cfg.evaluation.split, "evaluation.split")


def _group_options(group: str) -> str:
    conf = Path(__file__).resolve().parents[2] / "conf" / group
    names = sorted(p.stem for p in conf.glob("*.yaml")) if conf.is_dir() else []
    return f" ({' | '.join(names)})" if names else ""


def require_groups(cfg: DictConfig) -> None:
    """The pipeline-only groups (``sft``, ``rm``, ``evaluation``) are null in ``conf/config.yaml``: a stage
    that needs one that no recipe or override selected stops here, with one line naming the group."""
    if cfg.stage not in PIPELINE_STAGES:
        raise ConfigError(f"stage='{cfg.stage}' is not a pipeline stage; choose one of {', '.join(PIPELINE_STAGES)}")

    def need(group: str, why: str) -> None:
        if cfg.get(group) is None:
            raise ConfigError(f"{group} is not set (null in conf/config.yaml) but {why}: select one with "
                              f"{group}=NAME{_group_options(group)} or a recipe (+recipe=NAME)")

    stage = cfg.stage
    # `???` (reward_model=pretrained with no dir) reads as unset here; the RL stage names that key itself
    trains_rm = stage == "rm" or (stage == "pipeline" and not OmegaConf.select(cfg, "reward_model.pretrained"))
    if trains_rm:
        need("rm", f"stage={stage} trains a reward model" + (" (reward_model.pretrained is not set)" if stage == "pipeline" else ""))
    if stage == "sft":
        need("sft", "stage=sft trains it")
    elif trains_rm and cfg.rm.backbone == "sft":
        need("sft", "rm.backbone=sft trains the reward model on the SFT stage's trunk")
    elif stage == "pipeline" and not OmegaConf.select(cfg, "policy.pretrained"):
        need("sft", "stage=pipeline starts the RL stage from the SFT stage (policy.pretrained is not set)")
    if stage == "pipeline":
        need("evaluation", "stage=pipeline ends with the before/after evaluation")


def make_plan(cfg: DictConfig) -> dict:
    """Which stages run and where their outputs are (cache dirs, or the user's explicit dirs)."""
    require_groups(cfg)
    want_sft = cfg.stage == "sft" or (cfg.stage == "rm" and cfg.rm.backbone == "sft") or (
        cfg.stage == "pipeline" and (not cfg.policy.pretrained or (not cfg.reward_model.pretrained and cfg.rm.backbone == "sft")))
    want_rm = cfg.stage == "rm" or (cfg.stage == "pipeline" and not cfg.reward_model.pretrained)
    sk = sft_key(cfg) if want_sft else None
    rk = rm_key(cfg, sk) if want_rm else None
    plan = {"sft_key": sk, "rm_key": rk,
            "sft_dir": stage_dir(cfg, "sft", sk) if sk else None, "rm_dir": stage_dir(cfg, "rm", rk) if rk else None}
    plan["run_sft"] = bool(sk) and not is_complete(plan["sft_dir"])
    plan["run_rm"] = bool(rk) and not is_complete(plan["rm_dir"])
    if cfg.stage == "pipeline":
        policy_from = str(cfg.policy.pretrained) if cfg.policy.pretrained else f"sft-{sk}"
        reward_from = str(cfg.reward_model.pretrained) if cfg.reward_model.pretrained else f"rm-{rk}"
        plan["rl_key"] = rl_key(cfg, policy_from, reward_from)
        plan["rl_dir"] = stage_dir(cfg, "rl", plan["rl_key"])
        plan["run_rl"] = not is_complete(plan["rl_dir"])
    else:
        plan["run_rl"] = False
    return plan


# --------------------------------------------------------------------------------------------
# The stages
# --------------------------------------------------------------------------------------------
def _strip_history(info: dict) -> dict:
    return {k: v for k, v in info.items() if k != "history"}


def run_sft_stage(cfg, tokenizer, plan, timer) -> dict:
    from rlhf_train.pipeline.sft import train_sft

    with timer("sft") as row:
        def build(tmp: Path) -> dict:
            return {**train_sft(cfg, tokenizer, tmp), "config": OmegaConf.to_container(cfg.sft, resolve=True)}

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
                    "config": OmegaConf.to_container(cfg.rm, resolve=True)}

        info, row["reused"] = cached_stage(plan["rm_dir"], build)
    log.info("[rm] validation pairwise accuracy %.3f; reward model in %s", info["rm/val_accuracy"], plan["rm_dir"])
    return info


def rl_config(cfg: DictConfig, policy_dir: str, rm_dir: str) -> DictConfig:
    """The pipeline's config for :func:`rlhf_train.loop.trainer.train`: policy and reward model from the stages."""
    rl_cfg = cfg.copy()
    with open_dict(rl_cfg):
        rl_cfg.stage = "rl"
        rl_cfg.policy.pretrained = policy_dir
        rl_cfg.reward_model.pretrained = rm_dir
    return rl_cfg


def run_rl_stage(cfg, run_dir: Path, plan, policy_dir: str, rm_dir: str, timer) -> dict:
    from rlhf_train.loop.trainer import train

    with timer(algorithm_name(cfg)) as row:  # the timings row reads e.g. "GRPO"
        def build(tmp: Path) -> dict:
            out = train(rl_config(cfg, policy_dir, rm_dir), run_dir)
            # the run's export (train writes it): a plain HF model dir; with LoRA merged, adapter in policy/adapter/
            shutil.copytree(run_dir / "policy", tmp / "policy")
            return {"metrics": out["metrics"], "history": out["history"]}

        info, row["reused"] = cached_stage(plan["rl_dir"], build)
    return info


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
def eval_prompts(cfg: DictConfig, tokenizer):
    from hydra.utils import instantiate

    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in ("batch_size", "num_workers")}
    data["max_prompts"] = cfg.evaluation.num_prompts
    if "split" in data:  # a dataset with splits (synthetic prompts have none)
        data["split"] = cfg.evaluation.split
    return instantiate(data, tokenizer=tokenizer)


def run_evaluation(cfg, run_dir: Path, tokenizer, judge, policy_dir: str, rm_dir: str, rl_dir: str, rl_info: dict,
                   timer) -> dict:
    """Before (``policy_dir``, also the KL reference) vs after (``rl_dir/policy``) on held-out prompts."""
    from transformers import AutoModelForCausalLM

    from rlhf_train.models.reward_model import build_reward_model
    from rlhf_train.pipeline.evaluate import (
        evaluate_policy,
        format_table,
        plot_rl_history,
        samples_table,
    )

    with timer("evaluate"):
        prompts = eval_prompts(cfg, tokenizer)
        ref = AutoModelForCausalLM.from_pretrained(policy_dir).eval().requires_grad_(False)
        after_lm = AutoModelForCausalLM.from_pretrained(str(Path(rl_dir) / "policy")).eval()
        rm = build_reward_model(tokenizer=tokenizer, pretrained=rm_dir)
        before = evaluate_policy(ref, ref, rm, tokenizer, prompts, cfg, judge)
        after = evaluate_policy(after_lm, ref, rm, tokenizer, prompts, cfg, judge)
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
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
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
    rm_dir = str(cfg.reward_model.pretrained) if cfg.reward_model.pretrained else str(plan["rm_dir"])
    rl_info = run_rl_stage(cfg, run_dir, plan, policy_dir, rm_dir, timer)
    summary.update({"sft": _strip_history(sft_info) if sft_info else {"from": policy_dir},
                    "rm": _strip_history(rm_info) if rm_info else {"from": rm_dir},
                    "rl_final_metrics": rl_info.get("metrics", {}),
                    "stage_dirs": {"sft": policy_dir, "rm": rm_dir, "rl": str(plan["rl_dir"])}})
    # 5. evaluation
    if not cfg.evaluation.enabled:
        return _finish(cfg, run_dir, summary, timer, t_start, rl_info["metrics"].get("objective/score"))
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
