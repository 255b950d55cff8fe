"""Bad data through ``python -m rlhf_train``: one ``Error:`` line naming the file, the line and the fix, exit 2,
before any model is built, no run dir left behind (``rlhf_train/data/checks.py`` via ``check_config``).

Budget: ~15 s on 2 cores (three starts of the CLI, each importing torch and transformers; no model is built).
"""
from __future__ import annotations

import json
import re

import pytest

from tests.helpers.reliability import cli

CASES = {  # case: (file name, its rows, extra overrides, the error line's tail, a regex)
    "chat_row_0_empty": ("chat.jsonl", [{"messages": []}] + [{"messages": [{"role": "user", "content": "a b"}]}] * 19, [],
                         r"chat.jsonl line 1: data.prompt_column=messages is an empty message list; give it at least "
                         r"one \{role, content\} message or remove the row"),
    "malformed_jsonl": ("m.jsonl", ['{"prompt": "a"}', '{"prompt": "b",}'], [],
                        r"m.jsonl line 2 is not valid JSON \(.+ at column 1[56]\); fix or remove that line"),
    "max_prompts_0": ("p.jsonl", [{"prompt": "a"}, {"prompt": "b"}], ["data.max_prompts=0"],
                      r"Error: data.max_prompts=0 must be positive \(or null: every prompt\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_is_one_error_line_and_exit_2(tmp_path, case):
    name, rows, extra, tail = CASES[case]
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = cli("+recipe=smoke", "logger=none", "data=prompts", f"data.dataset={path}", f"hydra.run.dir={run_dir}",
               f"cache_dir={tmp_path / 'cache'}", *extra, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(tail + "$", errors[0]), errors[0]
    assert not run_dir.exists() and not (tmp_path / "cache").exists()  # nothing built, nothing left
