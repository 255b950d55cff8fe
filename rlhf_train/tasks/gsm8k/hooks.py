"""What the pipeline needs from GSM8K, named by dotted path in ``conf/recipe/gsm8k_grpo.yaml``:
``evaluation.task_check`` -> :func:`check_options`, run in the pre-flight before any stage."""
from __future__ import annotations

from omegaconf import DictConfig


def check_options(cfg: DictConfig) -> None:
    """The training and the evaluation split can be read (offline without a cached copy: one line naming
    ``data.dataset``), before any model is built."""
    from rlhf_train.tasks.gsm8k.prompts import load_split

    d = cfg.data
    if not str(d.get("_target_", "")).endswith("gsm8k_prompts"):
        return
    load_split(d.dataset, d.split)
    if cfg.get("evaluation") is not None and cfg.evaluation.enabled:
        load_split(d.dataset, cfg.evaluation.split)
