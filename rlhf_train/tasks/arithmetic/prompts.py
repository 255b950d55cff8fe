"""``data=arithmetic``: the generated arithmetic problems (:mod:`rlhf_train.tasks.arithmetic.generator`) as chat
prompts with an ``answer`` column, for reward functions such as ``final_answer_match``.

The rows are generated in memory (a few thousand at most, milliseconds), so nothing is written to disk and the
dataset is the same wherever it runs; :func:`rlhf_train.data.questions.question_prompts` renders them
(``system_prompt``, ``few_shot``: as for ``data=prompts``).
"""
from __future__ import annotations

import logging

from rlhf_train.data.hf_prompts import HFPromptDataset
from rlhf_train.data.questions import check_max_prompts, question_prompts
from rlhf_train.tasks.arithmetic.generator import OPERATIONS, check_options, rows, split_facts

log = logging.getLogger(__name__)


def arithmetic_prompts(tokenizer, split: str = "train", seed: int = 0, operations=OPERATIONS, max_operand: int = 9,
                       test_fraction: float = 0.25, max_prompts: int | None = None, system_prompt: str | None = None,
                       few_shot: list | None = None) -> HFPromptDataset:
    """The prompts of ``split`` (``train``, or ``test``: the held-out facts), at most ``max_prompts`` of them
    (the first of the seeded order); columns ``answer`` and ``fact`` travel to the reward functions."""
    ops = check_options(split, operations, max_operand, test_fraction)
    check_max_prompts(max_prompts)
    table = rows(split, seed, ops, max_operand, test_fraction)
    split_of = split_facts(seed, ops, max_operand, test_fraction)
    used = table[: int(max_prompts)] if max_prompts is not None else table
    what = (f"{len(split_of['test'])} held-out facts" if split == "test" else
            f"{len(split_of['train'])} facts (none of the {len(split_of['test'])} held-out ones)")
    log.info("[data] arithmetic (data.seed=%d, %s, operands 0..%d): split '%s': %s, %d prompts; using %d%s", seed,
             " and ".join(ops), max_operand, split, what, len(table), len(used),
             f" (data.max_prompts={max_prompts})" if len(used) < len(table) else "")
    return question_prompts(tokenizer, [r["prompt"] for r in used],
                            {"answer": [r["answer"] for r in used], "fact": [r["fact"] for r in used]},
                            system_prompt, few_shot, task="data=arithmetic")
