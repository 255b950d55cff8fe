"""Layer 7, tasks: everything specific to one task (data, tokenizer, judge), one folder per task.

``movie_reviews`` is the embedded default's offline sentiment task. Generic code never imports a task
by name outside ``rlhf_train.pipeline`` and the YAML configs that point at its factories.

May import: every layer up to ``rlhf_train.rollout``.

Extension point: a new task goes in ``rlhf_train/tasks/<name>/``: its data loading and splits, its
config-group factories (prompts for ``data``, a tokenizer for ``tokenizer``), and any task-only
evaluation, with YAML options under ``conf/`` whose ``_target_`` names them.
"""
