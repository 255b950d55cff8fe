"""``python -m rlhf_train [+recipe=NAME] [key=value ...]``: the Hydra entry point.

With no ``recipe=`` / ``+recipe=`` override it runs the embedded default: ``+recipe=default`` is added
to the command line (so ``.hydra/overrides.yaml`` shows it); ``conf/config.yaml`` alone is generic.
``--help`` is the page of ``conf/hydra/help/rlhf_train.yaml`` (recipes and groups read from ``conf/`` by
:mod:`rlhf_train.config.help`). A run logs its run dir first and what it wrote there last (the console and
``<run dir>/__main__.log``); bad input is one ``Error:`` line, exit 2, and no run dir left behind that this
start created unless a pipeline stage ran in it (:func:`rlhf_train.infra.run_dir.remove_unused_run_dir`);
a run dir that stays has the ``Error:`` line at the end of its log (exit 1 and exit 2 alike).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

# CPU defaults (huge pages for the logits, glibc's malloc keeping freed memory mapped), set before torch
# is imported: why and what they measured in rlhf_train/infra/cpu_defaults.py; export a variable to override.
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402  (imports nothing but os)

set_cpu_defaults()

import hydra  # noqa: E402  (after the CPU defaults)
from omegaconf import DictConfig  # noqa: E402

from rlhf_train.config.help import register_help_resolver  # noqa: E402
from rlhf_train.config.schema import register_configs  # noqa: E402

register_configs()
register_help_resolver()  # `--help` lists the recipes and config groups read from conf/


def _process_rank() -> int:
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


DEFAULT_RECIPE = "default"  # conf/recipe/default.yaml: the embedded default


def default_recipe_overrides(argv: list[str]) -> list[str]:
    """``["+recipe=default"]`` when the command line selects no recipe (``recipe=``, ``+recipe=``,
    ``++recipe=``), else ``[]``: ``python -m rlhf_train`` alone runs the embedded default."""
    if any(a.lstrip("+").startswith("recipe=") for a in argv):
        return []
    return [f"+recipe={DEFAULT_RECIPE}"]


def hydra_help_argv(argv: list[str]) -> list[str]:
    """For ``--hydra-help`` (Hydra's own page): the flags and ``hydra...`` overrides of ``argv`` only. Hydra
    composes that page without the primary config, where a recipe's ``override /group`` cannot apply."""
    return [a for a in argv if a.startswith("-") or a.lstrip("+~").startswith("hydra")]


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


log = logging.getLogger("rlhf_train")  # Hydra's job logging: the console and <run dir>/__main__.log


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import InstantiationException

    from rlhf_train.infra.checkpoint import CheckpointError
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.infra.logger import in_multirun
    from rlhf_train.infra.run_dir import (
        RUN_DIR_LINE,
        log_to_run_dir,
        remove_unused_run_dir,
        restore_hydra_dir,
        run_dir_contents,
    )
    from rlhf_train.pipeline.stages import run_stage
    from rlhf_train.pipeline.sweep import run_job

    hc = HydraConfig.get()
    run_dir, started, main_process = Path(hc.runtime.output_dir).absolute(), time.time(), _process_rank() == 0
    if main_process:
        log.info("%s%s", RUN_DIR_LINE, run_dir)

    def say_what_was_written():
        if main_process and run_dir.is_dir():
            log.info("[rlhf_train] written in %s: %s", run_dir, ", ".join(run_dir_contents(run_dir, started)))

    def bad_input(err) -> None:  # one line, exit 2; the run dir goes if this start created it and it is empty;
        print(f"Error: {err}", file=sys.stderr, flush=True)  # an existing run dir gets its .hydra/ back
        if main_process and not remove_unused_run_dir(run_dir, f"{hc.job.name}.log"):
            restore_hydra_dir(run_dir, str(hc.output_subdir or ".hydra"))
            log_to_run_dir(run_dir, f"Error: {err}")  # the kept log says why the start stopped
        sys.exit(2)

    if in_multirun():  # a failing job is recorded in the sweep report; the other jobs still run
        value = run_job(run_stage, cfg)
        say_what_was_written()
        return value
    try:
        value = run_stage(cfg)
    except ConfigError as err:  # bad input: one line, non-zero exit, nothing started
        bad_input(err)
    except InstantiationException as err:  # a ConfigError raised inside a _target_
        cause = err
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        bad_input(cause)
    except (FloatingPointError, CheckpointError) as err:  # max_consecutive_faults reached (last good state
        print(f"Error: {err}", file=sys.stderr, flush=True)  # checkpointed); a checkpoint write failed (disk full)
        say_what_was_written()
        if main_process:
            log_to_run_dir(run_dir, f"Error: {err}")  # the log ends with why the run stopped
        sys.exit(1)
    say_what_was_written()
    return value


if __name__ == "__main__":
    import atexit
    import gc

    # The interpreter's last act is a full garbage collection over every object torch, transformers and the
    # rest created at import (millions): 1.2-2 s of a 2-core machine's time at every exit (measured: the
    # imports of a run, then exit, 9.8 s median against 7.75 s with this). gc.freeze() in an atexit handler
    # moves them out of that walk; it runs after the run's own files, logs and W&B were closed (each in its
    # own code or atexit handler: the final collection is no place to rely on for that).
    atexit.register(gc.freeze)
    from rlhf_train.infra.preemption import die_with_parent, launched_by_torch_elastic

    if launched_by_torch_elastic():  # a worker of `accelerate launch` / torchrun: never outlive the launcher
        die_with_parent()
    from rlhf_train.config.moved_keys import moved_key_message

    moved = next((m for m in map(moved_key_message, sys.argv[1:]) if m), None)
    if moved:  # a key of an older layout: one line naming the new one, before Hydra composes
        print(f"Error: {moved}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "--hydra-help" in sys.argv[1:]:
        sys.argv[1:] = hydra_help_argv(sys.argv[1:])
    else:
        sys.argv += default_recipe_overrides(sys.argv[1:])
    sys.argv += non_main_process_overrides(sys.argv[1:])
    main()
