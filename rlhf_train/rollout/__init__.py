"""Layer 6, rollout: turning prompts into scored rollouts.

``RolloutFromModel`` (``rollout_from_model``) is the class the training loop calls each iteration: a
prompt batch and β in, a typed ``Rollout`` out, assembled from a generation backend, the reference, the
reward sources and the shaping stack. Its torchrl-compatible surface is :mod:`rlhf_train.compat.torchrl`.

May import: every layer up to ``rlhf_train.algorithms``.

Public name re-exported here: ``from rlhf_train.rollout import RolloutFromModel``.
"""

from rlhf_train.rollout.rollout_from_model import RolloutFromModel

__all__ = ["RolloutFromModel"]
