"""What the pipeline needs from the arithmetic task, named by dotted path in ``conf/recipe/arithmetic_grpo.yaml``:
``evaluation.task_check`` -> :func:`check_options`, run in the pre-flight before any stage."""
from __future__ import annotations

from omegaconf import DictConfig


def check_options(cfg: DictConfig) -> None:
    """One ConfigError naming the ``data.*`` key that is not valid (split, operations, max_operand, test_fraction),
    and the same for the evaluation's split, before any model is built."""
    from rlhf_train.data.prefix import check_prefix
    from rlhf_train.tasks.arithmetic.generator import check_options as check

    d = cfg.data
    if not str(d.get("_target_", "")).endswith("arithmetic_prompts"):
        return
    ops = list(d.operations) if d.get("operations") is not None else None
    check(d.split, ops, d.max_operand, d.test_fraction)
    if cfg.get("evaluation") is not None:
        check(cfg.evaluation.split, ops, d.max_operand, d.test_fraction)
    check_prefix(d.get("system_prompt"), d.get("few_shot"))
