"""Graceful preemption: SIGTERM / SIGINT end the run at an iteration boundary with a checkpoint.

Under ``accelerate launch`` (torch elastic underneath), what happens to signals (read in torch 2.13's
``torch/distributed/elastic``): the launcher's agent turns SIGTERM/SIGINT into a ``SignalException``,
sends the same signal to every worker, waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) for
them to exit, SIGKILLs the rest, then re-raises: ``accelerate launch`` ends with a traceback and exit 1.
Each worker runs in its own session (``start_new_session=True``), so a signal to the launcher's process
group does not reach the workers, and a launcher killed with SIGKILL leaves them running. Hence:

* :class:`PreemptionHandler` in each worker: finish the iteration, checkpoint (all processes together),
  exit 143. A second signal within :data:`SAME_REQUEST_S` seconds counts as the same request (SLURM
  signals the workers and the launcher, whose agent then signals them again); a later one exits at once.
  Whatever the run is doing (a reward function that hangs, a long generation), it exits 143 at most
  ``grace_s`` seconds after the first signal: a watchdog thread gives up the iteration in progress there,
  keeping the last complete checkpoint (checkpoints are written atomically, so one cut off mid-write is
  only a temp dir). Schedulers SIGKILL after their own grace period (SLURM's ``KillWait`` and Kubernetes'
  ``terminationGracePeriodSeconds`` default to 30 s; torch elastic waits 30 s), hence a default below it;
* :func:`die_with_parent`: a worker started by a launcher asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), so workers never outlive their launcher;
* ``python -m rlhf_train.tools.launch`` (= ``accelerate launch``, same arguments) exits 143 as a whole
  when the launch was preempted (see :mod:`rlhf_train.tools.launch`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what schedulers (SLURM, k8s) read as "terminated, requeue"
SAME_REQUEST_S = 5.0  # a second signal this soon after the first is the same preemption, not "exit now"


class PreemptionHandler:
    """First SIGTERM/SIGINT: finish the current iteration, checkpoint, exit 143; if that has not happened
    ``grace_s`` seconds later (None: no bound), exit 143 there, saying ``on_give_up()``. Another signal more
    than :data:`SAME_REQUEST_S` seconds after the first: exit at once."""

    def __init__(self, grace_s: float | None = None, on_give_up=None):
        self.requested = False
        self.first_at = 0.0
        self.grace_s, self.on_give_up = grace_s, on_give_up
        self._old = {}
        self._watchdog: threading.Timer | None = None

    def install(self) -> "PreemptionHandler":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside some launchers)
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self.first_at > SAME_REQUEST_S:
                os._exit(128 + signum)
            return
        self.requested, self.first_at = True, time.monotonic()
        bound = f" (at most {self.grace_s:g} s)" if self.grace_s is not None else ""
        print(f"[rlhf_train] received {signal.Signals(signum).name}: finishing this iteration{bound}, then "
              f"checkpointing and exiting (send it again to exit at once)", flush=True)
        if self.grace_s is not None:
            self._watchdog = threading.Timer(self.grace_s, self._give_up)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _give_up(self) -> None:
        """The watchdog: the iteration in progress did not finish in time. Exit 143 now, from this thread
        (the main thread may be blocked in a reward function or in C code): ``os._exit`` skips the hung
        work and the worker threads that ``sys.exit`` would wait for."""
        try:
            where = self.on_give_up() if self.on_give_up is not None else ""
            sys.stderr.write(f"[rlhf_train] preempted: the iteration in progress did not finish within "
                             f"{self.grace_s:g} s of the signal (trainer.preempt_grace_s), so it is given up; "
                             f"{where}\n")
            sys.stderr.flush()
        finally:
            os._exit(PREEMPTED_EXIT_CODE)

    def restore(self) -> None:
        """Restore the previous handlers and stop the watchdog (the loop has ended: what follows, closing the
        logger, is short, and a caller that handles the ``SystemExit`` in-process lives on)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, old in self._old.items():
            signal.signal(sig, old)


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Linux: have the kernel send ``sig`` to this process when its parent (the launcher) dies. Returns
    whether it was set. Exits at once if the parent died while the request was being made."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect (a launcher may be PID 1)
        os._exit(128 + int(sig))
    return True


def launched_by_torch_elastic() -> bool:
    """This process is a worker of ``accelerate launch`` / ``torchrun`` (torch elastic sets these)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ
