"""``set_cpu_defaults`` (rlhf_train/infra/cpu_defaults.py): the variables it exports (an exported one wins) and
glibc's malloc settings applied to the running process: memory freed by one training pass is mapped again
by the next without page faults.

Budget: ~3 s on 2 CPU cores (two small subprocesses).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# 24 tensors of 16 MB (the size of a SmolLM2-shape activation), held and freed twice; the second round's
# minor page faults (fresh pages) are printed
ROUNDS = """
import resource, sys
if sys.argv[1] == "defaults":
    from rlhf_train.infra.cpu_defaults import set_cpu_defaults
    set_cpu_defaults()
import torch
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(4 << 20) for _ in range(24)]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del held
print(faults[1])
"""


def second_round_faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif("glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""),
                    reason="the malloc settings are glibc's")
def test_freed_memory_is_reused_without_page_faults():
    plain, tuned = second_round_faults("plain"), second_round_faults("defaults")
    assert plain > 10_000  # 384 MB mapped afresh: ~100 k 4 KB pages
    # far fewer (520 on a quiet machine; up to ~10 k while other processes press on memory): the freed
    # memory is reused, not mapped afresh
    assert tuned < plain / 5


def test_exported_variables_win(monkeypatch):
    from rlhf_train.infra.cpu_defaults import CPU_DEFAULTS, NEVER_TRIM, set_cpu_defaults

    for key in CPU_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    set_cpu_defaults()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == str(NEVER_TRIM) == str(2**64 - 1)
