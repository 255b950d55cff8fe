"""Shared fixtures (helpers that are not fixtures: tests/helpers/)."""
from __future__ import annotations

import pytest


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
