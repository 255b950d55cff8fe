"""A model dir that cannot load, in one line: the policy's, the reference's, a reward model's.

:func:`check_model_dir` reads only what is cheap (``config.json``, which weight files exist, the header of
every safetensors file, which holds each tensor's byte range and so shows a truncated file, the first bytes
of a ``.bin``) and refuses, with one :class:`ConfigError` naming the config key: no or a garbled
``config.json``, no weights, a damaged weight file, custom code (``auto_map`` with an architecture
``transformers`` does not have) without ``trust_remote_code``. What it cannot see (bytes changed inside a
tensor, a missing custom-code file) comes out of ``from_pretrained`` as one line through
:func:`load_errors`, and NaN / inf weights through :func:`check_finite`, which names the file that holds them.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from rlhf_train.infra.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors")
# where a key's trust_remote_code lives when it is not next to it (the SFT stage loads with the policy's)
TRUST_KEYS = {"sft.init": "policy.trust_remote_code", "rm.backbone": "policy.trust_remote_code"}


def trust_key(override: str) -> str:
    return TRUST_KEYS.get(override, f"{override.rsplit('.', 1)[0]}.trust_remote_code")


def _damaged(override: str, shown: str, name: str, why: str) -> ConfigError:
    why = (why.strip().splitlines() or [""])[0][:200]
    return ConfigError(f"{override}='{shown}': {name} is damaged ({why}); point it at an intact model dir "
                       f"(or save the model again)")


def _check_weight_file(path: Path, override: str, shown: str, name: str) -> None:
    if not path.is_file():
        raise _damaged(override, shown, name, "missing")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:  # parses the header and checks that its byte ranges cover the file exactly: no tensor read
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise _damaged(override, shown, name, str(err) or type(err).__name__) from None
    elif path.suffix == ".bin":  # torch.save: a zip archive (or, before torch 1.6, a pickle: protocol 2 magic)
        import zipfile

        with open(path, "rb") as f:
            head = f.read(2)
        if not zipfile.is_zipfile(path) and head != b"\x80\x02":
            raise _damaged(override, shown, name, "neither a zip archive nor a pickle")


def check_model_dir(path: str, override: str, shown: str | None = None, trust_remote_code: bool = False) -> None:
    """One :class:`ConfigError` (see the module docstring) if the model dir ``path`` cannot load; ``override``
    is the config key (``reward_model.pretrained``), ``shown`` the value the user gave."""
    root, shown = Path(os.path.expanduser(str(path))), str(shown if shown is not None else path)
    try:
        cfg = json.loads((root / "config.json").read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise ConfigError(f"{override}='{shown}' has no config.json; point it at a saved model dir "
                          f"(save_pretrained)") from None
    except (ValueError, OSError) as err:
        raise ConfigError(f"{override}='{shown}': its config.json is corrupt ({type(err).__name__}); point it at "
                          f"an intact model dir") from None
    if not any((root / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{override}='{shown}' holds no weights (none of {', '.join(WEIGHT_FILES[:3])}, ...); "
                          f"point it at a saved model dir")
    for index in sorted(root.glob("*.index.json")):  # sharded weights: every shard the index names
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
            raise _damaged(override, shown, index.name, type(err).__name__) from None
        for shard in shards:
            _check_weight_file(root / shard, override, shown, shard)
    for file in sorted([*root.glob("*.safetensors"), *root.glob("*.bin")]):
        _check_weight_file(file, override, shown, file.name)
    if cfg.get("auto_map") and not trust_remote_code:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if cfg.get("model_type") not in CONFIG_MAPPING_NAMES:
            raise ConfigError(f"{override}='{shown}' needs the Python code shipped with it (config.json's auto_map, "
                              f"model_type '{cfg.get('model_type')}'): set {trust_key(override)}=true if you trust "
                              f"that code, or point it at a model of an architecture transformers has")


@contextlib.contextmanager
def load_errors(override: str, shown: str):
    """``from_pretrained``'s errors on a dir that passed :func:`check_model_dir` (a damage its cheap reads
    cannot see, a custom-code file that is missing) as one :class:`ConfigError` line naming ``override``."""
    import torch
    from safetensors import SafetensorError

    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError, SafetensorError, RuntimeError) as err:
        if isinstance(err, torch.OutOfMemoryError):
            raise
        why = (str(err).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"{override}='{shown}' cannot be loaded ({type(err).__name__}: {why}); point it at an "
                          f"intact model dir") from None


def _file_of(root: Path, name: str) -> str:
    """The weight file of ``root`` that holds parameter ``name`` (as far as the dir tells)."""
    for index in sorted(root.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, OSError):
            continue
        for key, file in weight_map.items():  # a loaded model may name its parameters with a prefix more or less
            if name.endswith(key) or key.endswith(name.split(".", 1)[-1]):
                return file
    files = [n for n in WEIGHT_FILES if (root / n).is_file() and not n.endswith(".json")]
    return files[0] if len(files) == 1 else "its weight files"


def check_finite(module, path: str, override: str, shown: str | None = None, file: str | None = None) -> None:
    """NaN / inf in any parameter of ``module`` (loaded from ``path``): one :class:`ConfigError` naming the
    file (``file``, or the one that holds it). One sum per weight: 0.09 s for 135M float32 parameters."""
    import torch

    for name, p in module.named_parameters():
        # the sum is NaN / inf when any value is (10x faster than isfinite(p).all(), which then confirms it: a
        # sum can also overflow)
        if p.is_meta or bool(torch.isfinite(p.detach().sum())) or bool(torch.isfinite(p.detach()).all()):
            continue
        where = file or _file_of(Path(os.path.expanduser(str(path))), name)
        raise ConfigError(f"{override}='{shown if shown is not None else path}': {where} holds NaN or inf values "
                          f"(weight '{name}'); the model is damaged: point it at an intact model dir (or write it "
                          f"again)")
