"""Layer 4, rewards: where the scalar reward of a rollout comes from and how it is shaped.

``sources`` defines the seam (``RewardSource``: complete sequences in, one score per sequence out), the
reward-model source and the weighted sum; ``function_source`` the Python-function source, which
``executor`` runs (in worker processes or the trainer's, with a timeout; ``async def`` awaited);
``functions`` holds ready-made reward functions (final-answer match, ``<think>/<answer>`` format, DAPO's soft
overlong punishment, regex, length penalty); ``shaping`` is the reward-shaping stack (score shaping, KL
penalty, per-token reward) as plain callables over the ``Rollout``; ``kl_controllers`` holds the constant and adaptive KL coefficient controllers.

May import: ``rlhf_train.core``, ``infra``, ``models``, ``data``. Sibling of ``rlhf_train.generation``.

Extension point: a new reward source (a Python reward function, a verifier, a remote reward server,
...) goes in ``rlhf_train/rewards/<name>.py`` as a callable implementing ``RewardSource``
(``rlhf_train/rewards/sources.py``).
"""
