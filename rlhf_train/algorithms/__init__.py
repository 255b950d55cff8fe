"""Layer 5, algorithms: what to do with a batch of scored rollouts.

The ``Algorithm`` and ``AdvantageEstimator`` interfaces (``base``), PPO with GAE (``ppo``), the critic-free
GRPO / RLOO / REINFORCE++ (``critic_free``), every algorithm by name (``registry``), their config sections
(``configs``: ``algorithm`` and ``update``) and the ``algorithm`` section's checks (``checks``), the rows the
update trains on (``selection``: DAPO's zero-variance groups, truncated responses, no update without a signal)
and the minibatch update with gradient accumulation and skipping of non-finite minibatches (``update``), whose
micro-batches are fixed slices or, with ``update.packing``, packed bins of at most ``update.token_budget``
tokens (``micro_batches``). The per-tensor math they call lives in :mod:`rlhf_train.core`.

May import: every layer up to ``rlhf_train.generation`` / ``rlhf_train.rewards``.

Extension point: a new algorithm or advantage estimator is one file ``rlhf_train/algorithms/<name>.py``
(``rlhf_train/algorithms/base.py`` says what it holds), one line in ``registry.ALGORITHMS`` and its
``conf/algorithm/<name>.yaml``.
"""
