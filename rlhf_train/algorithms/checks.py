"""The ``algorithm`` section's checks (one line each, naming the key and the fix), run by
:func:`rlhf_train.loop.checks.check_config` before any work starts."""
from __future__ import annotations

from omegaconf import DictConfig

from rlhf_train.infra.errors import ConfigError


def check_algorithm(cfg: DictConfig) -> None:
    """The ``algorithm`` section against ``rollout.num_samples``: one line naming the key and the fix."""
    from rlhf_train.algorithms.registry import ALGORITHMS, GROUP_ALGORITHMS, GROUP_RELATIVE
    from rlhf_train.core.advantages import SCALE_REWARDS
    from rlhf_train.core.losses import LOSS_AGGS, RATIO_LEVELS

    a, k = cfg.get("algorithm") or {}, cfg.rollout.get("num_samples", 1)
    name = a.get("name", "ppo")
    for key, value, allowed in (("name", name, tuple(ALGORITHMS)), ("scale_rewards", a.get("scale_rewards", "group"),
                                SCALE_REWARDS), ("loss_agg", a.get("loss_agg", "token_mean"), LOSS_AGGS),
                                ("ratio_level", a.get("ratio_level", "token"), RATIO_LEVELS)):
        if value not in allowed:
            raise ConfigError(f"algorithm.{key}='{value}' is not valid; choose one of: {', '.join(allowed)}")
    if k is None or k < 1:
        raise ConfigError(f"rollout.num_samples={k} must be positive")
    if name in GROUP_ALGORITHMS and k < 2:
        raise ConfigError(f"algorithm={name} compares the samples of a prompt: set rollout.num_samples >= 2 "
                          f"(got {k})")
    for key in ("clip_low", "clip_high", "norm_length"):
        if a.get(key) is not None and a.get(key) <= 0:
            raise ConfigError(f"algorithm.{key}={a.get(key)} must be positive (or null)")
    if a.get("beta", 0.0) < 0:
        raise ConfigError(f"algorithm.beta={a.get('beta')} must be >= 0")
    if a.get("beta", 0.0) > 0 and a.get("kl_in_reward", True):
        raise ConfigError(f"algorithm.beta={a.get('beta')} puts the KL in the loss while algorithm.kl_in_reward=true "
                          f"also puts it in the reward: set algorithm.kl_in_reward=false or algorithm.beta=0")
    if a.get("filter_zero_std_groups", False) and name not in GROUP_RELATIVE:
        raise ConfigError(f"algorithm.filter_zero_std_groups=true drops groups whose advantage is 0; algorithm={name}'s "
                          f"is not 0 for them: use it with algorithm=grpo|rloo, or set it to false")
    if a.get("kl_ratio_weighted", False) and not a.get("beta", 0.0) > 0:
        raise ConfigError("algorithm.kl_ratio_weighted=true weighs the KL term in the loss, and algorithm.beta=0 puts "
                          "none there: set algorithm.beta > 0 (with algorithm=grpo) or kl_ratio_weighted=false")
    if a.get("scale_eps", 1e-6) <= 0:
        raise ConfigError(f"algorithm.scale_eps={a.get('scale_eps')} must be positive")
    if name == "ppo":
        default = {"loss_agg": "token_mean", "ratio_level": "token", "clip_low": None, "clip_high": None,
                   "kl_in_reward": True, "beta": 0.0}
        changed = [key for key, value in default.items() if a.get(key, value) != value]
        if changed:
            raise ConfigError(f"algorithm.{changed[0]} does not apply to algorithm=ppo (PPO: clipped surrogate with "
                              f"update.clip_eps, token mean, KL in the reward); choose algorithm=grpo|rloo|reinforce_pp")
