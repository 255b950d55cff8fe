"""What a decode step's matmuls cost on this machine, apart from everything else the step runs.

A decode step of ``rows`` sequences multiplies a ``[rows, d]`` activation by every weight of the model once (the
trunk's q/k/v, o, gate/up and down projections of every layer, then the LM head): small-``M`` GEMMs. This
times exactly those matmuls, on weights of a shape in ``shapes.py`` (distinct tensors per layer, as in the model,
so none stays in cache), and sets them against a large GEMM's rate and the memory bandwidth (one read of all
the weights per step). One JSON line: the step's matmul seconds, its GFLOP/s, the bytes/s it streams, the
large-GEMM rate, the bandwidth, and the seconds of ``new_tokens`` steps; then the same step computed weight-major,
``(W @ xᵀ)ᵀ`` (what the decode loop does, ``rlhf_train/generation/weight_major.py``), ``step_matmul_weight_major_s``,
with ``same_numbers`` (whether both give equal results to the last bit, on the first layer's weights); and with the
trunk's weights MKL-packed for ``rows`` rows (``torch.ops.mkl._mkl_linear``), ``step_matmul_packed_s``, and the
seconds packing all of them takes, ``pack_s`` (null where torch has no MKL). The steps alternate, ``--rounds``
times; the best of each is printed.

    python benchmarks/decode_gemm.py --shape smollm2 --rows 32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402


def best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", choices=[k for k, v in SHAPES.items() if v["arch"] == "llama"])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = SHAPES[args.shape]
    d, inter, layers, vocab = s["width"], s["intermediate"], s["layers"], s["vocab"]
    kv = d // s["heads"] * s["kv_heads"]
    weights = [[torch.randn(d + 2 * kv, d), torch.randn(d, d), torch.randn(2 * inter, d), torch.randn(d, inter)]
               for _ in range(layers)]
    head = torch.randn(vocab, d)
    x, xi = torch.randn(args.rows, d), torch.randn(args.rows, inter)

    def step():
        for qkv, o, gate_up, down in weights:
            F.linear(x, qkv), F.linear(x, o), F.linear(x, gate_up), F.linear(xi, down)
        torch.mm(head, x.t())  # the LM head, vocabulary-major as the decode loop computes it

    def weight_major(x_, w):  # (W @ xᵀ)ᵀ, as rlhf_train/generation/weight_major.py computes a decode step's linear
        return torch.mm(w, x_.t()).t()

    def weight_major_step():
        for qkv, o, gate_up, down in weights:
            weight_major(x, qkv), weight_major(x, o), weight_major(x, gate_up), weight_major(xi, down)
        torch.mm(head, x.t())

    def packed_step():
        for (qkv, o, gate_up, down), (p_qkv, p_o, p_gate_up, p_down) in zip(weights, packed):
            mkl_linear(x, p_qkv, qkv), mkl_linear(x, p_o, o), mkl_linear(x, p_gate_up, gate_up)
            mkl_linear(xi, p_down, down)
        torch.mm(head, x.t())

    def pack():
        return [[torch.ops.mkl._mkl_reorder_linear_weight(w, args.rows) for w in layer] for layer in weights]

    mkl_linear = lambda x_, p, w: torch.ops.mkl._mkl_linear(x_, p, w, None, args.rows)  # noqa: E731
    has_mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    start = time.perf_counter()
    packed = pack() if has_mkl else None
    pack_s = time.perf_counter() - start if has_mkl else None
    step_s = weight_major_s = packed_s = float("inf")
    for _ in range(args.rounds):  # alternating: the machine's speed changes between them alike
        step_s, weight_major_s = min(step_s, best_of(step)), min(weight_major_s, best_of(weight_major_step))
        packed_s = min(packed_s, best_of(packed_step)) if has_mkl else packed_s
    same = all(torch.equal(F.linear(x_, w), weight_major(x_, w)) for x_, w in zip((x, x, x, xi), weights[0]))
    params = sum(w.numel() for layer in weights for w in layer) + head.numel()
    big = torch.randn(2048, 2048)
    gemm = 2 * 2048 ** 3 / best_of(lambda: big @ big) / 1e9
    a = torch.randn(256 * 1024 * 1024 // 4)  # 256 MB
    read = a.numel() * 4 / best_of(lambda: a.sum()) / 1e9
    flops = 2 * args.rows * params
    print(json.dumps(dict(shape=args.shape, rows=args.rows, threads=args.threads, step_matmul_s=round(step_s, 4),
                          step_gflop=round(flops / 1e9, 2), step_gflop_per_s=round(flops / step_s / 1e9, 1),
                          step_weight_mb=round(params * 4 / 1e6), step_gb_per_s=round(params * 4 / step_s / 1e9, 1),
                          large_gemm_gflop_per_s=round(gemm, 1), memory_read_gb_per_s=round(read, 1),
                          new_tokens=s["new_tokens"], decode_matmul_s=round(s["new_tokens"] * step_s, 2),
                          decode_matmul_at_large_gemm_rate_s=round(s["new_tokens"] * flops / gemm / 1e9, 2),
                          step_matmul_weight_major_s=round(weight_major_s, 4), same_numbers=same,
                          decode_matmul_weight_major_s=round(s["new_tokens"] * weight_major_s, 2),
                          step_matmul_packed_s=round(packed_s, 4) if has_mkl else None,
                          pack_s=round(pack_s, 3) if has_mkl else None)))


if __name__ == "__main__":
    main()
