"""Secrets never land in what a run writes: values of secret keys, and of secret environment variables, redacted.

A **secret key** is named like one (:func:`is_secret_key`; any case, ``snake_case``, ``kebab-case``,
``camelCase`` or ``UPPER_CASE``; the last part of a dotted override key): its last word is ``secret(s)``,
``password``, ``passwd``, ``passphrase``, ``credential(s)``, ``creds``, ``auth``, ``authorization`` or
``apikey``; or ``token`` (``api_token``, ``HF_TOKEN``, ``accessToken``), except a model's token
(``pad_token``, ``eos_token``, ... :data:`MODEL_TOKENS`); or ``key`` (``openai_api_key``, ``signing_key``,
``key``), except a data or dict key (``prompt_key``, ``sort_key``, ``rng_key``, ... :data:`NOT_SECRET_KEYS`).
Names whose last word is something else stay visible: ``tokenizer``, ``max_new_tokens``, ``token_budget``,
``bos_token_id``, ``api_key_file``, ``exclude_keys``. A pattern, not a list of names, because the names
users give their secrets (``openai_api_key``, ``judge_token``, ``db_password``) are not known in advance.

A **secret value** is the value of a secret key given on the command line or in the config, or of an
environment variable with a secret name (``OPENAI_API_KEY``, ``HF_TOKEN``, ``WANDB_API_KEY``, ...;
:func:`secret_env_values`): replaced by ``<redacted>`` wherever it appears in a string (a config value that
interpolates ``${oc.env:...}``, an override, a run name). Values shorter than :data:`MIN_SECRET_LEN`
characters are redacted under their key only (replacing ``1`` or ``true`` everywhere would mangle the config).

Redacted:

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
import os
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

REDACTED = "<redacted>"
MIN_SECRET_LEN = 8  # shorter values are redacted under their key only, never replaced inside other strings

# a name's last word that always names a secret
SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwords", "passwd", "passphrase", "credential",
                          "credentials", "creds", "auth", "authorization", "apikey", "apikeys"})
# `<word>_token` is a model's token (a string of its vocabulary, not a credential)
MODEL_TOKENS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "start", "end", "stop", "special",
                          "added", "additional", "image", "img", "audio", "video", "vision", "eot", "eom", "eod",
                          "im", "think", "fim", "placeholder", "decoder", "begin", "boi", "eoi", "prefix",
                          "suffix", "middle", "newline", "reasoning", "sentinel", "separator", "delimiter",
                          "ignore", "label", "boundary", "tool", "turn"})
# `<word>_key` that names a data column, a dict key or a public / random key, not a credential
NOT_SECRET_KEYS = frozenset({"prompt", "prompts", "text", "label", "labels", "input", "output", "response",
                             "chosen", "rejected", "reward", "metric", "sort", "column", "field", "dataset", "data",
                             "group", "sample", "message", "messages", "content", "role", "answer", "question",
                             "completion", "query", "target", "score", "cache", "primary", "foreign", "lookup",
                             "hash", "dict", "map", "state", "monitor", "log", "id", "name", "image", "chat",
                             "conversation", "context", "document", "instruction", "reference", "feature", "batch",
                             "index", "shard", "join", "unique", "value", "partition", "split", "config", "public",
                             "rng", "prng", "random", "seed", "env"})
# `<word>_keys` / `<word>_tokens` (plural: usually lists of names or counts) name secrets only after these
SECRET_PLURAL_AFTER = frozenset({"api", "access", "auth", "refresh", "bearer", "session", "secret", "private"})

# words of a name: UPPER runs, Capitalized / lower runs and digits (splits snake, kebab, dotted and camelCase)
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def is_secret_key(key: Any) -> bool:
    """``key`` (or the last part of a dotted override key such as ``+logger.openai_api_key``) names a secret."""
    words = [w.lower() for w in _WORDS.findall(str(key).lstrip("+~").rsplit(".", 1)[-1])]
    if not words:
        return False
    last, prev = words[-1], (words[-2] if len(words) > 1 else None)
    if last in SECRET_WORDS:
        return True
    if last in ("token", "key"):
        return prev not in (MODEL_TOKENS if last == "token" else NOT_SECRET_KEYS)
    if last in ("tokens", "keys"):
        return prev in SECRET_PLURAL_AFTER
    return False


def secret_env_values(environ: Any = None) -> set[str]:
    """The values of environment variables with secret names (``OPENAI_API_KEY``, ``HF_TOKEN``, ...), at least
    :data:`MIN_SECRET_LEN` characters long (a config may interpolate them with ``${oc.env:...}``)."""
    environ = os.environ if environ is None else environ
    return {v for k, v in environ.items() if is_secret_key(k) and len(v.strip()) >= MIN_SECRET_LEN}


def _replace_values(text: str, values: set[str]) -> str:
    for v in sorted(values, key=len, reverse=True):  # longest first: a value inside another is not half-replaced
        if len(v) >= MIN_SECRET_LEN:
            text = text.replace(v, REDACTED)
    return text


def _config_secret_values(obj: Any, out: set[str]) -> set[str]:
    """The (string) values of secret keys anywhere in a nested config."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if is_secret_key(k) and isinstance(v, (str, int, float)) and not isinstance(v, bool):
                out.add(str(v))
            else:
                _config_secret_values(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _config_secret_values(v, out)
    return out


def _redact_value(value: Any, values: set[str], overrides: bool) -> Any:
    """The value of a secret key: ``<redacted>``; a dict under it (``credentials: {user: .., token: ..}``) keeps
    its keys and has its own secret keys redacted; ``None`` and booleans stay (no secret in them)."""
    if isinstance(value, dict):
        return _scrub(value, values, overrides)
    if value is None or isinstance(value, bool):
        return value
    return REDACTED


def _scrub(obj: Any, values: set[str], overrides: bool) -> Any:
    if isinstance(obj, dict):
        return {k: (_redact_value(v, values, overrides) if is_secret_key(k) else _scrub(v, values, overrides))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v, values, overrides) for v in obj]
    if isinstance(obj, str):
        return _replace_values(redact_overrides(obj) if overrides else obj, values)
    return obj


def redact(obj: Any) -> Any:
    """A (nested) config dict with the values of secret keys replaced by ``<redacted>``, and the secret values
    (those keys' values, secret environment variables) replaced wherever they appear in its strings."""
    return _scrub(obj, _config_secret_values(obj, set()) | secret_env_values(), overrides=False)


def redact_overrides(overrides: Any, sep: str = ",") -> Any:
    """Command-line overrides with the values of secret keys (and secret environment variables' values)
    redacted: a list (``["+logger.api_key=x"]``), one override, or Hydra's ``override_dirname`` (overrides
    joined by ``sep``)."""
    if isinstance(overrides, (list, tuple)):
        return [redact_overrides(o, sep) for o in overrides]
    if overrides is None:
        return None
    text = str(overrides)
    if sep in text and "=" in text:
        return sep.join(redact_overrides(part, "\0") for part in text.split(sep))
    key, eq, _ = text.partition("=")  # quoted: the result still parses as an override (the sweep report reads it)
    return f"{key}='{REDACTED}'" if eq and is_secret_key(key) else _replace_values(text, secret_env_values())


def dirname_overrides(override_dirname: str, sep: str = ",") -> str:
    """Hydra's ``override_dirname`` without the secret overrides (for multirun job dir names)."""
    env = secret_env_values()
    return sep.join(p for p in str(override_dirname).split(sep)
                    if not is_secret_key(p.partition("=")[0]) and _replace_values(p, env) == p)


def secret_values(overrides: list[str]) -> set[str]:
    """The values given to secret keys on the command line (quotes stripped)."""
    out = set()
    for o in overrides:
        key, eq, value = str(o).partition("=")
        if eq and is_secret_key(key) and value.strip("'\""):
            out.add(value.strip("'\""))
    return out


def scrub(obj: Any, values: set[str]) -> Any:
    """:func:`redact` plus: overrides in strings redacted, and the given secret ``values`` (and secret
    environment variables' values) replaced wherever they appear in a string (a run dir name, a job id, ...)."""
    return _scrub(obj, set(values) | _config_secret_values(obj, set()) | secret_env_values(), overrides=True)


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

        return secret_env_values() | secret_values([*(OmegaConf.select(config, "hydra.overrides.task") or []),
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
