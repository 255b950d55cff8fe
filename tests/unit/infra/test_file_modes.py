"""Files a run writes get the modes the process umask gives, checkpoints included (issue 18, item 7).

``safetensors`` writes ``model.safetensors`` 0600 and ``tempfile.mkdtemp`` makes 0700 dirs: a group that
shares the output dir could not read them. With umask 0o022 every file must be 0644, every dir 0755.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.helpers.reliability import make_cfg


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _wrong_modes(root: Path) -> list[str]:
    wrong = []
    for p in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        want = 0o755 if p.is_dir() else 0o644
        if not p.is_symlink() and mode != want:
            wrong.append(f"{p.relative_to(root.parent)}: {oct(mode)} (want {oct(want)})")
    return wrong


def test_apply_umask_gives_plain_modes(tmp_path, umask_022):
    import tempfile

    import torch
    from safetensors.torch import save_file

    from rlhf_train.infra.checkpoint import apply_umask, current_umask

    assert current_umask() == 0o022
    d = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700
    save_file({"w": torch.zeros(2)}, d / "model.safetensors")  # 0600
    fd, _ = tempfile.mkstemp(dir=d)  # 0600
    os.close(fd)
    (d / "sub").mkdir(mode=0o700)
    (d / "run.sh").write_text("#!/bin/sh\n")
    (d / "run.sh").chmod(0o700)
    assert _wrong_modes(d)
    apply_umask(d)
    assert stat.S_IMODE((d / "run.sh").stat().st_mode) == 0o755  # an executable stays executable
    (d / "run.sh").unlink()
    assert _wrong_modes(d) == []


def test_smoke_run_checkpoints_and_run_dir_follow_the_umask(tmp_path, umask_022):
    from rlhf_train.loop.trainer import train

    run = tmp_path / "run"
    train(make_cfg("trainer.num_iterations=1", "trainer.checkpoint_every=1"), run)
    ckpts = run / "checkpoints"
    assert list(ckpts.glob("iter_*/policy/model.safetensors")), "no checkpoint written"
    assert _wrong_modes(ckpts) == []
    assert _wrong_modes(run) == []  # metrics.csv, config, logs: everything the run wrote


def test_stage_cache_dirs_follow_the_umask(tmp_path, umask_022):
    import torch
    from safetensors.torch import save_file

    from rlhf_train.pipeline.cache import cached_stage

    def build(tmp: Path) -> dict:
        (tmp / "policy").mkdir()
        save_file({"w": torch.zeros(2)}, tmp / "policy" / "model.safetensors")  # as save_pretrained does
        return {"ok": 1}

    stages = tmp_path / "stages"
    info, reused = cached_stage(stages / "sft-abc", build)
    assert info == {"ok": 1} and not reused
    assert _wrong_modes(stages / "sft-abc") == []
