"""Ready-made reward functions with TRL's ``reward_funcs`` signature, for the ``rewards`` config dict:

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

* :func:`final_answer_match`: 1 when the completion's final answer (:func:`extract_answer`: ``\\boxed{}``,
  else ``<answer>...</answer>``, else the last number) equals the dataset's answer column, else 0;
* :func:`think_answer_format`: 1 for ``<think>...</think><answer>X</answer>`` with an ``X`` that can be read
  as an answer, else 0 (a format reward that cannot be paid for empty tags);
* :class:`SoftOverlongPunishment`: DAPO's length penalty (arXiv 2503.14476 eq. 13), built with the
  policy's tokenizer to count tokens;
* :func:`regex_match`: 1 when the completion matches a regular expression, else 0;
* :func:`length_penalty`: ``-coef · max(0, words - target)``, or the distance to a target length.

docs/rewards.md ("Ready-made reward functions") states each one's rules. Config entries (``conf/config.yaml``'s
``rewards``; every key but ``_target_``, ``weight`` and the execution keys is passed as a keyword argument)::

    rewards:
      answer: {_target_: rlhf_train.rewards.functions.final_answer_match, column: answer, weight: 1.0}
      format: {_target_: rlhf_train.rewards.functions.think_answer_format, weight: 0.2}

Your own function is the same: ``rewards.mine._target_=my_module.my_reward`` (its module on PYTHONPATH).
``math-verify``'s signal-based timeouts are off here (they need the main thread, and functions may run in
a worker thread or process: :mod:`rlhf_train.rewards.sources`).
"""
from __future__ import annotations

import logging
import re
import unicodedata
from typing import Any


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning, logged once per process on the first ``parse`` /
    ``verify``: the timeout it asks for is the reward executor's (``rewards.<name>.timeout_s``), not its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())

import torch

from rlhf_train.core.overlong import soft_overlong_punishment as _overlong

# The last number of a text: an optional sign, digits with optional thousands commas, an optional decimal
# part, an optional "/denominator" ("1/2"); or a bare decimal (".5").
NUMBER = re.compile(r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|\.\d+)")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL | re.IGNORECASE)
TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None (none, or unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):  # a scan over one answer's characters, not a hot path over tokens
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, by precedence: the last ``\\boxed{...}``; else the last
    ``<answer>...</answer>``; else the last number (:data:`NUMBER`). The first kind present decides: an empty
    ``\\boxed{}`` or ``<answer></answer>`` is no answer (None), not a reason to look for a number elsewhere.
    Stripped of surrounding whitespace; None when there is none."""
    for found in (last_boxed(text), (ANSWER_TAG.findall(text) or [None])[-1]):
        if found is not None:
            return found.strip() or None
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(text: str) -> str:
    """What a word answer is compared by: Unicode NFKC, ``\\text{X}``-style wrappers unwrapped, case folded,
    whitespace collapsed, surrounding ``$``, quotes and punctuation (``.,;:!?``) stripped."""
    text = TEXT_WRAPPERS.sub(r"\1", unicodedata.normalize("NFKC", str(text)))
    return " ".join(text.casefold().split()).strip(" .,;:!?\"'`$")


def is_math(text: str) -> bool:
    """An answer compared by math-verify: one that holds a digit or a LaTeX command (``\\frac``, ``\\pi``).
    Word answers ("Paris", "no") are compared as strings only: math-verify would read them as products of
    symbols (``no`` = n·o = ``on``)."""
    return any(c.isdigit() for c in text) or "\\" in text


def math_parse(text: str) -> list:
    """math-verify's ``parse`` of the text (its own extraction: ``$...$``, ``\\boxed``, "the answer is 7") and of
    the text as LaTeX (``$text$``: a bare ``x+1``), the first that finds something; LaTeX first when the text
    has a LaTeX command and no ``$`` (a bare ``\\sqrt 2``, which the plain parse reads as 2)."""
    from math_verify import parse

    tries = [f"${text}$", text] if "\\" in text and "$" not in text else [text, f"${text}$"]
    for t in tries:
        found = parse(t, parsing_timeout=None)
        if found:
            return found
    return []


def answers_match(gold: str, pred: str) -> bool:
    """Whether an extracted answer ``pred`` equals ``gold``: equal after :func:`normalize`, or, when ``gold``
    :func:`is_math`, equal by ``math_verify.verify`` (``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree)."""
    if normalize(gold) == normalize(pred):
        return True
    if not is_math(gold):
        return False
    from math_verify import verify

    gold_parsed, pred_parsed = math_parse(gold), math_parse(pred)
    return bool(gold_parsed and pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def final_answer_match(prompts: list[str], completions: list[str], column: str = "answer",
                       **columns: Any) -> list[float | None]:
    """1.0 when the completion's :func:`extract_answer` :func:`answers_match` the ``column`` value, 0.0 when
    it does not or the completion has no answer; ``None`` for a row whose answer is missing or blank (no
    reward for it rather than a wrong one)."""
    if column not in columns:
        raise KeyError(f"final_answer_match needs the dataset column '{column}' (has {sorted(columns)}); "
                       f"set its `column` argument")
    out: list[float | None] = []
    for completion, answer in zip(completions, columns[column]):
        gold = str(answer).strip() if answer is not None else ""
        if not gold:
            out.append(None)
            continue
        pred = extract_answer(completion)
        out.append(float(pred is not None and answers_match(gold, pred)))
    return out


def readable_answer(text: str, kind: str = "math") -> bool:
    """Whether ``text`` (an ``<answer>`` tag's content) is an answer: non-empty and free of ``<think>`` /
    ``<answer>`` tags; ``kind="math"``: it :func:`is_math` and math-verify finds a number or expression in it;
    ``"text"``: any."""
    text = text.strip()
    if not text or re.search(r"</?(?:think|answer)>", text, re.IGNORECASE):
        return False
    return kind == "text" or (is_math(text) and bool(math_parse(text)))


def think_answer_format(prompts: list[str], completions: list[str], answer_kind: str = "math",
                        **columns: Any) -> list[float]:
    """1.0 when the whole completion is ``<think>T</think><answer>X</answer>`` (whitespace around and between
    the blocks allowed; tags case-insensitive; ``T`` may be empty but holds no ``<think>`` / ``<answer>``
    tag) and ``X`` is a :func:`readable_answer` of ``answer_kind`` (``math`` or ``text``), else 0.0.
    No partial credit: tags around nothing, or text after ``</answer>``, earn 0."""
    if answer_kind not in ("math", "text"):
        raise ValueError(f"think_answer_format: answer_kind={answer_kind!r}; choose math or text")
    out = []
    for c in completions:
        m = THINK_ANSWER.fullmatch(c)
        ok = m is not None and not re.search(r"</?(?:think|answer)>", m.group(1), re.IGNORECASE)
        out.append(float(ok and readable_answer(m.group(2), answer_kind)))
    return out


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment as a reward function (arXiv 2503.14476 eq. 13,
    :func:`rlhf_train.core.overlong.soft_overlong_punishment`): 0 up to ``L_max − L_cache`` tokens, linear down
    to −1 at ``L_max``, −1 beyond. ``rewards.<name>: {_target_: rlhf_train.rewards.functions.SoftOverlongPunishment,
    max_length: L_max, cache_length: L_cache}``; ``L_max`` is usually ``rollout.max_new_tokens`` (a response cut
    there scores −1).

    Lengths are tokens of the policy's tokenizer (``tokenizer=`` is passed by
    :func:`~rlhf_train.rewards.sources.build_reward_sources`): ``completion_ids`` when the caller passes them
    (TRL's reward-function keyword), else the completion text re-encoded without special tokens (the text has
    EOS dropped, so EOS is not counted). A class, not a closure, so that it pickles (a process pool)."""

    def __init__(self, max_length: int | None = None, cache_length: int | None = None, tokenizer: Any = None):
        from rlhf_train.infra.errors import ConfigError

        for key, value in (("max_length", max_length), ("cache_length", cache_length)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"SoftOverlongPunishment: {key}={value!r}; set rewards.<name>.{key} to a number "
                                  f"of tokens")
        if not 0 < cache_length <= max_length:
            raise ConfigError(f"SoftOverlongPunishment: need 0 < cache_length ({cache_length}) <= max_length "
                              f"({max_length}); the penalty ramps from max_length - cache_length to max_length tokens")
        if tokenizer is None:
            raise ConfigError("SoftOverlongPunishment needs the policy's tokenizer to count tokens (rewards.<name> "
                              "entries get it)")
        self.max_length, self.cache_length, self.tokenizer = max_length, cache_length, tokenizer

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list | None = None,
                 **columns: Any) -> list[float]:
        if completion_ids is None:
            completion_ids = self.tokenizer(list(completions), add_special_tokens=False)["input_ids"]
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
        return _overlong(lengths, self.max_length, self.cache_length).tolist()


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
