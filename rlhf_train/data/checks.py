"""The ``data`` group's pre-flight: what can be checked before any model is built (run by
:func:`rlhf_train.loop.checks.check_config`, so also at the start of a pipeline, before its SFT / RM stages).

Every data group: ``data.max_prompts`` positive or null. ``data=prompts``: the types of ``data.system_prompt``
and ``data.few_shot``, and :func:`read_prompts` over the data, so a missing or unreadable file, a missing column and every invalid row are one line at start rather
than after the models are built (the second read, when the dataset is built, comes from ``datasets``' cache).
"""
from __future__ import annotations

from typing import Any

from rlhf_train.data.hf_prompts import hf_prompts, read_prompts
from rlhf_train.data.prefix import check_prefix
from rlhf_train.infra.errors import ConfigError

HF_PROMPTS = f"{hf_prompts.__module__}.{hf_prompts.__name__}"


def check_data(data: dict[str, Any]) -> None:
    """``data``: the ``data`` config section as a plain dict (``"???"`` where a required key is unset)."""
    max_prompts = data.get("max_prompts")
    if max_prompts is not None and int(max_prompts) <= 0:
        raise ConfigError(f"data.max_prompts={max_prompts} must be positive (or null: every prompt)")
    if data.get("_target_") != HF_PROMPTS:
        return
    if data.get("dataset") in (None, "", "???"):
        raise ConfigError("data.dataset is not set: data=prompts needs data.dataset=<a .jsonl/.json/.csv/.parquet "
                          "file, a dir of them, a save_to_disk dir or a cached hub name>")
    check_prefix(data.get("system_prompt"), data.get("few_shot"))
    read_prompts(data["dataset"], data.get("split", "train"), data.get("prompt_column"),
                 data.get("max_prompt_tokens", 256), data.get("truncation", "drop"), max_prompts)
