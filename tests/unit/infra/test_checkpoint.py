"""Checkpoint integrity and failed writes (issue 17, items 6 and 8).

* a failed write (disk full, read-only dir) is one line: what failed, where, which checkpoint is intact;
* a checkpoint without ``COMPLETE`` is skipped with a line saying so (none left: an error, not a fresh start);
* same-size corruption (zeroed bytes) is caught by the manifest's checksums, and resume falls back past it;
* the fault stop does not call diverged weights (``optimizer.lr=1e6``) "the last good state".

Budget: ~3 s of tiny-model saves + ~8 s for one in-process run.
"""
from __future__ import annotations

import errno
import shutil

import pytest
import torch

from rlhf_train.infra.errors import ConfigError
from tests.helpers.reliability import make_cfg, tiny_policy


def _model_and_optim():
    policy = tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return policy, optimizer, scheduler


def _save(run_dir, iteration, keep=0):
    from accelerate import Accelerator
    from rlhf_train.infra.checkpoint import save_checkpoint

    policy, optimizer, scheduler = _model_and_optim()
    return save_checkpoint(run_dir, iteration, accelerator=Accelerator(cpu=True), policy=policy, optimizer=optimizer,
                           scheduler=scheduler, trainer_state={"kl_controller": {}}, config_yaml="a: 1\n", keep=keep,
                           rank_state={"ppo_generator": torch.Generator().manual_seed(iteration).get_state()})


# --------------------------------------------------------------------------------------------
# item 6: failed writes
# --------------------------------------------------------------------------------------------
def test_disk_full_while_checkpointing_is_one_line_naming_the_intact_checkpoint(tmp_path, monkeypatch):
    from rlhf_train.infra import checkpoint as ckpt
    from rlhf_train.infra.resume import verify_checkpoint

    first = _save(tmp_path, 1)
    real_save = torch.save

    def full_disk(obj, f, *a, **k):  # what torch says when the disk fills during optimizer.pt
        if str(f).endswith("optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 64 vs 0")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 4096))
    with pytest.raises(ckpt.CheckpointError) as exc:
        _save(tmp_path, 2)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "checkpoint iter_000002 could not be written" in msg and str(tmp_path / "checkpoints") in msg
    assert "the disk is full" in msg and f"the last complete checkpoint, {first}, is intact" in msg
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]  # no half-written temp dir
    assert verify_checkpoint(first) is None


def test_read_only_checkpoints_dir_is_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    from rlhf_train.infra import checkpoint as ckpt

    _save(tmp_path, 1)
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if self.name.startswith(".tmp-iter_"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ckpt.CheckpointError, match=r"could not be written in .*Read-only file system.*"
                                                   r"the last complete checkpoint, .*iter_000001, is intact"):
        _save(tmp_path, 2)


# --------------------------------------------------------------------------------------------
# item 8: integrity
# --------------------------------------------------------------------------------------------
def test_missing_complete_marker_is_reported_and_all_missing_is_an_error(tmp_path, capsys):
    from rlhf_train.infra.resume import resolve_resume

    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    (second / "COMPLETE").unlink()
    assert resolve_resume("auto", tmp_path) == first
    out = capsys.readouterr().out
    assert f"skipping checkpoint {second}: no COMPLETE marker" in out
    (first / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match=r"trainer\.resume=auto: every checkpoint .* is damaged"):
        resolve_resume("auto", tmp_path)


@pytest.mark.parametrize("target", ["optimizer.pt", "policy/model.safetensors", "rng_rank0.pt"])
def test_same_size_corruption_is_caught_by_checksums(tmp_path, capsys, target):
    from rlhf_train.infra.resume import resolve_resume, verify_checkpoint

    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    f = second / target
    data = bytearray(f.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(16) if any(data[middle:middle + 16]) else b"\xff" * 16
    f.write_bytes(bytes(data))  # same size, zeroed bytes inside
    assert "does not match its SHA-256" in verify_checkpoint(second)
    assert resolve_resume("auto", tmp_path) == first  # falls back past the corrupt one
    assert f"skipping checkpoint {second}: '{target}' does not match its SHA-256" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"trainer\.resume=.*SHA-256"):
        resolve_resume(str(second), tmp_path)


def test_fault_stop_does_not_checkpoint_diverged_weights(tmp_path):
    from rlhf_train.infra.checkpoint_files import list_checkpoints
    from rlhf_train.loop.trainer import train

    with pytest.raises(FloatingPointError) as exc:
        train(make_cfg("optimizer.lr=1e6", "trainer.num_iterations=8", "trainer.checkpoint_every=100"), tmp_path)
    msg = str(exc.value)
    assert "last good state is checkpointed" not in msg
    assert "diverged" in msg or "not finite" in msg, msg
    assert list_checkpoints(tmp_path) == []


def test_weights_problem():
    from rlhf_train.infra.distributed import max_abs_weight, weights_problem

    policy = tiny_policy()
    start = max_abs_weight(policy)
    assert weights_problem(policy, start) is None
    with torch.no_grad():
        next(policy.parameters()).mul_(1e6)
    assert "diverged" in weights_problem(policy, start)
    with torch.no_grad():
        next(policy.parameters())[0] = float("nan")
    assert weights_problem(policy, start) == "the weights are not finite"


# --------------------------------------------------------------------------------------------
# a full disk under the writers that raise no OSError
# --------------------------------------------------------------------------------------------
class _FullDiskTokenizer:
    def save_pretrained(self, path):  # what the tokenizers binding raises when tokenizer.json cannot be written
        raise Exception("No space left on device (os error 28)")


@pytest.mark.parametrize("failing", ["safetensors", "tokenizers"])
def test_checkpoint_write_failure_of_safetensors_or_tokenizers_is_one_line(tmp_path, monkeypatch, failing):
    import safetensors.torch
    from safetensors import SafetensorError

    from rlhf_train.infra import checkpoint as ckpt
    from rlhf_train.infra.resume import verify_checkpoint

    first = _save(tmp_path, 1)
    tokenizer = None
    if failing == "safetensors":
        def full(*a, **k):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:
        tokenizer = _FullDiskTokenizer()
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 200 << 20))
    from accelerate import Accelerator

    policy, optimizer, scheduler = _model_and_optim()
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.save_checkpoint(tmp_path, 2, accelerator=Accelerator(cpu=True), policy=policy, optimizer=optimizer,
                             scheduler=scheduler, trainer_state={}, config_yaml="a: 1\n", tokenizer=tokenizer)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint iter_000002 could not be written in {tmp_path / 'checkpoints'}")
    assert "(the disk is full (200.0 MiB free))" in msg and f"the last complete checkpoint, {first}, is intact" in msg
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]  # no temp dir left
    assert verify_checkpoint(first) is None


def test_checkpoint_onto_a_full_disk(tmp_path):
    """A real full disk (a tmpfs) under safetensors' writer: one line with the path and the free space, the
    temp dir gone, the first checkpoint intact."""
    from rlhf_train.infra import checkpoint as ckpt
    from rlhf_train.infra.resume import verify_checkpoint
    from tests.helpers.disk import fill_disk, small_tmpfs

    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        first = _save(disk, 1)
        fill_disk(disk, leave=36 << 10)  # room for rng_rank0.pt (~20 KB) and policy/config.json, not model.safetensors
        with pytest.raises(ckpt.CheckpointError) as exc:
            _save(disk, 2)
        msg = str(exc.value)
        assert "\n" not in msg and f"could not be written in {disk / 'checkpoints'} (the disk is full (" in msg
        assert f"MiB free)); the last complete checkpoint, {first}, is intact" in msg
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["iter_000001"]
        assert verify_checkpoint(first) is None
