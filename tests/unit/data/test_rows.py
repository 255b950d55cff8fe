"""The prompt column's rows (``rlhf_train/data/rows.py``): text or chat decided from every row, not row 0, and
one line naming the file, the line and the fix for each kind of invalid row, raised while reading the data.

Budget: ~3 s on 2 quiet cores (tiny JSONL files, a word-level tokenizer, no model).
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.byo import chat_tokenizer

USER = {"role": "user", "content": "w4 w5"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_is_detected_from_every_row_not_row_0(tmp_path):
    """A chat dataset whose first row has an empty message list was trained as text (Python reprs)."""
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": []}, {"messages": [USER]}, {"messages": [USER]}])
    with pytest.raises(ConfigError, match=r"chat.jsonl line 1: data.prompt_column=messages is an empty message "
                                          r"list.*remove the row") as err:
        hf_prompts(chat_tokenizer(), path, eval_holdout=0)
    assert "\n" not in str(err.value)


def test_a_valid_chat_dataset_is_chat_whatever_its_first_row_holds(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    rows = [{"messages": [{"role": "system", "content": ""}, USER]}, {"messages": [USER]}]
    ds = hf_prompts(tok, write_jsonl(tmp_path / "c.jsonl", rows), eval_holdout=0)
    assert ds.text == [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]


BAD_ROWS = {  # case: (rows, the line's middle, the fix)
    "null_prompt": ([{"prompt": "w4"}, {"prompt": None}], r"line 2: data.prompt_column=prompt is null",
                    "give the row a prompt or remove it"),
    "empty_prompt": ([{"prompt": "w4"}, {"prompt": "  "}], r"line 2: data.prompt_column=prompt is empty",
                     "give the row a prompt or remove it"),
    "all_empty": ([{"prompt": ""}, {"prompt": ""}, {"prompt": ""}],
                  r"line 1: data.prompt_column=prompt is empty \(and 2 more rows\)", "give the row"),
    "null_content": ([{"messages": [USER]}, {"messages": [{"role": "user", "content": None}]}],
                     r"line 2: data.prompt_column=messages, message 1: its content is null", "content must be"),
    "int_content": ([{"messages": [USER]}, {"messages": [USER, {"role": "user", "content": 5}]}],
                    r"line 2: data.prompt_column=messages, message 2: its content is an int", "content must be"),
    "list_content": ([{"messages": [USER]}, {"messages": [{"role": "user", "content": ["w5"]}]}],
                     r"line 2: data.prompt_column=messages, message 1: its content is a list", "content must be"),
    "missing_role": ([{"messages": [USER]}, {"messages": [{"content": "w5"}]}],
                     r"line 2: data.prompt_column=messages, message 1: it has no role", 'add "role"'),
    "not_a_message": ([{"messages": [USER]}, {"messages": ["w5"]}],
                      r"line 2: data.prompt_column=messages, message 1: it is a str", "role"),
    "mixed": ([{"messages": [USER]}, {"messages": "w5"}],
              r"line 2: data.prompt_column=messages is text but line 1 is a message list", "one kind"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_an_invalid_row_is_one_line_naming_the_file_line_and_fix(tmp_path, case):
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    rows, where, fix = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        hf_prompts(chat_tokenizer(), path, eval_holdout=0)
    line = str(err.value)
    assert "\n" not in line and f"data.dataset={path}: " in line and "bad.jsonl " + where.split(":")[0] in line
    assert __import__("re").search(where, line) and fix in line, line


def test_rows_are_numbered_in_the_file_even_past_blank_lines_and_held_out_rows_count(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "w4"}\n\n{"prompt": "w5"}\n{"prompt": "w6"}\n{"prompt": null}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl line 5: data.prompt_column=prompt is null"):
        hf_prompts(chat_tokenizer(), str(path), eval_holdout=1)  # the bad row is held out for the evaluation


def test_rows_of_a_csv_and_of_a_dir_of_files_are_named_by_file_and_row(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "w4"}, {"prompt": "w5"}])
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"prompt": "w6"}, {"prompt": None}])
    with pytest.raises(ConfigError, match=r"b.jsonl line 2: data.prompt_column=prompt is null"):
        hf_prompts(chat_tokenizer(), str(tmp_path / "d"), eval_holdout=0)
    (tmp_path / "p.csv").write_text("prompt,answer\nw4,1\n,2\n")
    with pytest.raises(ConfigError, match=r"p.csv row 2 \(line 3\): data.prompt_column=prompt is null"):
        hf_prompts(chat_tokenizer(), str(tmp_path / "p.csv"), eval_holdout=0)


def test_a_prompt_with_no_tokens_is_named_with_its_row(tmp_path):
    """Prompts of characters the tokenizer drops reached the rollout as zero-length rows."""
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    tok = chat_tokenizer()
    tok.backend_tokenizer.normalizer = __import__("tokenizers").normalizers.Replace("?", "")  # '?' -> nothing
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w4"}, {"prompt": "w5"}, {"prompt": "??"}])
    with pytest.raises(ConfigError, match=r"p.jsonl line 3: data.prompt_column=prompt has no tokens"):
        hf_prompts(tok, path, eval_holdout=0, shuffle=True, seed=3)


def test_max_prompts_must_be_positive(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w4"}, {"prompt": "w5"}])
    with pytest.raises(ConfigError, match=r"data.max_prompts=0 must be positive \(or null: every prompt\)"):
        hf_prompts(chat_tokenizer(), path, eval_holdout=0, max_prompts=0)
