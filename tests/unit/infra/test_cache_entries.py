"""Cache entries: the seal finds every kind of damage; stale temp dirs go (writer gone, or too old), live ones stay;
verifying is one SHA-256 pass per process while the files keep their stat."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from rlhf_train.infra import cache_entries
from rlhf_train.infra.cache_entries import damage, remove_stale_temps, seal, temp_dir


def test_seal_and_damage(tmp_path):
    entry = tmp_path / "e"
    entry.mkdir()
    (entry / "w.bin").write_bytes(b"abcd" * 100)
    assert damage(entry) == "no COMPLETE seal"
    seal(entry)
    assert damage(entry) is None
    (entry / "w.bin").write_bytes(b"abcd" * 99)
    assert damage(entry) == "w.bin: 396 bytes, sealed with 400"
    (entry / "w.bin").write_bytes(b"abce" * 100)
    assert damage(entry) == "w.bin: its bytes changed (SHA-256)"
    (entry / "w.bin").unlink()
    assert damage(entry) == "w.bin: missing"
    (entry / "COMPLETE").write_text("not json")
    assert damage(entry) == "its COMPLETE seal holds no file list"


def test_a_verified_entry_is_not_hashed_again(tmp_path, monkeypatch):
    entry = tmp_path / "e"
    entry.mkdir()
    (entry / "w.bin").write_bytes(os.urandom(1000))
    seal(entry)
    calls = []
    from rlhf_train.infra import checkpoint_files

    real = checkpoint_files.sha256
    monkeypatch.setattr(checkpoint_files, "sha256", lambda p: calls.append(p) or real(p))
    assert damage(entry) is None and damage(entry) is None and len(calls) == 1


def test_stale_temp_dirs_go_live_ones_stay(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = cache_entries._host()
        dirs = {name: tmp_path / name for name in (
            f".a.tmp-{dead.pid}-{host}-0123abcd",         # its writer is gone: removed
            f".b.tmp-{live.pid}-{host}-0123abcd",         # its writer runs: kept
            f".c.tmp-{live.pid}-otherhost-0123abcd",      # another host's, fresh: kept
            f".d.tmp-{live.pid}-otherhost-89abcdef",      # another host's, 7 h old: removed
            "e-0123",                                     # an entry: never touched
        )}
        for d in dirs.values():
            d.mkdir()
            (d / "f").write_bytes(b"x" * 10)
        old = time.time() - 7 * 3600
        os.utime(dirs[f".d.tmp-{live.pid}-otherhost-89abcdef"], (old, old))
        own = temp_dir(tmp_path / "f-0123")  # this process's: kept
        removed = remove_stale_temps(tmp_path)
        assert sorted(removed) == [f".a.tmp-{dead.pid}-{host}-0123abcd", f".d.tmp-{live.pid}-otherhost-89abcdef"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [own.name, "e-0123", f".b.tmp-{live.pid}-{host}-0123abcd", f".c.tmp-{live.pid}-otherhost-0123abcd"])
    finally:
        live.kill()
        live.wait()


def test_stale_temp_files_go_live_ones_stay(tmp_path):
    from rlhf_train.infra.cache_entries import temp_file
    from rlhf_train.infra.checkpoint import current_umask

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = cache_entries._host()
    stale = tmp_path / f".x.json.tmp-{dead.pid}-{host}-0123abcd"  # a writer killed mid-write
    stale.write_bytes(b"x" * 10)
    fd, own = temp_file(tmp_path / "x.json")  # this process's, being written: kept
    os.close(fd)
    assert own.name.startswith(f".x.json.tmp-{os.getpid()}-{host}-")
    assert own.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # the umask's mode, as every cache file
    assert remove_stale_temps(tmp_path) == [stale.name]
    assert [p.name for p in tmp_path.iterdir()] == [own.name]
