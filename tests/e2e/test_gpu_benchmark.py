"""``python benchmarks/gpu.py --device cpu --tiny``: the GPU benchmark's own code path, at toy sizes on a CPU.

One subprocess (the benchmark sets its CPU defaults before torch is imported, as a user runs it) builds
SmolLM2's architecture (Llama, grouped-query attention, tied head) at toy sizes for PPO and GRPO, full and
LoRA, fp32 and bf16 (8 rows) through the trainer's ``build_run`` + ``step``, and prints one JSON object. Checked: every row ran (no ``error``), carries the
fields ``docs/performance.md``'s GPU table reads, its step split adds up to the iteration, the phases that
must run did (a reference pass for PPO and GRPO, a policy scoring pass under mixed precision and LoRA), and
MFU is null on a CPU. Speed is never asserted.

Budget: ~15 s on 2 quiet CPU cores (one start of torch + transformers, 8 one-iteration toy runs).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"model", "algorithm", "mode", "dtype", "params_m", "trainable_m", "rows", "prompt_width",
            "response_tokens", "iteration_s", "split_s", "gen_tok_per_s", "trained_tok_per_s",
            "iteration_tok_per_s", "tflop_per_iteration", "mfu", "mfu_generate", "mfu_update", "mfu_peak",
            "matmul_dtypes", "first_ratio", "finite_loss", "skipped_updates", "peak_rss_mib", "wall_s"}
PHASES = {"generate", "policy_score", "reference", "reward", "update", "other"}


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # the worker's share of the cores (tests/conftest.py), not the benchmark's 2 threads: OpenMP threads spin
    # before they sleep, and two of them beside another worker would fight it for the cores
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--tiny", "--threads", threads],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_combination_runs_and_reports(result):
    assert result["machine"]["device"] == "cpu"
    assert {"torch", "transformers", "float32_matmul_precision"} <= set(result["machine"])
    rows = result["rows"]
    assert {(r["model"], r["algorithm"], r["mode"], r["dtype"]) for r in rows} == {
        ("smollm2_135m", a, mode, d) for a in ("ppo", "grpo") for mode in ("full", "lora") for d in ("fp32", "bf16")}
    for r in rows:
        assert "error" not in r, r
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert set(r["split_s"]) == PHASES
        assert sum(r["split_s"].values()) == pytest.approx(r["iteration_s"], abs=1e-3)
        assert r["mfu"] is None and r["mfu_update"] is None  # no peak FLOP/s for a CPU
        assert r["response_tokens"] > 0 and r["gen_tok_per_s"] > 0 and r["trained_tok_per_s"] > 0
        assert r["finite_loss"] and r["first_ratio"] == pytest.approx(1.0, abs=1e-4)


def test_the_phases_that_must_run_did(result):
    for r in result["rows"]:
        split = r["split_s"]
        assert split["generate"] > 0 and split["update"] > 0 and split["reward"] > 0
        assert split["reference"] > 0  # PPO's KL in the reward, GRPO's beta 0.04 in the loss
        # the policy's own scoring pass: only when the log-probs cannot come from the generation steps
        assert (split["policy_score"] > 0) == (r["dtype"] == "bf16" or r["mode"] == "lora"), r
        assert (r["trainable_m"] < r["params_m"]) == (r["mode"] == "lora")
        if r["dtype"] == "bf16":  # Accelerate's autocast reaches the update's matmuls
            assert r["matmul_dtypes"]["update"] == ["bfloat16"]
