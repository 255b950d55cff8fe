"""rlhf_train: a Hydra-configured PPO/RLHF trainer.

Run it with ``python -m rlhf_train`` (:mod:`rlhf_train.__main__`, which also sets its CPU defaults).
"""
