"""Shared by test_resume.py, test_faults.py and test_bad_input.py: configs of a tiny, fast PPO run."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"

# the smoke recipe, smaller still: 4 prompts per batch, 2 per minibatch, 8-token responses, 3 batches
# per epoch (so 4 iterations cross an epoch boundary)
FAST = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "data.batch_size=4", "data.max_prompts=12",
        "update.minibatch_size=2", "update.num_epochs=2", "rollout.max_new_tokens=8"]


def make_cfg(*overrides: str):
    """The composed config of ``FAST`` + ``overrides`` (no Hydra run dir involved)."""
    from hydra import compose, initialize_config_dir

    import rlhf_train.data.prompts  # noqa: F401  (makes `rlhf_train.data.prompts` the module for instantiate)
    from rlhf_train.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*FAST, *overrides])


def cli(*args: str, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    """``python -m rlhf_train ARGS`` in the repo, output captured (forked from tests/helpers/zygote.py's server)."""
    from tests.helpers import zygote

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return zygote.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def files_of(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (relative path → bytes), to check that nothing was changed."""
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(Path(run_dir).rglob("*")) if p.is_file()}


def tiny_policy(vocab: int = 32):
    from rlhf_train.models.policy import build_policy

    torch.manual_seed(0)
    return build_policy(config={"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32, "vocab_size": vocab,
                                "eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 1})


class BadShapeRewardModel(torch.nn.Module):
    """A reward model that returns one score per *token* where one per sequence is expected."""

    def __init__(self, **_):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask):
        rewards = torch.zeros(input_ids.shape, dtype=torch.float32) + self.w
        return rewards, rewards  # end_scores should be [B], not [B, L]


def bad_shape_reward_model(**kwargs):
    return BadShapeRewardModel(**kwargs)
