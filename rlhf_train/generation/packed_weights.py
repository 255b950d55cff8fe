"""MKL-packed weights for the decode loop's small matmuls (CPU, float32).

A decode step multiplies ``[B, H]`` rows (B = 32 at the benchmark shapes) by every linear layer's weight. MKL
runs such thin GEMMs at a fraction of its large-GEMM rate; its packed GEMM (``cblas_sgemm_pack``, reached through
``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what ``torch.compile``'s CPU freezing pass uses)
lays each weight out once for a given row count, and every step then skips that work. The results are the
same as ``nn.functional.linear``'s (tests/unit/generation/test_packed_weights.py). Measured in
``benchmarks/decode_gemm.py`` (docs/performance.md).

:func:`packed_linears` packs the ``nn.Linear`` layers of a trunk for the duration of the decode steps (weights
change with every update, so a trainable weight is packed again for every generation call: one copy, freed at
the end) and gives each layer a forward that uses its packed weight when the call has the packed row count,
``nn.functional.linear`` otherwise. It does nothing off CPU, off float32, under autocast, when grads are
enabled, or where torch was built without MKL.

Memory. A frozen weight (``requires_grad=False``: a LoRA adapter's base layer, a model loaded for evaluation)
keeps its packed copy for the trunk's next call while its storage and version counter stay the same, so a LoRA
run packs its base once; one trunk's copies are kept at a time. When kept copies are dropped (a weight changed,
or another trunk is packed: an evaluation's models) the heap is trimmed (``malloc_trim``, glibc only; ~25 ms at
SmolLM2-135M's shape): freed into glibc's heap under the tensors allocated after them, they stayed resident (the
embedded default, packing every weight anew for every call, grew from a 3.0 GB peak RSS to 7.2 GB over 20
iterations). A trainable weight's copy, packed anew for every call, is freed into the heap as it is: the
update's activations reuse that memory right after (GRPO at SmolLM2-135M's shape, full fine-tuning: peak RSS
flat at 6.4 GB over 9 iterations). Trimming after every call there handed back the free memory the next passes
reuse, and they faulted it in again: 23.2 s an iteration against 19.0 s without the trim (docs/performance.md,
the packed weights under "What makes it fast").
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import weakref
from collections.abc import Iterator

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch has MKL's packed linear ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


# Narrower layers (a LoRA adapter's rank-r A and B) are left plain: their matmuls are a rounding error of a
# step's time, and packing them anew after every update only churns the heap.
_MIN_WIDTH = 64


def _packable(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is nn.Linear and w is not None and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2 and min(w.shape) >= _MIN_WIDTH and "forward" not in m.__dict__)


# trunk -> {frozen layer: ((storage pointer, version, rows), packed weight)}: the packed copies of one trunk's
# frozen weights, kept for its next call; packing another trunk frees them (one kept set at a time)
_KEPT: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _packed_weight(layer: nn.Linear, rows: int, kept: dict) -> tuple[torch.Tensor, bool]:
    """``(packed weight for rows, whether a kept copy was dropped now)``; a frozen weight's packing is kept in
    ``kept`` and reused while the weight is unchanged."""
    w = layer.weight
    key = (w.data_ptr(), w._version, rows)
    entry = kept.get(layer)
    if entry is not None and entry[0] == key:
        return entry[1], False
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)
    if w.requires_grad:  # freed when the call ends, into the heap as it is (see the module)
        return packed, kept.pop(layer, None) is not None
    kept[layer] = (key, packed)
    return packed, entry is not None


def _trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (AttributeError, OSError):  # not glibc (musl has no malloc_trim)
            pass


class _PackedForward:
    """``layer.forward`` while packed: MKL's packed GEMM for ``rows`` rows, the layer's own forward otherwise."""

    def __init__(self, layer: nn.Linear, rows: int, kept: dict):
        self.layer, self.rows = layer, rows
        self.packed, self.fresh = _packed_weight(layer, rows, kept)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if x.numel() != self.rows * layer.in_features or x.dtype != torch.float32:
            return nn.functional.linear(x, layer.weight, layer.bias)
        out = torch.ops.mkl._mkl_linear(x.reshape(self.rows, layer.in_features), self.packed, layer.weight,
                                        layer.bias, self.rows)
        return out.view(*x.shape[:-1], layer.out_features)


@contextlib.contextmanager
def packed_linears(trunk: nn.Module, rows: int) -> Iterator[None]:
    """Within the block, the ``nn.Linear`` layers of ``trunk`` multiply ``rows``-row inputs by MKL-packed copies
    of their weights (see the module); the layers are as before when it exits."""
    layers = [] if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or not packing_available() else [
        m for m in trunk.modules() if _packable(m)]
    kept = _KEPT.get(trunk)
    fresh = False
    if layers and kept is None:
        fresh = any(_KEPT.values())  # another trunk's kept copies (if it has any) are freed
        _KEPT.clear()
        kept = _KEPT[trunk] = {}
    try:
        for m in layers:
            m.forward = _PackedForward(m, rows, kept)  # an instance attribute: shadows nn.Linear.forward until deleted
            fresh |= m.forward.fresh
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
        if fresh:  # kept copies were dropped: they lie under live tensors in the heap (see the module)
            _trim_heap()
