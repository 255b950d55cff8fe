"""The chat template's side of a multi-turn episode: the first prompt, each environment turn as a token suffix, and
the check of what the template would give for the whole conversation.

Token in, token out: the episode's token ids are the first prompt's, then exactly the ids the policy sampled, then
the environment's suffix, then the policy's next ids, and so on; the history is never re-rendered through the
template (re-rendering changes the tokens a model generated: Qwen3's template drops the ``<think>`` blocks of
earlier turns, a template may strip whitespace or re-tokenize text differently).

The suffix of an environment turn (:meth:`ChatFormat.suffix_ids`) is the template rendered for the new messages
only: after a fixed stand-in conversation ``[user "U", assistant MARK]``, the text that follows the stand-in
assistant's content and its end-of-turn token, up to the next assistant header (``add_generation_prompt``). In
ChatML: ``\\n<|im_start|>tool\\n{result}<|im_end|>\\n<|im_start|>assistant\\n`` after the ``<|im_end|>`` the policy
sampled.

The check (:meth:`ChatFormat.drifted`): the whole conversation as messages rendered by the template, against the
episode's ids; both go through the tokenizer's decode (the render encoded first), so a tokenizer whose decode is
not the exact inverse of its encode is no false alarm. An episode where they differ at any environment turn (or
at its end) counts in ``env/template_drift`` (the share of the batch's episodes). Nothing is forked: the policy
trains on the tokens it sampled either way; drift says that a deployment that re-renders the history with this
template shows the model another history than the one it was trained on.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from rlhf_train.envs.base import Message

MARK = "RLHFTRAINTURNMARK"  # the stand-in assistant content whose end the suffix is cut at
STAND_IN: list[Message] = [{"role": "user", "content": "U"}, {"role": "assistant", "content": MARK}]


class ChatFormat:
    """The tokenizer's chat template for one episode (``tools``: the environment's, announced in the prompt)."""

    def __init__(self, tokenizer: Any, tools: Sequence[Callable] | None = None):
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first prompt: ``messages`` rendered with the tools and the assistant header, tokenized."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def suffix_ids(self, messages: list[Message], turn_end: str) -> list[int]:
        """The tokens of the environment's ``messages`` after an assistant turn that ended with the text
        ``turn_end`` (its EOS token), up to the next assistant header (see the module docstring)."""
        text = self.render(STAND_IN + list(messages), add_generation_prompt=True)
        at = text.find(MARK)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content as it is, so an "
                             "environment turn cannot be cut from it")
        cut = at + len(MARK)
        if turn_end and text.startswith(turn_end, cut):  # the policy sampled it: not part of the suffix
            cut += len(turn_end)
        return self.encode(text[cut:])

    def drifted(self, messages: list[Message], ids: Sequence[int], add_generation_prompt: bool) -> bool:
        """Whether the template renders the conversation ``messages`` as other text than the episode's ``ids``:
        with ``add_generation_prompt`` (an environment turn was just added) exactly, else (the episode's end) as
        a prefix (the ids may stop at the last EOS, before the template's end of turn)."""
        rendered = self.decode(self.encode(self.render(messages, add_generation_prompt)))
        actual = self.decode(ids)
        return rendered != actual if add_generation_prompt else not rendered.startswith(actual)
