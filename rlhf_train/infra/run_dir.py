"""The run dir: writable before anything starts, said where it is, not left empty after a failed start,
locked while a run uses it, never silently shared by two runs.

Hydra creates the run dir (and writes ``.hydra/``) before :func:`rlhf_train.__main__.main` runs, so the
CLI check is a Hydra callback (:class:`RunDirCheck`, registered in ``conf/config.yaml`` under
``hydra.callbacks``) that runs first; :func:`rlhf_train.loop.trainer.train` checks again for callers that
pass a run dir themselves. The callback also notes which folders of the run dir's path do not exist yet:
after bad input (exit 2) :func:`remove_unused_run_dir` takes away the folders this run created when they
hold nothing but Hydra's ``.hydra/`` and a log of the failed start's own notes (no pipeline stage ran);
a run dir that stays gets the ``Error:`` line at the end of its log (:func:`log_to_run_dir`).
:func:`run_dir_contents` lists what a run wrote (its last log line).

One run per run dir (:func:`claim_run_dir`, the trainer's first step, on rank 0, before any model is built):
* :func:`lock_run_dir` takes an exclusive ``flock`` on ``<run dir>/.lock`` (holding the PID and host) for
  the run's lifetime; a second run or resume gets one line naming the holder's PID. The kernel drops the
  lock when the holder dies (SIGKILL included); the file goes when the lock is released.
* a fresh run (``trainer.resume`` unset) refuses a run dir that already holds checkpoints (the pruning of
  the new run would delete them, and a later ``resume=auto`` would pick the old run's);
* ``<run dir>/policy``, where the end of the run exports the trained policy, must be missing, empty or an
  earlier export (:func:`rlhf_train.infra.export_dir.check_export_target`): nothing else is ever replaced;
* ``trainer.resume`` is resolved (:func:`rlhf_train.infra.resume.resolve_resume`: verified, same config).
Hydra writes ``.hydra/`` before any of this runs: :class:`RunDirCheck` keeps a copy of an existing run
dir's ``.hydra/`` files, and :func:`restore_hydra_dir` puts them back after bad input (exit 2).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback

from rlhf_train.infra.errors import ConfigError

RUN_DIR_LINE = "[rlhf_train] run dir: "  # the first line a run logs (rlhf_train/__main__.py)
# log lines of a pipeline stage that ran (the record of real work: a failed start's run dir is kept for them);
# any other line of a failed start (the run-dir line, notes such as "policy.lora.r=4: no reference copy")
# goes with its run dir, the Error line on stderr saying why it stopped
WORK_LINES = ("[pipeline] ", "[sft] ", "[rm] ", "[evaluation] ")
# run dir (absolute) -> the top-most folder of its path that did not exist before Hydra created it
_CREATED: dict[str, Path] = {}
# run dir (absolute) -> {file name: bytes} of the .hydra/ it held before this start (restored after bad input)
_HYDRA_BEFORE: dict[str, dict[str, bytes]] = {}
LOCK_NAME = ".lock"


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
        hydra_dir = path / str(config.hydra.get("output_subdir") or ".hydra")
        if hydra_dir.is_dir():  # an existing run's: put back if this start turns out to be bad input
            _HYDRA_BEFORE[str(path)] = {p.name: p.read_bytes() for p in hydra_dir.iterdir() if p.is_file()}
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
    created it and it holds nothing but ``.hydra/`` and ``log_name`` with no line of a pipeline stage in it
    (:data:`WORK_LINES`). Returns whether it was removed. A dir that existed before the run, or holds
    anything else, stays."""
    run_dir = Path(run_dir).absolute()
    top = _CREATED.get(str(run_dir))
    if top is None or not run_dir.is_dir():
        return False
    if any(p.name not in (".hydra", log_name, LOCK_NAME) for p in run_dir.iterdir()):
        return False
    log_file = run_dir / log_name
    if log_file.is_dir() or (run_dir / ".hydra").is_file():
        return False
    if log_file.exists():
        lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
        if any(mark in line for line in lines for mark in WORK_LINES):
            return False
    _close_file_handlers(run_dir)
    shutil.rmtree(run_dir)
    for folder in run_dir.parents:  # the parents this run created, while nothing else is in them
        if not folder.is_relative_to(top) or any(folder.iterdir()):
            break
        folder.rmdir()
    return True


def restore_hydra_dir(run_dir: str | Path, subdir: str = ".hydra") -> bool:
    """After bad input in a run dir that held a ``.hydra/`` before this start: put its files back (Hydra
    overwrote them) and remove the ones this start added. Returns whether anything was restored."""
    before = _HYDRA_BEFORE.get(str(Path(run_dir).absolute()))
    if before is None:
        return False
    hydra_dir = Path(run_dir) / subdir
    for p in hydra_dir.iterdir() if hydra_dir.is_dir() else []:
        if p.is_file() and p.name not in before:
            p.unlink()
    hydra_dir.mkdir(parents=True, exist_ok=True)
    for name, data in before.items():
        (hydra_dir / name).write_bytes(data)
    return True


def log_to_run_dir(run_dir: str | Path, message: str, level: int = logging.ERROR) -> bool:
    """Write ``message`` through the logging file handlers that write into ``run_dir`` (Hydra's job log,
    ``<run dir>/__main__.log``) and not the console, which got it on stderr already: the ``Error:`` line of
    a run that stopped is the last line of its log. Returns whether any handler took it."""
    run_dir = Path(run_dir).absolute()
    record = logging.LogRecord("rlhf_train", level, __file__, 0, message, None, None)
    took = False
    for handler in logging.getLogger().handlers:
        name = getattr(handler, "baseFilename", None)
        if name and Path(name).absolute().is_relative_to(run_dir):
            handler.handle(record)
            handler.flush()
            took = True
    return took


def _close_file_handlers(run_dir: Path) -> None:
    """Detach and close the logging file handlers that write into ``run_dir`` (Hydra's job log)."""
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


# --------------------------------------------------------------------------------------------
# One run per run dir
# --------------------------------------------------------------------------------------------
_HELD: dict[str, "RunDirLock"] = {}  # run dir -> this process's lock on it


class RunDirLock:
    """An exclusive ``flock`` on ``<run dir>/.lock``; :meth:`release` unlocks and removes the file."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _HELD.get(str(self.path.parent)) is self:
                del _HELD[str(self.path.parent)]
            self.path.unlink(missing_ok=True)  # while still locked: a waiter re-checks the inode
        except OSError:
            pass
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None


NO_LOCK = RunDirLock(Path(LOCK_NAME), None)  # what processes other than rank 0 hold


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Lock ``run_dir`` for this run, or raise one :class:`ConfigError` naming the PID (and host) of the
    run that holds it. A lock this process already holds on it (an earlier in-process run that failed) is
    released first."""
    run_dir = Path(run_dir).absolute()
    if str(run_dir) in _HELD:
        _HELD[str(run_dir)].release()
    path = run_dir / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if not isinstance(err, BlockingIOError):  # a file system without locks (some NFS set-ups)
                os.close(fd)
                print(f"[rlhf_train] warning: cannot lock {path} ({err.strerror}): nothing stops a second run "
                      f"from using this run dir at the same time", flush=True)
                return RunDirLock(path, None)
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            who = f"PID {holder[0]} on {holder[1]}" if len(holder) >= 2 else "PID unknown"
            raise ConfigError(f"hydra.run.dir='{run_dir}' is in use by another run ({who}); wait for it to end, "
                              f"or give this run another hydra.run.dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # released (and removed) between our open and flock: try again
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    lock = _HELD[str(run_dir)] = RunDirLock(path, fd)
    return lock


def claim_run_dir(run_dir: Path, accelerator, resume: str | None, config_yaml: str) -> tuple[Path | None, RunDirLock]:
    """The trainer's first step on the run dir (rank 0 does the work, every process gets the outcome):
    writable, created, locked, not another run's (a fresh run refuses a dir with checkpoints), and the
    checkpoint to resume from. Returns ``(checkpoint or None, the lock)``; one :class:`ConfigError` on
    every process otherwise."""
    from rlhf_train.infra.checkpoint_files import checkpoint_dirs
    from rlhf_train.infra.export_dir import check_export_target
    from rlhf_train.infra.resume import resolve_resume

    outcome, lock, crash = None, NO_LOCK, None
    if accelerator.is_main_process:
        try:
            check_writable(run_dir, "hydra.run.dir")  # probes with a temp file (os.access lies for root)
            run_dir.mkdir(parents=True, exist_ok=True)
            if (run_dir / "checkpoints").is_dir():  # a read-only checkpoints dir fails now, not at the first save
                check_writable(run_dir / "checkpoints", "hydra.run.dir")
            lock = lock_run_dir(run_dir)
            check_export_target(run_dir / "policy", key="<hydra.run.dir>/policy")  # the end of the run writes there
            path = resolve_resume(resume, run_dir, config_yaml)
            old = checkpoint_dirs(run_dir)
            if path is None and old:
                raise ConfigError(f"hydra.run.dir='{run_dir}' already holds checkpoints (newest: {old[-1].name}) of "
                                  f"an earlier run: continue it with trainer.resume=auto, or give this run a new "
                                  f"hydra.run.dir")
            outcome = ("ok", str(path) if path else None)
        except Exception as err:  # bad input: one line everywhere; anything else: raised here, a line elsewhere
            lock.release()
            crash = None if isinstance(err, ConfigError) else err
            lock, outcome = NO_LOCK, ("error" if crash is None else "crash", str(err))
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        outcome = broadcast_object_list([outcome], from_process=0)[0]
    if crash is not None:
        raise crash
    if outcome[0] == "error":
        raise ConfigError(outcome[1])
    if outcome[0] == "crash":
        raise RuntimeError(f"rank 0 failed to prepare the run dir: {outcome[1]}")
    return (Path(outcome[1]) if outcome[1] else None), lock
