"""Ready-made reward functions with TRL's ``reward_funcs`` signature, for the ``rewards`` config dict:

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

* :func:`final_answer_match`: 1 when the completion's final answer equals the dataset's answer column
  (normalised and compared by ``math-verify``: ``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree), else 0;
* :func:`regex_match`: 1 when the completion matches a regular expression (a format reward), else 0;
* :func:`length_penalty`: ``-coef · max(0, words - target)``, or the distance to a target length.

Config entries (``conf/config.yaml``'s ``rewards``; every key but ``_target_`` and ``weight`` is passed as a
keyword argument)::

    rewards:
      answer: {_target_: rlhf_train.rewards.functions.final_answer_match, column: answer, weight: 1.0}
      format: {_target_: rlhf_train.rewards.functions.regex_match, pattern: "\\\\boxed\\{.+\\}", weight: 0.2}

Your own function is the same: ``rewards.mine._target_=my_module.my_reward`` (its module on PYTHONPATH).
Functions run in the reward worker thread (:mod:`rlhf_train.rewards.sources`), so ``math-verify``'s
signal-based timeouts are off (they need the main thread).
"""
from __future__ import annotations

import re
from typing import Any


def final_answer_match(prompts: list[str], completions: list[str], column: str = "answer",
                       **columns: Any) -> list[float | None]:
    """1.0 when ``math_verify.verify(parse(answer), parse(completion))``, else 0.0; ``None`` for a row whose
    answer is missing or cannot be parsed (no reward for it rather than a wrong one)."""
    from math_verify import parse, verify

    if column not in columns:
        raise KeyError(f"final_answer_match needs the dataset column '{column}' (has {sorted(columns)}); "
                       f"set its `column` argument")
    out: list[float | None] = []
    for completion, answer in zip(completions, columns[column]):
        gold = parse(str(answer), parsing_timeout=None) if answer is not None else []
        if not gold:
            out.append(None)
            continue
        pred = parse(completion, parsing_timeout=None)
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=None)))
    return out


def regex_match(prompts: list[str], completions: list[str], pattern: str = r".+", full: bool = False,
                **columns: Any) -> list[float]:
    """1.0 when ``pattern`` is found in the completion (``full``: matches the whole stripped completion)."""
    rx = re.compile(pattern, re.DOTALL)
    find = (lambda c: rx.fullmatch(c.strip())) if full else rx.search
    return [float(find(c) is not None) for c in completions]


def length_penalty(prompts: list[str], completions: list[str], target: int = 50, coef: float = 0.01,
                   two_sided: bool = False, **columns: Any) -> list[float]:
    """``-coef · max(0, words - target)`` (``two_sided``: ``-coef · |words - target|``); words = whitespace split."""
    out = []
    for c in completions:
        excess = len(c.split()) - target
        out.append(-coef * (abs(excess) if two_sided else max(excess, 0)))
    return out
