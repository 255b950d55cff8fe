"""``python -m rlhf_train [+recipe=NAME] [key=value ...]``: the Hydra entry point."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from rlhf_train.schema import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig):
    from rlhf_train.errors import ConfigError
    from rlhf_train.stages import run_stage

    try:
        return run_stage(cfg)
    except ConfigError as err:  # bad input: one line, non-zero exit, nothing started
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
