"""Prompt-data options for verifiable-reward training: a system prompt and few-shot examples before every
prompt (rlhf_train/data/prefix.py; chat: messages, text: a prefix), and the one line that says how many rows
the data has, how many are held out (``data.eval_holdout``) and how many are used (``data.max_prompts``).

The tokenizer's chat template inserts its own default system prompt ("w30") when the messages have none, as
SmolLM2's does ("You are a helpful AI assistant named SmolLM, trained by Hugging Face").

Budget: ~4 s on 2 quiet cores (no model runs).
"""
from __future__ import annotations

import json
import logging

import pytest

from tests.helpers.byo import chat_tokenizer

DEFAULT_SYSTEM = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system w30<|im_end|>"
                  "{% endif %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
USER = [{"role": "user", "content": "w5 w6"}]
OWN_SYSTEM = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w7"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_ds(tmp_path, **kwargs):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer(DEFAULT_SYSTEM)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": USER, "answer": "1"}, {"messages": OWN_SYSTEM, "answer": "2"}])
    return tok, hf_prompts(tok, path, eval_holdout=0, **kwargs)


def test_without_a_system_prompt_the_template_inserts_its_default(tmp_path):
    _, ds = chat_ds(tmp_path)
    assert ds.text[0] == "<|im_start|>system w30<|im_end|><|im_start|>user w5 w6<|im_end|><|im_start|>assistant"


def test_the_system_prompt_replaces_the_templates_default_and_a_rows_own_is_kept(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlhf_train.data.hf_prompts")
    tok, ds = chat_ds(tmp_path, system_prompt="w31 w32")
    assert ds.text[0] == "<|im_start|>system w31 w32<|im_end|><|im_start|>user w5 w6<|im_end|><|im_start|>assistant"
    assert ds.text[1] == "<|im_start|>system w9<|im_end|><|im_start|>user w7<|im_end|><|im_start|>assistant"
    expected = tok.apply_chat_template([{"role": "system", "content": "w31 w32"}, *USER], add_generation_prompt=True)
    assert ds[0]["input_ids"].tolist() == expected["input_ids"]
    assert ds.columns["messages"][0][0] == {"role": "system", "content": "w31 w32"}  # what the policy saw, travels
    assert "1 of 2 prompts have their own system message: kept" in caplog.text
    _, empty = chat_ds(tmp_path, system_prompt="")  # "": an empty system message, so no default either
    assert empty.text[0].startswith("<|im_start|>system <|im_end|><|im_start|>user w5 w6")


def test_few_shot_examples_are_user_assistant_turns_after_the_system_message(tmp_path):
    shots = [{"prompt": "w10 w11", "completion": "w12"}, {"prompt": "w13", "completion": "w14"}]
    tok, ds = chat_ds(tmp_path, system_prompt="w31", few_shot=shots)
    turns = "<|im_start|>user w10 w11<|im_end|><|im_start|>assistant w12<|im_end|>" \
            "<|im_start|>user w13<|im_end|><|im_start|>assistant w14<|im_end|>"
    assert ds.text[0] == f"<|im_start|>system w31<|im_end|>{turns}<|im_start|>user w5 w6<|im_end|><|im_start|>assistant"
    assert ds.text[1] == f"<|im_start|>system w9<|im_end|>{turns}<|im_start|>user w7<|im_end|><|im_start|>assistant"
    _, no_system = chat_ds(tmp_path, few_shot=shots[:1])  # no system prompt: the template's default, then the turns
    assert no_system.text[0].startswith("<|im_start|>system w30<|im_end|><|im_start|>user w10 w11<|im_end|>")


def test_text_prompts_get_a_prefix(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer(DEFAULT_SYSTEM)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w5 w6"}, {"prompt": "w7"}])
    ds = hf_prompts(tok, path, eval_holdout=0, system_prompt="w31", few_shot=[{"prompt": "w10 is", "completion": " 4"}])
    assert ds.text == ["w31\n\nw10 is 4\n\nw5 w6", "w31\n\nw10 is 4\n\nw7"]
    assert ds[1]["input_ids"].tolist() == tok("w31\n\nw10 is 4\n\nw7")["input_ids"]
    as_chat = hf_prompts(tok, path, eval_holdout=0, system_prompt="w31", text_as_chat=True)
    assert as_chat.text[1] == "<|im_start|>system w31<|im_end|><|im_start|>user w7<|im_end|><|im_start|>assistant"


@pytest.mark.parametrize("kwargs, line", [
    (dict(system_prompt=3), r"data.system_prompt=3 must be a string"),
    (dict(few_shot=[{"prompt": "w5"}]), r"data.few_shot example 1 is \{'prompt': 'w5'\}; each example is "
                                        r"\{prompt: <text>, completion: <text>\}"),
    (dict(few_shot="w5"), r"data.few_shot must be a list of \{prompt, completion\} examples, got str"),
])
def test_bad_prefix_options_are_one_line_before_any_model(tmp_path, kwargs, line):
    from rlhf_train.data.checks import check_data
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w5"}, {"prompt": "w6"}])
    with pytest.raises(ConfigError, match=line):
        check_data({"_target_": "rlhf_train.data.hf_prompts.hf_prompts", "dataset": path, **kwargs})
    with pytest.raises(ConfigError, match=line):
        hf_prompts(chat_tokenizer(), path, **kwargs)


def test_the_options_compose_as_typed_config_keys(tmp_path):
    from hydra.utils import instantiate

    from tests.helpers.reliability import make_cfg

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w5"}, {"prompt": "w6"}])
    cfg = make_cfg("data=prompts", f"data.dataset={path}", "data.eval_holdout=0", "data.system_prompt=w31",
                   "data.few_shot=[{prompt: w10, completion: ' w11'}]")
    assert cfg.data.system_prompt == "w31" and list(cfg.data.few_shot) == [{"prompt": "w10", "completion": " w11"}]
    data = {k: v for k, v in cfg.data.items() if k not in ("batch_size", "num_workers")}
    ds = instantiate(data, tokenizer=chat_tokenizer(), _convert_="all")
    assert ds.text == ["w31\n\nw10 w11\n\nw5", "w31\n\nw10 w11\n\nw6"]


# --------------------------------------------------------------------------- the rows line
def test_caps_and_hold_outs_are_logged_with_counts(tmp_path, caplog):
    """Fails on the old code: ``data.max_prompts`` and ``data.eval_holdout`` took rows without a word."""
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w5"}] * 1200)
    caplog.set_level(logging.INFO, logger="rlhf_train.data.hf_prompts")

    def line(**kwargs) -> str:
        caplog.clear()
        hf_prompts(tok, path, **kwargs)
        return "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("[data] 1,200"))

    assert line(max_prompts=256, eval_holdout=64) == (
        f"[data] 1,200 rows in {path}; holding out the last 64 for evaluation (data.eval_holdout); using 256 of the "
        f"other 1,136 (data.max_prompts=256)")
    assert line(eval_holdout=64) == (
        f"[data] 1,200 rows in {path}; holding out the last 64 for evaluation (data.eval_holdout); training on the "
        f"other 1,136")
    assert line(max_prompts=10, eval_holdout=0, shuffle=True) == (
        f"[data] 1,200 rows in {path}; none held out for evaluation (data.eval_holdout=0); using 10 (data.max_prompts=10, "
        f"after a shuffle (data.seed))")
    assert line(split="test", eval_holdout=64, max_prompts=32) == (
        f"[data] 1,200 rows in {path}; evaluating on the last 64 (held out of training by data.eval_holdout); using 32 "
        f"of them (data.max_prompts=32)")
    assert line(split="test", eval_holdout=0) == (
        f"[data] 1,200 rows in {path}; none held out (data.eval_holdout=0): evaluating on every row, the training "
        f"rows too")
