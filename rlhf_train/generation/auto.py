"""``generation=auto``: the backend meant to generate fastest on the policy's device.

* CUDA: :class:`~rlhf_train.generation.static_cache.StaticCacheBackend` (a static KV cache, the decode
  step compiled into a CUDA graph: one launch per step instead of hundreds of small kernels);
* anything else (CPU, MPS): :class:`~rlhf_train.generation.decode_loop.DecodeLoopBackend`, rlhf_train's
  KV-cached loop (faster than ``generate`` on CPU; compiling the step takes longer than it saves there).

The CUDA choice is not yet measured on a GPU (``benchmarks/generation.py`` does; docs/performance.md,
"Generation backends"), so ``generation=decode_loop`` stays the default. Both backends give the same
tokens under greedy decoding (a test checks it on CPU) and record the sampling log-probs and values the
same way: the choice changes speed, not the run's numbers beyond rounding. ``generation=decode_loop`` /
``static_cache`` / ``hf_generate`` choose one by name.
"""
from __future__ import annotations

from rlhf_train.generation.base import GenerationBackend
from rlhf_train.generation.decode_loop import DecodeLoopBackend
from rlhf_train.generation.static_cache import StaticCacheBackend


def device_type(model) -> str:
    """``"cuda"``, ``"cpu"``, ... : where ``model``'s first parameter lives (``"cpu"`` without parameters)."""
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def auto_backend(model, *, unwrap_fn=None, **settings) -> GenerationBackend:
    """The backend for ``model``'s device (module docstring), built with the rollout's ``settings``."""
    on_cuda = device_type(unwrap_fn(model) if unwrap_fn is not None else model) == "cuda"
    return (StaticCacheBackend if on_cuda else DecodeLoopBackend)(model, unwrap_fn=unwrap_fn, **settings)
