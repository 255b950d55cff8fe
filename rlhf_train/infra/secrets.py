"""Secrets never land in what a run writes: the values of secret keys are redacted.

A secret key is one whose whole name (any case; the last part of a dotted override key) is in
:data:`SECRET_KEYS`: ``api_key``, ``token``, ``hf_token``, ``password``, ``secret``, ... Whole names only,
so ``tokenizer``, ``max_new_tokens`` or ``pad_token`` stay visible. Redacted:

* the checkpoint's ``config.yaml`` and the W&B config (:func:`redact`), the W&B run's recorded argv,
  group and name (:func:`redact_overrides`; rlhf_train/infra/logger.py);
* Hydra's ``.hydra/config.yaml``, ``overrides.yaml``, ``hydra.yaml`` and the sweep's ``multirun.yaml``:
  :class:`RedactSecrets` (a Hydra callback, ``hydra.callbacks`` in conf/config.yaml) rewrites them when
  the job starts, right after Hydra wrote them, and filters Hydra's "#0 : overrides" launch lines;
* multirun job dir names (``${dirname_overrides:...}`` in ``hydra.sweep.subdir``: secret overrides left
  out) and sweep reports (which read the redacted ``hydra.yaml``; ``job_status.json`` via
  :func:`redact_overrides`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

SECRET_KEYS = frozenset({"api_key", "apikey", "token", "hf_token", "auth_token", "access_token", "wandb_key",
                         "wandb_api_key", "password", "passwd", "secret", "secret_key", "client_secret",
                         "private_key", "credentials"})
REDACTED = "<redacted>"


def is_secret_key(key: Any) -> bool:
    """``key`` (or the last part of a dotted override key such as ``+logger.api_key``) names a secret."""
    return str(key).lstrip("+~").rsplit(".", 1)[-1].strip().lower() in SECRET_KEYS


def redact(obj: Any) -> Any:
    """The values of secret keys (:data:`SECRET_KEYS`) of a (nested) config dict replaced by ``<redacted>``."""
    if isinstance(obj, dict):
        return {k: (REDACTED if is_secret_key(k) else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def redact_overrides(overrides: Any, sep: str = ",") -> Any:
    """Command-line overrides with the values of secret keys redacted: a list (``["+logger.api_key=x"]``),
    one override, or Hydra's ``override_dirname`` (overrides joined by ``sep``)."""
    if isinstance(overrides, (list, tuple)):
        return [redact_overrides(o, sep) for o in overrides]
    if overrides is None:
        return None
    text = str(overrides)
    if sep in text and "=" in text:
        return sep.join(redact_overrides(part, "\0") for part in text.split(sep))
    key, eq, _ = text.partition("=")  # quoted: the result still parses as an override (the sweep report reads it)
    return f"{key}='{REDACTED}'" if eq and is_secret_key(key) else text


def dirname_overrides(override_dirname: str, sep: str = ",") -> str:
    """Hydra's ``override_dirname`` without the secret overrides (for multirun job dir names)."""
    return sep.join(p for p in str(override_dirname).split(sep) if not is_secret_key(p.partition("=")[0]))


def secret_values(overrides: list[str]) -> set[str]:
    """The values given to secret keys on the command line (quotes stripped)."""
    out = set()
    for o in overrides:
        key, eq, value = str(o).partition("=")
        if eq and is_secret_key(key) and value.strip("'\""):
            out.add(value.strip("'\""))
    return out


def scrub(obj: Any, values: set[str]) -> Any:
    """:func:`redact` plus: overrides in strings redacted, and the given secret ``values`` replaced
    wherever they appear in a string (a run dir name, a job id, ...)."""
    if isinstance(obj, dict):
        return {k: (REDACTED if is_secret_key(k) else scrub(v, values)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, values) for v in obj]
    if isinstance(obj, str):
        obj = redact_overrides(obj)
        for v in values:
            obj = obj.replace(v, REDACTED)
    return obj


def scrub_yaml_file(path: Path, values: set[str]) -> None:
    """Rewrite a YAML file (Hydra's) with :func:`scrub` applied; interpolations are kept as written."""
    from omegaconf import OmegaConf

    if not path.is_file():
        return
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    clean = scrub(data, values)
    if clean != data:
        OmegaConf.save(OmegaConf.create(clean), path)


class _LaunchLineFilter(logging.Filter):
    """Redacts secret values in Hydra's own log lines (the multirun launcher's ``#0 : overrides``)."""

    def __init__(self, values: set[str]):
        super().__init__()
        self.values = values

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(v in message for v in self.values):
            record.msg, record.args = scrub(message, self.values), None
        return True


class RedactSecrets(Callback):
    """Hydra callback: the ``.hydra/*.yaml`` of each job (and ``multirun.yaml``) without secret values."""

    @staticmethod
    def _values(config) -> set[str]:
        from omegaconf import OmegaConf

        return secret_values([*(OmegaConf.select(config, "hydra.overrides.task") or []),
                              *(OmegaConf.select(config, "hydra.overrides.hydra") or [])])

    def on_multirun_start(self, config, **kwargs) -> None:
        values = self._values(config)
        if values:
            for name in ("hydra._internal.core_plugins.basic_launcher", "hydra_plugins"):
                logging.getLogger(name).addFilter(_LaunchLineFilter(values))

    def on_job_start(self, config, **kwargs) -> None:
        values = self._values(config)
        try:
            subdir = config.hydra.output_subdir
            job_dir = Path(str(config.hydra.runtime.output_dir))
        except Exception:
            return
        if subdir is not None:
            for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
                scrub_yaml_file(job_dir / str(subdir) / name, values)
        if values:  # the sweep's multirun.yaml (written before the first job starts)
            try:
                scrub_yaml_file(Path(str(config.hydra.sweep.dir)) / "multirun.yaml", values)
            except Exception:
                pass
