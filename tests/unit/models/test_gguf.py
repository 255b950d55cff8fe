"""The GGUF cache (``$RLHF_TRAIN_CACHE/gguf/``) on a tiny GGUF file (tests/helpers/gguf.py), never the real one.

A converted dir is sealed (size + SHA-256 of each file): a truncated, garbled, NaN-overwritten or unsealed one
is converted again with a line saying so; a GGUF whose weights hold NaN, a junk or truncated file and an
unwritable cache are one ``ConfigError`` line naming the file; the temp dir of a conversion killed with SIGKILL
is removed by the next one.

Budget: ~15 s on 2 CPU cores (about a second per conversion, one subprocess start).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_train.infra.errors import ConfigError
from tests.helpers.gguf import write_tiny_gguf

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def _weights(out: str) -> dict:
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(os.path.join(out, "model.safetensors")).items()}  # not the mmap


def _truncate(out):
    p = Path(out) / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble(out):
    (Path(out) / "config.json").write_text("{not json")


def _nan(out):  # same size, other bytes: only the checksum sees it (and the loaded weights would be NaN)
    from safetensors.torch import save_file

    weights = _weights(out)
    weights["lm_head.weight"] = torch.full_like(weights["lm_head.weight"], float("nan"))
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def _unseal(out):
    (Path(out) / "COMPLETE").unlink()


@pytest.mark.parametrize("damage", [_truncate, _garble, _nan, _unseal], ids=["truncated", "garbled", "nan", "unsealed"])
def test_a_damaged_conversion_converts_again_with_a_line(tmp_path, cache, caplog, damage):
    from rlhf_train.models.gguf import gguf_to_dir

    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = gguf_to_dir(str(src))
    first = _weights(out)
    assert gguf_to_dir(str(src)) == out and "is damaged" not in caplog.text  # an intact dir is reused
    damage(out)
    caplog.clear()
    assert gguf_to_dir(str(src)) == out
    assert f"the converted dir {out} is damaged" in caplog.text and "converting" in caplog.text
    again = _weights(out)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    from rlhf_train.models.loading import build_causal_lm

    assert build_causal_lm(str(src)).config.model_type == "llama"  # loads, finite


def test_nan_in_the_gguf_is_refused_naming_the_file(tmp_path, cache):
    from rlhf_train.models.gguf import gguf_to_dir

    src = write_tiny_gguf(tmp_path / "nan.gguf", nan_in="output.weight")
    with pytest.raises(ConfigError, match=rf"policy\.pretrained={src}: its tensor 'lm_head\.weight' holds NaN") as exc:
        gguf_to_dir(str(src))
    assert "\n" not in str(exc.value)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # nothing half-written kept


def test_junk_truncated_and_unwritable_are_one_line(tmp_path, cache, monkeypatch):
    from rlhf_train.models.gguf import gguf_to_dir

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(2048))
    with pytest.raises(ConfigError, match=rf"reward_model\.pretrained={junk} is not a GGUF file"):
        gguf_to_dir(str(junk), "reward_model.pretrained")
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ConfigError, match=rf"policy\.pretrained={cut} cannot be read as a GGUF model") as exc:
        gguf_to_dir(str(cut))
    assert "\n" not in str(exc.value)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.raises(ConfigError, match=r"the cache dir '.*a_file/cache/gguf' is not writable .*RLHF_TRAIN_CACHE"):
        gguf_to_dir(str(src))


def test_the_temp_dir_of_a_killed_conversion_is_removed(tmp_path, cache, caplog):
    """SIGKILL in the middle of a conversion leaves its temp dir; the next conversion removes it."""
    from rlhf_train.models.gguf import gguf_to_dir

    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    stall = ("import time, transformers\n"  # the conversion stalls in reading the file, its temp dir made
             "transformers.AutoTokenizer.from_pretrained = lambda *a, **k: time.sleep(600)\n"
             f"from rlhf_train.models.gguf import gguf_to_dir\ngguf_to_dir({str(src)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", stall], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 120
        while not (cache.is_dir() and any(".tmp-" in p.name for p in cache.iterdir())):
            assert proc.poll() is None and time.time() < deadline, "the conversion never started"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p for p in cache.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1 and left[0].name.startswith(".tiny-") and f".tmp-{proc.pid}-" in left[0].name
    out = gguf_to_dir(str(src))
    assert not left[0].exists() and f"removed the temp dir {left[0]}" in caplog.text
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [Path(out).name]
