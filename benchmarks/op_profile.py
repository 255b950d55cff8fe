"""Where one iteration's CPU time goes, op by op: ``torch.profiler`` over the loop's own ``step``.

Builds the same run as ``benchmarks/ppo_iteration.py`` (its flags; ``--shape smollm2`` for SmolLM2-135M's shape
with ``benchmarks/compare_trl.py``'s settings), runs ``--warmup`` untimed iterations, then one more under the
profiler, split in two phases: ``rollout`` (generation, the reference's and the reward model's passes) and
``update`` (the algorithm's forward + backward passes and optimizer steps; the KL controller's step, tiny).
Prints one JSON line: per phase, its wall seconds under the profiler, the ops' self CPU seconds (the time on
the calling thread, intra-op threads included in it: a matmul on 2 threads counts its wall time once) in all
and by kind (``matmul``, ``attention``, ``elementwise``, ``reduction``, ``copy_fill``, ``optimizer``,
``other``), the ``--top`` ops, and for the update the matmuls' GFLOP/s (the update's matmul FLOPs,
``benchmarks/flops.py``, over their self seconds) beside the large-GEMM rate of the same process, and
``small_op_share``: the ops that are not matmuls, over the matmuls' seconds (what an update costs above its
matmuls). The profiler's own overhead lands on the small ops (a few µs per op): the share is an upper bound.

    python benchmarks/op_profile.py --shape smollm2 --algorithm ppo
    python benchmarks/op_profile.py --shape smollm2 --algorithm grpo
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_iteration  # noqa: E402  (sets the CPU defaults before torch is imported)

import json  # noqa: E402
import time  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

# an op's kind: aten ops by name (``aten::add_`` is ``add``, in place), the rest (e.g. ``mkl::_mkl_linear``) by a
# part of their name
KINDS = {
    "matmul": {"mm", "addmm", "bmm", "baddbmm", "matmul", "addmv", "mv", "dot"},
    "attention": {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                  "_softmax", "_softmax_backward_data"},
    "optimizer": {"_fused_adamw", "_fused_adam"},
    "reduction": {"sum", "mean", "norm", "linalg_vector_norm", "max", "amax", "logsumexp", "cumsum", "argmax", "var"},
    "copy_fill": {"copy", "zero", "fill", "clone", "cat", "index", "index_put", "scatter", "gather", "empty",
                  "_to_copy", "masked_fill", "where", "index_select", "embedding", "embedding_dense_backward",
                  "empty_strided", "resize", "_index_put_impl", "repeat_interleave", "stack"},
    "elementwise": {"mul", "add", "sub", "div", "silu", "silu_backward", "exp", "rsqrt", "pow", "neg", "log",
                    "sigmoid", "tanh", "gelu", "gelu_backward", "clamp", "sqrt", "minimum", "maximum",
                    "threshold_backward", "lerp", "reciprocal", "abs", "sgn", "_log_softmax", "clamp_min",
                    "clamp_max", "sign", "exp2", "log1p", "expm1", "eq", "ne", "lt", "gt", "le", "ge"},
}
SUBSTRINGS = {"matmul": ("mkldnn", "mkl_linear"), "attention": ("flash_attention", "scaled_dot_product"),
              "optimizer": ("_foreach_", "_fused_adam")}


def kind_of(name: str) -> str:
    op = name.removeprefix("aten::").rstrip("_") if name.startswith("aten::") else None
    for kind, names in KINDS.items():
        if op is not None and op in names:
            return kind
    for kind, parts in SUBSTRINGS.items():
        if any(part in name for part in parts):
            return kind
    return "other"


def summarize(prof, wall_s: float, top: int) -> tuple[dict, dict]:
    """Self CPU seconds of the phase's ops: in all, by kind, and the ``top`` largest (JSON fields, rounded), and
    the unrounded seconds by kind."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    by_kind: dict[str, float] = {}
    for e in events:
        kind = kind_of(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_cpu_time_total / 1e6
    ops_s = sum(by_kind.values())
    largest = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"wall_s": round(wall_s, 3), "ops_self_cpu_s": round(ops_s, 3),
            "by_kind_s": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": e.key, "kind": kind_of(e.key), "self_s": round(e.self_cpu_time_total / 1e6, 3),
                         "calls": e.count}
                        for e in largest]}, by_kind


class _PhaseSplit:
    """Stands in for ``run.rollout``: stops the rollout's profiler when the rollout returns, starts the update's."""

    def __init__(self, rollout, rollout_prof, update_prof):
        self.inner, self.profs, self.t = rollout, (rollout_prof, update_prof), [0.0, 0.0, 0.0]

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.profs[0].stop()
        self.t[1] = time.perf_counter()
        self.profs[1].start()
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main(argv=None):
    p = ppo_iteration.parser()
    p.add_argument("--top", type=int, default=12, help="the largest ops listed per phase")
    a = p.parse_args(argv)
    ppo_iteration.apply_shape(a)
    bench = ppo_iteration.benchmark_from_args(a, max_iterations=a.warmup + 1)
    for _ in range(a.warmup):
        bench.run()
    rollout_prof, update_prof = (profile(activities=[ProfilerActivity.CPU]) for _ in range(2))
    split = _PhaseSplit(bench.run_.rollout, rollout_prof, update_prof)
    bench.run_.rollout = split
    split.t[0] = time.perf_counter()
    rollout_prof.start()
    result = bench.run()
    update_prof.stop()
    split.t[2] = time.perf_counter()
    bench.run_.rollout = split.inner
    (rollout, _), (upd, kinds) = (summarize(rollout_prof, split.t[1] - split.t[0], a.top),
                                  summarize(update_prof, split.t[2] - split.t[1], a.top))
    matmul_s, ops_s = kinds.get("matmul", 0.0), sum(kinds.values())
    upd["matmul_gflop_per_s"] = round(result["update_gflop"] / matmul_s, 1) if matmul_s else None
    upd["small_op_share"] = round((ops_s - matmul_s) / matmul_s, 3) if matmul_s else None
    phases = {"rollout": rollout, "update": upd}
    print(json.dumps({"algorithm": result["algorithm"], "shape": a.shape, "threads": a.threads,
                      "gemm_gflop_per_s": result["gemm_gflop_per_s"], "update_gflop": result["update_gflop"],
                      "rollout_gflop": result["rollout_gflop"], **phases}))


if __name__ == "__main__":
    main()
