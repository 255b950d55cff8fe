"""Prompt datasets for PPO (the ``data`` config group).

Every dataset yields dicts of tensors: ``input_ids [P]`` and ``attention_mask [P]`` (left-padded to a
common width), optionally ``reference_input_ids`` / ``reference_attention_mask`` (prompt + a reference
response, the reward baseline of the TL;DR recipe), and an integer ``index``.
"""
from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset

from rlhf_train.data.files import row_location, source_files
from rlhf_train.data.loading import holdout, load_any, rows_line
from rlhf_train.data.rows import prompt_kind
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)


class PromptDataset(Dataset):
    """Tensors of left-padded prompts, ``[N, P]``, plus optional reference sequences ``[N, L]``."""

    def __init__(self, input_ids, attention_mask, reference_input_ids=None, reference_attention_mask=None,
                 text=None):
        if input_ids.shape[0] == 0:
            raise ConfigError("the prompt dataset is empty; check data.split / data.max_prompts / data.dataset")
        self.tensors = {"input_ids": input_ids, "attention_mask": attention_mask.long()}
        if reference_input_ids is not None:
            self.tensors["reference_input_ids"] = reference_input_ids
            self.tensors["reference_attention_mask"] = reference_attention_mask.long()
        self.text = text

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict:
        item = {k: v[i] for k, v in self.tensors.items()}
        item["index"] = torch.tensor(i)
        return item

    @property
    def prompt_width(self) -> int:
        return self.tensors["input_ids"].shape[1]


def _limit(n: int, max_prompts: int | None) -> int:
    return n if max_prompts is None else min(n, int(max_prompts))


def synthetic_prompts(tokenizer=None, min_prompt_tokens: int = 32, max_prompt_tokens: int = 64,
                      max_prompts: int | None = 1024, seed: int = 0, vocab_size: int | None = None) -> PromptDataset:
    """Random-token prompts with random lengths (benchmarks): no text involved."""
    n = max_prompts or 1024
    V = vocab_size or len(tokenizer)
    special = {tokenizer.eos_token_id, tokenizer.pad_token_id} if tokenizer is not None else set()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, max_prompt_tokens), generator=g)
    for s in special:  # keep special ids out of the prompts
        ids = torch.where(ids == s, (ids + 1) % V, ids)
    lengths = torch.randint(min_prompt_tokens, max_prompt_tokens + 1, (n,), generator=g)
    mask = torch.arange(max_prompt_tokens)[None] >= (max_prompt_tokens - lengths)[:, None]
    pad = tokenizer.pad_token_id if tokenizer is not None else 0
    return PromptDataset(ids.masked_fill(~mask, pad), mask)


def tldr_prompts(tokenizer, dataset: str = "CarperAI/openai_summarize_tldr", split: str = "train",
                 max_prompt_length: int = 500, max_prompts: int | None = None, seed: int = 0) -> PromptDataset:
    """TL;DR posts (column ``prompt``) with their reference summaries (column ``label``). ``dataset``: a hub
    name, a ``save_to_disk`` dir or a local .json / .jsonl / .csv / .parquet file; one without splits holds
    out its last 64 rows for the evaluation's split (:func:`rlhf_train.data.loading.holdout`)."""
    ds, has_splits = load_any(dataset, split)
    files = source_files(dataset)
    for col in ("prompt", "label"):
        if col not in ds.column_names:
            raise ConfigError(f"dataset '{dataset}' has no '{col}' column (has {ds.column_names}); set data.dataset"
                              + ("; prompts without reference summaries (or chat messages): data=prompts"
                                 if col == "label" else ""))
        # every row text, held-out ones included (rlhf_train/data/rows.py): a null is one line, not a TypeError
        prompt_kind(ds, col, lambda i: row_location(files, i, split), f"data.dataset={dataset}", f"column '{col}'",
                    chat=False, empty_ok=col == "label")
    total = len(ds)
    ds = holdout(ds, has_splits, split, 64)
    held = 0 if has_splits else min(64, total // 2)  # split train: those left out; any other split: those kept
    n = _limit(len(ds), max_prompts)
    log.info("%s", rows_line(dataset, split, has_splits, total, held, n, max_prompts,
                             holdout_key="a fixed 64 for TL;DR data", shuffled=n < len(ds)))
    ds = ds.shuffle(seed=seed).select(range(n)) if n < len(ds) else ds
    old_side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
    try:
        tokenizer.padding_side = "left"
        enc = tokenizer(list(ds["prompt"]), max_length=max_prompt_length, truncation=True, padding=True,
                        return_tensors="pt")
        tokenizer.padding_side = "right"
        ref = tokenizer([p + l for p, l in zip(ds["prompt"], ds["label"])], max_length=max_prompt_length + 64,
                        truncation=True, padding=True, return_tensors="pt")
    finally:
        tokenizer.truncation_side = old_side
    return PromptDataset(enc["input_ids"], enc["attention_mask"], ref["input_ids"], ref["attention_mask"],
                         text=list(ds["prompt"]))


def collate(items: list[dict]) -> dict:
    """Stack a list of dataset items into a batch of ``[B, ...]`` tensors; ``columns`` (other per-row data,
    e.g. a reference answer) become ``{name: [B] values}``."""
    out = {k: torch.stack([it[k] for it in items]) for k in items[0] if k != "columns"}
    if "columns" in items[0]:
        out["columns"] = {c: [it["columns"][c] for it in items] for c in items[0]["columns"]}
    return out
