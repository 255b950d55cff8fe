"""Questions with answers as chat prompts: the prompt datasets of the verifiable-reward tasks
(``data=arithmetic``, ``data=gsm8k``), built from rows a task made or loaded.

Each question is one user message; ``data.system_prompt`` and ``data.few_shot`` go before it as for
``data=prompts`` (:mod:`rlhf_train.data.prefix`: ``null`` keeps the chat template's own system prompt), and
the tokenizer's chat template renders it with the generation prompt. A tokenizer without a chat template (a
base model) gets text instead, ``Question: <question>\\nAnswer:`` after the text prefix of ``data.system_prompt``
and ``data.few_shot`` (one log line says so). The answers and any other column travel with the prompt to the
reward functions (``final_answer_match`` reads ``answer``).
"""
from __future__ import annotations

import logging
from typing import Any

from rlhf_train.data.hf_prompts import HFPromptDataset
from rlhf_train.data.prefix import chat_messages, check_prefix, text_prefix
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)
TEXT_FORM = "Question: {question}\nAnswer:"


def check_max_prompts(max_prompts: int | None) -> None:
    if max_prompts is not None and int(max_prompts) <= 0:
        raise ConfigError(f"data.max_prompts={max_prompts} must be positive (or null: every prompt)")


def question_prompts(tokenizer, questions: list[str], columns: dict[str, list[Any]], system_prompt: str | None = None,
                     few_shot: list | None = None, task: str = "data") -> HFPromptDataset:
    """``questions [N]`` as prompts (``columns``: ``{name: [N] values}``, e.g. ``answer``): chat prompts, or text
    (:data:`TEXT_FORM`) for a tokenizer without a chat template. A bad system prompt or few-shot example: one
    ``ConfigError`` line."""
    examples = check_prefix(system_prompt, few_shot)
    if not questions:
        raise ConfigError(f"{task} has no questions (check data.split / data.max_prompts)")
    if getattr(tokenizer, "chat_template", None):
        messages = [chat_messages([{"role": "user", "content": q}], system_prompt, examples) for q in questions]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        log.info("[data] %s: the tokenizer has no chat template, so each question is text: %r", task, TEXT_FORM)
        prefix = text_prefix(system_prompt, examples)
        text = [prefix + TEXT_FORM.format(question=q) for q in questions]
        ids = tokenizer(text)["input_ids"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFPromptDataset([list(x) for x in ids], dict(columns), pad, list(text))
