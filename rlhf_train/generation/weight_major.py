"""The decode loop's thin matmuls computed weight-major: ``(W @ xᵀ)ᵀ`` instead of ``x @ Wᵀ`` (CPU, float32).

A decode step multiplies ``[B, H]`` rows (B = 32 at the benchmark shapes) by every linear layer's weight. MKL runs
``x @ Wᵀ`` with so few rows at about half its large-GEMM rate; the same product with the operands' roles swapped,
``W @ xᵀ`` (the weight's rows as the GEMM's long side, as the LM head's vocabulary-major logits already are), gives
the same numbers (equal to the last bit in ``benchmarks/decode_gemm.py``'s check) in less time. Measured on one
2-core AMD EPYC VM (2 threads, 2026-11-29), SmolLM2-135M's trunk (separate q/k/v/o/gate/up/down weights, 30
layers): a step's matmuls 50 ms against 66 ms at 32 rows, and 17-33 % less at 8 to 128 rows;
``decode_gemm.py`` (q/k/v and gate/up fused, the LM head included): 62 against 71 ms; the decode loop, 8 prompts ×
4 samples × 48 tokens: 4.7 against 5.5 s with MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on weights packed
for the row count, which this module replaced: on that VM it ran no faster than the plain product and packed
every trained weight anew for each generation call). The result is ``[out, B]`` read through a transposed view:
the ops after it take strided inputs as they are.

Layers narrower than ``_MIN_WIDTH`` keep ``nn.functional.linear``: at width 32 the swapped product was 6 % slower
(and GPT-2's ``Conv1D`` layers, with their bias, are not ``nn.Linear``: swapped, they ran 7-17 % slower at widths
128-256 on the same VM).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_MIN_WIDTH = 64  # the smaller side of a weight from which the swapped product pays (measured: see the module)


def _swappable(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is nn.Linear and w is not None and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2 and min(w.shape) >= _MIN_WIDTH and "forward" not in m.__dict__)


class _WeightMajorForward:
    """``layer.forward`` in the block: ``(W @ xᵀ)ᵀ`` for float32 input, the layer's own forward otherwise."""

    def __init__(self, layer: nn.Linear):
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if x.dtype != torch.float32:
            return nn.functional.linear(x, layer.weight, layer.bias)
        rows = x.reshape(-1, layer.in_features).T                                # [H_in, N]
        out = (torch.mm(layer.weight, rows) if layer.bias is None
               else torch.addmm(layer.bias[:, None], layer.weight, rows))        # [H_out, N]
        return out.T.reshape(*x.shape[:-1], layer.out_features)                  # a view: [..., H_out]


@contextlib.contextmanager
def weight_major_linears(trunk: nn.Module) -> Iterator[None]:
    """Within the block, the ``nn.Linear`` layers of ``trunk`` compute ``(W @ xᵀ)ᵀ`` (see the module); nothing
    changes off CPU, off float32, under autocast, or while gradients are recorded. The layers are as before when
    it exits."""
    layers = [] if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") else [
        m for m in trunk.modules() if _swappable(m)]
    try:
        for m in layers:
            m.forward = _WeightMajorForward(m)  # an instance attribute: shadows nn.Linear.forward until deleted
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)
