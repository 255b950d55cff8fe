"""Layer 8, loop: the PPO training loop.

``trainer.train(cfg)`` reads top to bottom: rollout, advantages, algorithm update, KL-controller step,
logging and checkpoints; ``components`` builds its components from the config and runs the pre-flight
checks.

May import: every layer up to ``rlhf_train.tasks``.
"""
