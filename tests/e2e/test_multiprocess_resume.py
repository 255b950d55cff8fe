"""Several processes and machines (issue 17, items 2, 3 and 9), on CPU (gloo), in one chain of runs:

A. reference: ``accelerate launch`` with 2 processes, uninterrupted;
B. the same run, its launcher's process group killed with SIGKILL after checkpoint 2: the workers
   (torch elastic starts them in their own sessions) must die with their launcher (item 3);
C. resumed (``trainer.resume=auto``) as 2 "machines" × 1 process on localhost, each launched by
   ``python -m rlhf_train.tools.launch`` (= ``accelerate launch --num_machines 2 --machine_rank R
   --main_process_ip 127.0.0.1 --main_process_port P``); machine 1 cannot see rank 0's checkpoints (its own
   local disk, tests/helpers/reliability_worker.py). SIGTERM to machine 0's launcher: checkpoint, exit 143 from
   both launchers (item 3, item 9);
D. resumed again on one machine with 2 processes, to the end.
``metrics.csv`` of B+C+D must equal A's, cell for cell: per-process state (RNGs, PPO minibatch generator)
is restored per rank (item 2), and the 2-machine part trains exactly like 2 processes on one machine.

Budget: ~2-3 min on 2 idle cores (A and B side by side, then C, then D), hence ``slow``. Every launch has a
hard timeout and is killed with its whole process group, so a hang fails the test instead of CI.
"""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.ports import free_port
from tests.helpers.reliability import REPO

WORKER = str(REPO / "tests" / "helpers" / "reliability_worker.py")
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
LAUNCH = [sys.executable, "-m", "rlhf_train.tools.launch"]
FLAGS = ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
ONE_MACHINE = [*FLAGS, "--num_processes", "2", "--num_machines", "1"]
ITERATIONS = 5
CFG = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "trainer.num_threads=1", "data.batch_size=4",
       "data.max_prompts=24", "update.minibatch_size=2", "update.num_epochs=1", "rollout.max_new_tokens=8",
       "trainer.checkpoint_every=1", f"trainer.num_iterations={ITERATIONS}"]
TIMEOUT_S = 400


def _env(cache: Path, **extra) -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "RLHF_TRAIN_CACHE": str(cache), **extra}


def _start(cmd: list[str], cwd: Path, log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as f:  # its own process group: the test can kill the launcher and all it started
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, log: Path, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{log.name}: no exit in time (hang?)\n{log.read_text()[-3000:]}")


def _until(cond, proc: subprocess.Popen, log: Path, deadline: float, what: str) -> None:
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"{log.name} exited ({proc.returncode}) before {what}\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{log.name}: no {what} in time\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


@pytest.mark.slow
def test_kill_resume_on_two_machines_preempt_resume_gives_the_uninterrupted_metrics(tmp_path):
    import psutil

    cache, deadline = tmp_path / "cache", time.monotonic() + TIMEOUT_S
    ref, res = tmp_path / "reference", tmp_path / "resumed"
    env = _env(cache)
    # A + B side by side, each on a port of its own (started together, both could otherwise see accelerate's
    # default port free and then race for it: EADDRINUSE)
    a = _start([*ACCELERATE, *ONE_MACHINE, "--main_process_port", str(free_port()), WORKER, *CFG,
                f"hydra.run.dir={ref}"], tmp_path, tmp_path / "A.log", env)
    b = _start([*ACCELERATE, *ONE_MACHINE, "--main_process_port", str(free_port()), WORKER, *CFG,
                f"hydra.run.dir={res}"], tmp_path, tmp_path / "B.log", env)
    try:
        _until(lambda: (res / "checkpoints" / "iter_000002" / "COMPLETE").exists(), b, tmp_path / "B.log", deadline,
               "checkpoint 2")
        workers = psutil.Process(b.pid).children(recursive=True)
        assert len([w for w in workers if "reliability_worker" in " ".join(w.cmdline())]) == 2, workers
        os.killpg(b.pid, signal.SIGKILL)  # the launcher's process group: the workers are in sessions of their own
        b.wait()
        gone, alive = psutil.wait_procs(workers, timeout=20)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"workers outlived their launcher: {alive}"
        assert _wait(a, tmp_path / "A.log", deadline) == 0, (tmp_path / "A.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    killed_rows = len(_rows(res))
    assert 2 <= killed_rows < ITERATIONS

    # C: resume as 2 machines x 1 process; machine 1 has its own disk; SIGTERM to machine 0's launcher
    port, resume = free_port(), ["trainer.resume=auto", f"hydra.run.dir={res}"]
    machines = [_start([*LAUNCH, *FLAGS, "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(r),
                        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), WORKER, *CFG, *resume],
                       tmp_path / f"m{r}", tmp_path / f"C{r}.log", _env(cache, RLHF_TEST_LOCAL_DISK="1"))
                for r in (0, 1) if (tmp_path / f"m{r}").mkdir() is None]
    try:
        _until(lambda: len(_rows(res)) > killed_rows, machines[0], tmp_path / "C0.log", deadline, "a resumed iteration")
        os.kill(machines[0].pid, signal.SIGTERM)
        codes = [_wait(m, tmp_path / f"C{r}.log", deadline) for r, m in enumerate(machines)]
    finally:
        for m in machines:
            if m.poll() is None:
                os.killpg(m.pid, signal.SIGKILL)
    log0 = (tmp_path / "C0.log").read_text()
    assert codes == [143, 143], f"{codes}\n{log0[-3000:]}\n{(tmp_path / 'C1.log').read_text()[-3000:]}"
    assert "Traceback" not in log0, log0[-3000:]
    assert "resumed from" in log0 and "preempted: checkpoint written at iteration" in log0, log0[-3000:]
    assert not list((tmp_path / "m1").rglob("*.csv")) and not list((tmp_path / "m0").rglob("checkpoints"))
    preempted_rows = len(_rows(res))
    assert killed_rows < preempted_rows < ITERATIONS, preempted_rows

    # D: resume on one machine, to the end
    d = _start([*ACCELERATE, *ONE_MACHINE, WORKER, *CFG, *resume], tmp_path, tmp_path / "D.log", env)
    try:
        assert _wait(d, tmp_path / "D.log", deadline) == 0, (tmp_path / "D.log").read_text()[-3000:]
    finally:
        if d.poll() is None:
            os.killpg(d.pid, signal.SIGKILL)
    assert (res / "metrics.csv").read_text() == (ref / "metrics.csv").read_text()
    rows = _rows(ref)
    assert [int(r["iteration"]) for r in rows] == list(range(1, ITERATIONS + 1))


def test_slurm_script_launches_one_launcher_per_node_and_requeues_on_143(tmp_path):
    """slurm/rlhf_train.sbatch with stand-ins for ``srun`` (records the command, exits 143: preempted) and
    ``scontrol`` (records the requeue; lists the nodes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/srun.txt\nexit 143\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then echo node7; echo node8; '
                                      f'else echo "$@" >> {tmp_path}/scontrol.txt; fi\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[7-8]",
           "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "99", "SLURM_JOB_NAME": "rlhf_train"}
    out = subprocess.run(["bash", str(REPO / "slurm" / "rlhf_train.sbatch"), "+recipe=smoke", "task_name=a b"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 143, out.stderr
    inner = " ".join((tmp_path / "srun.txt").read_text().splitlines()[-1].split())  # each node task's command
    assert inner.startswith("python -m rlhf_train.tools.launch --config_file accelerate/multi_gpu.yaml")
    for part in ("--num_machines 2", "--num_processes 8", "--machine_rank $SLURM_NODEID",
                 "--main_process_ip node7", "-m rlhf_train trainer.resume=auto",
                 "hydra.run.dir=outputs/slurm/rlhf_train-99", "+recipe=smoke", "task_name=a\\ b"):
        assert part in inner, (part, inner)
    assert (tmp_path / "scontrol.txt").read_text().split() == ["requeue", "99"]


def test_resume_check_launches_several_processes_through_the_launcher(tmp_path):
    from rlhf_train.tools.resume_check import _command

    cmd = _command(tmp_path / "run", 4, ["data.batch_size=4"], num_processes=2)
    assert cmd[1:9] == ["-m", "rlhf_train.tools.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                        "--mixed_precision"]
    assert cmd[cmd.index("-m", 2):cmd.index("-m", 2) + 3] == ["-m", "rlhf_train", "+recipe=smoke"]
    assert cmd[-2:] == ["data.batch_size=4", f"hydra.run.dir={tmp_path / 'run'}"]
    assert _command(tmp_path / "run", 4, [])[1:3] == ["-m", "rlhf_train"]


def test_die_with_parent_kills_the_child_when_its_parent_dies(tmp_path):
    """A parent that starts a child (in a session of its own, as torch elastic does) and is SIGKILLed."""
    import psutil

    child = ("import time; from rlhf_train.infra.preemption import die_with_parent; "
             "assert die_with_parent(); print('armed', flush=True); time.sleep(60)")
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
              f"start_new_session=True); print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "armed"  # the child shares its parent's stdout
        kid = psutil.Process(pid)
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([kid], timeout=20)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the child outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
