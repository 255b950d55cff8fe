"""The run dir: writable before anything starts, said where it is, not left empty after a failed start.

Hydra creates the run dir (and writes ``.hydra/``) before :func:`rlhf_train.__main__.main` runs, so the
CLI check is a Hydra callback (:class:`RunDirCheck`, registered in ``conf/config.yaml`` under
``hydra.callbacks``) that runs first; :func:`rlhf_train.loop.trainer.train` checks again for callers that
pass a run dir themselves. The callback also notes which folders of the run dir's path do not exist yet:
after bad input (exit 2) :func:`remove_unused_run_dir` takes away the folders this run created when they
hold nothing but Hydra's ``.hydra/`` and a log with the run-dir line alone. :func:`run_dir_contents`
lists what a run wrote (its last log line).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback

from rlhf_train.infra.errors import ConfigError

RUN_DIR_LINE = "[rlhf_train] run dir: "  # the first line a run logs (rlhf_train/__main__.py)
# run dir (absolute) -> the top-most folder of its path that did not exist before Hydra created it
_CREATED: dict[str, Path] = {}


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
        try:
            path = Path(str(config.hydra.run.dir)).expanduser().absolute()
        except Exception:
            return
        top = None
        for folder in (path, *path.parents):
            if folder.exists():
                break
            top = folder
        if top is not None:  # Hydra is about to create `top` and everything below it
            _CREATED[str(path)] = top

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config, "hydra.sweep.dir")


def remove_unused_run_dir(run_dir: str | Path, log_name: str) -> bool:
    """After a failed start: remove ``run_dir`` (and the empty parents it was created with) if this run
    created it and it holds nothing but ``.hydra/`` and ``log_name`` with at most the run-dir line in it.
    Returns whether it was removed. A dir that existed before the run, or holds anything else, stays."""
    run_dir = Path(run_dir).absolute()
    top = _CREATED.get(str(run_dir))
    if top is None or not run_dir.is_dir():
        return False
    if any(p.name not in (".hydra", log_name) for p in run_dir.iterdir()):
        return False
    log_file = run_dir / log_name
    if log_file.is_dir() or (run_dir / ".hydra").is_file():
        return False
    if log_file.exists():
        lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
        if any(RUN_DIR_LINE not in line for line in lines):
            return False
    _close_file_handlers(run_dir)
    shutil.rmtree(run_dir)
    for folder in run_dir.parents:  # the parents this run created, while nothing else is in them
        if not folder.is_relative_to(top) or any(folder.iterdir()):
            break
        folder.rmdir()
    return True


def _close_file_handlers(run_dir: Path) -> None:
    """Detach and close the logging file handlers that write into ``run_dir`` (Hydra's job log)."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        name = getattr(handler, "baseFilename", None)
        if name and Path(name).absolute().is_relative_to(run_dir):
            root.removeHandler(handler)
            handler.close()


def run_dir_contents(run_dir: str | Path, since: float | None = None) -> list[str]:
    """The entries of ``run_dir`` (folders with a trailing ``/``), sorted; with ``since`` (a ``time.time()``)
    only those with a file written at or after it (a folder counts when any file under it was)."""
    def newest(path: Path) -> float:
        if not path.is_dir():
            return path.stat().st_mtime
        return max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.rglob("*"))])

    out = []
    for entry in sorted(Path(run_dir).iterdir(), key=lambda p: p.name):
        try:
            if since is None or newest(entry) >= since - 1.0:  # 1 s: coarse file-system timestamps
                out.append(entry.name + ("/" if entry.is_dir() else ""))
        except OSError:  # removed while listing
            continue
    return out
