"""Exact-resume check: kill a run with SIGKILL mid-way, resume it, compare with an uninterrupted run.

    python -m rlhf_train.tools.resume_check                     # smoke recipe, 4 iterations, kill after 2
    python -m rlhf_train.tools.resume_check --iterations 6 --kill-after 3 --workdir /tmp/rc data.batch_size=16
    python -m rlhf_train.tools.resume_check --kill-during-write   # SIGKILL while checkpoint 3 is being written
    python -m rlhf_train.tools.resume_check --num-processes 2     # each run: accelerate launch, 2 processes

1. reference run: ``--iterations`` iterations, uninterrupted (``hydra.run.dir=<workdir>/reference``);
2. the same run (``<workdir>/resumed``) with a checkpoint every iteration, killed with SIGKILL as soon as
   checkpoint ``--kill-after`` is complete, i.e. in the middle of the next iteration (with
   ``--kill-during-write``: as soon as the *next* checkpoint's temp dir appears, i.e. mid-write, so the
   resume must fall back to checkpoint ``--kill-after``); runs 1 and 2 run side by side (one CPU thread each);
3. ``trainer.resume=auto`` in ``<workdir>/resumed``: continues from the newest complete checkpoint;
4. ``metrics.csv`` of 2+3 is compared with 1's, cell by cell, as text: exit 0 when identical, else 1
   with the cells that differ.

``--recipe`` picks the recipe (default ``smoke``); ``--num-processes N`` (N > 1) launches every run with
``python -m rlhf_train.tools.launch --multi_gpu --num_processes N`` (gloo on a machine without GPUs) and
kills the launcher's process group (its workers die with it); any other arguments are Hydra overrides for
all three runs. Logs of each run land next to its run dir (``<workdir>/<name>.log``).
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _command(run_dir: Path, iterations: int, overrides: list[str], recipe: str = "smoke",
             num_processes: int = 1) -> list[str]:
    launch = [sys.executable, "-m", "rlhf_train"]
    if num_processes > 1:
        launch = [sys.executable, "-m", "rlhf_train.tools.launch", "--multi_gpu", "--num_processes", str(num_processes),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "rlhf_train"]
    return [*launch, f"+recipe={recipe}", "logger=csv", "trainer.num_threads=1",
            "trainer.progress_bar=false", "trainer.checkpoint_every=1", f"trainer.num_iterations={iterations}",
            *overrides, f"hydra.run.dir={run_dir}"]


def _start(name: str, workdir: Path, cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, HYDRA_FULL_ERROR="1", OMP_NUM_THREADS="1")
    with open(workdir / f"{name}.log", "w") as log:  # the child keeps its own copy of the file descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _tail(workdir: Path, name: str, n: int = 15) -> str:
    lines = (workdir / f"{name}.log").read_text(errors="replace").splitlines()
    return "\n".join(f"    {ln}" for ln in lines[-n:])


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def compare_metrics(reference: Path, resumed: Path) -> list[str]:
    """Differences between two ``metrics.csv`` files, compared as text (empty when identical)."""
    a, b = _read(reference), _read(resumed)
    diffs = []
    if len(a) != len(b):
        diffs.append(f"{len(a)} rows in {reference}, {len(b)} in {resumed}")
    cols_a, cols_b = (set(rows[0]) if rows else set() for rows in (a, b))
    if cols_a != cols_b:
        diffs.append(f"columns differ: only in reference {sorted(cols_a - cols_b)}, "
                     f"only in resumed {sorted(cols_b - cols_a)}")
    for ra, rb in zip(a, b):
        for col in sorted(cols_a & cols_b):
            if ra[col] != rb[col]:
                diffs.append(f"iteration {ra['iteration']}: {col}: {ra[col]} (reference) != {rb[col]} (resumed)")
    return diffs


def run_check(workdir: str | Path, iterations: int = 4, kill_after: int = 2, overrides: list[str] = (),
              timeout: float = 600.0, during_write: bool = False, recipe: str = "smoke", num_processes: int = 1) -> dict:
    """Run the check (see the module docstring); returns ``dict(diffs, killed_at_rows, resumed_from)``."""
    if not 0 < kill_after < iterations:
        raise ValueError(f"need 0 < --kill-after ({kill_after}) < --iterations ({iterations})")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ref_dir, res_dir = workdir / "reference", workdir / "resumed"
    overrides = list(overrides)
    deadline = time.monotonic() + timeout

    # 1 + 2. reference and to-be-killed runs side by side
    ref = _start("reference", workdir, _command(ref_dir, iterations, overrides, recipe, num_processes))
    victim = _start("killed", workdir, _command(res_dir, iterations, overrides, recipe, num_processes))
    resumed = None
    marker = res_dir / "checkpoints" / (f".tmp-iter_{kill_after + 1:06d}" if during_write else
                                        f"iter_{kill_after:06d}/COMPLETE")
    try:
        while not marker.exists():
            if victim.poll() is not None:
                raise RuntimeError(f"the run to be killed exited (status {victim.returncode}) before checkpoint "
                                   f"{kill_after}:\n{_tail(workdir, 'killed')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no checkpoint {kill_after} after {timeout:.0f} s")
            time.sleep(0.005 if during_write else 0.02)
        os.killpg(victim.pid, signal.SIGKILL)  # the run (or its launcher; the workers die with it)
        victim.wait()
        killed_rows = len(_read(res_dir / "metrics.csv"))

        # 3. resume from the newest complete checkpoint
        resumed = _start("resumed", workdir, _command(res_dir, iterations, overrides + ["trainer.resume=auto"], recipe,
                                                       num_processes))
        for name, proc in (("reference", ref), ("resumed", resumed)):
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            if rc != 0:
                raise RuntimeError(f"the {name} run failed (status {rc}):\n{_tail(workdir, name)}")
    finally:
        for proc in (ref, victim, resumed):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = (workdir / "resumed.log").read_text(errors="replace")
    resumed_from = next((ln.strip() for ln in log.splitlines() if "resumed from" in ln), None)
    # 4. compare
    return {"diffs": compare_metrics(ref_dir / "metrics.csv", res_dir / "metrics.csv"),
            "killed_at_rows": killed_rows, "resumed_from": resumed_from}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_train.tools.resume_check", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="smoke", help="recipe of the runs, conf/recipe/NAME.yaml (default smoke)")
    parser.add_argument("--iterations", type=int, default=4, help="iterations of each run (default 4)")
    parser.add_argument("--kill-after", type=int, default=2, help="SIGKILL once this checkpoint is complete (default 2)")
    parser.add_argument("--workdir", default=None, help="where the two run dirs go (default: a new temp dir)")
    parser.add_argument("--kill-during-write", action="store_true",
                        help="SIGKILL while checkpoint KILL_AFTER+1 is being written (resume must use KILL_AFTER)")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes per run (> 1: launched with rlhf_train.tools.launch; default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole check (default 600)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlhf_resume_check_"))
    out = run_check(workdir, args.iterations, args.kill_after, args.overrides, args.timeout, args.kill_during_write,
                    args.recipe, args.num_processes)
    when = f"while writing checkpoint {args.kill_after + 1}" if args.kill_during_write else \
        f"after checkpoint {args.kill_after}"
    print(f"killed with SIGKILL {when} ({out['killed_at_rows']} rows in metrics.csv); "
          f"{out['resumed_from'] or 'resume line missing'}")
    if out["diffs"]:
        print(f"FAIL: {len(out['diffs'])} differences between {workdir}/reference/metrics.csv and "
              f"{workdir}/resumed/metrics.csv:")
        print("\n".join(f"  {d}" for d in out["diffs"][:50]))
        return 1
    print(f"OK: {workdir}/resumed/metrics.csv (killed, resumed) is identical to {workdir}/reference/metrics.csv "
          f"({args.iterations} iterations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
