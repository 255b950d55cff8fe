"""Bad input: one clear error naming the problem, before any work starts, nothing already written changed.

One test per bad input of issue 7; most in-process (``ConfigError`` is the one line ``python -m rlhf_train``
prints as ``Error: ...`` with exit status 2), three through the CLI. Budget: ~20 s.
"""
from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from rlhf_train.infra.errors import ConfigError
from tests.helpers import zygote
from tests.helpers.reliability import cli, files_of, make_cfg, tiny_policy


def _train_fails(tmp_path, *overrides, match: str):
    """``train`` raises a ConfigError matching ``match``, and writes nothing into the run dir."""
    from rlhf_train.loop.trainer import train

    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.csv").write_text("iteration,objective/score\n1,0.5\n")  # an earlier run's output
    before = files_of(run)
    with pytest.raises(ConfigError, match=match) as exc:
        train(make_cfg(*overrides), run)
    assert "\n" not in str(exc.value)  # one line
    assert files_of(run) == before and not (run / "checkpoints").exists()
    return str(exc.value)


# ---------------------------------------------------------------- config keys and types
def test_unknown_config_key():
    with pytest.raises((HydraException, OmegaConfBaseException), match=r"trainer\.bogus|bogus"):
        make_cfg("trainer.bogus=1")


def test_wrong_type():
    with pytest.raises((HydraException, OmegaConfBaseException), match=r"trainer\.num_iterations"):
        make_cfg("trainer.num_iterations=many")


def test_unknown_key_via_cli_fails_fast(tmp_path):
    out = cli("+recipe=smoke", "ppo.bogus_key=1", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert out.returncode != 0 and "bogus_key" in out.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- values Hydra's types cannot catch
@pytest.mark.parametrize("override,key", [
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("rollout.max_new_tokens=-4", "rollout.max_new_tokens"),
    ("kl_controller.target=0", "kl_controller.target"),
    ("kl_controller.horizon=-10", "kl_controller.horizon"),
    ("data.batch_size=0", "data.batch_size"),
    ("update.minibatch_size=-2", "update.minibatch_size"),
    ("rollout.logprob_batch_size=0", "rollout.logprob_batch_size"),
    ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints"),
    ("trainer.max_consecutive_faults=0", "trainer.max_consecutive_faults"),
])
def test_non_positive_values(override, key):
    from omegaconf import OmegaConf

    from rlhf_train.loop.checks import check_config

    cfg = copy.deepcopy(_adaptive_cfg())
    OmegaConf.update(cfg, key, int(override.split("=")[1]))  # as the override would (types still checked)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_config(cfg)


@functools.lru_cache(maxsize=1)
def _adaptive_cfg():
    return make_cfg("kl_controller=adaptive")


def test_non_positive_value_via_cli_is_one_line(tmp_path):
    out = cli("+recipe=smoke", "logger=csv", "rollout.max_new_tokens=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["Error: rollout.max_new_tokens=0 must be positive"]
    assert not (tmp_path / "run" / "metrics.csv").exists()


# ---------------------------------------------------------------- data, tokenizer, models
def test_prompts_longer_than_the_context(tmp_path):
    msg = _train_fails(tmp_path, "policy.config.n_positions=16", match="context")
    assert "rollout.max_new_tokens" in msg and "16 tokens" in msg


def test_empty_dataset(tmp_path):
    _train_fails(tmp_path, "data.max_prompts=0", match=r"^data\.max_prompts=0 must be positive")


def test_unknown_split(tmp_path):
    _train_fails(tmp_path, "data.split=no_such_split", match=r"data\.split='no_such_split'")


def test_tokenizer_without_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the a movie was good bad".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    _train_fails(tmp_path, "tokenizer=pretrained", f"tokenizer.pretrained={tmp_path / 'tok'}",
                 match=r"no EOS token.*tokenizer")


def test_reward_model_output_of_the_wrong_shape(tmp_path):
    msg = _train_fails(tmp_path, "reward_model._target_=tests.helpers.reliability.bad_shape_reward_model",
                       match="reward model's output has the wrong shape")
    assert "end_scores [2]" in msg and "reward_model" in msg


def test_hub_model_name_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _train_fails(tmp_path, "policy.pretrained=no-such-org/no-such-model",
                 match=r"no-such-org/no-such-model.*policy\.pretrained=")


# ---------------------------------------------------------------- checkpoints
def test_missing_checkpoint_path(tmp_path):
    _train_fails(tmp_path, f"trainer.resume={tmp_path / 'nope' / 'iter_000003'}",
                 match=r"trainer\.resume=.*no such checkpoint directory")


def _checkpoint(tmp_path):
    from accelerate import Accelerator
    from rlhf_train.infra.checkpoint import save_checkpoint

    policy = tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = save_checkpoint(tmp_path / "old_run", 1, accelerator=Accelerator(cpu=True), policy=policy,
                           optimizer=optimizer, scheduler=scheduler, trainer_state={}, config_yaml="")
    return path, policy, optimizer, scheduler


def test_corrupt_checkpoint_path(tmp_path):
    path, *_ = _checkpoint(tmp_path)
    weights = path / "policy" / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)  # same size, garbage
    _train_fails(tmp_path, f"trainer.resume={path}", match=r"trainer\.resume=.*model\.safetensors.*corrupt")


def test_corrupt_optimizer_state_fails_to_load_with_one_line(tmp_path):
    from accelerate import Accelerator
    from rlhf_train.infra.resume import load_checkpoint, resolve_resume

    path, policy, optimizer, scheduler = _checkpoint(tmp_path)
    opt = path / "optimizer.pt"
    opt.write_bytes(b"x" * opt.stat().st_size)  # same size: only the checksum would catch it ...
    manifest = json.loads((path / "COMPLETE").read_text())
    del manifest["sha256"]  # ... and a checkpoint written before checksums has none: torch.load fails
    (path / "COMPLETE").write_text(json.dumps(manifest))
    assert resolve_resume(str(path), tmp_path) == path
    with pytest.raises(ConfigError, match=r"trainer\.resume: checkpoint .* cannot be loaded") as exc:
        load_checkpoint(path, accelerator=Accelerator(cpu=True), policy=policy, optimizer=optimizer,
                        scheduler=scheduler)
    assert "\n" not in str(exc.value)


def test_all_checkpoints_damaged_with_resume_auto(tmp_path):
    from rlhf_train.infra.resume import resolve_resume

    path, *_ = _checkpoint(tmp_path)
    (path / "value_head.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"trainer\.resume=auto: every checkpoint .* is damaged"):
        resolve_resume("auto", tmp_path / "old_run")


# ---------------------------------------------------------------- output dir
def test_output_dir_not_writable(tmp_path):
    from rlhf_train.infra.run_dir import check_writable
    from rlhf_train.loop.trainer import train

    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"hydra\.run\.dir=.*not writable"):
        train(make_cfg(), tmp_path / "a_file" / "run")
    check_writable(tmp_path / "new" / "deep" / "run")  # creatable is fine, and the check creates nothing
    assert not (tmp_path / "new").exists()


def test_output_dir_not_writable_via_cli(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = cli("+recipe=smoke", f"hydra.run.dir={tmp_path / 'a_file' / 'run'}", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"Error: hydra.run.dir='{tmp_path / 'a_file' / 'run'}' is not writable: '{tmp_path / 'a_file'}' is not a "
        f"directory; set hydra.run.dir=<a writable dir>"]


# ---------------------------------------------------------------- no empty run dir after a failed start
def test_failed_start_leaves_no_run_dir_behind(tmp_path):
    """Bad input (exit 2) with the default run dir ``outputs/<task>/<time>/`` under the cwd: the folders
    this start created go again; a run dir that existed before stays, as does anything in it."""
    import os

    from tests.helpers.reliability import REPO

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    bad = ["+recipe=smoke", "logger=csv", "rollout.max_new_tokens=0"]
    out = zygote.run(bad, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"[rlhf_train] run dir: {tmp_path / 'outputs' / 'smoke'}" in out.stdout  # it was said, then removed
    assert list(tmp_path.iterdir()) == []

    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    out = zygote.run([*bad, f"hydra.run.dir={mine}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=120, check=False)
    assert out.returncode == 2 and (mine / "notes").is_dir() and (mine / ".hydra").is_dir()


def test_only_a_run_dir_this_start_created_and_left_empty_is_removed(tmp_path):
    from omegaconf import OmegaConf

    from rlhf_train.infra.run_dir import (
        RUN_DIR_LINE,
        RunDirCheck,
        remove_unused_run_dir,
    )

    def start(run_dir, log_lines=(), extra=None):
        """What Hydra and a failed start leave: .hydra/, the job log, maybe one more file."""
        RunDirCheck().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}}))
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text("stage: ppo\n")
        (run_dir / "__main__.log").write_text("".join(f"[t][rlhf_train][INFO] - {line}\n" for line in log_lines))
        if extra:
            (run_dir / extra).write_text("x")
        return run_dir

    run = start(tmp_path / "outputs" / "smoke" / "t1", [f"{RUN_DIR_LINE}somewhere"])
    assert remove_unused_run_dir(run, "__main__.log") and list(tmp_path.iterdir()) == []  # created parents too
    (tmp_path / "outputs").mkdir()
    run = start(tmp_path / "outputs" / "smoke" / "t2")
    assert remove_unused_run_dir(run, "__main__.log") and list(tmp_path.iterdir()) == [tmp_path / "outputs"]
    # the start's own notes go with it (the Error line on stderr says why it stopped)
    run = start(tmp_path / "outputs" / "t2b", [f"{RUN_DIR_LINE}x", "[rlhf_train] policy.lora.r=4: no reference copy"])
    assert remove_unused_run_dir(run, "__main__.log") and not (tmp_path / "outputs" / "t2b").exists()
    # kept: a line of a pipeline stage that ran, a file other than Hydra's, a dir that existed before
    run = start(tmp_path / "outputs" / "t3", [f"{RUN_DIR_LINE}x", "[pipeline] sft done in 100 s"])
    assert not remove_unused_run_dir(run, "__main__.log") and run.is_dir()
    run = start(tmp_path / "outputs" / "t4", extra="metrics.csv")
    assert not remove_unused_run_dir(run, "__main__.log") and run.is_dir()
    (tmp_path / "old").mkdir()
    run = start(tmp_path / "old")
    assert not remove_unused_run_dir(run, "__main__.log") and run.is_dir()


# ---------------------------------------------------------------- issue 17, item 7: values that slipped through
@pytest.mark.parametrize("override,match", [
    ("scheduler.name=bogus", r"scheduler\.name='bogus' is not valid; choose one of: .*linear"),
    ("trainer.mixed_precision=fp9", r"trainer\.mixed_precision='fp9' is not valid .*use trainer\.precision="),
    ("trainer.precision=fp8", r"trainer\.precision='fp8' is not valid; choose one of: fp32, bf16, fp16"),
    ("trainer.precision=bf16 trainer.mixed_precision=no", r"trainer\.precision=bf16 and trainer\.mixed_precision=no "
                                                          r"disagree"),
    ("algorithm.is_correction.level=batch", r"algorithm\.is_correction\.level='batch' is not valid"),
    ("algorithm.is_correction.level=token algorithm.is_correction.mode=drop",
     r"algorithm\.is_correction\.mode='drop' is not valid; choose one of: clip, mask"),
    ("algorithm.is_correction.level=token algorithm.is_correction.threshold=[1.5,3]",
     r"algorithm\.is_correction\.threshold=\[1\.5, 3\.0\] must be \[low, high\] with 0 <= low <= 1 <= high"),
    ("algorithm.is_correction.level=sequence rollout.do_sample=false",
     r"algorithm\.is_correction needs the sampler's log-probs.*rollout\.do_sample=true"),
    ("data.num_workers=-1", r"data\.num_workers=-1 must be >= 0"),
    ("optimizer.lr=-1", r"optimizer\.lr=-1.0 must be positive"),
    ("kl_controller.init_kl_coef=-1", r"kl_controller\.init_kl_coef=-1.0 must be >= 0"),
    ("rollout.top_p=1.5", r"rollout\.top_p=1.5 must be in \(0, 1\]"),
    ("rollout.top_p=0", r"rollout\.top_p=0.0 must be in \(0, 1\]"),
    ("rollout.top_k=-1", r"rollout\.top_k=-1 must be >= 0"),
    ("update.clip_eps=-0.2", r"update\.clip_eps=-0.2 must be positive"),
    ("algorithm.gamma=-1", r"algorithm\.gamma=-1.0 must be in \[0, 1\]"),
    ("+trainer.foo=1", r"trainer\.foo is not a key of trainer .*remove the override"),
    ("data.batch_size=6", r"data\.batch_size=6 = 6 rollouts per process is not a multiple of update\.minibatch_size=4"),
    ("policy.config.n_head=3", r"policy\.config\.n_head=3 does not divide the width 64"),
])
def test_values_that_slipped_through(override, match):
    from rlhf_train.loop.checks import check_config

    cfg = make_cfg("kl_controller=adaptive", "update.minibatch_size=4", *override.split())
    with pytest.raises(ConfigError, match=match) as exc:
        check_config(cfg)
    assert "\n" not in str(exc.value)


def _saved_policy(path):
    tiny_policy().lm.save_pretrained(path)
    return path


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / "config.json").write_text("{not json"), r"policy\.pretrained=.*config\.json is corrupt"),
    (lambda d: (d / "model.safetensors").unlink(), r"policy\.pretrained=.* holds no weights"),
])
def test_damaged_policy_dir(tmp_path, damage, match):
    model_dir = _saved_policy(tmp_path / "model")
    damage(model_dir)
    _train_fails(tmp_path, "policy=gpt2", f"policy.pretrained={model_dir}", match=match)


def test_bad_value_via_cli_is_one_line_exit_2(tmp_path):
    out = cli("+recipe=smoke", "logger=csv", "scheduler.name=bogus", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: scheduler.name='bogus' is not valid"), out.stderr[-2000:]
