"""The typed keys of ``conf/data/arithmetic.yaml`` (registered with Hydra by :mod:`rlhf_train.config.schema`):
the keys :func:`rlhf_train.tasks.arithmetic.prompts.arithmetic_prompts` takes, plus ``batch_size`` and
``num_workers``, which the loop pops; an unknown key or a wrong type fails at start."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class ArithmeticDataSchema:  # conf/data/arithmetic.yaml -> tasks.arithmetic.prompts.arithmetic_prompts
    _target_: str = "rlhf_train.tasks.arithmetic.prompts.arithmetic_prompts"
    batch_size: int = 8
    num_workers: int = 0
    split: str = "train"
    seed: int = 0
    operations: List[str] = field(default_factory=lambda: ["+", "-"])
    max_operand: int = 9
    test_fraction: float = 0.25
    max_prompts: Optional[int] = None
    system_prompt: Optional[str] = None
    few_shot: Optional[List[Dict[str, str]]] = None
