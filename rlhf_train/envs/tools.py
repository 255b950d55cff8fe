"""Tool calling for environments: read the calls a model wrote, run them with a timeout, answer with ``tool``
messages. Errors never crash an episode: a call that is not valid JSON, names an unknown tool, raises or runs
past its timeout becomes a ``tool`` message saying so (``Error: ...``), counted in ``env/tool_errors``.

The call format is Hermes' (Qwen2.5 / Qwen3, SmolLM3, Hermes and others are trained on it, and their chat
templates announce the ``tools=`` in it): anywhere in the assistant message, one block per call,

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

``arguments`` may also be a JSON string of the object (some models write it so); a last block the model did not
close (it stopped at EOS) is read to the end of the message. The result goes back as
``{"role": "tool", "name": "add", "content": "5"}`` (a ``str`` as it is, anything else as JSON), which the chat
template renders (Qwen's as a ``<tool_response>`` in a user turn).

How a tool runs: in a daemon thread of the trainer's process (:func:`rlhf_train.rewards.executor.in_thread`, the
reward functions' own), waited for at most ``timeout_s``. Why a thread: tools are small pure-Python functions
(a calculator, a lookup), and a thread costs nothing to start and shares the environment's state; a tool that
runs past its timeout is left running in its thread (Python cannot stop a thread) and the episode goes on
with the error. Code that may never return or must be isolated (a sandbox for generated code) belongs in a
worker process or a service that the tool function calls with its own timeout.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhf_train.envs.base import Message, Step

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    """One call read from an assistant message: ``name`` and ``arguments``, or ``error`` (why it could not be read)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text``, in order."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str):
            calls.append(ToolCall(None, error='a tool call is a JSON object {"name": <tool name>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name, error=f"the arguments of {name} must be a JSON object, got {args!r:.60}"))
            continue
        calls.append(ToolCall(name, args))
    return calls


def tool_name(tool: Callable) -> str:
    return getattr(tool, "__name__", type(tool).__name__)


def run_tool(tool: Callable, arguments: dict[str, Any], timeout_s: float | None) -> tuple[str, bool]:
    """``(content, ok)``: ``tool(**arguments)`` as text, or the error (a raise, ``timeout_s`` exceeded) as text."""
    from rlhf_train.rewards.executor import in_thread

    name = tool_name(tool)
    future = in_thread(lambda: tool(**arguments))
    try:
        result = future.result(timeout=timeout_s)
    except FutureTimeout:
        return f"Error: the tool {name} did not return within {timeout_s:g} s", False
    if result.raised is not None:
        return f"Error: the tool {name} raised {result.raised}", False
    out = result.out
    return (out if isinstance(out, str) else json.dumps(out, default=str)), True


def tool_messages(text: str, tools: Sequence[Callable], timeout_s: float | None) -> tuple[list[Message], int, int]:
    """``(tool messages, calls, errors)`` for the calls in the assistant message ``text``, run in order."""
    by_name = {tool_name(t): t for t in tools}
    messages, errors = [], 0
    calls = parse_tool_calls(text)
    for call in calls:
        if call.error is not None:
            content, ok = f"Error: {call.error}", False
        elif call.name not in by_name:
            content, ok = f"Error: there is no tool {call.name!r}; the tools are: {', '.join(by_name) or 'none'}", False
        else:
            content, ok = run_tool(by_name[call.name], call.arguments, timeout_s)
        errors += not ok
        messages.append({"role": "tool", "name": call.name or "", "content": content})
    return messages, len(calls), errors


class ToolEnvironment:
    """An environment whose model may call its ``tools`` before it answers. Subclass it with ``tools`` (functions
    with type hints and Google-style docstrings: the chat template's ``tools=`` renders their JSON schemas),
    :meth:`reset` and :meth:`reward` (or :meth:`answer` for more than one answer turn).

    :meth:`step`: an assistant message with tool calls gets the tools' results (``tool`` messages; errors as
    ``Error: ...`` messages) and the episode goes on; one without is the answer: :meth:`answer` (by default the
    episode ends, paid :meth:`reward` of the answer's text). ``tool_call_reward`` (0: none) pays the first turn of
    an episode whose tool calls all returned a result (none an ``Error: ...`` message): a shaping reward for a model that does not call tools yet;
    keep it below the answer's reward so that a reward >= 1 still means a right answer."""

    tools: Sequence[Callable] = ()
    tool_timeout_s: float | None = 10.0  # seconds a tool call may take before it is an error message
    tool_call_reward: float = 0.0  # paid once per episode: its first turn whose tool calls all returned a result
    _tool_call_paid: bool = False

    def reset(self, row: dict[str, Any]) -> list[Message]:
        raise NotImplementedError

    def reward(self, text: str) -> float | None:
        """The final answer's reward (``None``: none)."""
        return None

    def answer(self, text: str) -> Step:
        return Step(None, self.reward(text))

    def step(self, message: Message) -> Step:
        text = message.get("content") or ""
        if "<tool_call>" in text:
            messages, calls, errors = tool_messages(text, self.tools, self.tool_timeout_s)
            reward = None
            answered = not errors and not any(m["content"].startswith("Error:") for m in messages)
            if self.tool_call_reward and calls and answered and not self._tool_call_paid:
                self._tool_call_paid, reward = True, float(self.tool_call_reward)
            return Step(messages, reward, {"tool_calls": calls, "tool_errors": errors})
        return self.answer(text)
