"""``data=gsm8k``: GSM8K questions as chat prompts, their final numbers as the ``answer`` column.

``dataset``: the hub name ``openai/gsm8k`` (configuration ``main``: ``train`` 7,473 and ``test`` 1,319 problems;
read from the local ``datasets`` cache or the Hub) or a local copy: a ``save_to_disk`` dir of it (with its splits),
or a ``.jsonl`` / ``.json`` / ``.parquet`` file or dir with the columns ``question`` and ``answer``. GSM8K's answer
is a worked solution ending in ``#### <number>``; the ``answer`` column is that number, commas dropped
(``1,000`` -> ``1000``), as verl's ``examples/data_preprocess/gsm8k.py`` extracts it.
"""
from __future__ import annotations

import logging
import re

from rlhf_train.data.hf_prompts import HFPromptDataset
from rlhf_train.data.questions import check_max_prompts, question_prompts
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)
FINAL = re.compile(r"####\s*(-?[0-9.,]+)")
HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"


def final_number(solution: str) -> str | None:
    """The number after GSM8K's ``####`` without thousands commas, or None when there is none."""
    found = FINAL.search(solution or "")
    return found.group(1).replace(",", "").rstrip(".") if found else None


def load_split(dataset: str, split: str):
    """The rows of ``split``: the hub name with its ``main`` configuration, or a local copy (module docstring);
    offline without a cached copy, one ``ConfigError`` naming ``data.dataset``."""
    from rlhf_train.data.loading import load_any, load_hf_dataset

    if dataset == HUB_NAME:
        return load_hf_dataset(dataset, split, config=HUB_CONFIG)
    ds, has_splits = load_any(dataset, split)
    if not has_splits and split != "train":
        raise ConfigError(f"data.dataset={dataset} has no splits: give a save_to_disk copy of {HUB_NAME} (with its "
                          f"'train' and 'test' splits) to evaluate on its test split")
    return ds


def gsm8k_prompts(tokenizer, dataset: str = HUB_NAME, split: str = "train", max_prompts: int | None = None,
                  seed: int = 0, shuffle: bool = False, system_prompt: str | None = None,
                  few_shot: list | None = None) -> HFPromptDataset:
    """The ``split`` questions (``shuffle``: in an order seeded by ``seed``; then at most ``max_prompts``)."""
    check_max_prompts(max_prompts)
    ds = load_split(dataset, split)
    missing = {"question", "answer"} - set(ds.column_names)
    if missing:
        raise ConfigError(f"data.dataset={dataset} has no column {sorted(missing)} (has {ds.column_names}); GSM8K "
                          f"rows are {{question, answer}}")
    if shuffle:
        ds = ds.shuffle(seed=seed)
    total = len(ds)
    if max_prompts is not None:
        ds = ds.select(range(min(total, int(max_prompts))))
    answers = [final_number(a) for a in ds["answer"]]
    log.info("[data] %d GSM8K problems in split '%s' of %s; using %d%s", total, split, dataset, len(ds),
             f" (data.max_prompts={max_prompts})" if len(ds) < total else "")
    return question_prompts(tokenizer, list(ds["question"]), {"answer": answers}, system_prompt, few_shot,
                            task="data=gsm8k")
