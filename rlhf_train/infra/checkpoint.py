"""Checkpoints that hold everything the next iteration depends on, written atomically.

Layout of ``<run dir>/checkpoints/iter_000012/``::

    policy/                  the policy LM (save_pretrained, safetensors) + tokenizer
    value_head.safetensors   the value head
    optimizer.pt             optimizer state (tensors and numbers only: loaded with weights_only=True)
    scheduler.pt             learning-rate scheduler state (idem)
    rng_rank{r}.pt           torch / python RNG states of each process (numpy's in trainer_state.json)
    trainer_state.json       iteration, KL controller state and pending KLs, data position, PPO minibatch
                             generator, W&B run id, fault counts
    config.yaml              the resolved config, secrets redacted
    COMPLETE                 written last: the iteration and the size of every file (a manifest)

How a checkpoint is written (:func:`save_checkpoint`):
  1. every file goes into ``checkpoints/.tmp-iter_000012/``, gets the mode the process umask gives
     (:func:`apply_umask`: safetensors alone would write 0600) and is fsync'ed;
  2. ``COMPLETE`` (the manifest) is written last;
  3. the directory is renamed to ``iter_000012`` (``os.replace``: atomic on POSIX), the parent fsync'ed;
  4. older checkpoints beyond ``trainer.keep_checkpoints`` and stale ``.tmp-*`` dirs are removed.
A crash at any point leaves either the previous checkpoints untouched plus a ``.tmp-*`` dir (ignored,
removed by the next save), or the new complete one. ``trainer.resume=auto`` takes the newest checkpoint
whose files match its manifest (:func:`verify_checkpoint`), so even a checkpoint damaged after the fact
(a truncated file) falls back to the one before it, with one line saying so.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_train.infra.errors import ConfigError

_ITER_RE = re.compile(r"^iter_(\d+)$")
REQUIRED_FILES = ("trainer_state.json", "value_head.safetensors", "optimizer.pt", "scheduler.pt", "policy/config.json")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints in ``run_dir`` that have their ``COMPLETE`` marker, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _ITER_RE.match(p.name) and (p / "COMPLETE").exists()]
    return sorted(found, key=lambda p: int(_ITER_RE.match(p.name).group(1)))


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------
def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}


def numpy_rng_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def set_rng_state(state: dict, numpy_state: list | None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if numpy_state is not None:
        name, keys, pos, has_gauss, cached = numpy_state
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _quiet_transformers():
    """No "Writing model shards" / "Loading weights" progress bars in the run's log at every checkpoint."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def current_umask() -> int:
    """The process umask (read from ``/proc/self/status`` where it can be, so nothing is changed; else
    set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``open`` / ``mkdir`` would have given them:
    ``0o666 & ~umask`` for files (``0o777`` for executables), ``0o777 & ~umask`` for directories.

    Needed after writers that create owner-only files: ``safetensors`` (``model.safetensors`` is written
    0600), ``tempfile.mkstemp`` (0600) and ``tempfile.mkdtemp`` (0700), so that a group sharing the
    output dir can read what a run wrote, as with every other file. Symlinks are left alone.
    """
    keep = ~current_umask()
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        if p.is_dir():
            p.chmod(0o777 & keep)
        elif p.is_file():
            p.chmod((0o777 if p.stat().st_mode & 0o111 else 0o666) & keep)


def _manifest(directory: Path) -> dict[str, int]:
    """``{relative path: size in bytes}`` of every file under ``directory`` except ``COMPLETE``."""
    return {p.relative_to(directory).as_posix(): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "COMPLETE"}


def save_checkpoint(run_dir: str | Path, iteration: int, *, accelerator, policy, optimizer, scheduler,
                    trainer_state: dict, config_yaml: str, tokenizer=None, keep: int = 2) -> Path | None:
    """Write checkpoint ``iter_<iteration>`` atomically (collective: call on every process).

    ``keep``: how many checkpoints to keep (older ones are deleted); ``0`` keeps all.
    """
    from safetensors.torch import save_file

    root = checkpoint_root(run_dir)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp-iter_{iteration:06d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(".tmp-iter_*"), *root.glob(".old-iter_*")]:  # left by a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    # 1. every file into the temp dir
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    state_dict = accelerator.get_state_dict(policy)  # gathers sharded (FSDP/ZeRO) weights; collective
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(policy)
        lm_state = {k[len("lm."):]: v for k, v in state_dict.items() if k.startswith("lm.")}
        with _quiet_transformers():
            model.lm.save_pretrained(tmp / "policy", state_dict=lm_state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "policy")
        vh = {k[len("value_head."):]: v.contiguous() for k, v in state_dict.items() if k.startswith("value_head.")}
        save_file(vh, tmp / "value_head.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        state = dict(trainer_state, iteration=iteration, numpy_rng=numpy_rng_state(),
                     num_processes=accelerator.num_processes)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        apply_umask(tmp)  # safetensors writes its files 0600: give them the modes of every other file
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        # 2. the manifest, last
        (tmp / "COMPLETE").write_text(json.dumps({"iteration": iteration, "files": _manifest(tmp)}, indent=1))
        _fsync(tmp / "COMPLETE")
        # 3. rename into place (an existing one of the same iteration, from an earlier run, goes aside first)
        old = root / f".old-iter_{iteration:06d}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(root)
        shutil.rmtree(old, ignore_errors=True)
        # 4. prune
        for stale in (list_checkpoints(run_dir)[:-keep] if keep > 0 else []):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# --------------------------------------------------------------------------------------------
# Finding and checking
# --------------------------------------------------------------------------------------------
def verify_checkpoint(path: str | Path) -> str | None:
    """What is wrong with checkpoint ``path``, or ``None`` if it looks loadable.

    Cheap (no tensor data is read): the ``COMPLETE`` manifest, the required files and their sizes, the
    JSON of ``trainer_state.json`` and the headers of the safetensors files.
    """
    path = Path(path)
    if not path.is_dir():
        return "no such checkpoint directory"
    if not (path / "COMPLETE").exists():
        return "not a complete checkpoint (no COMPLETE marker: its write was interrupted)"
    try:
        manifest = json.loads((path / "COMPLETE").read_text() or "{}")
    except ValueError:
        return "its COMPLETE marker is corrupt"
    files = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    for rel in REQUIRED_FILES:
        if not (path / rel).is_file():
            return f"'{rel}' is missing"
    weights = sorted(path.rglob("*.safetensors"))
    if not any(w.parent == path / "policy" for w in weights):
        return "'policy/model.safetensors' is missing"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"'{rel}' is missing"
        if f.stat().st_size != size:
            return f"'{rel}' has {f.stat().st_size} bytes, {size} were written (truncated or changed)"
    try:
        json.loads((path / "trainer_state.json").read_text())
    except ValueError:
        return "'trainer_state.json' is corrupt"
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(str(w), "pt") as f:
                f.keys()
        except Exception as err:
            return f"'{w.relative_to(path).as_posix()}' is corrupt ({type(err).__name__})"
    return None


def resolve_resume(resume: str | None, run_dir: str | Path) -> Path | None:
    """The checkpoint to resume from, checked before any work starts.

    ``None`` → start fresh; ``auto`` → the newest checkpoint in the run dir that passes
    :func:`verify_checkpoint` (damaged ones are skipped with one line each), fresh if there is none, a
    :class:`ConfigError` if all are damaged; a path → that checkpoint, or a :class:`ConfigError` naming
    ``trainer.resume``.
    """
    if resume in (None, "", "none", "null"):
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        for path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            print(f"[rlhf_train] skipping checkpoint {path}: {problem}", flush=True)
        if found:  # starting afresh would overwrite the run's files: refuse
            raise ConfigError(f"trainer.resume=auto: every checkpoint in {checkpoint_root(run_dir)} is damaged "
                              f"(see above); point trainer.resume at a good one, or start a new run dir")
        return None
    path = Path(resume).expanduser()
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ConfigError(f"trainer.resume='{resume}': {problem}; point it at another checkpoint "
                          f"(checkpoints/iter_*) or use trainer.resume=auto")
    return path


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def load_checkpoint(path: Path, *, accelerator, policy, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG; return the trainer state.

    Safe by construction: weights come from safetensors only, the ``.pt`` files (optimizer, scheduler,
    RNG) are read with ``torch.load(weights_only=True)``, which refuses anything but tensors and plain
    Python containers/numbers.
    """
    from safetensors.torch import load_file

    try:
        state = json.loads((path / "trainer_state.json").read_text())
        model = accelerator.unwrap_model(policy)
        from transformers import AutoModelForCausalLM

        with _quiet_transformers():
            lm = AutoModelForCausalLM.from_pretrained(path / "policy", use_safetensors=True)
        model.lm.load_state_dict(lm.state_dict())
        model.value_head.load_state_dict(load_file(path / "value_head.safetensors"))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng_file = path / f"rng_rank{accelerator.process_index}.pt"
        rng = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
    except ConfigError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(f"trainer.resume: checkpoint '{path}' cannot be loaded ({type(err).__name__}: {first}); "
                          f"point trainer.resume at another checkpoint") from None
    if rng is not None:
        set_rng_state(rng, state.get("numpy_rng"))
    saved_n = state.get("num_processes", accelerator.num_processes)
    if saved_n != accelerator.num_processes and accelerator.is_main_process:
        print(f"[rlhf_train] resuming with {accelerator.num_processes} processes from a checkpoint written by "
              f"{saved_n}: training continues, but not bit for bit as it would have", flush=True)
    return state


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "trainer_state.json").read_text())
