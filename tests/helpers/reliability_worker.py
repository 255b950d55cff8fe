"""``python -m rlhf_train <overrides>`` as a worker of ``accelerate launch``, with one simulated fault.

``RLHF_TEST_LOCAL_DISK=1``: processes other than rank 0 run as on another machine with its own local
disk: ``<run dir>/checkpoints`` does not exist for them, and writing into it fails. A run then works only
if rank 0 alone reads and writes checkpoints (rlhf_train/infra/checkpoint.py, resume.py).
"""
from __future__ import annotations

import os
import runpy
from pathlib import Path

import torch


def hide_checkpoints() -> None:
    def under_checkpoints(path) -> bool:
        return "checkpoints" in Path(str(path)).parts

    is_dir, exists, save = Path.is_dir, Path.exists, torch.save
    Path.is_dir = lambda self: False if under_checkpoints(self) else is_dir(self)
    Path.exists = lambda self: False if under_checkpoints(self) else exists(self)

    def no_save(obj, f, *args, **kwargs):
        if under_checkpoints(f):
            raise OSError(f"rank {os.environ.get('RANK')} wrote into the checkpoints of another machine: {f}")
        return save(obj, f, *args, **kwargs)

    torch.save = no_save


if __name__ == "__main__":
    if os.environ.get("RLHF_TEST_LOCAL_DISK") and int(os.environ.get("RANK", "0")) > 0:
        hide_checkpoints()
    runpy.run_module("rlhf_train", run_name="__main__", alter_sys=True)
