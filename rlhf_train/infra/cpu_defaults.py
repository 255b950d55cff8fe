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
"""
from __future__ import annotations

import os

CPU_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def set_cpu_defaults() -> None:
    """Sets each of :data:`CPU_DEFAULTS` that is not already in the environment (call before importing torch)."""
    for key, value in CPU_DEFAULTS.items():
        os.environ.setdefault(key, value)
