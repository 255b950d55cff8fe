"""Where an export may go, and putting one there without deleting anything rlhf_train did not write.

An export (the end of a run's ``<run dir>/policy/``, ``python -m rlhf_train.tools.export CKPT OUT``) is a
plain Hugging Face model dir plus :data:`EXPORT_MARKER`, the file that says rlhf_train wrote it. The rule
(:func:`check_export_target`, called before any work):

* ``OUT`` may be missing, an empty dir, or a previous export (it holds the marker): a previous export is
  replaced; anything else that exists there (a run dir, ``checkpoints/``, a model dir of your own, a file)
  is refused with one :class:`ConfigError` line, and nothing is deleted;
* ``OUT`` must neither contain nor be inside a source of the export (the checkpoint it is written from,
  the base model of a LoRA adapter).

:func:`write_export` writes into a fresh temp dir next to ``OUT`` (a unique ``.tmp-<name>-*``, marker first,
so that one left by a killed process is recognisably ours and removed by the next export) and puts it in
place with ``os.replace`` (into an existing empty dir, a mount point say, from a temp dir inside it). A write that fails (disk full, read-only) removes the temp dir and raises
:class:`~rlhf_train.infra.checkpoint.CheckpointError`: one line naming the path and the free space;
what was in ``OUT`` before is kept.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from rlhf_train.infra.errors import ConfigError

EXPORT_MARKER = "rlhf_train_export.json"


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is a dir rlhf_train exported (it holds :data:`EXPORT_MARKER`)."""
    path = Path(path)
    return path.is_dir() and not path.is_symlink() and (path / EXPORT_MARKER).is_file()


def check_export_target(out_dir: str | Path, sources: Iterable[str | Path] = (), key: str = "out_dir") -> Path:
    """``out_dir``, resolved, if an export may be written there (module docstring); else one
    :class:`ConfigError` naming ``key`` (what the user typed) and what to do."""
    out = Path(os.path.realpath(Path(out_dir).expanduser()))
    for src in sources:
        src = Path(os.path.realpath(Path(src).expanduser()))
        if out == src or src.is_relative_to(out):
            raise ConfigError(f"{key}='{out_dir}' contains '{src}', the source of this export: writing there would "
                              f"destroy it; give another dir, outside it")
        if out.is_relative_to(src):
            raise ConfigError(f"{key}='{out_dir}' is inside '{src}', the source of this export; give a dir outside it")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ConfigError(f"{key}='{out_dir}' exists and is not a directory; give a new or empty dir")
        if set(out.iterdir()) - set(_stale(out, out.name)) and not is_export(out):
            raise ConfigError(f"{key}='{out_dir}' holds files that are not an rlhf_train export (no {EXPORT_MARKER}); "
                              f"nothing was written or deleted: give a new or empty dir, or move those files away")
    return out


def _stale(folder: Path, name: str) -> list[Path]:
    """Temp / set-aside dirs of an earlier export to ``name`` that a killed process left in ``folder`` (its
    parent, or itself when it was an empty dir): ours, since the marker is their first file."""
    if not folder.is_dir():
        return []
    return [p for p in [*folder.glob(f".tmp-{name}-*"), *folder.glob(f".old-{name}-*")] if is_export(p)]


def write_export(out_dir: str | Path, fill: Callable[[Path], None], *, what: str, source: str,
                 sources: Iterable[str | Path] = (), intact: str, run_dir: str | Path | None = None) -> Path:
    """Check ``out_dir`` (:func:`check_export_target`), run ``fill(tmp)`` to write the export's files into a
    temp dir, and put it at ``out_dir``. A write that fails raises ``CheckpointError`` (one line: ``what``,
    the path, the free space, then ``intact``), its temp dir removed."""
    from rlhf_train.infra.checkpoint import CheckpointError, apply_umask, is_write_error, write_failure

    out = check_export_target(out_dir, sources)
    tmp = old = None
    moved: list[Path] = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in [*_stale(out.parent, out.name), *_stale(out, out.name)]:
            shutil.rmtree(stale, ignore_errors=True)
        into = out.is_dir() and not is_export(out)  # an empty dir (maybe a mount point): kept, filled in place
        # the temp dir on the file system of `out` (inside it when it is an empty dir), so the renames stay atomic
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out if into else out.parent))
        (tmp / EXPORT_MARKER).write_text(json.dumps({"written_by": "rlhf_train", "source": source}, indent=1) + "\n")
        fill(tmp)
        apply_umask(tmp)  # mkdtemp makes 0700 and safetensors writes 0600: the modes of every other file
        if is_export(out):  # a previous export: set aside, replaced, then removed
            old = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        elif into:  # the files moved up into it, the marker last
            for entry in sorted(tmp.iterdir(), key=lambda p: p.name == EXPORT_MARKER):
                os.replace(entry, out / entry.name)
                moved.append(out / entry.name)
            tmp.rmdir()
        else:
            os.replace(tmp, out)
        tmp = old = None
    except Exception as err:
        if old is not None and not out.exists():  # the previous export goes back where it was
            os.replace(old, out)
        for path in moved:  # the empty dir is left as it was
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if not is_write_error(err):
            raise
        raise CheckpointError(write_failure(err, what, out, run_dir, intact=intact)) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
