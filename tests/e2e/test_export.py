"""The end-of-run export onto a full disk, through ``python -m rlhf_train`` (docs/resume-and-faults.md).

``<run dir>/policy`` is an empty 64 KiB tmpfs (root only; skipped otherwise): the run trains and checkpoints,
then its export fails. One ``Error:`` line naming the path and the free space, exit 1, no traceback, no temp
dir left, the last checkpoint intact; with space again, ``trainer.resume=auto`` writes the export from it.

Budget: ~20 s (one CLI run, one in-process resume that trains nothing).
"""
from __future__ import annotations

import os
import re

from tests.helpers.disk import small_tmpfs
from tests.helpers.reliability import FAST, cli, make_cfg


def test_end_of_run_export_onto_a_full_disk_is_one_line_and_resume_writes_it(tmp_path):
    from rlhf_train.infra.checkpoint_files import list_checkpoints
    from rlhf_train.infra.resume import verify_checkpoint
    from rlhf_train.loop.trainer import train

    run_dir = tmp_path / "run"
    overrides = ["trainer.num_iterations=2", "trainer.checkpoint_every=1", "logger=none"]
    with small_tmpfs(run_dir / "policy", "64k") as policy:
        res = cli(*FAST, *overrides, f"hydra.run.dir={run_dir}")
        errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
        assert res.returncode == 1 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
        last = run_dir / "checkpoints" / "iter_000002"
        assert re.fullmatch(re.escape(f"Error: the export of the trained policy could not be written in {policy} "
                                      f"(the disk is full (") + r"0\.\d MiB free\)\); " + re.escape(
            f"the last complete checkpoint, {last}, is intact: free space, then run again with trainer.resume=auto "
            f"to write the export from it"), errors[0]), errors
        assert os.listdir(policy) == []  # no temp dir, no half export
        assert list_checkpoints(run_dir) == [run_dir / "checkpoints" / "iter_000001", last]
        assert verify_checkpoint(last) is None
    from rlhf_train.infra.export_dir import EXPORT_MARKER

    train(make_cfg(*overrides, "trainer.resume=auto"), run_dir)  # space again (the tmpfs is gone)
    assert list_checkpoints(run_dir)[-1] == last  # nothing trained again
    assert (run_dir / "policy" / "model.safetensors").is_file() and (run_dir / "policy" / EXPORT_MARKER).is_file()
