"""Giving the memory a finished stage freed back to the operating system.

glibc's ``malloc`` keeps the pages of freed blocks mapped for reuse: after the GGUF conversion (1.6 GB) or the
RL stage (the update's activations, GBs) the process's resident size stays at that stage's peak, and the next
stage's allocations only partly reuse the fragmented free space, so the run's peak RSS grows stage by stage.
``malloc_trim(0)`` returns the free pages to the kernel. Measured on SmolLM2-135M (one GRPO iteration of 64
rows with a LoRA adapter, ``update.micro_batch_tokens`` 1024): 2.9 GB after the iteration, 2.4 GB once its
objects are deleted and collected, 0.5 GB after the trim. Python has no portable call for it (hence ctypes);
other C libraries, or other systems, are left as they are.

:func:`release_pages` is the narrow form, for one large tensor about to be freed while the process goes on
working: only that tensor's pages go back (``madvise(MADV_DONTNEED)``), and the heap's other free pages stay
mapped for the next allocations. ``malloc_trim`` there would hand back every free page of the heap, which the
next passes then fault in again: after each generation call of a full fine-tune at SmolLM2-135M's shape, that
cost 4.2 s of a 23.2 s GRPO iteration (docs/performance.md, the packed weights under "What makes it fast").
"""
from __future__ import annotations

import ctypes
import gc
import mmap
import sys

import torch

_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


def release_freed_memory() -> None:
    """``gc.collect()``, then glibc's ``malloc_trim(0)`` on Linux (a no-op where there is no such call)."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to trim with
        pass


def release_pages(tensor: torch.Tensor) -> None:
    """Give the whole memory pages inside ``tensor``'s storage back to the kernel (Linux: ``madvise``
    ``MADV_DONTNEED``; elsewhere nothing). Call it on a CPU tensor whose storage nothing else uses, right before
    its last reference goes: the pages read as zeros afterwards. The allocator's own bookkeeping, which it writes
    when the block is freed, faults its page back in as usual; pages shared with a neighbouring block are kept."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return
    if tensor.layout == torch._mkldnn:  # an opaque oneDNN buffer (MKL's packed weights): no storage, its own pointer
        ptr, nbytes = torch.ops.mkldnn.data_ptr(tensor), tensor.numel() * tensor.element_size()
    else:
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    start = -(-ptr // page) * page  # whole pages only: round the start up, the end down
    end = (ptr + nbytes) // page * page
    if end > start:
        try:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
        except (OSError, AttributeError):  # no madvise in this C library: the pages stay until reused
            pass
