"""Bad values that reach the trainer without a Hydra type error (issue 17, item 7): one :class:`ConfigError`
line naming the key and the fix, before any work starts. Called by
:func:`rlhf_train.loop.components.validate_config`.

* keys a ``+`` override added to a typed section (``+trainer.foo=1``: Hydra opens the section to add it);
* names and ranges: ``scheduler.name``, ``trainer.mixed_precision``, ``data.num_workers``, ``optimizer.lr``,
  the KL coefficient, ``rollout.top_p`` / ``top_k``, ``ppo.clip_eps`` / ``gamma`` / ``lam``;
* a rollout batch that is not a multiple of ``ppo.minibatch_size`` (the remainder would be dropped);
* model dirs (``policy.pretrained``, ``ref_model.pretrained``): ``config.json`` that does not parse, no
  weights; architectures (``*.config``) whose ``n_head`` does not divide the width.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf_train.infra.errors import ConfigError

UNCHECKED_SECTIONS = ("logger",)  # W&B settings may be passed through (and +logger.api_key is redacted)
MIXED_PRECISION = (None, "no", "fp16", "bf16", "fp8")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors")


def check_added_keys(cfg: DictConfig, prefix: str = "") -> None:
    """A key that a ``+`` override added to a section typed by a schema (or to a typed sub-section, such as
    ``policy.lora``): Hydra accepts it, nothing reads it."""
    for key in cfg:
        node, name = cfg.get(key), f"{prefix}{key}"
        if name in UNCHECKED_SECTIONS or not OmegaConf.is_dict(node):
            continue
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            known = {f.name for f in dataclasses.fields(schema)}
            extra = [k for k in node if k not in known]
            if extra:
                raise ConfigError(f"{name}.{extra[0]} is not a key of {name} (its keys: {', '.join(sorted(known))}); "
                                  f"remove the override (a '+' adds a key without checking it)")
        check_added_keys(node, f"{name}.")


def check_ranges(cfg: DictConfig) -> None:
    """Names and numbers out of range (``ValueError`` tracebacks or silent nonsense otherwise)."""
    from transformers import SchedulerType

    schedulers = [s.value for s in SchedulerType]
    if cfg.scheduler.name not in schedulers:
        raise ConfigError(f"scheduler.name='{cfg.scheduler.name}' is not valid; choose one of: {', '.join(schedulers)}")
    if cfg.scheduler.get("warmup_steps", 0) < 0:
        raise ConfigError(f"scheduler.warmup_steps={cfg.scheduler.warmup_steps} must be >= 0")
    if cfg.trainer.mixed_precision not in MIXED_PRECISION:
        raise ConfigError(f"trainer.mixed_precision='{cfg.trainer.mixed_precision}' is not valid; choose one of: "
                          f"no, bf16, fp16, fp8 (or null: what `accelerate launch` was given)")
    if cfg.data.get("num_workers", 0) < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0 (0 loads in the main process)")
    lr = cfg.optimizer.get("lr")
    if lr is not None and not lr > 0:
        raise ConfigError(f"optimizer.lr={lr} must be positive")
    if cfg.optimizer.get("weight_decay", 0) < 0:
        raise ConfigError(f"optimizer.weight_decay={cfg.optimizer.weight_decay} must be >= 0")
    for key in ("init_kl_coef", "kl_coef"):
        value = cfg.kl_controller.get(key)
        if value is not None and value < 0:
            raise ConfigError(f"kl_controller.{key}={value} must be >= 0 (0 turns the KL penalty off)")
    r = cfg.rollout
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1] (1 = off)")
    if r.top_k < 0:
        raise ConfigError(f"rollout.top_k={r.top_k} must be >= 0 (0 = off)")
    p = cfg.ppo
    if p.get("clip_eps") is not None and not p.clip_eps > 0:
        raise ConfigError(f"ppo.clip_eps={p.clip_eps} must be positive (the ratio is clipped to 1 ± clip_eps)")
    if p.get("clip_eps_value") is not None and p.clip_eps_value < 0:
        raise ConfigError(f"ppo.clip_eps_value={p.clip_eps_value} must be >= 0")
    for key in ("gamma", "lam"):
        if p.get(key) is not None and not 0 <= p.get(key) <= 1:
            raise ConfigError(f"ppo.{key}={p.get(key)} must be in [0, 1]")
    if p.get("max_grad_norm") is not None and not p.max_grad_norm > 0:
        raise ConfigError(f"ppo.max_grad_norm={p.max_grad_norm} must be positive (or null: no clipping)")
    rollouts = cfg.data.batch_size * (r.get("num_samples", 1) or 1)
    if rollouts >= p.minibatch_size and rollouts % p.minibatch_size:  # (fewer: check_fits says "exceeds")
        per = f"data.batch_size={cfg.data.batch_size}" + (f" × rollout.num_samples={r.num_samples}"
                                                          if r.get("num_samples", 1) != 1 else "")
        raise ConfigError(f"{per} = {rollouts} rollouts per process is not a multiple of ppo.minibatch_size="
                          f"{p.minibatch_size}: the last {rollouts % p.minibatch_size} would never be trained on; "
                          f"make it a multiple")


def check_model_dirs(cfg: DictConfig) -> None:
    """Local model dirs that cannot load, and architectures that cannot be built."""
    for group in ("policy", "ref_model", "reward_model"):
        node = cfg.get(group)
        if not OmegaConf.is_dict(node):
            continue
        arch = node.get("config") or {}
        heads, width = arch.get("n_head", arch.get("num_attention_heads")), arch.get("n_embd", arch.get("hidden_size"))
        if heads and width and width % heads:
            key = "n_head" if "n_head" in arch else "num_attention_heads"
            raise ConfigError(f"{group}.config.{key}={heads} does not divide the width {width}; choose a divisor")
        pretrained = node.get("pretrained") if not OmegaConf.is_missing(node, "pretrained") else None
        if group == "reward_model" or not pretrained or not Path(str(pretrained)).expanduser().is_dir():
            continue  # a Hub name is checked when it loads; reward-model dirs have their own layout
        path = Path(str(pretrained)).expanduser()
        try:
            json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"{group}.pretrained='{pretrained}' has no config.json; point it at a saved model "
                              f"dir (save_pretrained)") from None
        except (ValueError, OSError) as err:
            raise ConfigError(f"{group}.pretrained='{pretrained}': its config.json is corrupt ({type(err).__name__}); "
                              f"point it at an intact model dir") from None
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            raise ConfigError(f"{group}.pretrained='{pretrained}' holds no weights (none of {', '.join(WEIGHT_FILES[:3])}"
                              f", ...); point it at a saved model dir")


def check_values(cfg: DictConfig) -> None:
    """Every check of this module, in order."""
    check_added_keys(cfg)
    check_ranges(cfg)
    check_model_dirs(cfg)
