"""The stage cache (``${cache_dir}/stages/``): an entry is sealed (size + SHA-256 of each file) and checked on
reuse; a truncated, changed, missing or unsealed one is removed with a line and the stage is built again; the
temp dir of a build killed with SIGKILL is removed by the next build; an unwritable cache is one line.

Budget: ~5 s on 2 CPU cores (one subprocess start).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_train.infra.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _build(calls):
    def build(d: Path) -> dict:
        calls.append(d)
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (d / "sub").mkdir()
        (d / "sub" / "config.json").write_text('{"a": 1}')
        return {"value": len(calls)}
    return build


def _same_size_other_bytes(entry: Path):
    p = entry / "model.safetensors"
    p.write_bytes(b"\0" * p.stat().st_size)


DAMAGES = {
    "truncated": lambda e: (e / "model.safetensors").write_bytes(b"x"),
    "changed": _same_size_other_bytes,
    "missing": lambda e: (e / "sub" / "config.json").unlink(),
    "garbled_info": lambda e: (e / "stage.json").write_text("{"),
    "unsealed": lambda e: (e / "COMPLETE").write_text("2025-01-01 12:00:00\n"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_stage_is_built_again_with_a_line(tmp_path, caplog, damage):
    from rlhf_train.pipeline.cache import cached_stage, is_complete

    entry, calls = tmp_path / "stages" / "rm-abc", []
    assert cached_stage(entry, _build(calls)) == ({"value": 1}, False)
    assert is_complete(entry) and cached_stage(entry, _build(calls)) == ({"value": 1}, True) and len(calls) == 1
    DAMAGES[damage](entry)
    assert not is_complete(entry)  # the plan sees it as missing: the stage runs again
    assert f"the cached stage {entry} is damaged" in caplog.text and "the stage runs again" in caplog.text
    assert not entry.exists()
    assert cached_stage(entry, _build(calls)) == ({"value": 2}, False)
    assert is_complete(entry) and json.loads((entry / "stage.json").read_text()) == {"value": 2}


def test_the_temp_dir_of_a_killed_build_is_removed(tmp_path, caplog):
    stages = tmp_path / "stages"
    stall = ("import time\nfrom pathlib import Path\nfrom rlhf_train.pipeline.cache import cached_stage\n"
             f"cached_stage(Path({str(stages / 'sft-abc')!r}), lambda d: time.sleep(600))\n")
    proc = subprocess.Popen([sys.executable, "-c", stall], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 120
        while not (stages.is_dir() and any(".tmp-" in p.name for p in stages.iterdir())):
            assert proc.poll() is None and time.time() < deadline, "the build never started"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p for p in stages.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1
    from rlhf_train.pipeline.cache import cached_stage

    assert cached_stage(stages / "rm-def", _build([]))[1] is False  # any later build in the same cache cleans up
    assert not left[0].exists() and "removed the temp dir" in caplog.text
    assert sorted(p.name for p in stages.iterdir() if not p.name.endswith(".lock")) == ["rm-def"]


def test_an_unwritable_stage_cache_is_one_line(tmp_path):
    from rlhf_train.pipeline.cache import cached_stage

    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"the stage cache dir '.*a_file/stages' is not writable \(.*\); set "
                                          r"RLHF_TRAIN_CACHE \(or cache_dir=\)") as exc:
        cached_stage(tmp_path / "a_file" / "stages" / "sft-abc", _build([]))
    assert "\n" not in str(exc.value)
