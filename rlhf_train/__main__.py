"""``python -m rlhf_train [+recipe=NAME] [key=value ...]``: the Hydra entry point."""
from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from rlhf_train.config.schema import register_configs

register_configs()


def _process_rank() -> int:
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def non_main_process_overrides(argv: list[str]) -> list[str]:
    """Extra Hydra overrides for processes other than rank 0 of a multi-process launch: they write
    nothing into the run dir (no ``.hydra/``, no ``<job>.log``); rank 0 writes the logs and checkpoints."""
    if _process_rank() == 0 or int(os.environ.get("WORLD_SIZE", "2")) <= 1:
        return []
    extra = []
    if not any(a.startswith(("hydra.output_subdir=", "++hydra.output_subdir=")) for a in argv):
        extra.append("hydra.output_subdir=null")
    if not any(a.lstrip("+").startswith("hydra/job_logging=") for a in argv):
        extra.append("hydra/job_logging=stdout")
    return extra


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig):
    from hydra.errors import InstantiationException

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.infra.logger import in_multirun
    from rlhf_train.pipeline.stages import run_stage
    from rlhf_train.pipeline.sweep import run_job

    if in_multirun():  # a failing job is recorded in the sweep report; the other jobs still run
        return run_job(run_stage, cfg)
    try:
        return run_stage(cfg)
    except ConfigError as err:  # bad input: one line, non-zero exit, nothing started
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except InstantiationException as err:  # a ConfigError raised inside a _target_
        cause = err
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        print(f"Error: {cause}", file=sys.stderr, flush=True)
        sys.exit(2)
    except FloatingPointError as err:  # trainer.max_consecutive_faults reached: last good state checkpointed
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    sys.argv += non_main_process_overrides(sys.argv[1:])
    main()
