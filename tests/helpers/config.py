"""Composing the project's Hydra config in a test: ``compose(overrides)`` (no recipe unless one is given)."""
from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_train.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
