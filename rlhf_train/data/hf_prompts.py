"""Generic prompt data (``data=prompts``): any dataset ``datasets`` can read, plain or chat prompts.

Sources (``data.dataset``): a local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file (or a dir of them),
a ``save_to_disk`` dir, or a hub name already in the local cache. The prompt is

* a text column (``data.prompt_column``, default ``prompt``): tokenized as is (``data.text_as_chat=true``
  wraps it as one user message and applies the chat template), or
* a chat column (a list of ``{"role", "content"}`` messages; ``data.prompt_column=messages``, which is also
  chosen when ``prompt`` is absent): ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.

``data.system_prompt`` and ``data.few_shot`` go before every prompt (:mod:`rlhf_train.data.prefix`: a system
message and user / assistant turns for chat, a text prefix for text). Every other column (e.g. ``answer``)
travels with its prompt to the reward functions (``columns`` of the batch, repeated for each sample); a chat
prompt travels as ``messages`` too (a reward model with its own chat template re-renders it). Prompts longer
than ``data.max_prompt_tokens`` are dropped or cut from the left (``data.truncation``), with the count logged.
Each batch is left-padded to its own longest prompt (:meth:`HFPromptDataset.collate`), not to the dataset's.
Held-out prompts: ``split`` selects a split; a dataset without splits holds out its last ``data.eval_holdout``
rows (split ``train`` is the rest, any other split those rows), so the pipeline's evaluation never sees training
prompts. One line at start says how many rows the data has, how many are held out and how many are used
(``data.max_prompts``). Bad input (a missing file or column, an empty dataset, a chat column and a tokenizer
with no chat template) is one ``ConfigError`` line before training.

Text or chat is decided from every row of the column, held-out rows included (:mod:`rlhf_train.data.rows`);
an invalid row (null, empty, an empty message list, a message without a role or with content that is not a
string) is one line naming its file and line. :func:`read_prompts` is the half that needs no tokenizer: the
pre-flight (:func:`rlhf_train.data.checks.check_data`) runs it before any model is built.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import Dataset

from rlhf_train.data.files import row_location, source_files
from rlhf_train.data.loading import holdout, load_any, rows_line
from rlhf_train.data.prefix import chat_messages, check_prefix, text_prefix
from rlhf_train.data.rows import prompt_kind
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)


class HFPromptDataset(Dataset):
    """Tokenized prompts of varying lengths plus their other columns; :meth:`collate` pads a batch."""

    def __init__(self, ids: list[list[int]], columns: dict[str, list[Any]], pad_token_id: int, text: list[str]):
        if not ids:
            raise ConfigError("the prompt dataset is empty; check data.dataset / data.split / data.max_prompt_tokens")
        self.ids, self.columns, self.pad_token_id, self.text = ids, columns, int(pad_token_id), text

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor(self.ids[i], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "index": torch.tensor(i),
                "columns": {k: v[i] for k, v in self.columns.items()}}

    @property
    def prompt_width(self) -> int:
        return max(len(x) for x in self.ids)

    def collate(self, items: list[dict]) -> dict:
        """``input_ids`` / ``attention_mask`` ``[B, P]`` left-padded to the batch's longest prompt, ``index [B]``,
        ``columns``: ``{name: [B] values}``."""
        P = max(it["input_ids"].shape[0] for it in items)
        ids = torch.full((len(items), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(items), P), dtype=torch.long)
        for r, it in enumerate(items):  # one copy per row (the collate runs once per batch, not per token)
            n = it["input_ids"].shape[0]
            ids[r, P - n:], mask[r, P - n:] = it["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask, "index": torch.stack([it["index"] for it in items]),
                "columns": {k: [it["columns"][k] for it in items] for k in items[0]["columns"]}}


def read_prompts(dataset: str, split: str = "train", prompt_column: str | None = None, max_prompt_tokens: int = 256,
                 truncation: str = "drop", max_prompts: int | None = None):
    """What needs no tokenizer: the arguments, the data read, its prompt column and every row of it checked.
    Returns ``(ds, has_splits, column, chat, where)``; ``where(i)`` names row ``i``'s file and line."""
    if truncation not in ("drop", "left"):
        raise ConfigError(f"data.truncation={truncation} is not valid; choose drop or left")
    if max_prompt_tokens is None or max_prompt_tokens <= 0:
        raise ConfigError(f"data.max_prompt_tokens={max_prompt_tokens} must be positive")
    if max_prompts is not None and int(max_prompts) <= 0:
        raise ConfigError(f"data.max_prompts={max_prompts} must be positive (or null: every prompt)")
    ds, has_splits = load_any(dataset, split)
    cols = ds.column_names
    column = prompt_column or ("prompt" if "prompt" in cols else "messages" if "messages" in cols else None)
    if column not in cols:
        raise ConfigError(f"data.dataset={dataset} has no column '{prompt_column or 'prompt'}' (has {cols}); "
                          f"set data.prompt_column")
    files = source_files(dataset)

    def where(i: int) -> tuple[str | None, str]:
        return row_location(files, i, split)

    return ds, has_splits, column, prompt_kind(ds, column, where, f"data.dataset={dataset}"), where


def hf_prompts(tokenizer, dataset: str, split: str = "train", prompt_column: str | None = None,
               text_as_chat: bool = False, max_prompt_tokens: int = 256, truncation: str = "drop",
               max_prompts: int | None = None, seed: int = 0, shuffle: bool = False,
               eval_holdout: int = 64, system_prompt: str | None = None,
               few_shot: list | None = None) -> HFPromptDataset:
    """The ``data=prompts`` dataset; see the module docstring (each argument is a ``data.*`` key)."""
    examples = check_prefix(system_prompt, few_shot)
    source, has_splits, column, chat, where = read_prompts(dataset, split, prompt_column, max_prompt_tokens,
                                                           truncation, max_prompts)
    ds = holdout(source, has_splits, split, eval_holdout)
    if len(ds) == 0:
        raise ConfigError(f"data.dataset={dataset} (split '{split}') has no rows")
    held = 0 if has_splits or eval_holdout <= 0 else min(int(eval_holdout), len(source) // 2)
    cols = ds.column_names
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if max_prompts is not None:
        ds = ds.select(range(min(len(ds), int(max_prompts))))
    log.info("%s", rows_line(dataset, split, has_splits, len(source), held, len(ds), max_prompts, shuffled=shuffle))
    values = list(ds[column])
    if chat or text_as_chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"data.prompt_column={column} holds chat messages but the tokenizer has no chat "
                              f"template; use the model's own tokenizer (tokenizer.pretrained) or plain text prompts")
        rows = values if chat else [[{"role": "user", "content": str(v)}] for v in values]
        own = sum(bool(m) and m[0].get("role") == "system" for m in rows) if system_prompt is not None else 0
        if own:
            log.info("[data] %d of %d prompts have their own system message: kept (data.system_prompt is given to "
                     "the others)", own, len(rows))
        messages = [chat_messages(m, system_prompt, examples) for m in rows]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        prefix = text_prefix(system_prompt, examples)
        messages, text = None, [prefix + str(v) for v in values]
        ids = tokenizer(text)["input_ids"]
    empty = [i for i, row in enumerate(ids) if len(row) == 0]
    if empty:  # a row of only characters the tokenizer drops: name the first source row holding that prompt
        row = next(i for i, v in enumerate(source[column]) if v == values[empty[0]])
        path, place = where(row)
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ConfigError(f"data.dataset={dataset}: {f'{path} ' if path else ''}{place}: data.prompt_column={column} "
                          f"has no tokens{more} (the tokenizer drops every character of it); give the row words "
                          f"the tokenizer knows or remove it")
    columns = {c: list(ds[c]) for c in cols if c != column}
    if messages is not None:
        columns["messages"] = messages
    keep, cut = [], 0
    for i, row in enumerate(ids):
        if len(row) > max_prompt_tokens:
            cut += 1
            if truncation == "drop":
                continue
            ids[i] = row[-max_prompt_tokens:]
        keep.append(i)
    if cut:
        log.warning("[data] %d of %d prompts are longer than data.max_prompt_tokens=%d: %s", cut, len(ids),
                    max_prompt_tokens, "dropped" if truncation == "drop" else "cut from the left")
    if not keep:
        raise ConfigError(f"every prompt is longer than data.max_prompt_tokens={max_prompt_tokens}; raise it or "
                          f"set data.truncation=left")
    columns = {k: [v[i] for i in keep] for k, v in columns.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ds_out = HFPromptDataset([list(ids[i]) for i in keep], columns, pad, [text[i] for i in keep])
    ds_out.num_truncated = cut
    return ds_out
