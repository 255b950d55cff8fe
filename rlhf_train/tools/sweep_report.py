"""The report of a sweep written afterwards: ``python -m rlhf_train.tools.sweep_report SWEEP_DIR``.

A sweep writes its report itself when it ends, also when a preemption, Ctrl-C or a crash ends it early
(:mod:`rlhf_train.pipeline.sweep`). What no process can do anything about (SIGKILL, an OOM kill,
``os._exit``) leaves a sweep dir without one, or with one from before; this writes it from the job dirs
(every dir under ``SWEEP_DIR`` with a ``.hydra/hydra.yaml``; a job without ``job_status.json`` is
``failed``: its process died or the sweep stopped) and the sweep's overrides (``SWEEP_DIR/multirun.yaml``).
Exit 0 when every job completed, 1 when one failed, 2 (one ``Error:`` line) when ``SWEEP_DIR`` is not a
sweep dir.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf

    from rlhf_train.pipeline.sweep import report_sweep

    parser = argparse.ArgumentParser(prog="python -m rlhf_train.tools.sweep_report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep dir (hydra.sweep.dir), which holds multirun.yaml")
    args = parser.parse_args(argv)
    multirun = args.sweep_dir / "multirun.yaml"
    if not multirun.is_file():
        print(f"Error: {args.sweep_dir} is not a sweep dir (no multirun.yaml in it); name the hydra.sweep.dir of "
              f"a `python -m rlhf_train -m ...` sweep", file=sys.stderr, flush=True)
        return 2
    overrides = OmegaConf.select(OmegaConf.load(multirun), "hydra.overrides.task") or []
    rows, paths = report_sweep(args.sweep_dir, list(overrides))
    failed = sum(r["status"] != "completed" for r in rows)
    print(f"[rlhf_train] sweep report ({len(rows)} jobs, {failed} failed): " + ", ".join(map(str, paths)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
