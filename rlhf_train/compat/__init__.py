"""Layer 7, compat: torchrl's API over rlhf_train's product code (``torchrl``: ``RolloutFromModel`` with
torchrl's constructor, methods and string keys, ``PromptData`` batches, ``KLConstrainedTransform`` /
``KLRewardTransform``; ``torchrl_transforms``: the seeds' shaping ``Transform``s).

Imported by nothing in the package (tests/compat and benchmarks/torchrl_* use it). May import: every
layer up to ``rlhf_train.rollout``.
"""
