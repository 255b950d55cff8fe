"""The prompt column's rows: text or chat messages, decided from every row (not the first), and one
``ConfigError`` line for the first invalid row, naming where it is (:func:`rlhf_train.data.files.row_location`)
and the fix.

A row is text (a string; or a number, as CSV reads a numeric prompt) or chat (a list of ``{"role", "content"}``
messages, both strings; other keys travel as they are). Invalid: null, empty or blank text; an empty message
list; a message that is not an object, has no role, or whose content is not a string (null, a number, a list
of parts); any other value; a column mixing text and chat rows. Tokenizing or templating such a row would
train on ``"None"``, on a Python repr of a list, or on nothing at all, without a word.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_train.infra.errors import ConfigError

TEXT, CHAT = "text", "a message list"
BATCH = 4096  # rows materialized at a time: a large dataset is checked without holding its column twice

Where = Callable[[int], "tuple[str | None, str]"]  # row -> (file or None, "line N" / "row N ...")


def _a(value: Any) -> str:
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _message_problem(k: int, m: Any) -> tuple[str, str] | None:
    """(what is wrong with message ``k`` (1-based), the fix), or None."""
    if not isinstance(m, dict):
        return f", message {k}: it is {_a(m)}", 'each message must be an object {"role": ..., "content": ...}'
    role, content = m.get("role"), m.get("content")
    if role is None or role == "":
        return f", message {k}: it has no role", 'add "role": "user" (or "system", "assistant") to it'
    if not isinstance(role, str):
        return f", message {k}: its role is {_a(role)}", 'the role must be a string such as "user"'
    if not isinstance(content, str):
        what = "null or missing" if content is None else _a(content)
        return f", message {k}: its content is {what}", 'content must be a string, e.g. {"role": "user", "content": "..."}'
    return None


def classify(value: Any) -> tuple[str | None, tuple[str, str] | None]:
    """``(kind, problem)``: the row's kind (TEXT / CHAT) and (what is wrong, the fix) when it is invalid."""
    if value is None:
        return None, (" is null", "give the row a prompt or remove it")
    if isinstance(value, str):
        return TEXT, None if value.strip() else (" is empty", "give the row a prompt or remove it")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return TEXT, None
    if isinstance(value, (list, tuple)):
        if not value:
            return CHAT, (" is an empty message list", "give it at least one {role, content} message or remove the row")
        return CHAT, next(filter(None, (_message_problem(k, m) for k, m in enumerate(value, 1))), None)
    return None, (f" is {_a(value)}", "a prompt is text or a list of {role, content} messages")


def _say(where: Where, i: int, other_file: str | None = None) -> str:
    path, place = where(i)
    return place if path is None or path == other_file else f"{path} {place}"


def prompt_kind(ds, column: str, where: Where, prefix: str, name: str | None = None, chat: bool = True,
                empty_ok: bool = False) -> bool:
    """Whether every row of ``ds[column]`` is chat (else every row is text); raises on the first invalid row
    (``prefix: FILE line N: data.prompt_column=C <what>[ (and K more rows)]; <fix>``) or a mix of kinds.
    ``name``: how the column is named (default ``data.prompt_column=C``); ``chat=False``: text rows only;
    ``empty_ok``: an empty string is valid (a reference answer, not a prompt)."""
    name = name or f"data.prompt_column={column}"
    first: dict[str, int] = {}
    bad, n_bad, mixed = None, 0, None
    for start in range(0, len(ds), BATCH):
        for j, value in enumerate(ds[start:start + BATCH][column]):
            kind, problem = classify(value)
            if kind == CHAT and not chat:
                kind, problem = None, (f" is {_a(value)}", "this dataset takes text (chat messages: data=prompts)")
            if empty_ok and value == "":
                kind, problem = TEXT, None
            if problem is not None:
                n_bad += 1
                bad = bad or (start + j, problem)
            if kind is not None:
                first.setdefault(kind, start + j)
                if mixed is None and len(first) == 2:
                    mixed = start + j
    if bad is not None:
        i, (what, fix) = bad
        more = f" (and {n_bad - 1} more row{'s' if n_bad > 2 else ''})" if n_bad > 1 else ""
        raise ConfigError(f"{prefix}: {_say(where, i)}: {name}{what}{more}; {fix}")
    if mixed is not None:
        kind = TEXT if first[TEXT] == mixed else CHAT
        other = CHAT if kind == TEXT else TEXT
        raise ConfigError(f"{prefix}: {_say(where, mixed)}: {name} is {kind} but "
                          f"{_say(where, first[other], where(mixed)[0])} is {other}; make every row one kind (text, "
                          f"or a list of {{role, content}} messages)")
    return CHAT in first
