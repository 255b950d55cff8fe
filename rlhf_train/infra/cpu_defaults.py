"""The process-wide CPU settings of ``python -m rlhf_train`` and the ``benchmarks/`` scripts, in one place.

Read once, when torch (its OpenMP runtime, its allocator) is loaded: :func:`set_cpu_defaults` must run
before ``import torch``. This module imports nothing but ``os`` so callers can import it first. It is
called by the command-line entry point and the benchmarks, never on ``import rlhf_train``: a library
import leaves the host process's environment alone. A variable already exported wins.

* ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator backs large tensors with transparent huge pages.
  The LM head's ``[tokens, V]`` logits are hundreds of MB, allocated afresh every minibatch; with 4 KB
  pages each allocation costs ~40k page faults: 0.10 s per 160 MB on a 2-core CPU, 0.02 s with huge pages.
* The OpenMP wait policy is left to GNU OpenMP (the runtime of PyPI's torch), as in any PyTorch program: a
  thread that reaches the barrier every multi-threaded op ends at spins for a while (libgomp's 300,000 turns)
  before it sleeps. Spinning keeps the core awake between the tens-of-microseconds ops of a decode step or a
  small layer; on a virtual machine whose host deschedules idle vCPUs a sleeping thread can take milliseconds
  to wake. Measured 2026-11-29 on the 2-core VM (interleaved runs): one GRPO iteration of
  ``benchmarks/ppo_iteration.py --shape smollm2 --algorithm grpo`` took 31.4-36.6 s with libgomp's default
  and 31.0-32.1 s with ``OMP_WAIT_POLICY=ACTIVE``, against 38.1-69.0 s with ``OMP_WAIT_POLICY=PASSIVE
  GOMP_SPINCOUNT=10000`` (threads that sleep after ~0.1 ms; its generation 16-17 s against 9 s). Where
  several processes share the cores (two PPO runs at ``--shape gpt2_2``, 2 threads each on 2 cores) the
  spinning threads burn the time slices the others need: 20-28 s per iteration spinning against 14.5-15.0 s
  sleeping. So export ``OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000`` on a machine you share, or give each
  process fewer threads (``trainer.num_threads``).
* ``MALLOC_MMAP_THRESHOLD_=33554432``, ``MALLOC_MMAP_MAX_=0`` and ``MALLOC_TRIM_THRESHOLD_`` (never): glibc's
  malloc serves every tensor from its heap and keeps freed memory mapped, instead of mapping each large
  tensor afresh (above its threshold, which grows only to the size last freed and never past 32 MB) and
  returning the heap's top to the kernel whenever 64 MB are free there. A training step allocates its
  activations anew every pass (SmolLM2-135M's shape: ~50 KB per token and layer, GB per update), and each
  fresh page is a page fault with its zeroing: allocating and holding 120 tensors of 22 MB ([32, 112, 1536])
  took 52-63 k minor faults and 1.8-3.7 s of CPU every round with glibc's defaults, 0 faults and 0.93-1.1 s
  from the second round on with the threshold and the trim setting. ``MALLOC_MMAP_MAX_=0`` (no mapping
  of its own for any size) does the same for the update's tensors of 32 MB and more, which glibc maps
  afresh at any threshold: the LM head's ``[V, N]`` buffer (144 MB per micro-batch at SmolLM2's shape) and
  the ``[V, H]`` gradients (108 MB). Measured 2026-11-30 on the 2-core VM, ``benchmarks/ppo_iteration.py
  --shape smollm2 --algorithm grpo --repeats 3``, two alternating rounds: update 8.71 and 8.68 s with it
  against 9.02 and 9.26 s without, peak RSS 5.94 / 5.91 against 5.85 / 5.91 GB; ``--algorithm ppo``: update
  39.7 and 38.0 s against 40.2 and 40.2 s, peak RSS 5.93 / 6.09 against 5.96 / 5.87 GB. The cost: the process's
  resident memory stays at its peak (it is reused, not returned; :func:`rlhf_train.infra.memory.release_freed_memory`
  gives it back between a pipeline's stages). glibc reads these variables when the process starts, so for
  the running process :func:`set_cpu_defaults` applies the same settings with ``mallopt``; the variables
  carry them to child processes.
"""
from __future__ import annotations

import os

MMAP_THRESHOLD = 32 << 20   # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
NEVER_TRIM = (1 << 64) - 1   # SIZE_MAX: the heap's top is never returned
CPU_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(NEVER_TRIM)}
# glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX and the value each is given here
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": (-1, -1), "MALLOC_MMAP_THRESHOLD_": (-3, MMAP_THRESHOLD),
            "MALLOC_MMAP_MAX_": (-4, 0)}


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
        libc.mallopt(*_MALLOPT[key])
    return True


def _confstr(name: str) -> str | None:
    try:
        return os.confstr(name)
    except (ValueError, OSError):
        return None
