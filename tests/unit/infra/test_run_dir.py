"""Run-dir safety and secrets (issue 17, items 1, 4, 5 and the last point of 7).

* a fresh run refuses a run dir that already holds checkpoints; ``trainer.resume=auto`` refuses a checkpoint
  written with another config (item 1);
* a lock on the run dir: a second run (or a resume) while one is live gets one line naming the other's PID,
  and leaves the live run's ``.hydra/`` alone (items 4, 7);
* secrets are redacted everywhere a run writes config, and nothing else is (item 5).

Budget: ~15 s in-process + ~25 s for two CLI starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhf_train.infra.errors import ConfigError
from tests.helpers.reliability import FAST, REPO, cli, files_of, make_cfg

SECRET = "SECRET123-do-not-log"


# --------------------------------------------------------------------------------------------
# item 1: a reused run dir
# --------------------------------------------------------------------------------------------
def test_fresh_run_refuses_a_dir_with_checkpoints_and_resume_checks_the_config(tmp_path):
    from rlhf_train.loop.trainer import train

    run = tmp_path / "run"
    train(make_cfg("trainer.num_iterations=2", "trainer.checkpoint_every=1"), run)
    before = files_of(run)
    with pytest.raises(ConfigError, match=r"hydra\.run\.dir=.* already holds checkpoints .*trainer\.resume=auto") as e:
        train(make_cfg("trainer.num_iterations=3", "trainer.seed=1"), run)
    assert "\n" not in str(e.value)
    assert files_of(run) == before  # nothing pruned, nothing overwritten
    with pytest.raises(ConfigError, match=r"another config.*trainer\.seed") as e:
        train(make_cfg("trainer.num_iterations=3", "trainer.seed=1", "trainer.resume=auto"), run)
    assert files_of(run) == before
    # the same config resumes (more iterations is not "another config"), and keeps the run id
    from rlhf_train.infra.checkpoint_files import list_checkpoints
    from rlhf_train.infra.resume import read_trainer_state

    run_id = read_trainer_state(list_checkpoints(run)[-1])["run_id"]
    out = train(make_cfg("trainer.num_iterations=3", "trainer.resume=auto"), run)
    assert [h["iteration"] for h in out["history"]] == [1, 2, 3]  # the history before the resume included
    assert read_trainer_state(list_checkpoints(run)[-1])["run_id"] == run_id


# --------------------------------------------------------------------------------------------
# item 4 (+7): a lock on the run dir
# --------------------------------------------------------------------------------------------
HOLD = ("import sys, time; from rlhf_train.infra.run_dir import lock_run_dir; lock_run_dir(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(120)")


@pytest.fixture
def held_lock(tmp_path):
    """A run dir whose lock another live process holds (as a running ``python -m rlhf_train`` does)."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield run, proc.pid
    proc.kill()
    proc.wait()


def test_second_run_in_a_live_run_dir_gets_one_line_naming_the_pid(held_lock):
    from rlhf_train.loop.trainer import train

    run, pid = held_lock
    with pytest.raises(ConfigError, match=rf"hydra\.run\.dir=.* is in use by another run \(PID {pid}\b") as e:
        train(make_cfg("trainer.num_iterations=1"), run)
    assert "\n" not in str(e.value) and not (run / "checkpoints").exists()


def test_second_run_via_cli_leaves_the_live_runs_hydra_dir_alone(held_lock):
    run, pid = held_lock
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("the live run's config\n")
    (run / ".hydra" / "overrides.yaml").write_text("- the live run's overrides\n")
    before = files_of(run / ".hydra")
    out = cli(*FAST, "trainer.num_iterations=1", f"hydra.run.dir={run}", timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("Error: ") and f"PID {pid}" in errors[0], out.stderr[-2000:]
    assert files_of(run / ".hydra") == before


def test_bad_input_aimed_at_an_existing_run_dir_keeps_its_hydra_dir(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("an earlier run's config\n")
    out = cli(*FAST, "update.clip_eps=-0.2", f"hydra.run.dir={run}", timeout=180)
    assert out.returncode == 2 and out.stderr.strip().startswith("Error: update.clip_eps"), out.stderr[-2000:]
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["config.yaml"]
    assert (run / ".hydra" / "config.yaml").read_text() == "an earlier run's config\n"


def test_lock_is_released_and_reacquired(tmp_path):
    from rlhf_train.infra.run_dir import lock_run_dir

    lock = lock_run_dir(tmp_path)
    assert f"{os.getpid()} " in (tmp_path / ".lock").read_text()
    lock.release()
    assert not (tmp_path / ".lock").exists()
    lock_run_dir(tmp_path).release()


# --------------------------------------------------------------------------------------------
# item 5: secrets
# --------------------------------------------------------------------------------------------
def test_redact_matches_whole_secret_key_names_only():
    from rlhf_train.infra.secrets import redact, redact_overrides

    cfg = {"tokenizer": {"pretrained": "gpt2", "pad_token": "<pad>"}, "rollout": {"max_new_tokens": 8},
           "logger": {"api_key": "a", "token": "b", "Password": "c"}, "hf_token": "d", "secret": "e",
           "wandb_api_key": "f", "tokens_per_step": 3}
    out = redact(cfg)
    assert out["tokenizer"] == cfg["tokenizer"] and out["rollout"] == cfg["rollout"]
    assert out["tokens_per_step"] == 3
    assert out["logger"] == {"api_key": "<redacted>", "token": "<redacted>", "Password": "<redacted>"}
    assert out["hf_token"] == out["secret"] == out["wandb_api_key"] == "<redacted>"
    assert redact_overrides(["+logger.api_key=SECRET123", "rollout.max_new_tokens=8", "hf_token=x"]) == [
        "+logger.api_key='<redacted>'", "rollout.max_new_tokens=8", "hf_token='<redacted>'"]
    assert redact_overrides("+logger.api_key=SECRET123,trainer.seed=1") == "+logger.api_key='<redacted>',trainer.seed=1"


def test_wandb_gets_no_secret_in_config_argv_or_names(tmp_path, monkeypatch):
    """A stand-in ``wandb`` module records what ``wandb.init`` was given (and the argv it could read)."""
    import types

    from omegaconf import OmegaConf

    from rlhf_train.infra import logger as logger_mod

    seen = {}
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kw: kw
    fake.init = lambda **kw: seen.update(kw, argv=list(sys.argv)) or types.SimpleNamespace(id="run1")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(sys, "argv", ["rlhf_train", f"+logger.api_key={SECRET}", "rollout.max_new_tokens=8"])
    monkeypatch.setattr(logger_mod, "wandb_names", lambda task=None: ("sweep", f"logger.api_key={SECRET},seed=1"))
    cfg = OmegaConf.create({"mode": "disabled", "project": "p", "entity": None, "group": None, "name": None,
                            "tags": [], "api_key": SECRET})
    logger_mod.WandbLogger(tmp_path, cfg, {"logger": {"api_key": SECRET}, "rollout": {"max_new_tokens": 8}})
    assert SECRET not in repr(seen), seen
    assert seen["config"]["rollout"]["max_new_tokens"] == 8
    assert sys.argv[1] == f"+logger.api_key={SECRET}"  # restored after init


@pytest.mark.slow
def test_cli_run_and_multirun_write_no_secret(tmp_path):
    run = tmp_path / "run"
    out = cli(*FAST, "trainer.num_iterations=1", f"+logger.api_key={SECRET}", f"hydra.run.dir={run}", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "api_key: <redacted>" in (run / ".hydra" / "config.yaml").read_text()
    assert "<redacted>" in (run / ".hydra" / "overrides.yaml").read_text()
    assert "max_new_tokens: 8" in (run / ".hydra" / "config.yaml").read_text()  # not over-redacted
    leaks = [name for name, data in files_of(run).items() if SECRET.encode() in data]
    assert not leaks, f"the secret leaked into {leaks}"
    # a multirun of two jobs that fail fast (bad input): dir names, job status and sweep report
    sweep = tmp_path / "sweep"
    out = cli("-m", *FAST, f"+logger.api_key={SECRET}", "rollout.max_new_tokens=0,-1", f"hydra.sweep.dir={sweep}",
              timeout=240)
    assert (sweep / "sweep_summary.csv").exists(), out.stderr[-3000:]
    leaks = [p for p in sweep.rglob("*") if SECRET in p.name or (p.is_file() and SECRET.encode() in p.read_bytes())]
    assert not leaks, f"the secret leaked into {leaks}"
    assert len([p for p in sweep.iterdir() if p.is_dir()]) == 2
    assert SECRET not in out.stdout + out.stderr


def test_job_status_and_report_rows_carry_redacted_overrides(tmp_path):
    """What the sweep report reads from a job's ``.hydra/hydra.yaml`` after the redaction callback."""
    from omegaconf import OmegaConf

    from rlhf_train.infra.secrets import RedactSecrets

    job = tmp_path / "0_x"
    (job / ".hydra").mkdir(parents=True)
    overrides = [f"+logger.api_key={SECRET}", "trainer.seed=1"]
    hydra_cfg = {"hydra": {"overrides": {"task": overrides}, "job": {"override_dirname": f"+logger.api_key={SECRET}"},
                           "output_subdir": ".hydra", "runtime": {"output_dir": str(job)}}}
    OmegaConf.save(OmegaConf.create(hydra_cfg), job / ".hydra" / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"logger": {"api_key": SECRET}, "tokenizer": {"x": 1}}), job / ".hydra" / "config.yaml")
    RedactSecrets().on_job_start(OmegaConf.create(hydra_cfg))
    for name, data in files_of(job).items():
        assert SECRET.encode() not in data, name
    assert OmegaConf.load(job / ".hydra" / "overrides.yaml")[1] == "trainer.seed=1"
    assert json.loads(json.dumps(OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "config.yaml"))))[
        "tokenizer"] == {"x": 1}
