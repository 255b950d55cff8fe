"""Shared fixtures (helpers that are not fixtures: tests/helpers/)."""
from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    """Under pytest-xdist (pyproject's ``-n``) each worker gets its share of the cores, in process and in the
    processes its tests start (``OMP_NUM_THREADS``), instead of every worker running one thread per core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


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
