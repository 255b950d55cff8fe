"""Shared fixtures (helpers that are not fixtures: tests/helpers/)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state whose mixed precision cannot change once set: every test starts
    with a fresh one (a recipe in bf16 after a test in fp32 would otherwise raise in ``Accelerator()``)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield


@pytest.fixture
def tiny_cfg():
    """``make_cfg(*overrides)``: the tiny smoke config of tests/helpers/reliability.py (2-layer GPT-2s, short
    rollouts), with the given overrides."""
    from tests.helpers.reliability import make_cfg

    return make_cfg


@pytest.fixture
def run_dir(tmp_path):
    """A fresh run dir for one training run."""
    path = tmp_path / "run"
    path.mkdir()
    return path
