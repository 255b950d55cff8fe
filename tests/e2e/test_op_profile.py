"""``python benchmarks/op_profile.py`` at toy sizes: the op profile docs/performance.md's "Where the update goes"
reads, on the benchmark's own code path (the loop's ``step`` under ``torch.profiler``, split at the rollout).

Checked: both phases report, the kinds add up to the ops' total, the update's matmuls are found (among its largest
ops, matrix products; their GFLOP/s and the small-op share are numbers). The benchmark runs in a subprocess: it
sets the CPU defaults (environment, ``mallopt``) as a user's run does, which must not leak
into the test worker. Speed is never asserted.

Budget: ~10 s on 2 CPU cores (one start of torch + transformers, two toy iterations).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_profile_of_a_toy_iteration():
    threads = os.environ.get("OMP_NUM_THREADS", "2")  # the xdist worker's share of the cores (tests/conftest.py)
    cmd = [sys.executable, "benchmarks/op_profile.py", "--layers", "1", "--width", "32", "--heads", "2",
           "--vocab", "128", "--prompt-len", "8", "--new-tokens", "4", "--rollouts", "4", "--minibatch", "2",
           "--epochs", "1", "--threads", threads, "--top", "40"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["algorithm"] == "ppo" and out["update_gflop"] >= 0  # rounded to 0.1: ~0 at these sizes
    for phase in ("rollout", "update"):
        p = out[phase]
        assert p["wall_s"] > 0 and 0 < len(p["top_ops"]) <= 40
        assert sum(p["by_kind_s"].values()) == pytest.approx(p["ops_self_cpu_s"], abs=0.01)
        assert "matmul" in p["by_kind_s"]
    assert {"aten::mm", "aten::addmm"} & {op["op"] for op in out["update"]["top_ops"] if op["kind"] == "matmul"}
    assert out["update"]["matmul_gflop_per_s"] is not None and out["update"]["small_op_share"] > 0
