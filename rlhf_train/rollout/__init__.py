"""Layer 6, rollout: turning prompts into scored rollouts.

``RolloutFromModel`` (``rollout_from_model``) generates with a ``GenerationBackend``, then scores policy,
reference and reward sources once each over prompt + response; ``torchrl_compat`` holds, in one place,
what it accepts and offers only because torchrl's does (``PromptData`` batches, torchrl's composite KL
transforms).

May import: every layer up to ``rlhf_train.algorithms``.

Public name re-exported here: ``from rlhf_train.rollout import RolloutFromModel``.
"""

from rlhf_train.rollout.rollout_from_model import RolloutFromModel

__all__ = ["RolloutFromModel"]
