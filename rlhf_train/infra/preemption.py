"""Graceful preemption: SIGTERM / SIGINT end the run at an iteration boundary with a checkpoint."""
from __future__ import annotations

import os
import signal

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what schedulers (SLURM, k8s) read as "terminated, requeue"


class PreemptionHandler:
    """First SIGTERM/SIGINT: finish the current iteration, checkpoint, exit 143. Second: exit at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def install(self) -> "PreemptionHandler":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside some launchers)
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        print(f"[rlhf_train] received {signal.Signals(signum).name}: finishing this iteration, then "
              f"checkpointing and exiting (send it again to exit at once)", flush=True)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
