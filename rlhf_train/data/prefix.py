"""What goes before every prompt of ``data=prompts``: a system prompt (``data.system_prompt``) and few-shot
examples (``data.few_shot``, a list of ``{prompt, completion}``).

Chat prompts (a ``messages`` column, or text with ``data.text_as_chat``): the messages become
``[system] + [user: prompt_1, assistant: completion_1, ...] + the row's messages``. ``data.system_prompt`` is a
system message put first; a row that has its own system message keeps it (the few-shot turns go after it), and
the count of such rows is logged. Chat templates that insert a default system prompt when there is none
(SmolLM2's: "You are a helpful AI assistant named SmolLM, trained by Hugging Face") use the given one instead;
``data.system_prompt=""`` gives an empty system message, i.e. no default. ``null`` leaves the rows as they are.

Text prompts: the prefix ``system_prompt + "\\n\\n" + prompt_1 + completion_1 + "\\n\\n" + ...`` goes before
each prompt (no separator is put between an example's prompt and its completion: end the prompt with what
the completion follows, e.g. ``"Q: 2+3?\\nA:"`` and ``" 5"``).
"""
from __future__ import annotations

from typing import Any

from rlhf_train.infra.errors import ConfigError


def check_prefix(system_prompt: Any, few_shot: Any) -> list[dict[str, str]]:
    """The few-shot examples as ``[{"prompt": str, "completion": str}]`` (``[]`` for none), or one line naming
    the bad value: a system prompt that is not a string, an example that is not ``{prompt, completion}`` strings."""
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ConfigError(f"data.system_prompt={system_prompt!r} must be a string (or null: none)")
    if few_shot is None:
        return []
    if isinstance(few_shot, (str, dict)) or not hasattr(few_shot, "__iter__"):
        raise ConfigError(f"data.few_shot must be a list of {{prompt, completion}} examples, got "
                          f"{type(few_shot).__name__}")
    out = []
    for k, example in enumerate(few_shot, 1):
        keys = set(example) if hasattr(example, "keys") else None
        if keys != {"prompt", "completion"} or not all(isinstance(example[x], str) for x in keys):
            raise ConfigError(f"data.few_shot example {k} is {dict(example) if keys is not None else example!r}; "
                              f"each example is {{prompt: <text>, completion: <text>}}, both strings")
        out.append({"prompt": example["prompt"], "completion": example["completion"]})
    return out


def chat_messages(messages: list[dict], system_prompt: str | None, few_shot: list[dict[str, str]]) -> list[dict]:
    """A row's messages with the system prompt first (unless the row has its own) and the few-shot turns
    after the system message."""
    own = bool(messages) and messages[0].get("role") == "system"
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    head = messages[:1] if own else system
    shots = [m for ex in few_shot for m in ({"role": "user", "content": ex["prompt"]},
                                            {"role": "assistant", "content": ex["completion"]})]
    return head + shots + list(messages[1:] if own else messages)


def text_prefix(system_prompt: str | None, few_shot: list[dict[str, str]]) -> str:
    """What goes before each text prompt: ``system_prompt + "\\n\\n"`` and ``prompt + completion + "\\n\\n"``
    per example ("" for neither)."""
    parts = ([system_prompt] if system_prompt else []) + [ex["prompt"] + ex["completion"] for ex in few_shot]
    return "".join(p + "\n\n" for p in parts)
