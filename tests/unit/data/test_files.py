"""Local data files (``rlhf_train/data/files.py``): a 0-byte file, an empty dir, bytes that are not UTF-8 and a
malformed JSON line are each one ``ConfigError`` line naming the file, the line and the fix, raised when the
data is read (before anything else reads it).

Budget: ~2 s on 2 quiet cores (tiny files, no model).
"""
from __future__ import annotations

import re

import pytest

from tests.helpers.byo import chat_tokenizer

CASES = {  # case: (files to write {name: bytes}, data.dataset, the line (regex))
    "zero_byte_jsonl": ({"z.jsonl": b""}, "z.jsonl", r"z.jsonl is empty \(0 bytes\); .*rows"),
    "zero_byte_csv": ({"z.csv": b""}, "z.csv", r"z.csv is empty \(0 bytes\)"),
    "zero_byte_in_a_dir": ({"d/a.jsonl": b'{"prompt": "w4"}\n', "d/b.jsonl": b""}, "d", r"d/b.jsonl is empty \(0 bytes\)"),
    "empty_dir": ({"e/.keep": None}, "e", r"data.dataset=\S*e: the directory holds no data files \(.json, .jsonl, .csv, "
                                           r".parquet, .arrow\); point data.dataset at"),
    "not_utf8_jsonl": ({"b.jsonl": b'{"prompt": "w4"}\n{"prompt": "w5 \xff\xfe"}\n'}, "b.jsonl",
                       r"b.jsonl line 2 is not UTF-8 \(byte 0xff at column 16\); save the file as UTF-8"),
    "not_utf8_csv": ({"b.csv": b"prompt\nw4\nw5 \xe9\n"}, "b.csv", r"b.csv line 3 is not UTF-8 \(byte 0xe9 at column 4\)"),
    "malformed_jsonl": ({"m.jsonl": b'{"prompt": "w4"}\n{"prompt": "w5"}\n\n{"prompt": w6}\n'}, "m.jsonl",
                        r"m.jsonl line 4 is not valid JSON \(Expecting value at column 12\); fix or remove that line"),
    "not_an_object": ({"o.jsonl": b'{"prompt": "w4"}\n["w5"]\n'}, "o.jsonl",
                      r"o.jsonl line 2 is not a JSON object \(a list\); each line must be one object"),
    "malformed_json_document": ({"m.json": b'[{"prompt": "w4"},\n {"prompt": "w5"}\n {"prompt": "w6"}]\n'}, "m.json",
                                r"m.json line 3 is not valid JSON \(Expecting ',' delimiter at column 2\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_file_is_one_line_naming_the_file_and_line(tmp_path, case):
    from rlhf_train.data.hf_prompts import hf_prompts
    from rlhf_train.infra.errors import ConfigError

    files, dataset, line = CASES[case]
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError) as err:
        hf_prompts(chat_tokenizer(), str(tmp_path / dataset), eval_holdout=0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"data.dataset={tmp_path / dataset}") and re.search(line, msg), msg


def test_valid_files_still_read(tmp_path):
    """UTF-8 beyond ASCII, a BOM-free JSON document and JSON lines with blank lines all read as before."""
    from rlhf_train.data.loading import load_any

    (tmp_path / "u.jsonl").write_text('{"prompt": "w4 \u00e9"}\n\n{"prompt": "w5"}\n', encoding="utf-8")
    (tmp_path / "d.json").write_text('[{"prompt": "w4"},\n {"prompt": "w5"}]\n')
    assert load_any(str(tmp_path / "u.jsonl"), "train")[0]["prompt"] == ["w4 \u00e9", "w5"]
    assert load_any(str(tmp_path / "d.json"), "train")[0]["prompt"] == ["w4", "w5"]
