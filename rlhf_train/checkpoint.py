"""Checkpoints that hold everything the next iteration depends on, written atomically.

Layout of ``<run dir>/checkpoints/iter_000012/``::

    policy/                  the policy LM (save_pretrained, safetensors) + tokenizer
    value_head.safetensors   the value head
    optimizer.pt             optimizer state (loaded with weights_only=True)
    scheduler.pt             learning-rate scheduler state
    rng_rank{r}.pt           torch / python RNG states of each process (numpy's in trainer_state.json)
    trainer_state.json       iteration, KL controller state, data position, W&B run id, fault count
    config.yaml              the resolved config
    COMPLETE                 written last; a checkpoint without it is ignored

It is written into ``.tmp-iter_000012`` and renamed into place only when complete, so a crash
mid-write never leaves a "latest" checkpoint that fails to load. Older ones are pruned.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_train.errors import ConfigError

_ITER_RE = re.compile(r"^iter_(\d+)$")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _ITER_RE.match(p.name) and (p / "COMPLETE").exists()]
    return sorted(found, key=lambda p: int(_ITER_RE.match(p.name).group(1)))


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


def save_checkpoint(run_dir: str | Path, iteration: int, *, accelerator, policy, optimizer, scheduler,
                    trainer_state: dict, config_yaml: str, tokenizer=None, keep: int = 2) -> Path | None:
    """Write checkpoint ``iter_<iteration>`` atomically (collective: call on every process)."""
    from safetensors.torch import save_file

    root = checkpoint_root(run_dir)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp-iter_{iteration:06d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    state_dict = accelerator.get_state_dict(policy)  # gathers sharded (FSDP/ZeRO) weights; collective
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(policy)
        lm_state = {k[len("lm."):]: v for k, v in state_dict.items() if k.startswith("lm.")}
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
        (tmp / "COMPLETE").write_text(str(iteration))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resolve_resume(resume: str | None, run_dir: str | Path) -> Path | None:
    """``None`` → start fresh; ``auto`` → newest complete checkpoint in the run dir (or fresh); a path → it."""
    if resume in (None, "", "none", "null"):
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ConfigError(f"trainer.resume='{resume}': no such checkpoint directory")
    if not (path / "COMPLETE").exists() or not (path / "trainer_state.json").exists():
        raise ConfigError(f"trainer.resume='{resume}' is not a complete checkpoint (no COMPLETE marker); "
                          f"use trainer.resume=auto or another checkpoint")
    return path


def load_checkpoint(path: Path, *, accelerator, policy, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG; return the trainer state."""
    from safetensors.torch import load_file

    try:
        state = json.loads((path / "trainer_state.json").read_text())
        model = accelerator.unwrap_model(policy)
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(path / "policy")
        model.lm.load_state_dict(lm.state_dict())
        model.value_head.load_state_dict(load_file(path / "value_head.safetensors"))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng_file = path / f"rng_rank{accelerator.process_index}.pt"
        rng = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"checkpoint '{path}' cannot be loaded ({type(err).__name__}: {err}); "
                          f"point trainer.resume at another checkpoint") from None
    if rng is not None:
        set_rng_state(rng, state.get("numpy_rng"))
    return state


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "trainer_state.json").read_text())
