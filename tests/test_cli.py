"""``python -m rlhf_train`` as a user runs it (subprocesses, offline).

1. Bad keys and values fail at start with a non-zero exit and a message naming the key (Hydra's
   messages for unknown keys / wrong types; ours for values Hydra cannot check).
2. An unknown KL estimator fails at start — before any model is built — with one line listing k1, k2, k3.
3. The reward-shaping stack can be changed from the command line: the k3 estimator, and the EOS-penalty
   entry dropped (``~transforms.eos_penalty``), both run.
4. The process-wide CPU settings (``OMP_WAIT_POLICY``, ``THP_MEM_ALLOC_ENABLE``) belong to the command-line
   entry point: ``import rlhf_train`` leaves the environment alone.

Budget: ~30 s on 2 CPU cores (two short training runs; each start imports torch and transformers).
"""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*overrides, tmp_path, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["WANDB_MODE"] = "disabled"
    cmd = [sys.executable, "-m", "rlhf_train", "+recipe=smoke", f"hydra.run.dir={tmp_path}",
           "trainer.progress_bar=false", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override, key", [
    ("ppo.nonexistent=1", "ppo.nonexistent"),   # unknown key
    ("ppo.clip_eps=abc", "ppo.clip_eps"),       # wrong type
])
def test_bad_override_exits_nonzero_naming_the_key(override, key, tmp_path):
    proc = run(override, tmp_path=tmp_path)
    assert proc.returncode != 0
    assert key in proc.stderr, proc.stderr


def test_unknown_estimator_fails_at_start_with_one_line(tmp_path):
    proc = run("transforms.kl.estimator=k4", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "estimator" in line]
    assert len(lines) == 1, proc.stderr
    assert "transforms.kl.estimator" in lines[0] and "k1, k2, k3" in lines[0]
    assert "Traceback" not in proc.stderr
    # nothing was started: no checkpoint, no metrics
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()


@pytest.mark.slow
def test_k3_estimator_runs(tmp_path):
    proc = run("transforms.kl.estimator=k3", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert len(rows) == 2
    assert all(float(r["objective/kl"]) >= 0 for r in rows)  # k3 is never negative


@pytest.mark.slow
def test_dropping_the_eos_penalty_entry_runs(tmp_path):
    proc = run("~transforms.eos_penalty", "trainer.num_iterations=1", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(csv.DictReader(open(tmp_path / "metrics.csv")))) == 1


# --------------------------------------------------------------------------- 4. CPU settings
CPU_VARS = ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")


def _env_after(statement: str) -> list[str]:
    """The two variables as seen by a fresh interpreter (started with both unset) after ``statement``."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_VARS}
    code = f"import os; {statement}; print([os.environ.get(k) for k in {CPU_VARS!r}])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


def test_import_leaves_cpu_settings_untouched():
    assert _env_after("import rlhf_train") == [None, None]


def test_entry_point_sets_cpu_settings_before_torch():
    # the entry point sets them at import, before anything it imports can import torch
    assert _env_after("import rlhf_train.__main__, sys; assert 'torch' not in sys.modules") == ["PASSIVE", "1"]
