"""Prompt data you bring (issue 13, item 3; item 7's data bullets): ``data=prompts`` over local files with
chat templates, columns travelling to the reward functions, per-batch padding, truncation, held-out rows,
and one line for each kind of bad input.

Budget: ~5 s on 2 quiet cores (no model runs).
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.byo import chat_tokenizer

CHATS = [[{"role": "user", "content": "w4 w5 w6"}],
         [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8"}],
         [{"role": "user", "content": "w9 w10 w11 w12 w13"}]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_jsonl_gives_exactly_the_chat_template_tokens_and_columns_travel(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m, "answer": str(i)} for i, m in enumerate(CHATS)])
    ds = hf_prompts(tok, str(path), eval_holdout=0)
    for i, m in enumerate(CHATS):
        expected = tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"]
        assert ds[i]["input_ids"].tolist() == expected
    batch = ds.collate([ds[0], ds[1]])  # padded to the longer of these two, not to the dataset's longest
    lengths = [len(tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"]) for m in CHATS]
    assert batch["input_ids"].shape == (2, max(lengths[:2])) and ds.prompt_width == max(lengths)
    assert batch["attention_mask"].sum(-1).tolist() == lengths[:2]
    assert batch["input_ids"][1, 0] == tok.pad_token_id if lengths[1] < lengths[0] else True  # left padding
    assert batch["columns"]["answer"] == ["0", "1"] and batch["columns"]["messages"] == CHATS[:2]


def test_text_prompts_as_chat(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w4 w5"}, {"prompt": "w6"}])
    ds = hf_prompts(tok, str(path), text_as_chat=True, eval_holdout=0)
    assert ds[1]["input_ids"].tolist() == tok.apply_chat_template(
        [{"role": "user", "content": "w6"}], add_generation_prompt=True)["input_ids"]


def test_columns_are_repeated_for_each_sample():
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    rollout = RolloutFromModel.__new__(RolloutFromModel)  # columns() reads nothing of the instance
    cols = rollout.columns({"columns": {"answer": ["a", "b"]}}, 6)
    assert cols == {"answer": ["a", "a", "a", "b", "b", "b"]}


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "save_to_disk"])
def test_plain_prompts_from_every_local_format_without_a_label_column(tmp_path, fmt):
    import datasets

    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    rows = {"prompt": ["w4 w5", "w6", "w7 w8 w9", "w10"], "answer": ["1", "2", "3", "4"]}
    d = datasets.Dataset.from_dict(rows)
    path = tmp_path / f"data.{fmt}"
    {"jsonl": lambda: d.to_json(str(path)), "json": lambda: path.write_text(json.dumps(
        [dict(zip(rows, v)) for v in zip(*rows.values())])), "csv": lambda: d.to_csv(str(path)),
     "parquet": lambda: d.to_parquet(str(path)), "save_to_disk": lambda: d.save_to_disk(str(path))}[fmt]()
    ds = hf_prompts(tok, str(path), eval_holdout=0)
    assert [tok.decode(ds[i]["input_ids"]) for i in range(4)] == rows["prompt"]
    assert [str(a) for a in ds.columns["answer"]] == rows["answer"]  # (CSV reads numbers back as numbers)


def test_long_prompts_are_dropped_or_cut_from_the_left_and_counted(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in ["w4 w5 w6 w7", "w8", "w9 w10 w11"]])
    dropped = hf_prompts(tok, str(path), max_prompt_tokens=3, eval_holdout=0)
    assert len(dropped) == 2 and dropped.num_truncated == 1
    cut = hf_prompts(tok, str(path), max_prompt_tokens=3, truncation="left", eval_holdout=0)
    assert len(cut) == 3 and tok.decode(cut[0]["input_ids"]) == "w5 w6 w7"


def test_a_dataset_without_splits_holds_out_evaluation_rows(tmp_path):
    from rlhf_train.data.hf_prompts import hf_prompts

    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"w{i}"} for i in range(4, 14)])
    train = hf_prompts(tok, str(path), eval_holdout=3)
    test = hf_prompts(tok, str(path), split="test", eval_holdout=3)
    assert len(train) == 7 and len(test) == 3
    seen = {tuple(train[i]["input_ids"].tolist()) for i in range(7)}
    assert not seen & {tuple(test[i]["input_ids"].tolist()) for i in range(3)}


def test_tldr_data_reads_a_jsonl_file_and_holds_out(tmp_path):
    """Item 7: ``data.dataset=<a .jsonl file>`` answered "Couldn't find any data file" for a file that exists."""
    from rlhf_train.data.prompts import tldr_prompts

    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "tldr.jsonl", [{"prompt": f"w{i} w5", "label": " w6"} for i in range(4, 14)])
    assert len(tldr_prompts(tok, str(path))) == 5 and len(tldr_prompts(tok, str(path), split="valid")) == 5


@pytest.mark.parametrize("case, line", [
    ("missing_file", r"data.dataset=.*nope.jsonl: no such file or directory"),
    ("missing_column", r"has no column 'text' \(has \['prompt'\]\); set data.prompt_column"),
    ("empty", r"has no rows"),
    ("no_template", r"holds chat messages but the tokenizer has no chat template"),
    ("all_too_long", r"every prompt is longer than data.max_prompt_tokens=1"),
])
def test_bad_data_gives_one_line(tmp_path, case, line):
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    tok = chat_tokenizer()
    plain = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w4 w5"}, {"prompt": "w6 w7"}])
    kwargs = {"missing_file": dict(dataset=str(tmp_path / "nope.jsonl")),
              "missing_column": dict(dataset=str(plain), prompt_column="text"),
              "empty": dict(dataset=str(tmp_path / "e.csv")),
              "no_template": dict(dataset=str(write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}]))),
              "all_too_long": dict(dataset=str(plain), max_prompt_tokens=1)}[case]
    if case == "empty":
        (tmp_path / "e.csv").write_text("prompt\n")
    if case == "no_template":
        tok.chat_template = None
    with pytest.raises(ConfigError, match=line):
        hf_prompts(tok, eval_holdout=0, **kwargs)


def test_multiple_eos_ids_end_the_response_at_the_first_of_any():
    from rlhf_train.core.containers import response_mask_from_tokens

    response = torch.tensor([[5, 3, 6, 0], [5, 6, 0, 3], [5, 6, 7, 8]])
    # by hand: row 0 ends at the <|im_end|> (3) at position 1, row 1 at the <|endoftext|> (0) at 2, row 2 never
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(response_mask_from_tokens(response, (0, 3)), expected)
    assert torch.equal(response_mask_from_tokens(response, 0), torch.tensor(
        [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))


@pytest.mark.parametrize("column", ["prompt", "label"])
def test_tldr_null_rows_are_one_line_naming_the_line(tmp_path, column):
    """A null TL;DR prompt or label was a TypeError traceback from the tokenizer (or ``None + str``)."""
    from rlhf_train.data.prompts import tldr_prompts
    from rlhf_train.infra.errors import ConfigError

    rows = [{"prompt": f"w{i} w5", "label": " w6"} for i in range(4, 10)]
    rows[2][column] = None
    path = write_jsonl(tmp_path / "tldr.jsonl", rows)
    with pytest.raises(ConfigError, match=rf"tldr.jsonl line 3: column '{column}' is null; give the row"):
        tldr_prompts(chat_tokenizer(), str(path))
