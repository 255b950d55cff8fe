"""Sweeps that lose nothing and hide nothing (rlhf_train/pipeline/sweep.py, ``hydra.sweep.subdir``).

Two real multiruns of tiny smoke jobs (~20 s together on 2 CPU cores, most of it imports and one job's
iteration): every job is found by the report and the exit status says whether one failed, with a ``/`` in
an override (a path), an override longer than a file name may be, and jobs that end with a BaseException
(``sys.exit(0)`` and a preemption's ``SystemExit(143)``).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import zygote

FAST = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "data.batch_size=4", "data.max_prompts=12",
        "update.minibatch_size=2", "update.num_epochs=1", "rollout.max_new_tokens=8", "trainer.num_iterations=1"]

# shaping entries named by `_target_`: Bye ends its job with sys.exit(0) (a BaseException that is not an
# Exception) while the run is being built; Preempt raises what a preempted run raises; Noop does nothing
HOOKS = '''
import sys


class Bye:
    def __init__(self):
        sys.exit(0)


class Preempt:
    def __init__(self):
        raise SystemExit(143)


class Noop:
    def __call__(self, rollout):
        return rollout
'''

LONG = "x" * 300  # longer than a file name may be (255 bytes)


def _sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "sweep_hooks.py").write_text(HOOKS)
    cmd = ["-m", *FAST, *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return zygote.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def _rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_sweep_with_path_and_long_overrides_and_an_exiting_job_reports_every_job(tmp_path):
    cache = os.environ.get("RLHF_TRAIN_CACHE") or str(Path.home() / ".cache" / "rlhf_train")  # a path: has `/`
    proc = _sweep(tmp_path, f"cache_dir={cache}", f"task_name={LONG}",
                  "+transforms.hook._target_=sweep_hooks.Bye,sweep_hooks.Noop")
    assert proc.returncode == 1, proc.stderr[-3000:]  # job 0 failed
    assert "job 0" in proc.stderr and "SystemExit" in proc.stderr
    sweep_dir = tmp_path / "sweep"
    job_dirs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [d.name.split("_")[0] for d in job_dirs] == ["0", "1"]  # one flat, short dir per job
    for d in job_dirs:
        assert len(d.name) <= 100 and "/" not in d.name
        assert f"task_name={LONG}" in OmegaConf.load(d / ".hydra" / "overrides.yaml")  # the full overrides
    rows = _rows(sweep_dir)
    assert [(r["job"], r["transforms.hook._target_"], r["status"]) for r in rows] == [
        ("0", "sweep_hooks.Bye", "failed"), ("1", "sweep_hooks.Noop", "completed")]
    assert "SystemExit" in rows[0]["error"]
    assert f"task_name={LONG}" in rows[0]["overrides"] and f"cache_dir={cache}" in rows[1]["overrides"]
    assert [Path(r["run_dir"]) for r in rows] == [d.resolve() for d in job_dirs]
    assert json.loads((job_dirs[1] / "final_metrics.json").read_text())["iteration"] == 1


@pytest.mark.slow
def test_preempted_sweep_stops_with_a_report_and_exit_143(tmp_path):
    proc = _sweep(tmp_path, "+transforms.hook._target_=sweep_hooks.Preempt,sweep_hooks.Noop")
    assert proc.returncode == 143, proc.stderr[-3000:]  # what schedulers requeue on; job 1 never starts
    rows = _rows(tmp_path / "sweep")
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed")]
    assert "SystemExit: 143" in rows[0]["error"] and "sweep stopped" in proc.stderr
