"""Exact resume, preemption, atomic checkpoints, and what checkpoints may contain (issue 7).

Budget: ~25 s in-process + ~35 s for the two subprocess tests (marked slow) on a quiet 2-core machine.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import zygote
from tests.helpers.reliability import FAST, REPO, files_of, make_cfg, tiny_policy

SECRET = "sk-test-0123456789abcdef-secret"


# --------------------------------------------------------------------------------------------
# metrics.csv: reproducible (no timings), full precision, truncated to the checkpoint on resume
# --------------------------------------------------------------------------------------------
def test_csv_logger_full_precision_timings_apart_and_resume_truncates(tmp_path):
    from rlhf_train.infra.logger import CSVLogger

    x = float(torch.tensor(1 / 3, dtype=torch.float32))  # 0.3333333432674408: needs all 17 digits
    log = CSVLogger(tmp_path)
    for it in (1, 2, 3):
        log.log({"objective/score": x * it, "time/iteration_s": 0.1 * it}, it)
        log.log_samples([{"prompt": "p", "response": "r"}], it)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [r["iteration"] for r in rows] == ["1", "2", "3"]
    assert "time/iteration_s" not in rows[0] and float(rows[0]["objective/score"]) == x  # bit for bit
    assert list(csv.DictReader(open(tmp_path / "timings.csv")))[2]["time/iteration_s"] == repr(0.1 * 3)
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"iteration": 4, "prom')  # a line cut short by SIGKILL

    CSVLogger(tmp_path, resume_iteration=2)  # resumed from checkpoint 2: rows 3 (and the cut line) go
    assert [r["iteration"] for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == ["1", "2"]
    assert [r["iteration"] for r in csv.DictReader(open(tmp_path / "timings.csv"))] == ["1", "2"]
    assert [json.loads(ln)["iteration"] for ln in open(tmp_path / "samples.jsonl")] == [1, 2]
    CSVLogger(tmp_path)  # a fresh run in the same dir starts afresh
    assert not (tmp_path / "metrics.csv").exists() and not (tmp_path / "samples.jsonl").exists()


# --------------------------------------------------------------------------------------------
# atomic checkpoints
# --------------------------------------------------------------------------------------------
def _save(run_dir, iteration, policy, optimizer, scheduler, keep=2):
    from accelerate import Accelerator
    from rlhf_train.infra.checkpoint import save_checkpoint

    return save_checkpoint(run_dir, iteration, accelerator=Accelerator(cpu=True), policy=policy, optimizer=optimizer,
                           scheduler=scheduler, trainer_state={"iteration": iteration, "kl_controller": {}},
                           config_yaml="a: 1\n", keep=keep)


def _model_and_optim():
    policy = tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return policy, optimizer, scheduler


def test_crash_mid_write_leaves_previous_checkpoint_latest(tmp_path, monkeypatch, capsys):
    from accelerate import Accelerator
    from rlhf_train.infra import checkpoint as ckpt
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.infra.resume import load_checkpoint, resolve_resume

    policy, optimizer, scheduler = _model_and_optim()
    first = _save(tmp_path, 1, policy, optimizer, scheduler)
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)

    real_save = torch.save

    def crash_on_scheduler(obj, f, *a, **k):  # the process dies half-way through writing checkpoint 2
        if str(f).endswith("scheduler.pt"):
            raise OSError("disk full (simulated crash mid-write)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", crash_on_scheduler)
    with pytest.raises(ckpt.CheckpointError, match="disk full"):  # a failed write: its temp dir is removed
        _save(tmp_path, 2, policy, optimizer, scheduler)
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    root = tmp_path / "checkpoints"
    assert not (root / ".tmp-iter_000002").exists() and not (root / "iter_000002").exists()
    shutil.copytree(first, root / ".tmp-iter_000002")  # what SIGKILL mid-write leaves
    assert resolve_resume("auto", tmp_path) == first  # the half-written one is never "latest"

    # and the previous one loads: the weights are those saved at iteration 1
    state = load_checkpoint(first, accelerator=Accelerator(cpu=True), policy=policy, optimizer=optimizer,
                            scheduler=scheduler)
    assert state["iteration"] == 1
    assert all(torch.equal(saved[k], v) for k, v in policy.state_dict().items())

    # a complete checkpoint damaged afterwards (truncated weights) is skipped by auto, refused by path
    second = _save(tmp_path, 2, policy, optimizer, scheduler)
    assert not (root / ".tmp-iter_000002").exists()  # the stale temp dir is cleaned up
    weights = second / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    assert resolve_resume("auto", tmp_path) == first
    assert "skipping checkpoint" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"trainer\.resume=.*model\.safetensors"):
        resolve_resume(str(second), tmp_path)


def test_prune_keeps_newest_and_manifest(tmp_path):
    from rlhf_train.infra.checkpoint_files import list_checkpoints
    from rlhf_train.infra.resume import verify_checkpoint

    policy, optimizer, scheduler = _model_and_optim()
    for it in (1, 2, 3):
        _save(tmp_path, it, policy, optimizer, scheduler, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_000002", "iter_000003"]
    manifest = json.loads((tmp_path / "checkpoints" / "iter_000003" / "COMPLETE").read_text())
    assert manifest["iteration"] == 3 and "policy/model.safetensors" in manifest["files"]
    assert verify_checkpoint(tmp_path / "checkpoints" / "iter_000003") is None


# --------------------------------------------------------------------------------------------
# exact resume in-process: SIGTERM after iteration 1 -> checkpoint + exit 143; resume -> same metrics
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_checkpoint_resume_is_exact_and_keeps_wandb_id(tmp_path, monkeypatch, capsys, caplog):
    from rlhf_train.infra.resume import read_trainer_state, verify_checkpoint
    from rlhf_train.loop import trainer

    overrides = ["trainer.num_iterations=2", "trainer.checkpoint_every=10", "kl_controller=adaptive"]
    trainer.train(make_cfg(*overrides), tmp_path / "reference")

    # a stand-in for W&B: records the resume id it is given, reports a run id
    resume_ids = []
    real_build = trainer.build_logger

    def fake_build(cfg, run_dir, config, resume_iteration=None, resume_id=None):
        resume_ids.append(resume_id)
        logger = real_build(cfg, run_dir, config, resume_iteration=resume_iteration, resume_id=resume_id)
        logger.run_id = resume_id or "wandb-run-42"
        real_log = logger.log

        def log(metrics, step):
            real_log(metrics, step)
            if step == 1 and resume_id is None:
                os.kill(os.getpid(), signal.SIGTERM)  # preempted during iteration 1's bookkeeping

        logger.log = log
        return logger

    monkeypatch.setattr(trainer, "build_logger", fake_build)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = OmegaConf.create(OmegaConf.to_container(make_cfg(*overrides)))  # untyped: a key can be added
    cfg.logger.api_key = "${oc.env:WANDB_API_KEY}"  # a secret in the config must never be saved
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        trainer.train(cfg, run)
    assert exc.value.code == 143
    out = capsys.readouterr().out + caplog.text  # the trainer logs (to the run's log under the CLI)
    assert "received SIGTERM" in out and "preempted: checkpoint written at iteration 1" in out
    ckpt = run / "checkpoints" / "iter_000001"  # written although checkpoint_every=10
    assert verify_checkpoint(ckpt) is None
    assert read_trainer_state(ckpt)["wandb_id"] == "wandb-run-42"

    cfg.trainer.resume = "auto"
    out = trainer.train(cfg, run)
    assert resume_ids == [None, "wandb-run-42"]  # the resumed run continues the same W&B run
    # the history (summary.json, report.md, plots, the pipeline's cached RL stage) holds the iterations
    # before the resume too
    assert [h["iteration"] for h in out["history"]] == [1, 2]
    assert [h["iteration"] for h in json.loads((run / "final_metrics.json").read_text())["history"]] == [1, 2]
    assert (run / "metrics.csv").read_text() == (tmp_path / "reference" / "metrics.csv").read_text()

    # secrets: nowhere in the run dir (config.yaml of each checkpoint has the key, redacted)
    assert "api_key: <redacted>" in (run / "checkpoints" / "iter_000002" / "config.yaml").read_text()
    leaks = [name for name, data in files_of(run).items() if SECRET.encode() in data]
    assert not leaks, f"the secret leaked into {leaks}"


def test_second_signal_exits_at_once(monkeypatch):
    from rlhf_train.infra import preemption

    exits = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    handler = preemption.PreemptionHandler()
    handler._handle(signal.SIGTERM, None)
    assert handler.requested and exits == []  # first: finish the iteration, checkpoint, exit 143
    handler._handle(signal.SIGTERM, None)
    assert exits == []  # at once again: the same request (SLURM signals workers and launcher, which relays)
    handler.first_at -= preemption.SAME_REQUEST_S + 1
    handler._handle(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]  # later: at once


# --------------------------------------------------------------------------------------------
# the CLI: SIGTERM -> checkpoint, one line, exit 143; SIGKILL + resume=auto -> identical metrics.csv
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_sigterm_checkpoints_and_exits_143(tmp_path):
    from rlhf_train.infra.checkpoint_files import list_checkpoints
    from rlhf_train.infra.resume import verify_checkpoint

    run = tmp_path / "run"
    cmd = [*FAST, "trainer.num_iterations=500", "trainer.checkpoint_every=400",
           "trainer.num_threads=1", f"hydra.run.dir={run}"]
    proc = zygote.popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.csv").exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no iteration finished in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    match = re.search(r"preempted: checkpoint written at iteration (\d+)", out)
    assert match, out[-3000:]
    ckpts = list_checkpoints(run)
    assert [p.name for p in ckpts] == [f"iter_{int(match.group(1)):06d}"] and verify_checkpoint(ckpts[0]) is None
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert int(rows[-1]["iteration"]) == int(match.group(1)) < 500


@pytest.mark.slow
def test_cli_sigkill_then_resume_auto_gives_identical_metrics(tmp_path):
    """The acceptance check; the same as ``python -m rlhf_train.tools.resume_check``."""
    from rlhf_train.tools.resume_check import run_check

    fast = [o for o in FAST if not o.startswith(("+recipe", "logger", "trainer.progress_bar"))]
    out = run_check(tmp_path, iterations=4, kill_after=2, overrides=fast, timeout=400)
    # killed in the middle of iteration 3 (2 rows), or, on a starved machine, a little later
    assert out["resumed_from"] and re.search(r"iter_00000[23]", out["resumed_from"]), out
    assert out["killed_at_rows"] in (2, 3), out
    assert out["diffs"] == []
    assert (tmp_path / "resumed" / "metrics.csv").read_text() == (tmp_path / "reference" / "metrics.csv").read_text()


# --------------------------------------------------------------------------------------------
# security
# --------------------------------------------------------------------------------------------
def test_source_loads_pickles_only_with_weights_only_and_no_remote_code():
    sources = {p: p.read_text() for p in (REPO / "rlhf_train").rglob("*.py")}
    for path, text in sources.items():
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"
        assert not re.search(r"trust_remote_code\s*=\s*True", text), path
        assert "pickle.load" not in text, path
    from rlhf_train.config import schema

    for node in (schema.PretrainedTokenizerSchema, schema.PolicySchema, schema.RefModelSchema, schema.RewardModelSchema):
        assert node.trust_remote_code is False


def test_checkpoint_weights_are_safetensors_and_pt_files_load_weights_only(tmp_path):
    policy, optimizer, scheduler = _model_and_optim()
    loss = policy(torch.randint(2, 32, (2, 6)), torch.ones(2, 6, dtype=torch.bool), 3)[1].sum()
    loss.backward()
    optimizer.step()  # optimizer state with tensors
    path = _save(tmp_path, 1, policy, optimizer, scheduler)
    assert (path / "policy" / "model.safetensors").exists() and (path / "value_head.safetensors").exists()
    assert not list(path.rglob("*.bin")) and not list(path.rglob("*.pkl"))
    for pt in path.glob("*.pt"):
        torch.load(pt, weights_only=True)  # raises if anything but tensors / plain containers is inside


# --------------------------------------------------------------------------------------------
# what a resume may rebuild: the same base model, the same tensor shapes; machine paths do not count
# --------------------------------------------------------------------------------------------
# a tiny GPT-2 loaded from a dir (policy.pretrained), a 32-token tokenizer and a reward model paying a token
BASE_DIR_RUN = ["policy.lora.r=4", "logger=none", "tokenizer._target_=tests.e2e.test_train.tiny_tokenizer",
                "reward_model._target_=tests.e2e.test_train.TokenCountRewardModel", "data=synthetic",
                "data.batch_size=4", "data.min_prompt_tokens=2", "data.max_prompt_tokens=4", "data.max_prompts=16"]


def _save_base(path, seed: int, n_embd: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    GPT2LMHeadModel(GPT2Config(vocab_size=32, n_layer=1, n_embd=n_embd, n_head=2, n_positions=32, eos_token_id=0,
                               bos_token_id=0, pad_token_id=1)).save_pretrained(path)


@pytest.mark.parametrize("lora_r", [4, 0])
def test_resume_refuses_a_base_model_replaced_on_disk(tmp_path, lora_r):
    """LoRA: the adapter's frozen base; full fine-tuning: the reference, a copy of the initial policy. Both
    are rebuilt from policy.pretrained: another model of the same shape there is one line, nothing written."""
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.infra.resume import read_trainer_state
    from rlhf_train.loop.trainer import train

    base, run = tmp_path / "base", tmp_path / "run"
    _save_base(base, seed=0)
    overrides = [*BASE_DIR_RUN, f"policy.lora.r={lora_r}", f"policy.pretrained={base}"]
    train(make_cfg(*overrides, "trainer.num_iterations=1"), run)
    ckpt = run / "checkpoints" / "iter_000001"
    assert read_trainer_state(ckpt)["base_model"]["files"] == {"model.safetensors": (base / "model.safetensors")
                                                               .stat().st_size}
    shutil.move(base, tmp_path / "original")
    _save_base(base, seed=1)  # another model of the same shape, in its place
    before = files_of(run)
    for resume in ("auto", str(ckpt)):
        with pytest.raises(ConfigError, match=r"policy\.pretrained='.*/base' is not the base model .*iter_000001 was "
                                              r"trained on \(its weights differ .*\); .*point policy\.pretrained at "
                                              r"the model the run started from") as e:
            train(make_cfg(*overrides, "trainer.num_iterations=2", f"trainer.resume={resume}"), run)
        assert "\n" not in str(e.value)
    assert files_of(run) == before
    shutil.rmtree(base)
    shutil.move(tmp_path / "original", base)  # the base it was trained on, back (moved: the same bytes)
    out = train(make_cfg(*overrides, "trainer.num_iterations=2", "trainer.resume=auto"), run)
    assert [h["iteration"] for h in out["history"]][-1] == 2


def test_checkpoint_without_a_base_fingerprint_still_resumes(tmp_path):
    from rlhf_train.infra.checkpoint_files import manifest
    from rlhf_train.infra.resume import resolve_resume

    base, run = tmp_path / "base", tmp_path / "run"
    _save_base(base, seed=0)
    cfg = make_cfg(*BASE_DIR_RUN, f"policy.pretrained={base}", "trainer.num_iterations=1")
    from rlhf_train.loop.trainer import train

    train(cfg, run)
    ckpt = run / "checkpoints" / "iter_000001"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["base_model"]  # as a checkpoint written without it
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    sizes, sums = manifest(ckpt)
    (ckpt / "COMPLETE").write_text(json.dumps({"iteration": 1, "files": sizes, "sha256": sums}))
    _save_base(base, seed=1)
    config_yaml = (ckpt / "config.yaml").read_text()
    assert resolve_resume("auto", run, config_yaml) == ckpt  # nothing recorded: nothing compared


@pytest.mark.parametrize("change, key", [
    ("policy.lora.r=8", r"policy\.lora\.r: 4 in the checkpoint, 8 now"),
    ("policy.lora.target_modules=[c_attn]", r"policy\.lora\.target_modules: all-linear in the checkpoint, "
                                            r"\['c_attn'\] now"),
    ("policy.config.n_layer=1", r"policy\.config\.n_layer: 2 in the checkpoint, 1 now"),
])
def test_resume_from_a_path_with_other_tensor_shapes_is_one_line(tmp_path, capsys, change, key):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.trainer import train

    lora = ["policy.lora.r=4", "logger=none"]
    train(make_cfg(*lora, "trainer.num_iterations=1"), tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "iter_000001"
    with pytest.raises(ConfigError, match=rf"checkpoint '.*iter_000001' does not fit the model this config builds "
                                          rf"\(the config differs in {key}\): .*tensor .*; resume with the checkpoint's") as e:
        train(make_cfg(*lora, "trainer.num_iterations=2", f"trainer.resume={ckpt}", change), tmp_path / "b")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_resume_auto_ignores_where_the_cache_is_but_not_a_real_change(tmp_path, monkeypatch):
    """The cache location (RLHF_TRAIN_CACHE) is this machine's, not the run's: paths under it compare by their
    place in it (the smoke recipe's tokenizer.cache_dir)."""
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.trainer import train

    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "cache_a"))
    train(make_cfg("logger=none", "trainer.num_iterations=1"), tmp_path / "run")
    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "cache_b"))
    with pytest.raises(ConfigError, match=r"another config \(trainer\.seed: 0 in the checkpoint, 1 now\)"):
        train(make_cfg("logger=none", "trainer.num_iterations=2", "trainer.resume=auto", "trainer.seed=1"),
              tmp_path / "run")
    out = train(make_cfg("logger=none", "trainer.num_iterations=2", "trainer.resume=auto"), tmp_path / "run")
    assert [h["iteration"] for h in out["history"]][-1] == 2
