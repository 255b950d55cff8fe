"""Structured-config schemas of the environments' groups (see :mod:`rlhf_train.config.schema`, which registers them):
the ``env`` group and the prompt datasets of the ready-made environments (``data=guess_number``, ``data=calculator``:
the keys their functions take, plus ``batch_size`` and ``num_workers``, which the loop pops). The meaning of every
key is in ``conf/env/*.yaml`` and ``conf/data/*.yaml``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class EnvSchema:  # conf/env/*.yaml -> rlhf_train.envs.base.env_spec (the multi-turn rollout's environment)
    _target_: Optional[str] = None  # None: no environment (one prompt, one completion)
    max_turns: int = 4
    max_tokens: int = 1024
    weight: float = 1.0
    truncated_reward: Optional[float] = None  # an episode a limit ended before any step paid (None: no reward)
    kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class GuessNumberDataSchema:  # conf/data/guess_number.yaml -> rlhf_train.envs.guess_number.guess_number_prompts
    _target_: str = "rlhf_train.envs.guess_number.guess_number_prompts"
    batch_size: int = 8
    num_workers: int = 0
    split: str = "train"
    max_prompts: Optional[int] = 2048
    seed: int = 0
    size: int = 10
    offset: int = 90


@dataclass
class CalculatorDataSchema:  # conf/data/calculator.yaml -> rlhf_train.envs.calculator.calculator_prompts
    _target_: str = "rlhf_train.envs.calculator.calculator_prompts"
    batch_size: int = 8
    num_workers: int = 0
    split: str = "train"
    max_prompts: Optional[int] = 2048
    seed: int = 0
    max_steps: int = 3


def register(cs) -> None:
    """Store the schemas in Hydra's ConfigStore ``cs``."""
    cs.store(group="env", name="env_schema", node=EnvSchema)
    cs.store(group="data", name="guess_number_schema", node=GuessNumberDataSchema)
    cs.store(group="data", name="calculator_schema", node=CalculatorDataSchema)
