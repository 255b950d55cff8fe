"""The README's worked example (issue 13, item 6), as written: ``examples/byo/make_model.py`` builds a small
local policy and an HF reward model, and the README's command trains it on ``examples/byo/prompts.jsonl``
with ``examples/byo/my_reward.py`` (2 iterations here instead of 30); the exported policy then loads and
generates with plain ``transformers`` (item 5).

Budget: ~10 s on 2 quiet cores.
"""
from __future__ import annotations

import importlib.util
import math
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_command() -> list[str]:
    """The overrides of the worked example's ``python -m rlhf_train`` command in the README."""
    text = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "examples/byo/make_model.py" in b)
    command = next(c for c in block.replace("\\\n", " ").splitlines() if "python -m rlhf_train" in c)
    return shlex.split(command.split("python -m rlhf_train", 1)[1])


def test_worked_example_runs_as_written_and_the_export_generates(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, pipeline

    from rlhf_train.loop.trainer import train
    from tests.e2e.test_train import compose

    spec = importlib.util.spec_from_file_location("make_model", REPO / "examples" / "byo" / "make_model.py")
    make_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_model)
    make_model.main(tmp_path / "byo")
    monkeypatch.syspath_prepend(str(REPO / "examples" / "byo"))  # the README's PYTHONPATH=examples/byo
    monkeypatch.chdir(REPO)
    overrides = [o.replace("/tmp/byo", str(tmp_path / "byo")) for o in readme_command()]
    assert "+rewards.correct._target_=my_reward.correct" in overrides and "data=prompts" in overrides
    overrides += ["trainer.num_iterations=2", "trainer.progress_bar=false", "trainer.num_threads=1",
                  f"cache_dir={tmp_path / 'cache'}"]
    out = train(compose(overrides), run_dir=tmp_path / "run")
    m = out["metrics"]
    assert len(out["history"]) == 2 and math.isfinite(m["reward/correct"]) and math.isfinite(m["reward/reward_model"])
    assert out["run"].reward_model.reencodes  # its own tokenizer and chat template
    assert "my_reward" in sys.modules

    exported = tmp_path / "run" / "policy"
    model = AutoModelForCausalLM.from_pretrained(exported)
    tok = out["run"].tokenizer
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    generate = pipeline("text-generation", model=str(exported))
    reply = generate([{"role": "user", "content": "What is 2 + 3?"}], max_new_tokens=4, do_sample=False)
    assert reply[0]["generated_text"][-1]["role"] == "assistant"
