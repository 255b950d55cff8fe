"""GSM8K (Cobbe et al. 2021, ``openai/gsm8k``, config ``main``) for ``+recipe=gsm8k_grpo`` (recipes/gsm8k_grpo.md):
grade-school math word problems with a numeric answer.

``prompts`` is the ``data=gsm8k`` factory (the question as a chat prompt, the number after ``####`` as the
``answer`` column); ``schema`` its typed keys; ``hooks`` the pre-flight check that the data can be loaded (offline:
one line naming ``data.dataset`` for a local copy).

May import: every layer up to ``rlhf_train.rollout`` (it is part of ``rlhf_train.tasks``).
"""
