"""A finished multi-process run whose process-group teardown hangs (rlhf_train/infra/distributed.py
``end_training``): past the deadline it prints one line and every thread's stack, and exits with the status it
was given; a teardown that returns leaves the process running, silent; one process never waits on a deadline.

Budget: ~2 s on 2 CPU cores (three small subprocesses).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.reliability import REPO

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from rlhf_train.infra.distributed import end_training

    class Accelerator:  # what end_training reads
        num_processes = int(sys.argv[1])
        def end_training(self):
            if sys.argv[2] == "hang":
                threading.Event().wait()  # a teardown that never returns

    end_training(Accelerator(), exit_code=int(sys.argv[3]), seconds=0.3)
    print("after the teardown", flush=True)
""")


def _run(processes: int, teardown: str, exit_code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(processes), teardown, str(exit_code)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_a_hung_teardown_exits_with_the_given_status_and_the_threads_stacks():
    done = _run(2, "hang", 0)
    assert done.returncode == 0 and "after the teardown" not in done.stdout
    assert "did not return in 0 s after the run finished; everything was written before it" in done.stderr
    assert "in end_training" in done.stderr  # the stuck call's frame, from the stack dump
    assert _run(2, "hang", 1).returncode == 1  # a pipeline whose later stages cannot run now


def test_a_teardown_that_returns_goes_on_silently_and_one_process_sets_no_deadline():
    for processes in (2, 1):
        done = _run(processes, "returns", 1)
        assert done.returncode == 0 and done.stdout == "after the teardown\n" and done.stderr == ""
