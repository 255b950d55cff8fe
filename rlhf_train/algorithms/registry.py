"""Every algorithm by its ``algorithm.name``: ONE line each. A new algorithm or estimator is one file in
``rlhf_train/algorithms/`` (see :mod:`rlhf_train.algorithms.base`), one line here, and its
``conf/algorithm/<name>.yaml``."""
from __future__ import annotations

from typing import Callable

from rlhf_train.algorithms import critic_free, ppo
from rlhf_train.algorithms.base import Algorithm
from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig

# name -> factory(algorithm cfg, update cfg, group size, max_new_tokens) -> Algorithm
ALGORITHMS: dict[str, Callable[[AlgorithmConfig, UpdateConfig, int, int], Algorithm]] = {
    "ppo": ppo.build,                                           # PPO + GAE, critic, KL in the reward
    "grpo": critic_free.grpo,                                   # group-normalised advantage (Shao et al. 2024)
    "rloo": critic_free.rloo,                                   # leave-one-out baseline (Ahmadian et al. 2024)
    "reinforce_pp": critic_free.reinforce_pp,                   # whitened return-to-go (Hu 2025)
    "reinforce_pp_baseline": critic_free.reinforce_pp_baseline,  # + group-mean baseline (Hu 2025)
}
# names whose estimator compares the samples of a prompt: they need rollout.num_samples >= 2
GROUP_ALGORITHMS = ("grpo", "rloo", "reinforce_pp_baseline")
# names whose advantage is relative to the group alone, 0 for a group of equal rewards (their estimators say so
# with relative_to_group): algorithm.filter_zero_std_groups applies to them
GROUP_RELATIVE = ("grpo", "rloo")


def build_algorithm(cfg: AlgorithmConfig, update: UpdateConfig, group_size: int, max_new_tokens: int) -> Algorithm:
    """The algorithm named by ``cfg.name``."""
    return ALGORITHMS[cfg.name](cfg, update, group_size, max_new_tokens)
