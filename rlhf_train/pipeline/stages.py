"""Dispatch on ``cfg.stage``: ``ppo`` (the PPO loop), ``sft``, ``rm`` or ``pipeline`` (all three + evaluation)."""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rlhf_train.infra.errors import ConfigError

STAGES = ("pipeline", "sft", "rm", "ppo")


def run_dir() -> str:
    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # not under @hydra.main (tests calling compose)
        import os

        return os.getcwd()


def run_stage(cfg: DictConfig):
    if cfg.stage not in STAGES:
        raise ConfigError(f"stage='{cfg.stage}' is not valid; choose one of {', '.join(STAGES)}")
    if cfg.stage == "ppo":
        from rlhf_train.loop.trainer import train

        out = train(cfg, run_dir())
        return out["metrics"].get("objective/score")
    from rlhf_train.pipeline.run import run

    return run(cfg, run_dir())
