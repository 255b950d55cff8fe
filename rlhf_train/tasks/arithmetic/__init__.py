"""The arithmetic task of ``+recipe=arithmetic_grpo`` (recipes/arithmetic_grpo.md): small additions and
subtractions, generated from a seed, with a verifiable answer.

``generator`` makes the problems (pure Python; train and held-out facts disjoint by construction);
``prompts`` is the ``data=arithmetic`` factory (chat prompts with an ``answer`` column); ``schema`` its typed
keys; ``hooks`` the option check the pipeline's pre-flight runs (``evaluation.task_check``).

May import: every layer up to ``rlhf_train.rollout`` (it is part of ``rlhf_train.tasks``).
"""
