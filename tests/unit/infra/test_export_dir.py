"""Where an export may go (rlhf_train/infra/export_dir.py), through ``python -m rlhf_train.tools.export``.

* an ``out_dir`` that is the run dir, the checkpoint, ``checkpoints/``, a model dir of the user's, a file or a
  dir inside the checkpoint: one ``Error:`` line, exit 2, and not one byte under the run dir changed;
* a new dir, an empty dir (kept: the files go into it) and an earlier export (replaced) are written; temp
  dirs a killed export left are removed, a user's look-alike ``.tmp-*`` dir is not;
* a write that fails (disk full) is one line naming the path and the free space, exit 1, no temp dir left,
  the earlier export kept: monkeypatched writers here, a real full tmpfs when running as root.

Budget: ~4 s (tiny-model checkpoints, no training).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.disk import fill_disk, small_tmpfs
from tests.helpers.reliability import files_of, tiny_policy


@pytest.fixture
def run(tmp_path):
    """A run dir as a run leaves it: two checkpoints, metrics.csv, the log, the end-of-run export."""
    from accelerate import Accelerator

    from rlhf_train.infra.checkpoint import save_checkpoint
    from rlhf_train.models.export import export_policy

    run_dir = tmp_path / "run"
    policy = tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for it in (1, 2):
        save_checkpoint(run_dir, it, accelerator=Accelerator(cpu=True), policy=policy, optimizer=optimizer,
                        scheduler=scheduler, trainer_state={}, config_yaml="a: 1\n", keep=0)
    (run_dir / "metrics.csv").write_text("iteration,score\n1,0.5\n2,0.6\n")
    (run_dir / "__main__.log").write_text("[rlhf_train] run dir: x\n")
    export_policy(policy, None, run_dir / "policy")
    return run_dir


def _export(capsys, ckpt, out):
    from rlhf_train.tools.export import main

    rc = main([str(ckpt), str(out)])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("target", ["run dir", "checkpoint", "checkpoints", "inside checkpoint", "own model dir",
                                    "a file"])
def test_export_never_deletes_what_it_did_not_write(run, capsys, target):
    ckpt = run / "checkpoints" / "iter_000002"
    (run / "mine").mkdir()
    (run / "mine" / "config.json").write_text("{}")  # a model dir of the user's: not an export
    (run / "notes.txt").write_text("keep me")
    out = {"run dir": run, "checkpoint": ckpt, "checkpoints": run / "checkpoints",
           "inside checkpoint": ckpt / "exported", "own model dir": run / "mine", "a file": run / "notes.txt"}[target]
    before = files_of(run.parent)
    rc, err = _export(capsys, ckpt, out)
    assert rc == 2 and len(err) == 1 and err[0].startswith("Error: out_dir="), err
    assert ("source of this export" in err[0]) == (target in ("run dir", "checkpoint", "checkpoints",
                                                              "inside checkpoint"))
    assert files_of(run.parent) == before  # nothing written, nothing deleted
    assert sorted(p.name for p in run.iterdir()) == sorted(["checkpoints", "metrics.csv", "__main__.log", "policy",
                                                           "mine", "notes.txt"])


def test_export_writes_new_empty_and_earlier_export_dirs(run, tmp_path, capsys):
    from rlhf_train.infra.export_dir import EXPORT_MARKER

    ckpt = run / "checkpoints" / "iter_000001"
    weights = (ckpt / "policy" / "model.safetensors").read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    killed = tmp_path / ".tmp-fresh-abc123"  # what a killed export left (marker first): removed
    killed.mkdir()
    (killed / EXPORT_MARKER).write_text("{}")
    look_alike = tmp_path / ".tmp-fresh-mine"  # the user's (no marker): kept
    look_alike.mkdir()
    (look_alike / "data.bin").write_bytes(b"mine")
    for out in (tmp_path / "fresh", empty, run / "policy"):  # new, empty (kept, filled), an earlier export
        rc, err = _export(capsys, ckpt, out)
        assert rc == 0, err
        assert (out / "model.safetensors").read_bytes() == weights and (out / EXPORT_MARKER).is_file()
        assert (out / "value_head.safetensors").is_file()
    assert empty.stat().st_ino == inode
    assert not killed.exists() and (look_alike / "data.bin").read_bytes() == b"mine"
    assert not [p for p in [*tmp_path.iterdir(), *run.iterdir(), *empty.iterdir()]
                if p.name.startswith((".tmp-policy", ".old-", ".tmp-empty", ".tmp-fresh-")) and p != look_alike]


@pytest.mark.parametrize("failing", ["safetensors", "tokenizers"])
def test_export_write_failure_is_one_line_and_keeps_the_earlier_export(run, tmp_path, capsys, monkeypatch, failing):
    """The two writers whose errors are no OSError: safetensors' SafetensorError, the tokenizers binding's
    plain Exception (what each raises on a full disk)."""
    import shutil

    from safetensors import SafetensorError

    from rlhf_train.infra import checkpoint

    ckpt = run / "checkpoints" / "iter_000001"
    before = files_of(run)
    if failing == "safetensors":
        err = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    else:
        err = Exception("No space left on device (os error 28)")

    def full(src, dst, *a, **k):
        raise err

    monkeypatch.setattr(shutil, "copy2", full)  # copytree's and the value head's copy
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 123 << 20))
    rc, lines = _export(capsys, ckpt, run / "policy")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"Error: the export of {ckpt} could not be written in {run / 'policy'} "
                               f"(the disk is full (123.0 MiB free)); checkpoint {ckpt} is untouched"), lines
    assert files_of(run) == before and not [p for p in run.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_export_onto_a_full_disk(run, tmp_path, capsys):
    """A real full disk (a 512 KiB tmpfs): one line with the path and the free space; nothing left there."""
    ckpt = run / "checkpoints" / "iter_000001"
    with small_tmpfs(tmp_path / "disk", "512k") as disk:
        fill_disk(disk, leave=16 << 10)
        rc, lines = _export(capsys, ckpt, disk / "exported")
        assert rc == 1 and len(lines) == 1, lines
        assert f"could not be written in {disk / 'exported'} (the disk is full (" in lines[0]
        assert " MiB free)); checkpoint " in lines[0]
        assert sorted(os.listdir(disk)) == ["filler"]  # no .tmp-* dir, no half export


def test_a_run_refuses_at_start_a_policy_dir_it_did_not_write(tmp_path):
    """The end of a run exports into <run dir>/policy: one that holds the user's files stops the run at its
    start (before any model is built), with one line; an earlier run's export there is fine (replaced)."""
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.trainer import train
    from tests.helpers.reliability import make_cfg

    run_dir = tmp_path / "run"
    (run_dir / "policy").mkdir(parents=True)
    (run_dir / "policy" / "config.json").write_text('{"mine": true}')
    with pytest.raises(ConfigError, match=r"<hydra\.run\.dir>/policy=.* holds files that are not an rlhf_train "
                                          r"export .*nothing was written or deleted"):
        train(make_cfg("logger=none", "trainer.num_iterations=1"), run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["policy"]
    assert (run_dir / "policy" / "config.json").read_text() == '{"mine": true}'
