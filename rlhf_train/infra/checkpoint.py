"""Writing checkpoints that hold everything the next iteration depends on, atomically.

The files of a checkpoint (``checkpoints/iter_000012/``: the policy, value head, optimizer, scheduler,
each process's RNG state, trainer state, config and the ``COMPLETE`` manifest) and where checkpoints live:
:mod:`rlhf_train.infra.checkpoint_files`. Finding, verifying and loading one: :mod:`rlhf_train.infra.resume`.

How a checkpoint is written (:func:`save_checkpoint`); the main process writes every file (the other
processes' states are gathered to it), so with one disk per machine the checkpoints live on rank 0's:
  1. every file goes into ``checkpoints/.tmp-iter_000012/``, gets the mode the process umask gives
     (:func:`apply_umask`: safetensors alone would write 0600) and is fsync'ed;
  2. ``COMPLETE`` (the manifest) is written last;
  3. the directory is renamed to ``iter_000012`` (``os.replace``: atomic on POSIX), the parent fsync'ed;
  4. older checkpoints beyond ``trainer.keep_checkpoints`` and stale ``.tmp-*`` dirs are removed.
A crash at any point leaves either the previous checkpoints untouched plus a ``.tmp-*`` dir (ignored,
removed by the next save), or the new complete one. A write that fails (disk full, read-only dir) removes
its temp dir and raises :class:`CheckpointError`: one line saying what failed, where, and which complete
checkpoint is intact. ``trainer.resume=auto`` takes the newest checkpoint whose files match its manifest,
sizes and checksums (:func:`~rlhf_train.infra.resume.verify_checkpoint`), so a checkpoint damaged after the
fact (truncated, or bytes zeroed in place) falls back to the one before it, with one line saying so; so
does one without its ``COMPLETE`` marker.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch

from rlhf_train.infra.checkpoint_files import (
    checkpoint_root,
    list_checkpoints,
    manifest,
    process_state,
    quiet_transformers,
)
from rlhf_train.infra.distributed import all_processes

DISK_FULL_BYTES = 64 << 20  # a failed write with less free space than this is reported as "disk full"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written: one line (what, where, which checkpoint is intact)."""


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask (read from ``/proc/self/status`` where it can be, so nothing is changed; else
    set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``open`` / ``mkdir`` would have given them:
    ``0o666 & ~umask`` for files (``0o777`` for executables), ``0o777 & ~umask`` for directories.

    Needed after writers that create owner-only files: ``safetensors`` (``model.safetensors`` is written
    0600), ``tempfile.mkstemp`` (0600) and ``tempfile.mkdtemp`` (0700), so that a group sharing the
    output dir can read what a run wrote, as with every other file. Symlinks are left alone.
    """
    keep = ~current_umask()
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        if p.is_dir():
            p.chmod(0o777 & keep)
        elif p.is_file():
            p.chmod((0o777 if p.stat().st_mode & 0o111 else 0o666) & keep)


def is_write_error(err: BaseException) -> bool:
    """Whether ``err`` is what a writer raises when a write fails (disk full, read-only, quota): ``OSError``,
    torch's ``RuntimeError``, safetensors' ``SafetensorError`` and the ``tokenizers`` binding's plain
    ``Exception`` (its exact type: a subclass such as ``TypeError`` is a bug, and keeps its traceback)."""
    from safetensors import SafetensorError

    return isinstance(err, (OSError, RuntimeError, SafetensorError)) or type(err) is Exception


_DISK_FULL_TEXT = ("no space left on device", "os error 28", "storagefull", "disk quota exceeded", "os error 122")


def write_failure(err: BaseException, what: str, where: Path, run_dir: Path | None, intact: str | None = None) -> str:
    """The one line for a failed write: what failed, where, why (disk full / permission) with the free space
    there, and which complete checkpoint is intact (``intact``: that part, said otherwise)."""
    probe = Path(where)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    space = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    code = getattr(err, "errno", None)
    text = str(err).strip()
    if (code in (errno.ENOSPC, errno.EDQUOT) or any(t in text.lower() for t in _DISK_FULL_TEXT)
            or (free is not None and free < DISK_FULL_BYTES)):
        why = f"the disk is full ({space})"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"{err.strerror}: '{getattr(err, 'filename', None) or where}' cannot be written; {space}"
    else:
        first = text.splitlines()[0] if text else ""
        why = f"{type(err).__name__}: {first}; {space}"
    if intact is None:
        done = list_checkpoints(run_dir) if run_dir is not None else []
        intact = (f"the last complete checkpoint, {done[-1]}, is intact (trainer.resume=auto resumes from it)"
                  if done else "no earlier complete checkpoint exists")
    return f"{what} could not be written in {where} ({why}); {intact}"


def save_checkpoint(run_dir: str | Path, iteration: int, *, accelerator, policy, optimizer, scheduler,
                    trainer_state: dict, config_yaml: str, tokenizer=None, keep: int = 2,
                    rank_state: dict | None = None) -> Path:
    """Write checkpoint ``iter_<iteration>`` atomically (collective: call on every process).

    ``rank_state``: this process's own state besides its RNGs (e.g. its PPO minibatch generator).
    ``keep``: how many checkpoints to keep (older ones are deleted); ``0`` keeps all. A failed write raises
    :class:`CheckpointError` on every process, its temp dir removed, the earlier checkpoints untouched.
    """
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    root = checkpoint_root(run_dir)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp-iter_{iteration:06d}"
    error = None
    states = all_processes(accelerator, process_state(rank_state), gather=True)  # every process's own state
    state_dict = accelerator.get_state_dict(policy)  # gathers sharded (FSDP/ZeRO) weights; collective
    if accelerator.is_main_process:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in [*root.glob(".tmp-iter_*"), *root.glob(".old-iter_*")]:  # left by a crash mid-write
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
            # 1. every file into the temp dir
            for rank, st in enumerate(states):
                torch.save(st, tmp / f"rng_rank{rank}.pt")
            model = accelerator.unwrap_model(policy)
            lm_state = {k[len("lm."):]: v for k, v in state_dict.items() if k.startswith("lm.")}
            with quiet_transformers():
                model.lm.save_pretrained(tmp / "policy", state_dict=lm_state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "policy")
            vh = {k[len("value_head."):]: v.contiguous() for k, v in state_dict.items() if k.startswith("value_head.")}
            save_file(vh, tmp / "value_head.safetensors")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            state = dict(trainer_state, iteration=iteration, num_processes=accelerator.num_processes)
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            apply_umask(tmp)  # safetensors writes its files 0600: give them the modes of every other file
            for f in tmp.rglob("*"):
                if f.is_file():
                    _fsync(f)
            # 2. the manifest (sizes and checksums), last
            sizes, sums = manifest(tmp)
            (tmp / "COMPLETE").write_text(json.dumps({"iteration": iteration, "files": sizes, "sha256": sums},
                                                     indent=1))
            _fsync(tmp / "COMPLETE")
            # 3. rename into place (an existing one of the same iteration, from an earlier run, goes aside first)
            old = root / f".old-iter_{iteration:06d}"
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync(root)
            shutil.rmtree(old, ignore_errors=True)
        except Exception as err:  # disk full, read-only, ...: what, where, what is intact
            shutil.rmtree(tmp, ignore_errors=True)
            if not is_write_error(err):
                raise
            error = write_failure(err, f"checkpoint {final.name}", root, run_dir)
        else:
            # 4. prune
            for stale in (list_checkpoints(run_dir)[:-keep] if keep > 0 else []):
                shutil.rmtree(stale, ignore_errors=True)
    error = all_processes(accelerator, error, gather=False)  # every process raises, none waits forever
    if error:
        raise CheckpointError(error)
    return final
