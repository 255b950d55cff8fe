"""Damaged model dirs and caches through ``python -m rlhf_train``: one ``Error:`` line and exit 2.

A reward model with a garbled ``config.json`` (the ``reward_model`` group) or a truncated safetensors file (a
reward model listed under ``rewards.<name>``), a junk ``.gguf`` policy and an ``RLHF_TRAIN_CACHE`` that cannot be
a directory each stop the run at start, as a damaged ``policy.pretrained`` does.

Budget: ~25 s on 2 CPU cores (four starts; each imports torch and transformers; nothing trains).
"""
from __future__ import annotations

import os

import pytest

from tests.helpers.byo import chat_tokenizer, save_seq_classifier
from tests.helpers.reliability import cli

SMOKE = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "trainer.num_iterations=1"]


def _one_error_line(out, starts: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {starts}"), out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("where", ["reward_model", "rewards"])
def test_damaged_reward_model_dir_exits_2_with_one_line(tmp_path, where):
    rm = save_seq_classifier(chat_tokenizer(), tmp_path / "rm")
    if where == "reward_model":
        (rm / "config.json").write_text("{not json")
        args, key = ["reward_model=pretrained", f"reward_model.pretrained={rm}"], "reward_model.pretrained="
    else:
        data = (rm / "model.safetensors").read_bytes()
        (rm / "model.safetensors").write_bytes(data[: len(data) // 2])
        args = ["reward_model=none", "+rewards.judge._target_=rlhf_train.models.reward_model.build_reward_model",
                f"+rewards.judge.pretrained={rm}"]
        key = "rewards.judge.pretrained="
    _one_error_line(cli(*SMOKE, *args, f"hydra.run.dir={tmp_path / 'run'}", timeout=180), key)
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_junk_gguf_and_unwritable_cache_exit_2_with_one_line(tmp_path, monkeypatch):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(os.urandom(4096))
    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "cache"))
    line = _one_error_line(cli(*SMOKE, "policy=pretrained", f"policy.pretrained={junk}",
                               f"hydra.run.dir={tmp_path / 'run1'}", timeout=180), "policy.pretrained=")
    assert "not a GGUF file" in line
    (tmp_path / "a_file").write_text("")  # the cache "dir" is a file: nothing can be written under it
    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "a_file" / "cache"))
    junk.write_bytes(b"GGUF" + os.urandom(4096))  # looks like a GGUF file: the conversion needs the cache
    line = _one_error_line(cli(*SMOKE, "policy=pretrained", f"policy.pretrained={junk}",
                               f"hydra.run.dir={tmp_path / 'run2'}", timeout=180), "the cache dir")
    assert "RLHF_TRAIN_CACHE" in line
