"""Hydra multirun sweeps and the sweep report (rlhf_train/pipeline/sweep.py).

Budget: the two CLI sweeps take ~60 s + ~30 s on 2 quiet CPU cores (5 short smoke jobs, imports paid
once per sweep); the rest is in-process and well under a second.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf_train.infra.logger import in_multirun, wandb_names, write_final_metrics
from rlhf_train.pipeline.sweep import (
    collect_rows,
    swept_keys,
    write_report,
)
from tests.helpers import zygote

# smoke recipe, cut down to one short PPO iteration per job
FAST = ["+recipe=smoke", "logger=csv", "trainer.num_iterations=1", "trainer.progress_bar=false",
        "rollout.max_new_tokens=8", "update.num_epochs=1"]


def _multirun(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    sweep_dir = tmp_path / "sweep"
    cmd = ["-m", *FAST, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    return zygote.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                      env={**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"})


def _rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_sweep_2x2_writes_job_dirs_and_report(tmp_path):
    proc = _multirun(tmp_path, "kl_controller=adaptive", "kl_controller.init_kl_coef=0.05,0.2",
                     "kl_controller.target=3,6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_dir = tmp_path / "sweep"
    job_dirs = sorted(p.parent.parent for p in sweep_dir.glob("*/.hydra/hydra.yaml"))
    assert len(job_dirs) == 4
    for d in job_dirs:
        assert json.loads((d / "job_status.json").read_text())["status"] == "completed"
        assert (d / "final_metrics.json").is_file() and (d / "metrics.csv").is_file()

    rows = _rows(sweep_dir)
    assert len(rows) == 4
    assert {(r["kl_controller.init_kl_coef"], r["kl_controller.target"]) for r in rows} == {
        ("0.05", "3"), ("0.05", "6"), ("0.2", "3"), ("0.2", "6")}
    for r in rows:
        assert r["status"] == "completed" and r["error"] == ""
        # the coefficient the job used is the swept one
        assert math.isclose(float(r["objective/kl_coef"]), float(r["kl_controller.init_kl_coef"]), rel_tol=1e-6)
        assert math.isfinite(float(r["objective/reward_raw"])) and math.isfinite(float(r["objective/kl"]))
        assert Path(r["run_dir"]).is_dir() and Path(r["run_dir"]).parent == sweep_dir.resolve()
    assert (sweep_dir / "sweep_report.png").stat().st_size > 10_000
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert md.count("| completed |") == 4 and "sweep_report.png" in md


@pytest.mark.slow
def test_sweep_with_a_failing_job_still_reports(tmp_path):
    # job 0 fails validation (target must be positive); job 1 still runs; the report says which failed
    proc = _multirun(tmp_path, "kl_controller.target=-1,6")
    assert proc.returncode == 1, proc.stderr[-3000:]  # documented: non-zero after the report if a job failed
    assert "job 0" in proc.stderr and "kl_controller.target" in proc.stderr
    rows = _rows(tmp_path / "sweep")
    assert [(r["job"], r["kl_controller.target"], r["status"]) for r in rows] == [
        ("0", "-1", "failed"), ("1", "6", "completed")]
    assert "ConfigError" in rows[0]["error"] and "kl_controller.target" in rows[0]["error"]
    assert rows[0]["objective/reward_raw"] == "" and math.isfinite(float(rows[1]["objective/reward_raw"]))
    assert (tmp_path / "sweep" / "sweep_report.png").is_file()


# ------------------------------------------------------------------ in-process pieces
def _fake_job(sweep_dir: Path, num: int, overrides: list[str], status: str = "completed", judge: float | None = None):
    d = sweep_dir / f"{num}_job"
    (d / ".hydra").mkdir(parents=True)
    OmegaConf.save({"hydra": {"job": {"num": num}, "overrides": {"task": overrides}}}, d / ".hydra" / "hydra.yaml")
    (d / "job_status.json").write_text(json.dumps({"status": status, "error": None if status == "completed" else "boom"}))
    if status == "completed":
        hist = [{"iteration": i, "objective/reward_raw": 0.1 * i + num, "objective/kl": 0.5 * i,
                 "objective/kl_coef": 0.1, "objective/kl_coef_next": 0.1} for i in (1, 2, 3)]
        write_final_metrics(d, hist[-1], hist)
    if judge is not None:
        (d / "summary.json").write_text(json.dumps({"judge_positive_rate_before": 0.5, "judge_positive_rate_after": judge,
                                                    "timings": {"judge": {"wall_s": 1.0}}}))


def test_report_from_job_dirs_includes_judge_and_failures(tmp_path):
    _fake_job(tmp_path, 0, ["+recipe=smoke", "kl_controller.kl_coef=0.1"], judge=0.75)
    _fake_job(tmp_path, 1, ["+recipe=smoke", "kl_controller.kl_coef=0.3"], status="failed")
    swept = swept_keys(["+recipe=smoke", "kl_controller.kl_coef=0.1,0.3"])
    rows, keys = collect_rows(tmp_path, swept)
    assert keys == ["kl_controller.kl_coef"]
    write_report(tmp_path, rows, keys)
    out = _rows(tmp_path)
    assert [(r["kl_controller.kl_coef"], r["status"], r["error"]) for r in out] == [
        ("0.1", "completed", ""), ("0.3", "failed", "boom")]
    assert float(out[0]["judge_positive_rate"]) == 0.75 and out[1]["judge_positive_rate"] == ""
    assert float(out[0]["objective/reward_raw"]) == pytest.approx(0.3) and out[0]["iterations"] == "3"
    assert (tmp_path / "sweep_report.png").is_file() and "| failed |" in (tmp_path / "sweep_summary.md").read_text()


def test_wandb_group_and_name_in_multirun(tmp_path, monkeypatch):
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rlhf_train.infra.logger import WandbLogger

    assert wandb_names("smoke") == (None, None)  # not in a multirun
    hc = OmegaConf.create({"hydra": OmegaConf.structured(HydraConf)})
    hc.hydra.mode = RunMode.MULTIRUN
    hc.hydra.sweep.dir = str(tmp_path / "kl_sweep")
    hc.hydra.job.num = 3
    hc.hydra.job.override_dirname = "kl_controller.kl_coef=0.1"
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(id="x"),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    try:
        HydraConfig.instance().set_config(hc)
        assert in_multirun()
        assert wandb_names("smoke") == ("smoke-kl_sweep", "kl_controller.kl_coef=0.1")
        assert wandb_names("kl") == ("kl_sweep", "kl_controller.kl_coef=0.1")
        log_cfg = OmegaConf.create({"kind": "wandb", "project": "p", "entity": None, "group": None, "name": None,
                                    "mode": "offline", "tags": []})
        WandbLogger(tmp_path, log_cfg, {"task_name": "smoke"})
        assert (calls[-1]["group"], calls[-1]["name"]) == ("smoke-kl_sweep", "kl_controller.kl_coef=0.1")
        log_cfg.group, log_cfg.name = "mine", "run1"  # explicit settings win
        WandbLogger(tmp_path, log_cfg, {"task_name": "smoke"})
        assert (calls[-1]["group"], calls[-1]["name"]) == ("mine", "run1")
    finally:
        HydraConfig.instance().cfg = None


# ------------------------------------------------------------------ nothing lost, nothing silent
def test_job_dirname_is_short_and_safe():
    from rlhf_train.pipeline.sweep import JOB_DIRNAME_CHARS, job_dirname

    name = job_dirname("cache_dir=/data/my cache,+logger.api_key=s3cr3t,data.dataset=/srv/ds/é," + "x=" + "v" * 500)
    assert name.startswith("cache_dir=_data_my_cache,data.dataset=_srv_ds_,x=vvv") and len(name) == JOB_DIRNAME_CHARS
    assert "s3cr3t" not in name and "api_key" not in name  # secret overrides stay out of dir names
    assert job_dirname("kl_controller.kl_coef=0.1,kl_controller.target=3") == "kl_controller.kl_coef=0.1,kl_controller.target=3"


def test_report_finds_job_dirs_at_any_depth_but_not_runs_nested_in_a_job(tmp_path):
    # a `hydra.sweep.subdir` that nests (as `/` in an override value did); a pipeline's own run inside job 1
    _fake_job(tmp_path / "0_cache_dir=" / "data" / "c", 0, ["cache_dir=/data/c", "seed=1"], status="failed")
    _fake_job(tmp_path, 1, ["cache_dir=/data/c", "seed=2"])
    _fake_job(tmp_path / "1_job" / "rl", 7, ["stage=rl"])
    rows, keys = collect_rows(tmp_path, ["seed"])
    assert [(r["job"], r["seed"], r["status"]) for r in rows] == [(0, "1", "failed"), (1, "2", "completed")]
    assert rows[0]["overrides"] == "cache_dir=/data/c seed=1"


def _hydra_config(tmp_path: Path, num: int = 0):
    from hydra.conf import HydraConf
    from hydra.types import RunMode

    hc = OmegaConf.create({"hydra": OmegaConf.structured(HydraConf)})
    hc.hydra.mode = RunMode.MULTIRUN
    hc.hydra.sweep.dir = str(tmp_path)
    hc.hydra.job.num = num
    hc.hydra.job.override_dirname = "seed=1"
    hc.hydra.runtime.output_dir = str(tmp_path / f"{num}_job")
    hc.hydra.overrides.task = ["+recipe=smoke", "seed=1,2"]
    return hc


def test_run_job_catches_any_base_exception_but_stops_the_sweep_when_preempted(tmp_path):
    from hydra.core.hydra_config import HydraConfig

    from rlhf_train.pipeline.sweep import JobFailed, run_job

    hc = _hydra_config(tmp_path)
    (tmp_path / "0_job").mkdir()
    try:
        HydraConfig.instance().set_config(hc)
        assert run_job(lambda cfg: sys.exit(0), OmegaConf.create({})) == JobFailed("SystemExit: 0")  # next job runs
        assert run_job(lambda cfg: 3, OmegaConf.create({})) == 3
        with pytest.raises(SystemExit) as stopped:  # preempted: the sweep stops, the job's status is kept
            run_job(lambda cfg: sys.exit(143), OmegaConf.create({}))
        assert stopped.value.code == 143
        status = json.loads((tmp_path / "0_job" / "job_status.json").read_text())
        assert (status["status"], status["error"]) == ("failed", "SystemExit: 143")
    finally:
        HydraConfig.instance().cfg = None


def test_a_sweep_that_stops_early_still_gets_its_report(tmp_path):
    import atexit

    from rlhf_train.pipeline.sweep import SweepReportCallback

    cb = SweepReportCallback()
    cb.on_multirun_start(_hydra_config(tmp_path))
    try:
        _fake_job(tmp_path, 0, ["+recipe=smoke", "seed=1"])
        (tmp_path / "1_job" / ".hydra").mkdir(parents=True)  # job 1 had started when the sweep was stopped
        OmegaConf.save({"hydra": {"job": {"num": 1}, "overrides": {"task": ["+recipe=smoke", "seed=2"]}}},
                       tmp_path / "1_job" / ".hydra" / "hydra.yaml")
        cb._report_unfinished()  # what atexit calls when the sweep ends before on_multirun_end
        assert [(r["job"], r["seed"], r["status"]) for r in _rows(tmp_path)] == [("0", "1", "completed"), ("1", "2", "failed")]
        assert "sweep stopped" in _rows(tmp_path)[1]["error"]
    finally:
        atexit.unregister(cb._report_unfinished)


def test_sweep_report_tool_writes_the_report_of_a_killed_sweep(tmp_path, capsys):
    from rlhf_train.tools.sweep_report import main

    OmegaConf.save({"hydra": {"overrides": {"task": ["+recipe=smoke", "seed=1,2"]}}}, tmp_path / "multirun.yaml")
    _fake_job(tmp_path, 0, ["+recipe=smoke", "seed=1"])
    (tmp_path / "1_job" / ".hydra").mkdir(parents=True)  # killed (SIGKILL) while job 1 ran: no job_status.json
    OmegaConf.save({"hydra": {"job": {"num": 1}, "overrides": {"task": ["+recipe=smoke", "seed=2"]}}},
                   tmp_path / "1_job" / ".hydra" / "hydra.yaml")
    assert main([str(tmp_path)]) == 1
    assert [(r["job"], r["seed"], r["status"]) for r in _rows(tmp_path)] == [("0", "1", "completed"), ("1", "2", "failed")]
    capsys.readouterr()
    assert main([str(tmp_path / "1_job")]) == 2  # not a sweep dir: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error: ") and "multirun.yaml" in err[0]


def test_report_reads_a_null_metric_as_missing(tmp_path):
    """final_metrics.json writes a NaN / inf metric as null (valid JSON): the report shows it as an empty cell."""
    _fake_job(tmp_path, 0, ["+recipe=smoke", "kl_controller.kl_coef=0.1"])
    hist = [{"iteration": 1, "objective/reward_raw": float("nan"), "objective/kl": float("inf")}]
    write_final_metrics(tmp_path / "0_job", hist[-1], hist)
    rows, _ = collect_rows(tmp_path, swept_keys(["+recipe=smoke", "kl_controller.kl_coef=0.1"]))
    assert math.isnan(rows[0]["objective/reward_raw"]) and math.isnan(rows[0]["_history"][0]["objective/kl"])
