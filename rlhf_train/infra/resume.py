"""Resuming: which checkpoint, checked before any work starts, and loading it on every process.

* :func:`verify_checkpoint`: the ``COMPLETE`` manifest, the required files, their sizes and SHA-256
  checksums, the JSON and safetensors headers;
* :func:`resolve_resume`: ``trainer.resume`` → a checkpoint. ``auto`` takes the newest checkpoint of the
  run dir that verifies (each one skipped says why in one line: no ``COMPLETE``, a size or checksum that
  does not match, ...) and was written with this run's config (:func:`config_differences`: keys that only
  say how long or how verbosely to run are ignored, and so is where this machine keeps its cache,
  ``cache_dir``); another config is an error, not a silent restart. Either way the base model the
  checkpoint was trained on must still be what ``policy.pretrained`` holds (:func:`check_same_base`);
* :func:`load_checkpoint`: weights, optimizer, scheduler, and each process's own state (RNGs, PPO minibatch
  generator) from ``rng_rank{r}.pt``; weights that do not fit the model this config builds (another LoRA
  ``r``, layers, target modules) are one line naming the config keys that differ. Rank 0 reads the per-process files and sends each process its own;
  when some process cannot see the checkpoint dir (one disk per machine) rank 0 reads everything and
  sends it to all (``broadcast_object_list``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlhf_train.infra.checkpoint_files import (
    REQUIRED_FILES,
    checkpoint_dirs,
    checkpoint_root,
    quiet_transformers,
    set_rng_state,
    sha256,
)
from rlhf_train.infra.distributed import all_processes
from rlhf_train.infra.errors import ConfigError
from rlhf_train.infra.fingerprint import fingerprint_change, model_fingerprint

# config keys that may change between a run and its resume (how long, how often, how verbose, where)
RESUME_MAY_CHANGE = ("trainer.resume", "trainer.num_iterations", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                     "trainer.samples_every", "trainer.progress_bar", "trainer.num_threads",
                     "trainer.max_consecutive_faults", "trainer.cpu", "logger", "cache_dir")


def verify_checkpoint(path: str | Path, checksums: bool = True) -> str | None:
    """What is wrong with checkpoint ``path``, or ``None`` if it looks loadable.

    The ``COMPLETE`` manifest, the required files and their sizes, the JSON of ``trainer_state.json``, the
    headers of the safetensors files and (``checksums``, reading every file once) each file's SHA-256.
    """
    path = Path(path)
    if not path.is_dir():
        return "no such checkpoint directory"
    if not (path / "COMPLETE").exists():
        return "no COMPLETE marker (its write was interrupted, or the marker was removed)"
    try:
        manifest = json.loads((path / "COMPLETE").read_text() or "{}")
    except ValueError:
        return "its COMPLETE marker is corrupt"
    files = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    for rel in REQUIRED_FILES:
        if rel == "policy/config.json" and (path / "policy/adapter_config.json").is_file():
            continue  # a LoRA policy: policy/ holds the peft adapter (the base model comes from the config)
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
    sums = manifest.get("sha256", {}) if isinstance(manifest, dict) and checksums else {}
    for rel, digest in sums.items():
        if sha256(path / rel) != digest:
            return f"'{rel}' does not match its SHA-256 in COMPLETE (corrupted after it was written)"
    return None


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _machine_neutral(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` with every path under its ``cache_dir`` (``$RLHF_TRAIN_CACHE``: where this machine keeps its
    caches, not what the run is) written as ``${cache_dir}/...``: a run resumed with the cache elsewhere
    still compares equal, a cached input of another key (another SFT stage) still differs."""
    root = flat.get("cache_dir")
    root = root.rstrip("/") if isinstance(root, str) else ""
    if not root:
        return flat

    def neutral(v):
        if isinstance(v, str) and (v == root or v.startswith(root + "/")):
            return "${cache_dir}" + v[len(root):]
        return [neutral(x) for x in v] if isinstance(v, list) else v

    return {k: neutral(v) for k, v in flat.items()}


def config_differences(saved_yaml: str, current_yaml: str) -> list[str]:
    """``["trainer.seed: 0 in the checkpoint, 1 now", ...]``: the keys whose values differ between two
    resolved (redacted) configs, except :data:`RESUME_MAY_CHANGE`, ``*.device`` placements and the place
    of the cache (:func:`_machine_neutral`)."""
    import yaml

    saved, current = (_machine_neutral(_flatten(yaml.safe_load(text) or {})) for text in (saved_yaml, current_yaml))
    out = []
    for key in sorted(set(saved) | set(current)):
        if key.endswith(".device") or any(key == p or key.startswith(p + ".") for p in RESUME_MAY_CHANGE):
            continue
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if a != b:
            out.append(f"{key}: {a} in the checkpoint, {b} now")
    return out


def check_same_config(path: Path, config_yaml: str | None) -> list[str]:
    """:func:`config_differences` of checkpoint ``path``'s ``config.yaml`` and ``config_yaml`` (none if
    either is missing or empty)."""
    saved = Path(path) / "config.yaml"
    if not config_yaml or not saved.is_file() or not saved.read_text().strip():
        return []
    return config_differences(saved.read_text(), config_yaml)


def resolve_resume(resume: str | None, run_dir: str | Path, config_yaml: str | None = None) -> Path | None:
    """The checkpoint to resume from, checked before any work starts.

    ``None`` → start fresh; ``auto`` → the newest checkpoint in the run dir that passes
    :func:`verify_checkpoint` (damaged or unmarked ones are skipped with one line each), fresh if there is
    none, a :class:`ConfigError` if all are damaged or if it was written with another config than
    ``config_yaml``; a path → that checkpoint (another config: one line saying so), or a
    :class:`ConfigError` naming ``trainer.resume``.
    """
    if resume in (None, "", "none", "null"):
        return None
    if resume == "auto":
        found = checkpoint_dirs(run_dir)
        for path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is not None:
                print(f"[rlhf_train] skipping checkpoint {path}: {problem}", flush=True)
                continue
            diffs = check_same_config(path, config_yaml)
            if diffs:
                raise ConfigError(f"trainer.resume=auto: {path} was written by a run with another config "
                                  f"({'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}); resume with that "
                                  f"config, set trainer.resume=<that checkpoint> to start from it anyway, or use "
                                  f"a new run dir")
            check_same_base(path, config_yaml)
            return path
        if found:  # starting afresh would overwrite the run's files: refuse
            raise ConfigError(f"trainer.resume=auto: every checkpoint in {checkpoint_root(run_dir)} is damaged "
                              f"(see above); point trainer.resume at a good one, or start a new run dir")
        return None
    path = Path(resume).expanduser()
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ConfigError(f"trainer.resume='{resume}': {problem}; point it at another checkpoint "
                          f"(checkpoints/iter_*) or use trainer.resume=auto")
    diffs = check_same_config(path, config_yaml)
    if diffs:
        print(f"[rlhf_train] note: {path} was written with another config ({'; '.join(diffs[:3])}"
              f"{'; ...' if len(diffs) > 3 else ''}); starting from it as asked", flush=True)
    check_same_base(path, config_yaml)
    return path


def check_same_base(path: Path, config_yaml: str | None) -> None:
    """A :class:`ConfigError` when the base model checkpoint ``path`` was trained on (its ``base_model``
    fingerprint, :mod:`rlhf_train.infra.fingerprint`) is no longer what ``policy.pretrained`` holds, and the
    run would rebuild from it what the checkpoint does not hold: the frozen base under a LoRA adapter, or
    the reference copied from the initial policy. Checkpoints without a fingerprint are not checked."""
    import yaml

    try:
        saved = json.loads((Path(path) / "trainer_state.json").read_text()).get("base_model")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(saved, dict) or not config_yaml:
        return
    cfg = yaml.safe_load(config_yaml) or {}
    policy = cfg.get("policy") or {}
    lora = int((policy.get("lora") or {}).get("r") or 0) > 0
    if not lora and (cfg.get("ref_model") or {}).get("pretrained"):  # a reference of its own: the base is unused
        return
    pretrained = policy.get("pretrained")
    what = fingerprint_change(saved, model_fingerprint(pretrained))
    if what:
        rebuilt = "its LoRA adapter would train on another base" if lora else "the reference would copy another model"
        raise ConfigError(f"trainer.resume: policy.pretrained='{pretrained}' is not the base model {path} was trained "
                          f"on ({what}); {rebuilt}: point policy.pretrained at the model the run started from, or "
                          f"train this one in a new run dir")


def _read(path: Path, num_processes: int, weights: bool) -> dict:
    """The checkpoint's files as objects: trainer state, every process's state, and (``weights``) the LM,
    value head, optimizer and scheduler states. ``.pt`` files are read with ``weights_only=True``."""
    from safetensors.torch import load_file

    out: dict = {"state": json.loads((path / "trainer_state.json").read_text())}
    out["processes"] = [torch.load(f, weights_only=True) if f.exists() else None
                        for f in (path / f"rng_rank{r}.pt" for r in range(num_processes))]
    if weights:
        from transformers import AutoModelForCausalLM

        if (path / "policy/adapter_config.json").is_file():  # LoRA: the adapter alone (peft's format)
            out["adapter"] = load_file(path / "policy/adapter_model.safetensors")
        else:
            with quiet_transformers():
                out["lm"] = AutoModelForCausalLM.from_pretrained(path / "policy", use_safetensors=True).state_dict()
        out["value_head"] = load_file(path / "value_head.safetensors")
        out["optimizer"] = torch.load(path / "optimizer.pt", weights_only=True)
        out["scheduler"] = torch.load(path / "scheduler.pt", weights_only=True)
    return out


def _cannot_load(path: Path, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return (f"trainer.resume: checkpoint '{path}' cannot be loaded ({type(err).__name__}: {first}); "
            f"point trainer.resume at another checkpoint")


def _misfit(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], what: str) -> str | None:
    """The first tensor of ``what`` that is missing, extra or of another shape in the checkpoint."""
    for name in sorted(set(expected) | set(saved)):
        if name not in saved:
            return f"{what} {name} is not in it"
        if name not in expected:
            return f"its {what} {name} has no place in this model"
        if tuple(saved[name].shape) != tuple(expected[name].shape):
            return f"{what} {name} is {list(saved[name].shape)} there, {list(expected[name].shape)} here"
    return None


def _does_not_fit(path: Path, misfit: str, config_yaml: str | None) -> ConfigError:
    """One line: checkpoint ``path``'s weights do not fit this run's model, naming the config keys that differ
    (those that shape the model first)."""
    diffs = sorted(check_same_config(path, config_yaml),
                   key=lambda d: not d.startswith(("policy.", "tokenizer.", "algorithm.", "data.")))
    keys = (f"the config differs in {'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}" if diffs
            else "see the checkpoint's config.yaml")
    return ConfigError(f"trainer.resume: checkpoint '{path}' does not fit the model this config builds ({keys}): "
                       f"{misfit}; resume with the checkpoint's values of these keys, or start a new run dir")


def _check_fits(path: Path, payload: dict, model, accelerator, config_yaml: str | None) -> None:
    """Names and shapes of the checkpoint's tensors against the model's, before anything is loaded (peft
    loads an adapter with ``strict=False``: other target modules would load nothing, silently). Sharded
    models (FSDP, DeepSpeed) are left to the loads themselves (their state dicts are collective)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return
    if "adapter" in payload:
        from peft import get_peft_model_state_dict

        misfit = _misfit(get_peft_model_state_dict(model.lm), payload["adapter"], "adapter tensor")
    else:
        misfit = _misfit(model.lm.state_dict(), payload["lm"], "tensor")
    if misfit is None and model.value_head is not None and payload["value_head"]:
        misfit = _misfit(model.value_head.state_dict(), payload["value_head"], "value-head tensor")
    if misfit is not None:
        raise _does_not_fit(path, misfit, config_yaml)


def load_checkpoint(path: Path, *, accelerator, policy, optimizer, scheduler, config_yaml: str | None = None) -> dict:
    """Restore weights, optimizer, scheduler and this process's own state (RNGs; returned under
    ``"process"`` with its PPO minibatch generator); return the trainer state. Collective. Weights that do
    not fit the model are one :class:`ConfigError` naming the keys where ``config_yaml`` (this run's
    config) differs from the checkpoint's.

    Safe by construction: weights come from safetensors only, the ``.pt`` files (optimizer, scheduler,
    per-process states) are read with ``torch.load(weights_only=True)``, which refuses anything but tensors
    and plain Python containers/numbers.
    """
    path = Path(path)
    n, rank = accelerator.num_processes, accelerator.process_index
    everyone_sees_it = all(all_processes(accelerator, path.is_dir(), gather=True))
    payload, error = None, None
    if everyone_sees_it or accelerator.is_main_process:
        try:  # each process reads the weights itself; rank 0 reads the per-process states (and all, if need be)
            payload = _read(path, n if accelerator.is_main_process else 0, weights=True)
        except Exception as err:
            error = _cannot_load(path, err)
    errors = [e for e in all_processes(accelerator, error, gather=True) if e]
    if errors:
        raise ConfigError(errors[0])
    if n > 1:
        shared = all_processes(accelerator, payload if not everyone_sees_it else
                                {"processes": payload["processes"] if accelerator.is_main_process else None},
                                gather=False)
        payload = shared if not everyone_sees_it else dict(payload, processes=shared["processes"])
    model = accelerator.unwrap_model(policy)
    if ("adapter" in payload) != hasattr(model.lm, "peft_config"):  # LoRA checkpoint vs full fine-tuning, or back
        held, r = ("a LoRA adapter", "0") if "adapter" in payload else ("a full model", "set")
        raise ConfigError(f"trainer.resume: checkpoint '{path}' holds {held}, but policy.lora.r is {r}: resume "
                          f"with the run's policy.lora (see the checkpoint's config.yaml)")
    _check_fits(path, payload, model, accelerator, config_yaml)
    try:
        if "adapter" in payload:  # the base weights were rebuilt from the config; the adapter is the trained state
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model.lm, payload["adapter"])
        else:
            model.lm.load_state_dict(payload["lm"])
        if model.value_head is not None:  # None: a critic-free algorithm (no value head, nothing saved for it)
            if not payload["value_head"]:
                raise ConfigError(f"trainer.resume: checkpoint '{path}' has no value head (a critic-free algorithm "
                                  f"trained it): resume with the run's algorithm (see the checkpoint's config.yaml)")
            model.value_head.load_state_dict(payload["value_head"])
        optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError) as err:  # size mismatches the check above leaves to the loads (sharded)
        if isinstance(err, ConfigError):
            raise
        raise _does_not_fit(path, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__,
                            config_yaml) from None
    scheduler.load_state_dict(payload["scheduler"])
    state = payload["state"]
    own = payload["processes"][rank] if rank < len(payload["processes"]) else None
    if own is not None:
        set_rng_state(own, own.get("numpy", state.get("numpy_rng")))
    state["process"] = own or {}
    saved_n = state.get("num_processes", n)
    if saved_n != n and accelerator.is_main_process:
        print(f"[rlhf_train] resuming with {n} processes from a checkpoint written by {saved_n}: training "
              f"continues, but not bit for bit as it would have", flush=True)
    return state


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "trainer_state.json").read_text())
