"""Tool calling: the Hermes ``<tool_call>`` blocks are read, tools run with a timeout, and every failure (bad JSON, an
unknown tool, bad arguments, a raise, a timeout) comes back as a ``tool`` message saying so, never a crash."""
from __future__ import annotations

import time

from rlhf_train.envs.base import Step
from rlhf_train.envs.tools import ToolEnvironment, parse_tool_calls, tool_messages
from tests.helpers.envs import add, broken, slow


def test_parse_tool_calls():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call><tool_call>{"name": "slow", "arguments": {}}')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("add", {"a": 2, "b": 3}, True),
        ("add", {"a": 1, "b": 1}, True),           # arguments as a JSON string
        (None, {}, False),                         # not JSON
        (None, {}, False),                         # not an object with a name
        ("add", {}, False),                        # arguments not an object
        ("slow", {}, True),                        # the last block, not closed (the model stopped at EOS)
    ]
    assert "not valid JSON" in calls[2].error and "JSON object" in calls[3].error
    assert parse_tool_calls("no calls here") == []


def test_tools_run_and_every_failure_is_a_tool_message():
    text = ''.join(f'<tool_call>{c}</tool_call>' for c in [
        '{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name": "slow", "arguments": {"x": 1}}',
        '{"name": "broken", "arguments": {"x": 1}}', '{"name": "add", "arguments": {"c": 1}}',
        '{"name": "nope", "arguments": {}}', '{oops}'])
    t0 = time.perf_counter()
    messages, calls, errors = tool_messages(text, [add, slow, broken], timeout_s=0.2)
    assert time.perf_counter() - t0 < 3  # the slow tool (5 s) was not waited for
    assert (calls, errors) == (6, 5)
    assert [m["role"] for m in messages] == ["tool"] * 6
    assert [m["name"] for m in messages] == ["add", "slow", "broken", "add", "nope", ""]
    content = [m["content"] for m in messages]
    assert content[0] == "5"
    assert content[1] == "Error: the tool slow did not return within 0.2 s"
    assert content[2] == "Error: the tool broken raised ValueError: no 1"
    assert content[3].startswith("Error: the tool add raised TypeError")  # an argument it does not take
    assert content[4] == "Error: there is no tool 'nope'; the tools are: add, slow, broken"
    assert content[5].startswith("Error: the tool call is not valid JSON")


def test_results_that_are_not_text_go_back_as_json():
    def lookup(key: str) -> dict:
        """Look up.

        Args:
            key: what
        """
        return {"key": key, "n": [1, 2]}

    messages, _, errors = tool_messages('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>',
                                        [lookup], 1.0)
    assert errors == 0 and messages[0]["content"] == '{"key": "k", "n": [1, 2]}'


class Calculator(ToolEnvironment):
    tools = [add, broken]
    tool_timeout_s = 1.0

    def reset(self, row):
        return [{"role": "user", "content": "2 + 3?"}]

    def reward(self, text):
        return float("5" in text)


def test_tool_environment_steps():
    env = Calculator()
    step = env.step({"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
                                                     '</tool_call><tool_call>{"name": "broken", "arguments": {"x": 0}}'
                                                     '</tool_call>'})
    assert step == Step([{"role": "tool", "name": "add", "content": "5"},
                         {"role": "tool", "name": "broken", "content": "Error: the tool broken raised ValueError: no 0"}],
                        None, {"tool_calls": 2, "tool_errors": 1})
    assert env.step({"role": "assistant", "content": "It is 5."}) == Step(None, 1.0)  # the answer ends the episode
    assert env.step({"role": "assistant", "content": "It is 6."}) == Step(None, 0.0)
