"""The calculator tool and its environment (rlhf_train/envs/calculator.py): the safe evaluator's values worked by
hand, everything but arithmetic refused with a message (no eval / exec: names, calls, attributes never run), the
bounds, the timeout, a scripted episode (tool call -> result -> answer -> reward) and the seeded problems."""
from __future__ import annotations

import time

import pytest

from rlhf_train.envs import calculator
from rlhf_train.envs.calculator import (EXAMPLE, Calculator, CalculatorError, calculate, calculator_prompts,
                                       last_number, safe_eval)
from rlhf_train.envs.prompts import held_out, seeded_rows
from rlhf_train.envs.tools import parse_tool_calls
from rlhf_train.envs.word_problems import TEMPLATES, problem
from rlhf_train.infra.errors import ConfigError
from tests.helpers.envs import chatml_tokenizer


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14),               # precedence: 3 * 4 first
    ("(2 + 3) * 4", 20),             # parentheses
    ("7 / 2", 3.5), ("7 // 2", 3), ("-7 // 2", -4), ("7 % 3", 1), ("-3 % 5", 2),  # Python's floor semantics
    ("2 ** 10", 1024), ("2 ** -2", 0.25), ("-2 ** 2", -4),   # ** binds tighter than unary minus
    ("3 ^ 2", 9),                    # ^ read as power (what people write), not XOR
    ("12 × 3 ÷ 4", 9.0),
    ("1.5e3 - 0.5", 1499.5),
])
def test_values_worked_by_hand(expression, value):
    assert safe_eval(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('echo hacked')", "not Call"),
    ("open('/etc/passwd')", "not Call"),
    ("x + 1", "not Name"),
    ("(1).real", "not Attribute"),
    ("[1, 2][0]", "not Subscript"),
    ("1 < 2", "not Compare"),
    ("True + 1", "not True"),
    ("'a' * 3", "not 'a'"),
    ("lambda: 1", "not Lambda"),
    ("2 ** 65", "exponent 65 is too large"),
    ("9 ** 9 ** 9", "exponent 3.8742e+08 is too large"),  # 9 ** 9 is computed (small), the outer power is refused
    ("10 ** 31", "out of range"),
    ("1e300 * 1e300", "out of range"),
    ("(-8) ** 0.5", "out of range"),  # complex
    ("1 / 0", "division by zero"), ("1 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("1 +", "cannot parse"), ("", "empty"),
    ("1" * 201, "longer than 200 characters"),
])
def test_everything_else_is_refused_with_a_reason(expression, why):
    with pytest.raises(CalculatorError, match=why.replace("(", r"\(").replace("+", r"\+")):
        safe_eval(expression)
    assert calculate(expression).startswith("Error: ")  # the tool answers with the reason, never raises


def test_no_code_runs(tmp_path):
    marker = tmp_path / "ran"
    assert calculate(f"__import__('pathlib').Path('{marker}').touch()").startswith("Error")
    assert not marker.exists()


def test_results_as_text():
    assert [calculate(e) for e in ("12 * 4", "8 / 2", "1 / 3", "2.5 * 2")] == ["48", "4", "0.3333333333", "5"]


def test_last_number():
    assert last_number("It is 1,234 apples.") == 1234.0
    assert last_number("5 then -12.5") == -12.5
    assert last_number("no number") is None


def test_a_scripted_episode_calls_the_tool_and_pays_the_right_answer():
    env = Calculator()
    messages = env.reset({"question": "What is 17 * 23 - 5?", "answer": 386})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert "<tool_call>" in messages[0]["content"] and messages[1:5] == EXAMPLE  # the worked example as turns
    assert messages[-1] == {"role": "user", "content": "What is 17 * 23 - 5?"}
    assert calculate(parse_tool_calls(EXAMPLE[1]["content"])[0].arguments["expression"]) == EXAMPLE[2]["content"]
    assert env.tools == [calculate]
    step = env.step({"role": "assistant", "content": '<tool_call>{"name": "calculate", "arguments": '
                                                     '{"expression": "17 * 23 - 5"}}</tool_call>'})
    assert step.messages == [{"role": "tool", "name": "calculate", "content": "386"}] and step.reward is None
    assert step.info == {"tool_calls": 1, "tool_errors": 0}
    bad = env.step({"role": "assistant", "content": '<tool_call>{"name": "calculate", "arguments": '
                                                    '{"expression": "import os"}}</tool_call>'})
    assert bad.messages[0]["content"].startswith("Error: cannot parse")  # an error message, no tool error count:
    assert bad.info == {"tool_calls": 1, "tool_errors": 0}                # the tool answered
    done = env.step({"role": "assistant", "content": "The answer is 386."})
    assert done.messages is None and done.reward == 1.0
    assert env.step({"role": "assistant", "content": "385"}).reward == 0.0
    assert Calculator(describe_tools=False, example=False).reset({"question": "q", "answer": 1}) == \
        [{"role": "user", "content": "q"}]


def test_tool_call_reward_pays_the_first_call_that_returns_a_result_once():
    call = '<tool_call>{{"name": "calculate", "arguments": {{"expression": "{}"}}}}</tool_call>'
    env = Calculator(tool_call_reward=0.1)
    env.reset({"question": "What is 17 * 23?", "answer": 391})
    assert env.step({"role": "assistant", "content": call.format("17 *")}).reward is None  # "Error: cannot parse"
    assert env.step({"role": "assistant", "content": '<tool_call>{"name": "nope"}</tool_call>'}).reward is None
    assert env.step({"role": "assistant", "content": call.format("17 * 23")}).reward == 0.1
    assert env.step({"role": "assistant", "content": call.format("17 * 23")}).reward is None  # once per episode
    assert env.step({"role": "assistant", "content": "391"}).reward == 1.0
    fresh = Calculator(tool_call_reward=0.1)  # a new environment per episode: paid again
    fresh.reset({"question": "q", "answer": 1})
    assert fresh.step({"role": "assistant", "content": call.format("1 + 1")}).reward == 0.1
    default = Calculator()
    default.reset({"question": "q", "answer": 1})
    assert default.step({"role": "assistant", "content": call.format("1 + 1")}).reward is None


def test_a_tool_that_runs_too_long_is_an_error_message(monkeypatch):
    def slow_eval(expression):
        time.sleep(3)
        return 1

    monkeypatch.setattr(calculator, "safe_eval", slow_eval)
    env = Calculator(tool_timeout_s=0.2)
    env.reset({"question": "q", "answer": 1})
    t0 = time.perf_counter()
    step = env.step({"role": "assistant", "content": '<tool_call>{"name": "calculate", "arguments": '
                                                     '{"expression": "1"}}</tool_call>'})
    assert time.perf_counter() - t0 < 2
    assert step.messages[0]["content"] == "Error: the tool calculate did not return within 0.2 s"
    assert step.info == {"tool_calls": 1, "tool_errors": 1}


def test_problems_are_seeded_whole_numbers_and_the_splits_disjoint():
    import random

    for _ in range(200):
        p = problem(random.Random(_))
        assert isinstance(p["answer"], int) and p["answer"] > 0 and "?" in p["question"]
    train = seeded_rows("calculator", "train", 300, 0, problem, key=lambda r: r["question"])
    test = seeded_rows("calculator", "test", 50, 0, problem, key=lambda r: r["question"])
    assert train == seeded_rows("calculator", "train", 300, 0, problem, key=lambda r: r["question"])  # seeded
    assert train[:10] == seeded_rows("calculator", "train", 10, 0, problem, key=lambda r: r["question"])
    assert train != seeded_rows("calculator", "train", 300, 1, problem, key=lambda r: r["question"])
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert all(held_out(r["question"], 10) for r in test) and not any(held_out(r["question"], 10) for r in train)
    for steps in (1, 2, 3):  # data.max_steps: only templates of at most that many operations
        one = [problem(random.Random(i), max_steps=steps) for i in range(300)]
        assert all(isinstance(p["answer"], int) and p["answer"] > 0 for p in one)
        assert {t for t, n in TEMPLATES if n <= steps} == {t for t, n in TEMPLATES
                                                           if any(_asks(t, p["question"]) for p in one)}


def _asks(template, question: str) -> bool:
    """Whether ``question`` is ``template``'s wording (the same text with its numbers replaced)."""
    import random
    import re

    return re.sub(r"\d+", "#", template(random.Random(0))[0]) == re.sub(r"\d+", "#", question)


def test_calculator_prompts_render_the_first_messages():
    tok = chatml_tokenizer()
    with pytest.raises(ConfigError, match="data.max_steps=4"):
        calculator_prompts(tok, split="test", max_prompts=4, max_steps=4)
    data = calculator_prompts(tok, split="test", max_prompts=4)
    assert len(data) == 4 and set(data.columns) == {"question", "answer"}
    text = tok.decode(data[0]["input_ids"].tolist())
    assert text.startswith("<|im_start|>system\nTools: calculate<|im_end|>\n<|im_start|>system\nYou can use a calculator")
    assert text.endswith(f"{data.columns['question'][0]}<|im_end|>\n<|im_start|>assistant\n")
