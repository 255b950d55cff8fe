"""The ``data`` group's pre-flight (``rlhf_train/data/checks.py``, run by ``check_config``): bad data is one line
before any model is built: ``data.max_prompts=0`` for every data group, and the rows of ``data=prompts``.

Budget: ~3 s on 2 quiet cores (config composition, tiny JSONL files, no model).
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.reliability import make_cfg


@pytest.mark.parametrize("data", ["data=movie_reviews", "data=synthetic"])
def test_max_prompts_zero_fails_in_check_config(data):
    """``data.max_prompts=0`` ran 1024 synthetic prompts, or failed after the models were built."""
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=r"^data.max_prompts=0 must be positive \(or null: every prompt\)$"):
        check_config(make_cfg(data, "data.max_prompts=0"))


def test_prompt_rows_are_checked_before_any_model_is_built(tmp_path, monkeypatch):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.build import build_run
    from rlhf_train.models import policy

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"messages": [{"role": "user", "content": "a"}]},
                                                            {"messages": [{"role": "user"}]}]))
    monkeypatch.setattr(policy, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    cfg = make_cfg("data=prompts", f"data.dataset={path}", "data.eval_holdout=0")
    with pytest.raises(ConfigError, match=r"chat.jsonl line 2: data.prompt_column=messages, message 1: its content "
                                          r"is null or missing; content must be a string"):
        build_run(cfg, run_dir=tmp_path / "run")


def test_prompts_without_a_dataset_is_one_line():
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=r"^data.dataset is not set: data=prompts needs data.dataset="):
        check_config(make_cfg("data=prompts"))


def test_good_prompt_data_passes(tmp_path):
    from rlhf_train.loop.checks import check_config

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"w{i}"}) + "\n" for i in range(8)))
    check_config(make_cfg("data=prompts", f"data.dataset={path}"))
