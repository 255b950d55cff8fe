"""tests/helpers/zygote.py, which forks the suite's ``python -m rlhf_train`` runs from a pre-imported server,
gives what a fresh interpreter gives: exit code, stdout, stderr, the run dir; a signal as the exit status;
the request's cwd."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import zygote

REPO = Path(__file__).resolve().parents[2]


def _without_timestamps(text: str) -> str:
    return re.sub(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]", "[T]", text, flags=re.M)


def test_a_forked_run_prints_and_exits_as_a_fresh_interpreter(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    args = ["+recipe=smoke", "logger=csv", "scheduler.name=bogus"]  # bad input: one line, exit 2, dir removed
    fresh = subprocess.run([sys.executable, "-m", "rlhf_train", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    forked = zygote.run([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
    assert fresh.returncode == forked.returncode == 2, forked.stderr[-2000:]
    assert forked.stderr == fresh.stderr and fresh.stderr.startswith("Error: scheduler.name='bogus'")
    assert _without_timestamps(forked.stdout) == _without_timestamps(fresh.stdout) != ""
    assert not (tmp_path / "run").exists()


def test_a_signal_is_the_exit_status_and_the_cwd_is_the_requests(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    run = tmp_path / "run"
    proc = zygote.popen(["+recipe=smoke", "logger=csv", "trainer.num_iterations=1000", "trainer.progress_bar=false",
                         "hydra.run.dir=run"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (run / "metrics.csv").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert proc.pid != os.getpid()
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, out[-2000:]
    assert f"run dir: {run}" in out
