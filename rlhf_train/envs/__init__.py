"""Layer 4, envs: environments a policy acts in over several turns (tools, games, user simulators).

``base`` defines the seam (``Environment``: ``reset(row) -> first messages``, ``step(assistant message) ->
Step(new messages | None when done, reward or None, info)``, optional ``tools``), the episode's limits and reward
weight read from the ``env`` config group (``EnvSpec``) and the reward source that carries each episode's reward
into the weighted sum (``EpisodeRewards``, logged as ``reward/env``); ``tools`` the tool-calling helpers (the
Hermes ``<tool_call>`` JSON format, a tool run in a thread with a timeout, errors as ``tool`` messages;
``ToolEnvironment``); ``chat`` the chat-template side: the first prompt, an environment turn as a token suffix,
and the check of what the template would give for the whole conversation (``env/template_drift``).

Ready-made environments, each with a procedurally generated, seeded prompt dataset (``prompts``: the rows and
their held-out split, the first messages through the chat template): ``calculator`` (arithmetic word problems of
``word_problems`` with a ``calculate`` tool, a safe evaluator of numbers and ``+ - * / // % **``; ``env=calculator``,
``data=calculator``) and ``guess_number`` (a multi-turn game: guess a number, told higher / lower;
``env=guess_number``, ``data=guess_number``). The multi-turn rollout that drives them is
:mod:`rlhf_train.rollout.multi_turn`.

May import: ``rlhf_train.core``, ``infra``, ``models``, ``data``. Sibling of ``rlhf_train.rewards`` and
``rlhf_train.generation``.

Extension point: a new environment is a class with ``reset`` and ``step`` (``rlhf_train/envs/base.py``'s
``Environment``) in your own module or ``rlhf_train/envs/<name>.py``, selected by ``env=<name>``
(``conf/env/<name>.yaml``) or ``env._target_=my_module.MyEnv``; docs/environments.md.
"""
