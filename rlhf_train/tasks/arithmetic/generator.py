"""The arithmetic task's problems, generated from a seed: small additions and subtractions asked in words.

A **fact** is one sum or difference, ``(op, a, b)`` with ``op`` in :data:`OPERATIONS`, ``0 <= a, b <=
max_operand`` and, for ``-``, ``a >= b`` (no negative answers): ``(max_operand + 1)^2`` additions and
``(max_operand + 1)(max_operand + 2) / 2`` subtractions. The facts are shuffled with ``seed`` and the first
``round(test_fraction x len)`` of them are the held-out (``test``) facts, the rest the ``train`` facts: the
two splits are **disjoint by construction**, no sum or difference of one split is asked in the other, in any
wording. Each fact is then asked in every wording of its operation (:data:`TEMPLATES`: expressions such as
``What is 3 + 5?`` and one word problem whose name and object come from the seeded generator), and the rows
of a split are shuffled with ``seed``. Pure Python: the same ``seed`` gives the same rows on any machine.

Each row is ``{"prompt": str, "answer": str, "fact": "3+5"}``: the ``answer`` column is what
:func:`rlhf_train.rewards.functions.final_answer_match` compares the completion's answer with.
"""
from __future__ import annotations

import random

from rlhf_train.infra.errors import ConfigError

OPERATIONS = ("+", "-")
SPLITS = ("train", "test")
NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Zoe", "Ravi", "Nora")
THINGS = ("apples", "books", "coins", "stickers", "pencils", "marbles", "shells", "cards")
TEMPLATES = {
    "+": ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
          "Compute {a} + {b}.", "{a} + {b} = ?",
          "{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?"),
    "-": ("What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}.",
          "What is {a} take away {b}?", "Compute {a} - {b}.", "{a} - {b} = ?",
          "{name} has {a} {things} and gives away {b}. How many {things} does {name} have left?"),
}


def check_options(split: str = "train", operations=OPERATIONS, max_operand: int = 9,
                  test_fraction: float = 0.25) -> tuple[str, ...]:
    """The operations as a tuple, or one ``ConfigError`` line naming the ``data.*`` key that is not valid."""
    if split not in SPLITS:
        raise ConfigError(f"data.split='{split}' is not an arithmetic split; choose one of {', '.join(SPLITS)}")
    ops = tuple(operations) if operations is not None and not isinstance(operations, str) else ()
    if not ops or any(op not in OPERATIONS for op in ops) or len(set(ops)) != len(ops):
        raise ConfigError(f"data.operations={operations!r} is not valid; give a list of distinct operations "
                          f"from {list(OPERATIONS)}")
    if not isinstance(max_operand, int) or not 1 <= max_operand <= 99:
        raise ConfigError(f"data.max_operand={max_operand!r} must be an integer in 1..99")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError(f"data.test_fraction={test_fraction!r} must be in (0, 1): the share of facts held out")
    return ops


def facts(operations=OPERATIONS, max_operand: int = 9) -> list[tuple[str, int, int]]:
    """Every ``(op, a, b)`` of the task, in a fixed order (``-``: ``a >= b``)."""
    r = range(max_operand + 1)
    return [(op, a, b) for op in operations for a in r for b in r if op == "+" or a >= b]


def split_facts(seed: int, operations=OPERATIONS, max_operand: int = 9,
                test_fraction: float = 0.25) -> dict[str, list[tuple[str, int, int]]]:
    """``{"train": [...], "test": [...]}``: the facts shuffled with ``seed``, the first ``test_fraction`` held out."""
    every = facts(operations, max_operand)
    random.Random(seed).shuffle(every)
    n_test = max(1, min(len(every) - 1, round(test_fraction * len(every))))
    return {"test": every[:n_test], "train": every[n_test:]}


def answer(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b


def rows(split: str = "train", seed: int = 0, operations=OPERATIONS, max_operand: int = 9,
         test_fraction: float = 0.25) -> list[dict[str, str]]:
    """The rows of one split: each of its facts in every wording, shuffled with ``seed`` (module docstring)."""
    ops = check_options(split, operations, max_operand, test_fraction)
    rng = random.Random(f"{seed}-{split}")  # names / objects of the word problems, then the order of the rows
    out = []
    for op, a, b in split_facts(seed, ops, max_operand, test_fraction)[split]:
        for template in TEMPLATES[op]:
            prompt = template.format(a=a, b=b, name=rng.choice(NAMES), things=rng.choice(THINGS))
            out.append({"prompt": prompt, "answer": str(answer(op, a, b)), "fact": f"{a}{op}{b}"})
    rng.shuffle(out)
    return out
