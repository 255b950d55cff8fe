"""The arithmetic task (``data=arithmetic``, ``+recipe=arithmetic_grpo``): its generator is seeded, its held-out
facts never appear in training, every answer is right, and its prompts are chat prompts with an answer column."""
from __future__ import annotations

import pytest

from rlhf_train.infra.errors import ConfigError
from rlhf_train.tasks.arithmetic.generator import TEMPLATES, facts, rows, split_facts


def test_facts_by_hand():
    # operands 0..2: additions 3 x 3 = 9, subtractions with a >= b: (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) = 6
    every = facts(("+", "-"), max_operand=2)
    assert len(every) == 15 and len(set(every)) == 15
    assert ("-", 2, 1) in every and ("-", 1, 2) not in every
    assert len(facts(("+", "-"), 9)) == 100 + 55


def test_split_is_disjoint_by_fact_and_by_prompt_and_covers_every_fact():
    split = split_facts(seed=0)
    assert set(split["train"]).isdisjoint(split["test"])
    assert sorted(split["train"] + split["test"]) == sorted(facts())
    assert len(split["test"]) == round(0.25 * 155) == 39
    train, test = rows("train"), rows("test")
    assert {r["fact"] for r in train}.isdisjoint({r["fact"] for r in test})
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test})
    assert len(test) == 39 * 7 and len(train) == 116 * 7  # every fact in each of its 7 wordings


def test_seeded_and_deterministic():
    assert rows("test", seed=0) == rows("test", seed=0)
    assert rows("test", seed=0) != rows("test", seed=1)
    assert {r["fact"] for r in rows("test", seed=0)} != {r["fact"] for r in rows("test", seed=1)}


def test_every_answer_is_right():
    for r in rows("train") + rows("test"):
        a, op, b = r["fact"][0], r["fact"][1], r["fact"][2:]
        assert r["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b)), r
        assert int(r["answer"]) >= 0
        assert a in r["prompt"] and b in r["prompt"]


def test_every_wording_is_used():
    prompts = [r["prompt"] for r in rows("train")]
    assert sum("How many" in p for p in prompts) == len(prompts) // len(TEMPLATES["+"])  # one word problem per fact
    assert any(p.startswith("Subtract") for p in prompts) and any(p.endswith("= ?") for p in prompts)


@pytest.mark.parametrize("kwargs, key", [
    ({"split": "validation"}, "data.split='validation'"),
    ({"operations": ["*"]}, "data.operations"),
    ({"operations": ["+", "+"]}, "data.operations"),
    ({"max_operand": 0}, "data.max_operand=0"),
    ({"test_fraction": 1.0}, "data.test_fraction=1.0"),
])
def test_bad_options_are_one_line(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("*", r"\*")):
        rows(**kwargs)


def test_prompts_are_chat_prompts_with_answers(tiny_chat_tokenizer):
    from rlhf_train.tasks.arithmetic.prompts import arithmetic_prompts

    ds = arithmetic_prompts(tiny_chat_tokenizer, split="test", max_prompts=20, system_prompt="Answer briefly.")
    assert len(ds) == 20
    first = rows("test")[0]
    assert ds[0]["columns"] == {"answer": first["answer"], "fact": first["fact"]}
    assert ds.text[0] == f"<|system|>Answer briefly.<|user|>{first['prompt']}<|assistant|>"
    batch = ds.collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["columns"]["answer"][1] == rows("test")[1]["answer"]
    with pytest.raises(ConfigError, match="data.max_prompts=0"):
        arithmetic_prompts(tiny_chat_tokenizer, max_prompts=0)


def test_a_tokenizer_without_chat_template_gets_text_questions(tiny_chat_tokenizer):
    from rlhf_train.tasks.arithmetic.prompts import arithmetic_prompts

    tiny_chat_tokenizer.chat_template = None
    ds = arithmetic_prompts(tiny_chat_tokenizer, split="test", max_prompts=3, system_prompt="Answer briefly.")
    assert ds.text[0] == f"Answer briefly.\n\nQuestion: {rows('test')[0]['prompt']}\nAnswer:"
    assert tiny_chat_tokenizer.decode(ds[0]["input_ids"]) == ds.text[0]


@pytest.fixture
def tiny_chat_tokenizer(tmp_path):
    from tests.helpers.arithmetic import chat_tokenizer

    return chat_tokenizer(tmp_path)
