"""release_freed_memory gives the pages of freed heap blocks back to the kernel (glibc's malloc_trim)."""
from __future__ import annotations

import os
import sys

import pytest

from rlhf_train.infra.memory import release_freed_memory


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_freed_heap_pages_go_back_to_the_kernel():
    # 300 MB in 4 KiB blocks (malloc's heap, not mmap); one block in 64 kept, so free() alone cannot shrink the
    # heap from its top and the freed pages stay resident until trimmed
    blocks = [bytearray(4096) for _ in range(75_000)]
    keep = blocks[::64]
    del blocks
    before = rss_mb()
    release_freed_memory()
    after = rss_mb()
    assert before - after > 100, (before, after)
    assert len(keep) == 1172


def test_release_is_safe_to_call_twice():
    release_freed_memory()
    release_freed_memory()
