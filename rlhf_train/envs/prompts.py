"""The prompt datasets of the ready-made environments: procedurally generated, seeded, with a held-out split.

:func:`seeded_rows` draws rows (an environment's parameters: a word problem, a game's secret) from one
:class:`random.Random` stream seeded by the environment's name and ``seed``, and splits them by a hash of each row's
``key``: about one key in ``holdout`` is held out. ``split=train`` keeps the other keys, any other split
(``evaluation.split``) the held-out ones, so an evaluation never plays an episode training had (the same key) and
both splits are the same rows for the same seed, however many are asked for. :func:`episode_prompts` renders each
row's first messages (what the environment's ``reset`` returns) with the tokenizer's chat template, so the dataset's
prompt lengths are the episodes' (the context check in :mod:`rlhf_train.envs.checks` reads them); the row's values
travel as the batch's ``columns`` to ``reset``.
"""
from __future__ import annotations

import logging
import random
import zlib
from typing import Any, Callable, Sequence

from rlhf_train.envs.base import Message
from rlhf_train.envs.chat import ChatFormat
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)


def held_out(key: Any, holdout: int) -> bool:
    """Whether the row with ``key`` belongs to the held-out split (CRC-32 of its text: the same on every run)."""
    return zlib.crc32(str(key).encode()) % holdout == 0


def seeded_rows(name: str, split: str, max_prompts: int | None, seed: int, make_row: Callable[[random.Random], dict],
                key: Callable[[dict], Any], holdout: int = 10) -> list[dict]:
    """``max_prompts`` rows of ``split`` (module docstring); ``make_row(rng)`` draws one."""
    if max_prompts is None or int(max_prompts) <= 0:
        raise ConfigError(f"data.max_prompts={max_prompts}: the {name} data is generated, so give the number of "
                          f"prompts (a whole number >= 1)")
    n, want_held_out = int(max_prompts), split != "train"
    rng, rows, drawn = random.Random(f"{name}:{seed}"), [], 0
    while len(rows) < n:
        row = make_row(rng)
        drawn += 1
        if held_out(key(row), holdout) == want_held_out:
            rows.append(row)
        if drawn > 100 * n + 10_000:  # (a generator with too few distinct keys for the held-out share)
            raise ConfigError(f"data: the {name} generator gave only {len(rows)} of {n} rows of split '{split}'")
    log.info("[data] %s: %d %s rows generated (seed %d)%s", name, n, "held-out" if want_held_out else "training",
             seed, f", split '{split}'" if want_held_out else "")
    return rows


def episode_prompts(tokenizer, rows: list[dict], first_messages: Callable[[dict], list[Message]],
                    tools: Sequence[Callable] | None = None):
    """A :class:`~rlhf_train.data.hf_prompts.HFPromptDataset` of ``rows``: each row's ``first_messages(row)`` with
    ``tools`` through the chat template (with the assistant header), and the row's values as its columns."""
    from rlhf_train.data.hf_prompts import HFPromptDataset

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the environment's prompts are chats, and the tokenizer has no chat template; use the "
                          "policy's own tokenizer (tokenizer=pretrained tokenizer.pretrained=null)")
    chat = ChatFormat(tokenizer, tools)
    ids = [chat.prompt_ids(first_messages(row)) for row in rows]
    columns = {k: [row[k] for row in rows] for k in rows[0]}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFPromptDataset(ids, columns, pad, [chat.decode(x) for x in ids])
