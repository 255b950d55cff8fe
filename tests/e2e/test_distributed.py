"""Multi-process correctness on CPU: ``accelerate launch --multi_gpu --num_processes 2 -m rlhf_train``.

Without GPUs the trainer forms a gloo process group, so the whole data-parallel path (sharded prompts,
DDP gradient averaging, all-reduced advantage statistics and metrics, gathered KLs, rank-0-only
logging and checkpoints, shared run dir) runs on any machine. ``tests/helpers/dist_worker.py`` runs
``python -m rlhf_train`` exactly, with read-only probes that dump what each process saw.

Budget: ~1-1.5 min on 2 idle cores (one 2-process run, one 1-process run; each is a smoke run with a
handful of prompts). Both subprocesses have a hard timeout, so a hang fails the test instead of CI.
"""
from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.ports import with_free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "helpers" / "dist_worker.py")
TIMEOUT_S = 300
# the launch command of the README, minus `-m rlhf_train` (the worker runs that module itself)
LAUNCH_2 = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
# small, deterministic runs: greedy decoding, one PPO epoch with the whole batch as the minibatch
COMMON = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "rollout.do_sample=false",
          "update.num_epochs=1", "scheduler=linear", "rollout.max_new_tokens=8"]


def run(cmd: list[str], cwd: Path, dump: Path, cache: Path) -> subprocess.CompletedProcess:
    cmd = with_free_port(cmd)
    env = {**os.environ, "RLHF_TEST_DUMP_DIR": str(dump), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "RLHF_TRAIN_CACHE": str(cache)}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(cmd[-8:])}` did not finish in {TIMEOUT_S} s (hang?)\n{out[-3000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-5000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An empty tokenizer cache: both processes of the first run train the tokenizer at once (a race)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, cache):
    """2 processes × 4 prompts, 2 iterations, in a fresh dir, with Hydra's default (timestamped) run dir."""
    cwd = tmp_path_factory.mktemp("two")
    run([*LAUNCH_2, WORKER, *COMMON, "data.batch_size=4", "update.minibatch_size=4"], cwd, cwd / "dump", cache)
    ranks = [torch.load(cwd / "dump" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return cwd, ranks


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, cache, two_process_run):
    """1 process × 8 prompts (the same global batch), 1 iteration, 2 accumulation micro-batches of 4."""
    cwd = tmp_path_factory.mktemp("one")
    run([sys.executable, WORKER, *COMMON, "data.batch_size=8", "update.minibatch_size=8",
         "update.gradient_accumulation_steps=2", "trainer.num_iterations=1", f"hydra.run.dir={cwd / 'run'}"],
        cwd, cwd / "dump", cache)
    return torch.load(cwd / "dump" / "rank0.pt", weights_only=False)


@pytest.mark.slow
def test_two_processes_train_in_step(two_process_run):
    cwd, ranks = two_process_run
    assert [r["num_processes"] for r in ranks] == [2, 2], "the processes did not form a process group"
    # parameters identical on both ranks after training (and training changed them)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    # each rank draws its own prompts: global batch = 2 × per-process batch, no prompt twice
    for it in range(2):
        p0, p1 = ranks[0]["prompts"][it], ranks[1]["prompts"][it]
        assert len(p0) == len(p1) == 4
        assert len(set(p0.tolist()) | set(p1.tolist())) == 8
    # logged metrics are means over the ranks (which saw different data)
    for it in range(2):
        l0, l1 = ranks[0]["local_metrics"][it], ranks[1]["local_metrics"][it]
        reduced = ranks[0]["reduced_metrics"][it]
        assert reduced == ranks[1]["reduced_metrics"][it]
        for key in ("objective/score", "objective/reward_total", "loss/value", "response/length"):
            assert math.isclose(reduced[key], (l0[key] + l1[key]) / 2, rel_tol=1e-5, abs_tol=1e-6), key
    assert ranks[0]["local_metrics"][0]["objective/score"] != ranks[1]["local_metrics"][0]["objective/score"]
    # the LR schedule counts optimizer updates, not num_processes × updates: half-way after 1 of 2
    assert math.isclose(ranks[0]["reduced_metrics"][0]["lr"], 0.5e-4, rel_tol=1e-6)


@pytest.mark.slow
def test_two_processes_write_one_run_dir(two_process_run):
    cwd, ranks = two_process_run
    # both processes agreed on Hydra's timestamped run dir; only rank 0 wrote logs
    run_dirs = list((cwd / "outputs" / "smoke").iterdir())
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    assert [p.relative_to(cwd) for p in cwd.rglob("metrics.csv")] == [run_dir.relative_to(cwd) / "metrics.csv"]
    assert "job_logging" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    for row, reduced in zip(rows, ranks[0]["reduced_metrics"]):
        assert math.isclose(float(row["objective/score"]), reduced["objective/score"], rel_tol=1e-6)
    # one set of checkpoints, each complete, with both ranks' RNG states and no leftovers
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["iter_000001", "iter_000002"]
    for name in ckpts:
        files = {p.name for p in (run_dir / "checkpoints" / name).iterdir()}
        assert {"COMPLETE", "policy", "rng_rank0.pt", "rng_rank1.pt", "optimizer.pt"} <= files
    assert len(list(cwd.rglob("checkpoints"))) == 1


@pytest.mark.slow
def test_two_processes_share_one_tokenizer_cache_entry(two_process_run, cache):
    """Both processes trained the tokenizer into an empty cache at once: one entry, no half-written ones."""
    entries = sorted(p.name for p in cache.iterdir())
    assert len([e for e in entries if e.startswith("tokenizer-")]) == 1, entries
    assert not [e for e in entries if e.startswith(".tokenizer-")], entries


@pytest.mark.slow
def test_two_processes_give_the_gradient_of_one(two_process_run, one_process_run):
    """Greedy rollouts: 2 processes × 4 prompts and 1 process × 8 prompts (as 2 accumulation steps of 4)
    take the same first update: same prompts, same global advantage whitening, same token-mean loss."""
    _, ranks = two_process_run
    one = one_process_run
    assert sorted(one["prompts"][0].tolist()) == sorted(ranks[0]["prompts"][0].tolist() + ranks[1]["prompts"][0].tolist())
    g2, g1 = ranks[0]["first_grad"], one["first_grad"]
    assert len(g1) == len(g2)
    for a, b in zip(ranks[1]["first_grad"], g2):  # DDP left the same averaged gradient on both ranks
        assert torch.equal(a, b)
    flat1 = torch.cat([g.reshape(-1) for g in g1])
    flat2 = torch.cat([g.reshape(-1) for g in g2])
    assert flat1.abs().max() > 0
    torch.testing.assert_close(flat2, flat1, rtol=1e-4, atol=1e-6 * float(flat1.abs().max()))


def test_non_main_processes_write_nothing_through_hydra(monkeypatch):
    from rlhf_train.__main__ import non_main_process_overrides

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert non_main_process_overrides(["+recipe=smoke"]) == []
    monkeypatch.setenv("RANK", "1")
    assert non_main_process_overrides(["+recipe=smoke"]) == ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    assert non_main_process_overrides(["hydra/job_logging=none"]) == ["hydra.output_subdir=null"]


def test_launch_time_is_shared_by_the_processes_of_a_launch(monkeypatch):
    """Under a launcher every process reads the launcher's start time, so Hydra's run dirs agree."""
    import psutil

    from rlhf_train.config.schema import launch_time

    monkeypatch.setenv("LOCAL_RANK", "1")
    started = psutil.Process(os.getppid()).create_time()
    from datetime import datetime

    assert launch_time("%Y-%m-%d_%H-%M-%S") == datetime.fromtimestamp(started).strftime("%Y-%m-%d_%H-%M-%S")


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu", "fsdp", "deepspeed_zero2", "cpu_2proc"])
def test_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "accelerate" / f"{name}.yaml"))
    assert cfg.num_machines == 1
    if name == "fsdp":
        assert cfg.fsdp_config["fsdp_version"] == 1
    if name == "deepspeed_zero2":
        assert cfg.deepspeed_config["zero_stage"] == 2


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state (precision included): start and leave it clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.slow
def test_bf16_keeps_log_probs_and_kl_fp32_with_models_placed_on_cpu(tmp_path, monkeypatch, fresh_accelerate_state):
    """bf16 autocast through Accelerate; reference and reward model placed with ``*.device=cpu``."""
    from hydra import compose, initialize_config_dir

    from rlhf_train.config.schema import register_configs
    from rlhf_train.loop.trainer import train
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "+recipe=smoke", "logger=none", "trainer.progress_bar=false", "trainer.num_iterations=1",
            "trainer.precision=bf16", "ref_model.device=cpu", "reward_model.device=cpu",
            "rollout.max_new_tokens=8"])
    seen = []
    rollout_call = RolloutFromModel.__call__
    monkeypatch.setattr(RolloutFromModel, "__call__",
                        lambda self, batch, *a, **k: seen.append(rollout_call(self, batch, *a, **k)) or seen[-1])
    out = train(cfg, tmp_path)
    ro = seen[0]
    for name in ("sample_log_prob", "sampler_log_prob", "ref_log_prob", "kl", "values", "reward", "kl_per_sequence"):
        assert getattr(ro, name).dtype == torch.float32, name
    ref_model = out["rollout"].reference.model
    assert next(ref_model.parameters()).device.type == "cpu"
    assert next(out["run"].reward_model.parameters()).device.type == "cpu"
    assert next(ref_model.parameters()).dtype == torch.float32  # autocast, not a bf16 copy
    # the reference runs under the policy's autocast: π_ref = initial policy gives KL 0 and ratio 1
    assert out["history"][0]["objective/kl"] == 0.0
    assert out["history"][0]["val/first_ratio"] == 1.0
