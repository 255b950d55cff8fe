"""MKL-packed weights for the decode loop's small matmuls (CPU, float32).

A decode step multiplies ``[B, H]`` rows (B = 32 at the benchmark shapes) by every linear layer's weight. MKL
runs such thin GEMMs at a fraction of its large-GEMM rate; its packed GEMM (``cblas_sgemm_pack``, reached through
``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what ``torch.compile``'s CPU freezing pass uses)
lays each weight out once for a given row count, and every step then skips that work. The results are the
same as ``nn.functional.linear``'s (tests/unit/generation/test_packed_weights.py). Measured in
``benchmarks/decode_gemm.py`` (docs/performance.md).

:func:`packed_linears` packs the ``nn.Linear`` layers of a trunk for the duration of the decode steps (weights
change with every update, so they are packed again for every generation call: one copy of the trunk's weights,
freed at the end) and gives each layer a forward that uses its packed weight when the call has the packed row
count, ``nn.functional.linear`` otherwise. It does nothing off CPU, off float32, under autocast, when grads are
enabled, or where torch was built without MKL.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch has MKL's packed linear ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _packable(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is nn.Linear and w is not None and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2 and "forward" not in m.__dict__)


class _PackedForward:
    """``layer.forward`` while packed: MKL's packed GEMM for ``rows`` rows, the layer's own forward otherwise."""

    def __init__(self, layer: nn.Linear, rows: int):
        self.layer, self.rows = layer, rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), rows)

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
    try:
        for m in layers:
            m.forward = _PackedForward(m, rows)  # an instance attribute: shadows nn.Linear.forward until deleted
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
