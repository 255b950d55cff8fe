"""What a pipeline run will do, decided before any work: the stages' cache keys (:func:`sft_key`,
:func:`rm_key`, :func:`rl_key`: what each stage's output depends on), the plan (:func:`make_plan`: which
stages run, where their outputs go) and the pre-flight checks of every input they need (:func:`preflight`).
:func:`rlhf_train.pipeline.run.run` executes the plan."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from rlhf_train.infra.errors import ConfigError
from rlhf_train.pipeline.cache import _plain, is_complete, stage_dir, stage_key
from rlhf_train.pipeline.sft import task_hook

PIPELINE_STAGES = ("pipeline", "sft", "rm")


# --------------------------------------------------------------------------------------------
# Keys of the stages and what they depend on
# --------------------------------------------------------------------------------------------
def algorithm_name(cfg: DictConfig) -> str:
    """The RL stage's name for a reader (timings, table, plot, report): the algorithm's, e.g. ``GRPO``."""
    return cfg.algorithm.name.upper() if cfg.get("algorithm") is not None else "PPO"


def uses_reward_model(cfg: DictConfig) -> bool:
    """Whether the RL stage has a reward model (``reward_model=none``: the ``rewards`` functions score alone)."""
    node = cfg.get("reward_model")
    return node is not None and bool(node.get("_target_"))


def trains_reward_model(cfg: DictConfig) -> bool:
    """``stage=rm``, or a pipeline whose reward model is not given (``reward_model.pretrained``)."""
    # `???` (reward_model=pretrained with no dir) reads as unset here; the RL stage names that key itself
    return cfg.stage == "rm" or (cfg.stage == "pipeline" and uses_reward_model(cfg)
                                 and not OmegaConf.select(cfg, "reward_model.pretrained"))


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
    if cfg.get("rewards"):  # the reward functions (keys without them are those from before they were hashed)
        parts["rewards"] = cfg.rewards
    if cfg.get("evaluation") is not None and cfg.evaluation.enabled and cfg.evaluation.every > 0:
        parts["evaluation"] = cfg.evaluation  # the RL stage's own held-out evaluation (its history)
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

        check_config(rl_config(cfg, str(cfg.policy.pretrained or plan["sft_dir"]), reward_model_dir(cfg, plan)))
        if cfg.policy.pretrained:
            check_loadable(cfg.policy.pretrained, "policy.pretrained", "policy")
        if uses_reward_model(cfg) and cfg.reward_model.pretrained:
            check_loadable(cfg.reward_model.pretrained, "reward_model.pretrained", "reward model")
        check = task_hook(cfg, "evaluation.task_check") if cfg.get("evaluation") is not None else None
        if cfg.data.get("dataset") and check is None:  # a task's check reads its own data (GSM8K: a configuration)
            load_text_dataset(cfg.data.dataset, cfg.data.split, "data.dataset")
        if check is not None:  # the task's data options (movie reviews: data.split / data.sentiment)
            check(cfg)
    if cfg.stage == "pipeline" and cfg.evaluation.enabled:
        from rlhf_train.loop.checks import check_evaluation

        check_positive("evaluation", cfg.evaluation, ("num_prompts", "batch_size"))
        check_evaluation(cfg)  # num_samples, pass_k
        if cfg.evaluation.judge:
            task_hook(cfg, "evaluation.judge_fn")
        if cfg.data.get("dataset") and not cfg.evaluation.get("task_check"):
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

    stage, trains_rm = cfg.stage, trains_reward_model(cfg)
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
    want_rm = trains_reward_model(cfg)
    want_sft = cfg.stage == "sft" or (want_rm and cfg.rm.backbone == "sft") or (
        cfg.stage == "pipeline" and not cfg.policy.pretrained)
    sk = sft_key(cfg) if want_sft else None
    rk = rm_key(cfg, sk) if want_rm else None
    plan = {"sft_key": sk, "rm_key": rk,
            "sft_dir": stage_dir(cfg, "sft", sk) if sk else None, "rm_dir": stage_dir(cfg, "rm", rk) if rk else None}
    plan["run_sft"] = bool(sk) and not is_complete(plan["sft_dir"])
    plan["run_rm"] = bool(rk) and not is_complete(plan["rm_dir"])
    if cfg.stage == "pipeline":
        policy_from = str(cfg.policy.pretrained) if cfg.policy.pretrained else f"sft-{sk}"
        reward_from = reward_model_dir(cfg, plan) if not rk else f"rm-{rk}"
        plan["rl_key"] = rl_key(cfg, policy_from, reward_from)
        plan["rl_dir"] = stage_dir(cfg, "rl", plan["rl_key"])
        plan["run_rl"] = not is_complete(plan["rl_dir"])
    else:
        plan["run_rl"] = False
    return plan


def reward_model_dir(cfg: DictConfig, plan: dict) -> str | None:
    """The RL stage's reward model: ``reward_model.pretrained``, else the RM stage's dir; ``None`` without one."""
    if not uses_reward_model(cfg):
        return None
    return str(cfg.reward_model.pretrained) if cfg.reward_model.pretrained else str(plan["rm_dir"])


def rl_config(cfg: DictConfig, policy_dir: str, rm_dir: str | None) -> DictConfig:
    """The pipeline's config for :func:`rlhf_train.loop.trainer.train`: policy and reward model (``None``: none)
    from the stages. The RL loop evaluates on held-out prompts only with ``evaluation.every`` > 0 (the evaluation
    stage does the before / after)."""
    rl_cfg = cfg.copy()
    with open_dict(rl_cfg):
        rl_cfg.stage = "rl"
        rl_cfg.policy.pretrained = policy_dir
        if rm_dir is not None:
            rl_cfg.reward_model.pretrained = rm_dir
        if rl_cfg.get("evaluation") is not None and not rl_cfg.evaluation.every:
            rl_cfg.evaluation = None
    return rl_cfg
