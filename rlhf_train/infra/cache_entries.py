"""Entries of the cache dir (``$RLHF_TRAIN_CACHE``): GGUF conversions (:mod:`rlhf_train.models.gguf`) and the
pipeline's stages (:mod:`rlhf_train.pipeline.cache`). Each is built in a temp dir next to its place, sealed,
and moved into place; a reuse checks the seal first.

* :func:`seal` writes ``COMPLETE`` last: the size and SHA-256 of every file (the manifest of a checkpoint,
  :func:`rlhf_train.infra.checkpoint_files.manifest`). :func:`damage` says why an entry cannot be trusted (no
  seal, a file missing, another size, other bytes) or ``None``. A full SHA-256 because it is cheap: 0.36 s
  for a 540 MB file (SmolLM2-135M in float32) on a 2-core CPU, from the page cache, which the load that
  follows reads anyway; an entry checked once is not hashed again by the same process while its files keep
  their sizes and mtimes.
* :func:`temp_dir` and :func:`temp_file` name a temp dir or file after its writer
  (``.<entry>.tmp-<pid>-<host>-<random>``); :func:`remove_stale_temps` removes the ones whose writer is gone
  (same host, no such process) or that are older than :data:`STALE_HOURS` (another host, or a reused pid): a
  SIGKILL mid-write leaves nothing behind for long.
* :func:`writable_dir` makes the cache dir or stops with one :class:`ConfigError` line naming it and the
  variable that sets it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

from rlhf_train.infra.checkpoint_files import manifest
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)

SEAL = "COMPLETE"
STALE_HOURS = 6.0  # a temp dir whose writer cannot be asked (another host) is removed after this long
_TEMP_RE = re.compile(r"\.tmp-(\d+)-([A-Za-z0-9_.]+)-[0-9a-f]{8}$")
_verified: dict[str, tuple] = {}  # entry -> the stat of its files when this process last verified it


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


# --------------------------------------------------------------------------------------------
# Seal and verify
# --------------------------------------------------------------------------------------------
def seal(entry: str | Path, **extra) -> None:
    """Write ``entry/COMPLETE``: the size and SHA-256 of every other file (and ``extra``), as the last file."""
    entry = Path(entry)
    sizes, sums = manifest(entry)
    (entry / SEAL).write_text(json.dumps({"written": time.strftime("%Y-%m-%d %H:%M:%S"), **extra,
                                          "sizes": sizes, "sha256": sums}, indent=1))


def _stat_key(entry: Path, files) -> tuple:
    out = []
    for rel in sorted(files):
        st = (entry / rel).stat()
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def damage(entry: str | Path) -> str | None:
    """Why ``entry`` cannot be reused (``"no COMPLETE seal"``, ``"model.safetensors: 12 bytes, sealed with
    540 MB"``, ``"config.json: its bytes changed"``, ...), or ``None`` when every sealed file is as sealed."""
    from rlhf_train.infra.checkpoint_files import sha256

    entry = Path(entry)
    try:
        sealed = json.loads((entry / SEAL).read_text())
        sizes, sums = dict(sealed["sizes"]), dict(sealed["sha256"])
    except FileNotFoundError:
        return f"no {SEAL} seal"
    except (ValueError, KeyError, TypeError, OSError):
        return f"its {SEAL} seal holds no file list"
    for rel, size in sorted(sizes.items()):
        path = entry / rel
        if not path.is_file():
            return f"{rel}: missing"
        if path.stat().st_size != size:
            return f"{rel}: {path.stat().st_size} bytes, sealed with {size}"
    key = _stat_key(entry, sizes)
    if _verified.get(str(entry)) == key:
        return None
    for rel in sorted(sizes):
        if sha256(entry / rel) != sums.get(rel):
            return f"{rel}: its bytes changed (SHA-256)"
    _verified[str(entry)] = key
    return None


def discard(entry: str | Path) -> None:
    """Remove a damaged entry: renamed aside first (one rename: a reader sees the entry or nothing)."""
    entry = Path(entry)
    aside = entry.with_name(f"{entry.name}.tmp-{os.getpid()}-{_host()}-{secrets.token_hex(4)}")
    try:
        os.replace(entry, aside)
    except FileNotFoundError:  # another process removed it first
        return
    _verified.pop(str(entry), None)
    shutil.rmtree(aside, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Temp dirs and files
# --------------------------------------------------------------------------------------------
def temp_dir(entry: str | Path) -> Path:
    """A fresh temp dir next to ``entry``, named after this process (see :func:`remove_stale_temps`)."""
    path = _temp_name(entry)
    path.mkdir(parents=True)
    return path


def temp_file(path: str | Path) -> tuple[int, Path]:
    """A new file next to ``path``, named after this process (see :func:`remove_stale_temps`), opened for
    writing: ``(fd, its path)``. Its mode is what the umask gives (``tempfile.mkstemp`` would make it 0600)."""
    tmp = _temp_name(path)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def _temp_name(entry: str | Path) -> Path:
    """``.<entry>.tmp-<pid>-<host>-<random>`` next to ``entry``: what :data:`_TEMP_RE` reads back."""
    entry = Path(entry)
    return entry.with_name(f".{entry.name.lstrip('.')}.tmp-{os.getpid()}-{_host()}-{secrets.token_hex(4)}")


def _writer_gone(pid: int, host: str) -> bool:
    if host != _host():
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def remove_stale_temps(parent: str | Path, max_age_hours: float = STALE_HOURS) -> list[str]:
    """Remove the temp dirs and files in ``parent`` (:func:`temp_dir`, :func:`temp_file`) whose writer is gone or
    that are older than ``max_age_hours``; a line each (name and size). Returns their names."""
    parent, removed = Path(parent), []
    try:
        children = list(parent.iterdir())
    except OSError:
        return removed
    for path in children:
        m = _TEMP_RE.search(path.name)
        if m is None:
            continue
        try:
            age_h = (time.time() - path.stat().st_mtime) / 3600
        except FileNotFoundError:
            continue
        if not (_writer_gone(int(m.group(1)), m.group(2)) or age_h > max_age_hours):
            continue
        kind = "dir" if path.is_dir() else "file"
        files = list(path.rglob("*")) if kind == "dir" else [path]
        size = sum(f.stat().st_size for f in files if f.is_file())
        if kind == "dir":
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if not path.exists():
            removed.append(path.name)
            log.warning("[rlhf_train] removed the temp %s %s (%.1f MB) left by a writer that is gone (process %s "
                        "on %s, %.1f h old)", kind, path, size / 2**20, m.group(1), m.group(2), age_h)
    return removed


# --------------------------------------------------------------------------------------------
# The cache dir
# --------------------------------------------------------------------------------------------
def writable_dir(path: str | Path, what: str = "the cache dir",
                 how: str = "set RLHF_TRAIN_CACHE (or cache_dir=) to a writable dir") -> Path:
    """``path`` created if needed and writable, or one :class:`ConfigError` naming it and ``how`` to fix it."""
    path = Path(os.path.expanduser(str(path)))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ConfigError(f"{what} '{path}' is not writable ({type(err).__name__}: {why}); {how}") from None
    return path
