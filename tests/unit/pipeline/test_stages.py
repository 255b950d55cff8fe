"""``stage`` dispatch (rlhf_train/pipeline/stages.py): the RL loop alone is ``stage=rl`` (whatever the
algorithm); ``stage=ppo``, its old name, stops at start with one line saying to use ``stage=rl``.

Budget: ~10 s on 2 CPU cores (one ``python -m rlhf_train`` start).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import zygote
from tests.unit.pipeline.test_run import compose

REPO = Path(__file__).resolve().parents[3]


def test_rl_is_the_stage_of_the_rl_loop():
    from rlhf_train.config.schema import Config
    from rlhf_train.pipeline.stages import STAGES

    assert set(STAGES) == {"pipeline", "sft", "rm", "rl"} and Config.stage == "rl"
    assert compose("+recipe=smoke").stage == "rl"


def test_stage_ppo_names_stage_rl_in_one_line(tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.pipeline.stages import run_stage

    with pytest.raises(ConfigError, match=r"^stage=ppo was renamed: use stage=rl\b") as err:
        run_stage(compose("+recipe=smoke", "stage=ppo", f"cache_dir={tmp_path / 'cache'}"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"stage='bogus' is not valid; choose one of pipeline, sft, rm, rl$"):
        run_stage(compose("+recipe=smoke", "stage=bogus"))


def test_stage_ppo_fails_at_start_from_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(WANDB_MODE="disabled", RLHF_TRAIN_CACHE=str(tmp_path / "cache"))
    proc = zygote.run(["+recipe=smoke", "stage=ppo",
                       f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                      timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "use stage=rl" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # nothing started
