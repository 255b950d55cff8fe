"""A calculator tool and the arithmetic word-problem environment that uses it (``env=calculator``,
``data=calculator``, ``+recipe=tool_calculator``; docs/environments.md "Ready-made environments").

:func:`safe_eval` evaluates an arithmetic expression without ``eval`` / ``exec``: the text is parsed with
:mod:`ast` and only these nodes are evaluated: numeric literals (``int``, ``float``; not ``bool`` or ``complex``),
the binary operators ``+ - * / // % **``, unary ``+ -`` and parentheses (which the parser folds into the tree).
Names, calls, attributes, subscripts, comparisons, strings and everything else are refused with a message. Bounds
keep every evaluation small: at most :data:`MAX_CHARS` characters, exponents of at most :data:`MAX_EXPONENT` in
absolute value and every intermediate result at most :data:`MAX_ABS` in absolute value (so ``9**9**9`` or a chain of
products of huge numbers is refused before it is computed), finite results only. The tool :func:`calculate` is
that evaluator with its result (or the reason it refused) as text; the environment runs it under
:class:`~rlhf_train.envs.tools.ToolEnvironment`'s timeout (``tool_timeout_s``) in any case.

:class:`Calculator` is a :class:`~rlhf_train.envs.tools.ToolEnvironment`: the first messages are a system message
saying how to call the tool (Hermes' ``<tool_call>`` JSON; templates that announce ``tools=`` themselves, as Qwen's
do, announce it too) and the question; an assistant message with tool calls gets their results, one without is
the answer, paid 1.0 when its last number equals the problem's answer, else 0.0. The problems come from
:func:`rlhf_train.envs.word_problems.problem` (``data=calculator``: :func:`calculator_prompts`).
"""
from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from rlhf_train.envs.base import Message
from rlhf_train.envs.tools import ToolEnvironment

MAX_CHARS = 200  # longest expression evaluated
MAX_EXPONENT = 64  # largest |exponent| of **
MAX_ABS = 1e30  # largest |value| of any literal or intermediate result

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression :func:`safe_eval` refuses or cannot evaluate; the message says why."""


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_ABS:
        raise CalculatorError(f"the result is out of range (|x| > {MAX_ABS:g}, not finite or not real)")
    return value


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int subclass: refused
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {right:g} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise CalculatorError("division by zero")
        try:
            return _bounded(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"the result is out of range (|x| > {MAX_ABS:g})") from None
    what = (type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp))
            else f"{node.value!r:.20}" if isinstance(node, ast.Constant) else type(node).__name__)
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def safe_eval(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (see the module docstring); :class:`CalculatorError` otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {text!r:.60}") from None
    return _value(tree)


def format_number(value: int | float) -> str:
    """``7`` for 7 and 7.0, ``3.5``, ``0.3333333333`` (at most 10 significant digits after the point)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, for example "(12 + 30) * 4 / 7"
    """
    try:
        return format_number(safe_eval(expression))
    except CalculatorError as err:
        return f"Error: {err}"


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
INSTRUCTIONS = ("You can use a calculator. To use it, write exactly\n<tool_call>\n{\"name\": \"calculate\", "
                "\"arguments\": {\"expression\": \"<the expression>\"}}\n</tool_call>\nand you will get the result. "
                "When you know the answer, reply with the final number only.")
# A worked example as earlier turns of the conversation (``example=True``): SmolLM2-135M-Instruct wrote a tool call in
# 0 of 32 sampled replies (8 problems, temperature 0.7) with the instructions alone, 4 of 32 with the example inside
# the system message, and 22 of 32 with it as turns. Without any call GRPO has nothing to learn from.
EXAMPLE: list[Message] = [
    {"role": "user", "content": "A box holds 24 pens. How many pens are in 13 boxes?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "24 * 13"}}\n'
                                     '</tool_call>'},
    {"role": "tool", "name": "calculate", "content": "312"},
    {"role": "assistant", "content": "312"}]


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234`` is 1234), or ``None``."""
    found = NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def first_messages(row: dict[str, Any], instructions: str | None = INSTRUCTIONS,
                   example: bool = True) -> list[Message]:
    """A problem's first messages: the tool instructions (a system message), the worked :data:`EXAMPLE` (with
    ``example``) and the question."""
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + (EXAMPLE if example else []) + [{"role": "user", "content": str(row["question"])}]


class Calculator(ToolEnvironment):
    """An arithmetic word problem with the :func:`calculate` tool (module docstring). ``row``: a
    :func:`calculator_prompts` row (``question``, ``answer``). ``describe_tools``: put the call format in a system
    message (for templates that do not render ``tools=``, as SmolLM2's); ``tool_timeout_s``: seconds a call may
    take before it is an error message; ``tool_call_reward``: paid for the episode's first tool turn that ran without
    error (:class:`~rlhf_train.envs.tools.ToolEnvironment`), 0 by default; ``example``: the worked example as the
    conversation's first turns (:data:`EXAMPLE`)."""

    tools = [calculate]

    def __init__(self, describe_tools: bool = True, tool_timeout_s: float = 2.0, tool_call_reward: float = 0.0,
                 example: bool = True):
        self.instructions = INSTRUCTIONS if describe_tools else None
        self.example = bool(example)
        self.tool_timeout_s = float(tool_timeout_s)
        self.tool_call_reward = float(tool_call_reward)
        self.answer_value: float | None = None

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.answer_value = float(row["answer"])
        return first_messages(row, self.instructions, self.example)

    def reward(self, text: str) -> float:
        got = last_number(text)
        return float(got is not None and math.isclose(got, self.answer_value, rel_tol=0.0, abs_tol=1e-6))


def calculator_prompts(tokenizer, split: str = "train", max_prompts: int | None = 2048, seed: int = 0,
                       max_steps: int = 3):
    """``data=calculator``: ``max_prompts`` arithmetic word problems (:mod:`rlhf_train.envs.word_problems`) of
    templates needing at most ``max_steps`` operations, drawn from a stream seeded by ``seed``; ``split`` ``train``
    or any other (held out: problems ``train`` never has), each row's first messages (the tool instructions, the
    example and the question: the longest first prompt an episode has) rendered by ``tokenizer``'s chat template with
    the tool."""
    from rlhf_train.envs.prompts import episode_prompts, seeded_rows
    from rlhf_train.envs.word_problems import problem
    from rlhf_train.infra.errors import ConfigError

    if not 1 <= int(max_steps) <= 3:
        raise ConfigError(f"data.max_steps={max_steps}: the word problems need 1, 2 or 3 operations "
                          f"(1 <= max_steps <= 3)")
    rows = seeded_rows("calculator", split, max_prompts, seed, lambda r: problem(r, int(max_steps)),
                       key=lambda row: row["question"])
    return episode_prompts(tokenizer, rows, first_messages, tools=[calculate])
