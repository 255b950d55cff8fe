"""Layer 7, tasks: everything specific to one task (data, tokenizer, judge), one folder per task.

``movie_reviews`` is the embedded default's offline sentiment task; ``arithmetic`` (generated sums and
differences) and ``gsm8k`` are the verifiable-reward recipes' tasks. Generic code (``rlhf_train.pipeline``
included) never imports a task by name: only the YAML configs name its factories and hooks.

May import: every layer up to ``rlhf_train.rollout``.

Extension point: a new task goes in ``rlhf_train/tasks/<name>/``: its data loading and splits, its
config-group factories (prompts for ``data``, a tokenizer for ``tokenizer``), its pipeline hooks (SFT
data for ``sft.examples``, preference pairs for ``rm.pairs``, a judge for ``evaluation.judge_fn``, an
option check for ``evaluation.task_check``), with YAML options under ``conf/`` whose keys name them.
"""
