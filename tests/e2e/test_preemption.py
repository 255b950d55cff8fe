"""Preemption whatever the run is doing: a reward function that hangs still gives exit 143 within
``trainer.preempt_grace_s`` with the last checkpoint intact, and a skipped batch does not skip the
preemption check."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from tests.helpers import zygote
from tests.helpers.reliability import FAST, REPO, make_cfg

_CALLS = {"n": 0}


def hangs_on_third_call(prompts, completions, **_):
    """Fine on the probe and iteration 1, then hangs (as a verifier stuck on a pathological answer would),
    after writing its process id (a reward worker's) to ``$HANG_MARKER``."""
    _CALLS["n"] += 1
    if _CALLS["n"] >= 3:
        with open(os.environ["HANG_MARKER"], "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(1)
    return [0.5] * len(completions)


def fails_then_signals(prompts, completions, **_):
    """Fine on the probe and iteration 1; the next call is preempted (SIGTERM to this process) and raises."""
    _CALLS["n"] += 1
    if _CALLS["n"] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("verifier crashed")
    return [0.5] * len(completions)


@pytest.mark.slow
def test_sigterm_while_a_reward_function_hangs_exits_143_within_the_grace_period(tmp_path):
    from rlhf_train.infra.checkpoint_files import list_checkpoints
    from rlhf_train.infra.resume import verify_checkpoint

    run, marker = tmp_path / "run", tmp_path / "hanging"
    cmd = [*FAST, "trainer.num_iterations=50", "trainer.checkpoint_every=1",
           "trainer.num_threads=1", "trainer.preempt_grace_s=3", "reward_model=none",
           "+rewards.slow._target_=tests.e2e.test_preemption.hangs_on_third_call", f"hydra.run.dir={run}"]
    proc = zygote.popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env=dict(os.environ, OMP_NUM_THREADS="1", HANG_MARKER=str(marker)))
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the reward function was never called a third time"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    assert 3 <= took < 10, took  # the grace period, then at once (not when the function returns: never)
    worker = int(marker.read_text())  # the reward function's worker process (rewards.slow.workers: 1)
    assert worker != proc.pid
    for _ in range(50):  # killed with the trainer (PR_SET_PDEATHSIG), not left hanging
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"the hanging reward worker {worker} outlived the trainer")
    assert "did not finish within 3 s of the signal (trainer.preempt_grace_s), so it is given up" in out
    assert "iter_000001" in out and "resume with trainer.resume=auto" in out
    ckpts = list_checkpoints(run)
    assert [p.name for p in ckpts] == ["iter_000001"] and verify_checkpoint(ckpts[0]) is None
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_skipped_batch_does_not_skip_the_preemption_checkpoint(tmp_path):
    from rlhf_train.infra.resume import read_trainer_state
    from rlhf_train.loop.trainer import train

    _CALLS["n"] = 0
    cfg = make_cfg("trainer.num_iterations=6", "trainer.checkpoint_every=100", "reward_model=none",
                   "+rewards.f._target_=tests.e2e.test_preemption.fails_then_signals",
                   "+rewards.f.workers=0")  # in the trainer's process: its SIGTERM is the trainer's
    with pytest.raises(SystemExit) as exc:
        train(cfg, tmp_path / "run")
    assert exc.value.code == 143
    assert _CALLS["n"] == 3  # preempted right after the skipped batch, not one iteration later
    state = read_trainer_state(tmp_path / "run" / "checkpoints" / "iter_000001")
    assert state["faults"]["reward_errors"] == 1 and state["data_batch"] == 2  # the skipped batch is consumed
