"""A real full disk for tests: a small tmpfs, mounted where a test wants it (root only)."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """Mount a tmpfs of ``size`` (e.g. ``"256k"``) at ``path`` (created) for the ``with`` block; the test is
    skipped, with the reason, where it cannot be (not root, or no ``mount`` permission in this container)."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs mount, which needs root (the monkeypatched tests cover the rest)")
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_disk(path: Path, leave: int = 0) -> None:
    """Fill the file system of ``path`` with a file ``path/filler`` until ``leave`` bytes are free at most."""
    with open(path / "filler", "wb") as f:
        try:
            while True:
                free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
                if free <= leave:
                    break
                f.write(b"\0" * min(1 << 16, max(free - leave, 4096)))
                f.flush()
        except OSError:  # full
            pass
