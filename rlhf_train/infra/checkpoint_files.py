"""What a checkpoint is on disk, shared by writing it (``checkpoint``) and finding / loading it (``resume``).

Layout of ``<run dir>/checkpoints/iter_000012/``::

    policy/                  the policy LM (save_pretrained, safetensors) + tokenizer
    value_head.safetensors   the value head
    optimizer.pt             optimizer state (tensors and numbers only: loaded with weights_only=True)
    scheduler.pt             learning-rate scheduler state (idem)
    rng_rank{r}.pt           the state of process r: torch / python / numpy RNGs and its PPO minibatch
                             generator (each process draws differently; all are gathered to rank 0)
    trainer_state.json       iteration, run id, KL controller state, data position, W&B run id, fault counts
    config.yaml              the resolved config, secrets redacted (resume=auto compares it with its own)
    COMPLETE                 written last: the iteration, the size and SHA-256 of every file (a manifest)

Here: where checkpoints live and which are complete (:func:`checkpoint_dirs`, :func:`list_checkpoints`), the
files every checkpoint must have (:data:`REQUIRED_FILES`), the manifest and its checksums (:func:`manifest`,
:func:`sha256`), each process's RNG states (:func:`process_state` / :func:`set_rng_state`) and the quiet
``transformers`` context both ``save_pretrained`` and ``from_pretrained`` run in.
"""
from __future__ import annotations

import contextlib
import hashlib
import random
import re
from pathlib import Path

import numpy as np
import torch

ITER_RE = re.compile(r"^iter_(\d+)$")
REQUIRED_FILES = ("trainer_state.json", "value_head.safetensors", "optimizer.pt", "scheduler.pt", "policy/config.json")


# --------------------------------------------------------------------------------------------
# Where checkpoints are
# --------------------------------------------------------------------------------------------
def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every ``iter_*`` dir in ``run_dir``'s checkpoints, complete or not, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if ITER_RE.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(ITER_RE.match(p.name).group(1)))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints in ``run_dir`` that have their ``COMPLETE`` marker, oldest first."""
    return [p for p in checkpoint_dirs(run_dir) if (p / "COMPLETE").exists()]


# --------------------------------------------------------------------------------------------
# The manifest: sizes and checksums
# --------------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest(directory: Path) -> tuple[dict[str, int], dict[str, str]]:
    """``({relative path: size in bytes}, {relative path: SHA-256})`` of every file under ``directory``
    except ``COMPLETE``."""
    files = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "COMPLETE"]
    rel = [p.relative_to(directory).as_posix() for p in files]
    return dict(zip(rel, (p.stat().st_size for p in files))), dict(zip(rel, map(sha256, files)))


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------
def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}


def numpy_rng_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def process_state(extra: dict | None = None) -> dict:
    """What this process alone holds: its RNG states (torch, python, numpy) plus ``extra`` (e.g. the PPO
    minibatch generator's state); saved per process as ``rng_rank{r}.pt``."""
    return {**rng_state(), "numpy": numpy_rng_state(), **(extra or {})}


def set_rng_state(state: dict, numpy_state: list | None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if numpy_state is not None:
        name, keys, pos, has_gauss, cached = numpy_state
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# --------------------------------------------------------------------------------------------
# Writing and reading model dirs without progress bars
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_transformers():
    """No "Writing model shards" / "Loading weights" progress bars in the run's log at every checkpoint."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
