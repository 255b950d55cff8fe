"""Dispatch on ``cfg.stage``: ``rl`` (the RL loop alone: PPO, GRPO, ... by ``algorithm``), ``sft``, ``rm`` or
``pipeline`` (all three + evaluation). ``stage=ppo`` (its old name) stops at start with one line naming ``rl``."""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rlhf_train.infra.errors import ConfigError

STAGES = ("pipeline", "sft", "rm", "rl")
RENAMED_STAGES = {"ppo": "rl"}  # old name -> new: a ConfigError saying which to use


def run_dir() -> str:
    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # not under @hydra.main (tests calling compose)
        import os

        return os.getcwd()


def run_stage(cfg: DictConfig):
    if cfg.stage in RENAMED_STAGES:
        raise ConfigError(f"stage={cfg.stage} was renamed: use stage={RENAMED_STAGES[cfg.stage]} (the RL loop alone, "
                          f"whatever the algorithm)")
    if cfg.stage not in STAGES:
        raise ConfigError(f"stage='{cfg.stage}' is not valid; choose one of {', '.join(STAGES)}")
    if cfg.stage == "rl":
        from rlhf_train.loop.trainer import train

        out = train(cfg, run_dir())
        return out["metrics"].get("objective/score")
    from rlhf_train.pipeline.run import run

    return run(cfg, run_dir())
