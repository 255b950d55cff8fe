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

glibc_only = pytest.mark.skipif("glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""),
                                reason="the malloc settings are glibc's")

# `count` tensors of `mb` MB, held and freed `rounds` times; the last round's minor page faults (fresh pages) are
# printed
ROUNDS = """
import resource, sys
if sys.argv[1] == "defaults":
    from rlhf_train.infra.cpu_defaults import set_cpu_defaults
    set_cpu_defaults()
import torch
count, floats, rounds = int(sys.argv[2]), int(sys.argv[3]) << 18, int(sys.argv[4])
faults = []
for _ in range(rounds):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(floats) for _ in range(count)]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del held
print(faults[-1])
"""


def last_round_faults(mode: str, count: int = 24, mb: int = 16, rounds: int = 2, huge_pages: bool = True) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "THP_MEM_ALLOC_ENABLE"}
    if not huge_pages:  # an exported variable wins: every fresh 4 KB page is one fault
        env["THP_MEM_ALLOC_ENABLE"] = "0"
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode, str(count), str(mb), str(rounds)], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@glibc_only
def test_freed_memory_is_reused_without_page_faults():
    # 24 tensors of 16 MB (the size of a SmolLM2-shape activation)
    plain, tuned = last_round_faults("plain"), last_round_faults("defaults")
    assert plain > 10_000  # 384 MB mapped afresh: ~100 k 4 KB pages
    # far fewer (520 on a quiet machine; up to ~10 k while other processes press on memory): the freed
    # memory is reused, not mapped afresh
    assert tuned < plain / 5


@glibc_only
def test_tensors_above_glibcs_largest_threshold_are_reused_too():
    # 4 tensors of 64 MB (an LM head's [V, N] buffer or [V, H] gradient is 100+ MB), 4 KB pages: glibc maps
    # anything over 32 MB afresh at any threshold unless MALLOC_MMAP_MAX_=0. The sixth round: glibc 2.36's
    # posix_memalign (PyTorch's CPU allocator aligns to 64 bytes) asks for a little more than the block it
    # freed, so the heap grows for two or three more rounds before each tensor finds a freed block of its size
    plain = last_round_faults("plain", count=4, mb=64, rounds=6, huge_pages=False)
    tuned = last_round_faults("defaults", count=4, mb=64, rounds=6, huge_pages=False)
    assert plain > 30_000  # 256 MB mapped afresh: ~65 k 4 KB pages
    assert tuned < plain / 5


def test_exported_variables_win(monkeypatch):
    from rlhf_train.infra.cpu_defaults import CPU_DEFAULTS, NEVER_TRIM, set_cpu_defaults

    for key in CPU_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    set_cpu_defaults()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert os.environ["MALLOC_MMAP_MAX_"] == "0"
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == str(NEVER_TRIM) == str(2**64 - 1)
