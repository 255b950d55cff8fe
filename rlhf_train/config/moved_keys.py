"""Config keys that moved, and where: a command line (or a recipe) written for an older layout gets one
line naming the new key instead of Hydra's "not in struct" traceback. Torch-free: the CLI reads it before
Hydra composes."""
from __future__ import annotations

from rlhf_train.algorithms.configs import MOVED_PPO_KEYS


def moved_key_message(override: str) -> str | None:
    """``ppo.num_epochs=2`` -> "ppo.num_epochs is now update.num_epochs ..."; ``None`` for a current key."""
    key = override.lstrip("+~").split("=", 1)[0]
    if key == "ppo" or key.startswith("ppo."):
        name = key.split(".", 1)[1] if "." in key else ""
        where = MOVED_PPO_KEYS.get(name)
        new = f"{where}.{name}" if where else "update.<key> (the update's keys) or algorithm.<key> (PPO's own)"
        return (f"{key} is now {new}: the `ppo` section was split into `update` (num_epochs, minibatch_size, "
                f"gradient_accumulation_steps, clip_eps, ent_coef, max_grad_norm; every algorithm) and `algorithm` "
                f"(gamma, lam, vf_coef, clip_eps_value, whiten_advantages)")
    if key == "policy.gradient_checkpointing":
        return "policy.gradient_checkpointing is now update.gradient_checkpointing (the update's forward is what it recomputes)"
    if key == "rollout.hf_generate":
        return "rollout.hf_generate is now a config group: use generation=hf_generate (or generation=decode_loop)"
    if key == "transforms.ref_logprob" or key.startswith("transforms.ref_logprob."):
        return ("transforms.ref_logprob is gone: the reference pass is not a shaping entry; its Ray settings are "
                "ref_model.ray_service.* (e.g. ref_model.ray_service.enabled=true)")
    return None
