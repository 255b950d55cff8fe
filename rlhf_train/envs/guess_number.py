"""Guess the number: a multi-turn game whose answer needs what earlier turns said (``env=guess_number``,
``data=guess_number``, ``+recipe=guess_number``; docs/environments.md "Ready-made environments").

The environment thinks of a whole number from ``low`` to ``high`` (a row of :func:`guess_number_prompts`). Each
assistant turn is a guess (the last whole number the message writes); the environment answers ``My number is
higher than 5. Guess again.`` (or lower), or asks again for a number in the range (no number, or one outside it);
a right guess ends the episode with reward 1.0. Every other step pays ``valid_guess_reward`` for a guess in the
range (default 0: the reward is the success; a small value, e.g. 0.05, pays a model that does not yet answer
with numbers for starting to; keep ``env.max_turns x valid_guess_reward < 1`` so that a reward >= 1 still means a
win, ``evaluation.accuracy_threshold`` 1), else 0.0. Within ``env.max_turns = ceil(log2(high - low + 2))`` turns
only a player that uses what the earlier turns said (each reply narrows the range; binary search) always wins; one
that ignores it wins with probability about ``max_turns / (high - low + 1)``.
"""
from __future__ import annotations

import random
import re
from typing import Any

from rlhf_train.envs.base import Message, Step

INTEGER = re.compile(r"-?\d+")


def first_messages(row: dict[str, Any]) -> list[Message]:
    """The game's first message: the rules and the range (a user turn; the template's own system message stays)."""
    return [{"role": "user", "content": f"I am thinking of a number from {row['low']} to {row['high']}. Guess it. "
                                        f"Reply with one number only."}]


def guess_of(text: str) -> int | None:
    """The last whole number of ``text``, or ``None``."""
    found = INTEGER.findall(text or "")
    return int(found[-1]) if found else None


class GuessNumber:
    """One game (module docstring); ``row``: ``low``, ``high``, ``secret``."""

    def __init__(self, valid_guess_reward: float = 0.0):
        self.valid_guess_reward = float(valid_guess_reward)

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.low, self.high, self.secret = int(row["low"]), int(row["high"]), int(row["secret"])
        return first_messages(row)

    def step(self, message: Message) -> Step:
        guess = guess_of(message.get("content") or "")
        if guess is None or not self.low <= guess <= self.high:
            return Step([{"role": "user", "content": f"Reply with one number from {self.low} to {self.high}."}], 0.0,
                        {})
        if guess == self.secret:
            return Step(None, 1.0, {})
        hint = "higher" if self.secret > guess else "lower"
        return Step([{"role": "user", "content": f"My number is {hint} than {guess}. Guess again."}],
                    self.valid_guess_reward, {})


def game(size: int, offset: int) -> Any:
    """A row maker: a range of ``size`` numbers starting at 1 + a random shift of at most ``offset``, and a secret
    drawn uniformly in it."""
    def make(r: random.Random) -> dict[str, int]:
        low = 1 + r.randint(0, offset)
        high = low + size - 1
        return {"low": low, "high": high, "secret": r.randint(low, high)}
    return make


def guess_number_prompts(tokenizer, split: str = "train", max_prompts: int | None = 2048, seed: int = 0,
                         size: int = 10, offset: int = 90):
    """``data=guess_number``: ``max_prompts`` games of ``size`` numbers (from ``low`` = 1 + a shift of at most
    ``offset`` to ``low + size - 1``), drawn from a stream seeded by ``seed``. ``split`` ``train`` or any other: the
    held-out games (a range and secret training never has; :func:`rlhf_train.envs.prompts.seeded_rows`)."""
    from rlhf_train.envs.prompts import episode_prompts, seeded_rows
    from rlhf_train.infra.errors import ConfigError

    if size < 2 or offset < 0:
        raise ConfigError(f"data.size={size} / data.offset={offset}: a game has at least 2 numbers (size >= 2) and "
                          f"offset >= 0")
    rows = seeded_rows("guess_number", split, max_prompts, seed, game(size, offset),
                       key=lambda row: (row["low"], row["secret"]))
    return episode_prompts(tokenizer, rows, first_messages)
