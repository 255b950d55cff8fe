"""release_freed_memory gives the pages of freed heap blocks back to the kernel (glibc's malloc_trim); release_pages
those of one tensor only (madvise)."""
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED): Linux only")
def test_release_pages_gives_back_one_tensors_pages_only():
    import torch

    from rlhf_train.infra.memory import release_pages

    keep, drop = torch.ones(16 * 2**20 // 4), torch.ones(64 * 2**20 // 4)  # 16 MB and 64 MB, both touched
    before = rss_mb()
    release_pages(drop)
    after = rss_mb()
    assert before - after > 48, (before, after)  # the 64 MB went back (less a partial page at either end)
    assert float(drop[4096:-4096].abs().sum()) == 0.0  # released pages read as zeros: only for a dying tensor
    assert float(keep.sum()) == keep.numel()  # nothing else touched


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED): Linux only")
def test_release_pages_of_an_mkl_packed_weight():
    import torch

    from rlhf_train.generation.packed_weights import packing_available
    from rlhf_train.infra.memory import release_pages

    if not packing_available():
        pytest.skip("this torch has no MKL packed linear")
    packed = torch.ops.mkl._mkl_reorder_linear_weight(torch.randn(4096, 4096), 32)  # 64 MB, opaque (no storage)
    before = rss_mb()
    release_pages(packed)
    assert before - rss_mb() > 48
