"""The run dir must be writable: checked before anything is written or computed.

Hydra creates the run dir (and writes ``.hydra/``) before :func:`rlhf_train.__main__.main` runs, so the
CLI check is a Hydra callback (:class:`RunDirCheck`, registered in ``conf/config.yaml`` under
``hydra.callbacks``) that runs first; :func:`rlhf_train.loop.trainer.train` checks again for callers that
pass a run dir themselves.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback

from rlhf_train.infra.errors import ConfigError


def check_writable(path: str | Path, key: str = "hydra.run.dir") -> None:
    """Raise one :class:`ConfigError` naming ``key`` unless ``path`` exists, or can be created, and can be
    written. Probes with a temporary file in ``path`` or its nearest existing parent; creates nothing."""
    path = Path(path).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}='{path}' is not writable: '{existing}' is not a directory; "
                          f"set {key}=<a writable dir>")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".rlhf_train-write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{key}='{path}' is not writable ({err.strerror or type(err).__name__} in "
                          f"'{existing}'); set {key}=<a writable dir>") from None


class RunDirCheck(Callback):
    """Before Hydra creates the run (or sweep) dir: one ``Error:`` line and exit 2 if it is not writable."""

    @staticmethod
    def _check(config, key: str) -> None:
        try:
            path = str(config.hydra.run.dir if key == "hydra.run.dir" else config.hydra.sweep.dir)
        except Exception:  # an interpolation only Hydra's job set-up can resolve: leave it to Hydra
            return
        try:
            check_writable(path, key)
        except ConfigError as err:
            print(f"Error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    def on_run_start(self, config, **kwargs) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config, "hydra.sweep.dir")
