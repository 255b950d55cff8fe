"""Layer 5, algorithms: what to do with a batch of scored rollouts.

The ``Algorithm`` and ``AdvantageEstimator`` interfaces (``base``), PPO with GAE (``ppo``), the critic-free
GRPO / RLOO / REINFORCE++ (``critic_free``), their config sections (``configs``) and the minibatch
update with gradient accumulation and skipping of non-finite minibatches (``update``). The per-tensor
math they call lives in :mod:`rlhf_train.core`.

May import: every layer up to ``rlhf_train.generation`` / ``rlhf_train.rewards``.

Extension points: a new algorithm goes in ``rlhf_train/algorithms/<name>.py`` as a class implementing
``Algorithm`` (``rlhf_train/algorithms/base.py``), plus a config for it under ``conf/``; a new advantage
estimator is a pure function in ``rlhf_train/core/advantages.py`` wrapped as an ``AdvantageEstimator``.
"""
