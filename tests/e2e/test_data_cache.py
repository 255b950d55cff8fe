"""``data=prompts`` keeps no copy of the user's data outside the run: loading a local prompts file (JSON lines,
CSV, Parquet, a dir of them) writes nothing under ``HOME`` or ``HF_HOME`` (``datasets``' default cache,
``~/.cache/huggingface/datasets``), nothing under ``RLHF_TRAIN_CACHE`` and leaves nothing in the temp dir.
A fresh interpreter (``datasets`` reads ``HF_HOME`` when it is imported). Budget: ~5 s on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.reliability import REPO

LOAD = """
import sys
from rlhf_train.data.loading import load_any  # what data=prompts reads its file with
for path in sys.argv[1:]:
    ds = load_any(path, "train")[0]
    assert ds["prompt"][:2] == ["hello there", "a private prompt"], ds["prompt"]
print("loaded", len(sys.argv) - 1)
"""


def test_loading_prompts_writes_nothing_under_home_hf_home_or_the_caches(tmp_path):
    import pandas as pd

    data = tmp_path / "data"
    (data / "dir").mkdir(parents=True)
    rows = [{"prompt": "hello there", "answer": "1"}, {"prompt": "a private prompt", "answer": "2"}]
    (data / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "dir" / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_csv(data / "p.csv", index=False)
    pd.DataFrame(rows).to_parquet(data / "p.parquet")
    home, hf_home, cache, tmp = (tmp_path / n for n in ("home", "hf_home", "rlhf_cache", "tmp"))
    for d in (home, hf_home, cache, tmp):
        d.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_DATASETS_CACHE", "HF_HUB_CACHE", "XDG_", "HUGGINGFACE"))}
    env.update(HOME=str(home), HF_HOME=str(hf_home), RLHF_TRAIN_CACHE=str(cache), TMPDIR=str(tmp),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    paths = [str(data / n) for n in ("p.jsonl", "p.csv", "p.parquet", "dir")]
    out = subprocess.run([sys.executable, "-c", LOAD, *paths], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "loaded 4" in out.stdout, out.stderr[-3000:]
    for d in (home, hf_home, cache, tmp):
        left = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        assert not left, f"loading the prompts wrote under {d.name}: {left[:10]}"
