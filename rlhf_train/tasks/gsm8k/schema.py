"""The typed keys of ``conf/data/gsm8k.yaml`` (registered with Hydra by :mod:`rlhf_train.config.schema`): the keys
:func:`rlhf_train.tasks.gsm8k.prompts.gsm8k_prompts` takes, plus ``batch_size`` and ``num_workers``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass
class GSM8KDataSchema:  # conf/data/gsm8k.yaml -> tasks.gsm8k.prompts.gsm8k_prompts
    _target_: str = "rlhf_train.tasks.gsm8k.prompts.gsm8k_prompts"
    batch_size: int = 32
    num_workers: int = 0
    dataset: str = "openai/gsm8k"
    split: str = "train"
    max_prompts: Optional[int] = None
    seed: int = 0
    shuffle: bool = False
    system_prompt: Optional[str] = "Please reason step by step, and put your final answer within \\boxed{}."
    few_shot: Optional[List[Dict[str, str]]] = None
