"""No secret in anything a run writes, with secret names that no list holds (rlhf_train/infra/secrets.py).

One tiny PPO run (W&B offline, the files ``wandb sync`` would upload) given a secret three ways: under a
config key named like a secret (``+logger.openai_api_key=...``), in an environment variable with a secret
name interpolated into a key that is not (``+logger.notes=${oc.env:MY_JUDGE_API_TOKEN}``), and that
variable's value pasted into another override (as ``$MY_JUDGE_API_TOKEN`` in a shell would). Checked:
``.hydra/*.yaml``, every checkpoint's ``config.yaml``, the W&B offline files, the log, stdout / stderr.
Budget: ~15 s on 2 CPU cores.
"""
from __future__ import annotations

import pytest

from tests.helpers.reliability import FAST, cli, files_of

CFG_SECRET = "sk-cfg-0a1b2c3d4e5f6071"
ENV_SECRET = "tok-env-8f7e6d5c4b3a2910"


@pytest.mark.slow
def test_run_writes_no_secret_to_hydra_checkpoints_or_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_API_TOKEN", ENV_SECRET)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    run = tmp_path / "run"
    fast = [o for o in FAST if not o.startswith("logger=")]
    out = cli(*fast, "logger=wandb", "trainer.num_iterations=1", f"+logger.openai_api_key={CFG_SECRET}",
              "+logger.notes=${oc.env:MY_JUDGE_API_TOKEN}", f"+logger.judge_header=Bearer {ENV_SECRET}",
              f"hydra.run.dir={run}", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    files = files_of(run)
    wandb_files = [n for n in files if n.startswith("wandb/")]
    checkpoint_configs = [n for n in files if n.startswith("checkpoints/") and n.endswith("/config.yaml")]
    assert wandb_files and checkpoint_configs, sorted(files)
    leaks = [n for n, data in files.items() if CFG_SECRET.encode() in data or ENV_SECRET.encode() in data]
    assert not leaks, f"a secret leaked into {leaks}"
    assert CFG_SECRET not in out.stdout + out.stderr and ENV_SECRET not in out.stdout + out.stderr
    for name in [".hydra/config.yaml", *checkpoint_configs]:
        text = files[name].decode()
        assert "openai_api_key: <redacted>" in text and "judge_header: Bearer <redacted>" in text, name
        assert "max_new_tokens: 8" in text, name  # nothing else redacted
    assert "notes: <redacted>" in files[checkpoint_configs[0]].decode()  # the env value, resolved, redacted
    assert any(b"openai_api_key" in files[n] and b"<redacted>" in files[n] for n in wandb_files)
