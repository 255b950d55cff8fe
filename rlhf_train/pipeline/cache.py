"""The stage cache: each pipeline stage's output kept on disk, keyed by a hash of what produced it.

A stage's output lives in ``${cache_dir}/stages/<stage>-<key>/``. :func:`stage_key` is 16 hex digits of
sha256 over the stage's resolved config (without the keys in :data:`_NOT_HASHED`, which change where
things are written or how progress is shown, never the result; a local path counts by its files' names,
sizes and mtimes, so a model or dataset overwritten in place is a new input), the stage's code version
(:data:`STAGE_VERSIONS`: bump it when a stage's code changes what it produces) and the keys of the stages
it consumes; :mod:`rlhf_train.pipeline.run` decides which config sections each stage hashes.

:func:`cached_stage` builds a stage in a temporary dir next to its final place, writes ``stage.json``,
seals it with ``COMPLETE`` (the size and SHA-256 of every file: :mod:`rlhf_train.infra.cache_entries`) and
moves it into place with ``os.replace`` (atomic on one file system), so a crash never leaves a half-written
stage; the next build removes the temp dir of a killed one. :func:`is_complete` checks the seal: an entry
whose files are missing, truncated or changed is removed with a line saying so, and the stage runs again.
A file lock (``<stage>-<key>.lock``) makes concurrent runs of the same stage (a joblib sweep) wait for one
another and then reuse the result instead of building it twice. An unwritable cache dir is one
``ConfigError`` line. Delete a stage's dir (or the whole ``stages/``) to re-run it. :class:`Timer` records
the wall-clock and CPU time of each step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from rlhf_train.infra.checkpoint import apply_umask

log = logging.getLogger(__name__)


# bump a stage's version when its code changes what it produces: old cache entries are then ignored
STAGE_VERSIONS = {"sft": 1, "rm": 1, "rl": 1}


# config keys that never change a stage's output (where things are written, how progress is shown)
_NOT_HASHED = {"cache_dir", "progress_bar", "checkpoint_every", "samples_every", "keep_checkpoints", "resume",
               "num_threads", "max_consecutive_faults", "preempt_grace_s", "device",
               "gradient_checkpointing"}  # (recomputes the same activations)


# --------------------------------------------------------------------------------------------
# Stage cache
# --------------------------------------------------------------------------------------------
def _plain(node: Any) -> Any:
    """A resolved, JSON-able copy of a config node without the keys in :data:`_NOT_HASHED`."""
    obj = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in sorted(obj.items()) if k not in _NOT_HASHED}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.sep in value and os.path.exists(os.path.expanduser(value))


def content_fingerprint(path: str, max_files: int = 20000) -> str:
    """16 hex digits over the relative name, size and mtime of every file under ``path`` (or of the file):
    the same path with other contents (a model or dataset overwritten in place) gets another key."""
    path = os.path.expanduser(path)
    rows = []
    if os.path.isfile(path):
        st = os.stat(path)
        rows.append(("", st.st_size, st.st_mtime_ns))
    else:
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for f in sorted(files):
                full = os.path.join(root, f)
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                rows.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
                if len(rows) >= max_files:
                    break
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _with_contents(obj: Any) -> Any:
    """Every string of ``obj`` naming an existing local file or dir becomes ``"<path>@<content fingerprint>"``."""
    if isinstance(obj, dict):
        return {k: _with_contents(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_with_contents(v) for v in obj]
    if isinstance(obj, str) and _looks_like_path(obj) and os.path.exists(os.path.expanduser(obj)):
        return f"{obj}@{content_fingerprint(obj)}"
    return obj


def stage_key(stage: str, parts: dict[str, Any]) -> str:
    """16 hex digits of sha256 over the stage's version and its (plain) config parts and input keys.
    Local inputs (model dirs, dataset files) count by their contents (names, sizes, mtimes), not their paths."""
    payload = json.dumps(_with_contents({"stage": stage, "version": STAGE_VERSIONS[stage], **_plain(parts)}),
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def stage_dir(cfg: DictConfig, stage: str, key: str) -> Path:
    return Path(os.path.expanduser(str(cfg.cache_dir))) / "stages" / f"{stage}-{key}"


def _intact(path: Path) -> bool:
    """The entry at ``path`` is sealed and every sealed file is as sealed; a damaged one is removed (one
    line). The caller holds the stage's lock."""
    from rlhf_train.infra.cache_entries import damage, discard

    if not path.exists():
        return False
    why = damage(path)
    if why is None:
        return True
    log.warning("[pipeline] the cached stage %s is damaged (%s): removed; the stage runs again", path, why)
    discard(path)
    return False


def is_complete(path: Path) -> bool:
    """The stage's cache entry exists and is intact (a damaged one is removed: the stage then runs again)."""
    from filelock import FileLock

    from rlhf_train.infra.cache_entries import damage

    if not path.is_dir():
        return False
    if damage(path) is None:  # the common case: no lock needed to read a sealed entry
        return True
    with FileLock(str(path.parent / f"{path.name}.lock")):
        return _intact(path)


def read_stage_info(path: Path) -> dict:
    return json.loads((path / "stage.json").read_text())


def cached_stage(path: Path, build: Callable[[Path], dict]) -> tuple[dict, bool]:
    """Return ``(info, reused)``: the stage's ``stage.json``, building it first unless it is complete.

    ``build(tmp_dir) -> info`` writes the stage's files into ``tmp_dir``; ``info`` (JSON) is saved as
    ``stage.json``, then the seal ``COMPLETE``, then the dir is moved to ``path`` atomically. A file lock makes
    a concurrent run for the same stage wait and reuse the result instead of building it twice.
    """
    from filelock import FileLock

    from rlhf_train.infra.cache_entries import discard, remove_stale_temps, seal, temp_dir, writable_dir

    if is_complete(path):
        return read_stage_info(path), True
    writable_dir(path.parent, "the stage cache dir")
    remove_stale_temps(path.parent)  # left by a build that was killed
    with FileLock(str(path.parent / f"{path.name}.lock")):
        if _intact(path):  # another run finished it while we waited
            return read_stage_info(path), True
        tmp = temp_dir(path)
        try:
            info = build(tmp)
            (tmp / "stage.json").write_text(json.dumps(info, indent=1, default=float))
            seal(tmp)  # last: the size and SHA-256 of every file, checked at each reuse
            apply_umask(tmp)  # safetensors writes 0600: use the umask's modes
            if path.exists():  # a damaged leftover (_intact removes those; this is belt and braces)
                discard(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return info, False


class Timer:
    """Wall-clock and CPU time (``process_time``: all threads of this process) of each named step.

    A step that raises is logged as ``failed after N s: <error type>`` (``interrupted`` for a
    KeyboardInterrupt / SystemExit, e.g. a preempted RL stage), its row gets ``error``, and the
    exception propagates unchanged."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    @contextmanager
    def __call__(self, name: str):
        w0, c0 = time.perf_counter(), time.process_time()
        row = self.rows.setdefault(name, {})
        error = None
        try:
            yield row
        except BaseException as err:
            error = err
            raise
        finally:
            row["wall_s"] = round(time.perf_counter() - w0, 2)
            row["cpu_s"] = round(time.process_time() - c0, 2)
            if error is None:
                log.info("[pipeline] %-10s %s in %.1f s wall, %.1f s CPU", name,
                         "reused from cache" if row.get("reused") else "done", row["wall_s"], row["cpu_s"])
            else:
                row["error"] = type(error).__name__
                log.error("[pipeline] %s %s after %.1f s: %s", name,
                          "failed" if isinstance(error, Exception) else "interrupted", row["wall_s"],
                          type(error).__name__)
