"""The process-wide CPU settings of ``python -m rlhf_train`` and the ``benchmarks/`` scripts, in one place.

Read once, when torch (its OpenMP runtime, its allocator) is loaded: :func:`set_cpu_defaults` must run
before ``import torch``. This module imports nothing but ``os`` so callers can import it first. It is
called by the command-line entry point and the benchmarks, never on ``import rlhf_train``: a library
import leaves the host process's environment alone. A variable already exported wins.

* ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator backs large tensors with transparent huge pages.
  The LM head's ``[tokens, V]`` logits are hundreds of MB, allocated afresh every minibatch; with 4 KB
  pages each allocation costs ~40k page faults: 0.10 s per 160 MB on a 2-core CPU, 0.02 s with huge pages.
* ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads waiting at a barrier go to sleep instead of spinning for
  long. Every multi-threaded op ends at a barrier; on a CPU shared with other processes a thread that
  spins for milliseconds burns the time slice its partner needs: a 2-thread PPO iteration took 11-43 s
  instead of 6.5-8.6 s (load average 3.5-6 on 2 cores).
* ``GOMP_SPINCOUNT=10000``: ... but spin briefly first (GNU OpenMP, the runtime of PyPI's torch: ~0.1 ms;
  with PASSIVE alone the count is 0). A decode step or a small layer is a chain of ops of tens of
  microseconds each, and a sleeping thread takes about as long to wake: a 2-layer width-128 GPT-2
  decode step for 32 rows took 1.9 ms with sleeping threads and 0.84 ms with the short spin; one PPO
  iteration of ``benchmarks/ppo_iteration.py`` 2.41 -> 2.05 s (2 layers, width 128) and 3.79 -> 3.39 s
  (4 layers, width 256) at the same CPU time (medians of 3 interleaved runs, idle 2-core machine).
* ``MALLOC_MMAP_THRESHOLD_=33554432`` and ``MALLOC_TRIM_THRESHOLD_`` (never): glibc's malloc serves
  tensors under 32 MB (its largest threshold) from its heap and keeps freed memory mapped, instead of
  mapping every such tensor afresh (glibc's own threshold grows only to the size last freed) and
  returning the heap's top to the kernel whenever 64 MB are free there. A training step allocates its
  activations anew every pass (SmolLM2-135M's shape: ~50 KB per token and layer, GB per update), and each
  fresh page is a page fault with its zeroing: allocating and holding 120 tensors of 22 MB ([32, 112, 1536])
  took 52-63 k minor faults and 1.8-3.7 s of CPU every round with glibc's defaults, 0 faults and 0.93-1.1 s
  from the second round on with these. The cost: the process's resident memory stays at its peak (it is
  reused, not returned). glibc reads these variables when the process starts, so for the running process
  :func:`set_cpu_defaults` applies the same two settings with ``mallopt``; the variables carry them to
  child processes.
"""
from __future__ import annotations

import os

MMAP_THRESHOLD = 32 << 20   # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
NEVER_TRIM = (1 << 64) - 1   # SIZE_MAX: the heap's top is never returned
CPU_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000",
                "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(NEVER_TRIM)}
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}  # glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD


def set_cpu_defaults() -> None:
    """Sets each of :data:`CPU_DEFAULTS` that is not already in the environment (call before importing torch),
    and applies the malloc settings to this process (:func:`apply_malloc_settings`)."""
    unset = [key for key in CPU_DEFAULTS if key not in os.environ]
    for key in unset:
        os.environ[key] = CPU_DEFAULTS[key]
    apply_malloc_settings([key for key in unset if key in _MALLOPT])


def apply_malloc_settings(keys) -> bool:
    """``mallopt`` for the given ``MALLOC_*_`` keys of :data:`CPU_DEFAULTS` in this process (glibc read the
    environment when the process started; an exported variable has already been applied there). False
    where the C library is not glibc (nothing done)."""
    import ctypes

    if not keys or not hasattr(os, "confstr") or "glibc" not in (_confstr("CS_GNU_LIBC_VERSION") or ""):
        return False
    libc = ctypes.CDLL(None)
    for key in keys:  # mallopt takes an int: -1 is SIZE_MAX once glibc casts it to size_t (never trim)
        value = MMAP_THRESHOLD if key == "MALLOC_MMAP_THRESHOLD_" else -1
        libc.mallopt(_MALLOPT[key], value)
    return True


def _confstr(name: str) -> str | None:
    try:
        return os.confstr(name)
    except (ValueError, OSError):
        return None
