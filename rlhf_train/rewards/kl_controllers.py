"""KL-penalty coefficient controllers (the beta in r = score - beta * KL).

Adaptive control follows Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", section 2.2:

    e_t       = clip(KL_t / KL_target - 1, -0.2, 0.2)
    beta_t+1  = beta_t * (1 + K_beta * e_t),   K_beta = n_steps / horizon

Why not ``torchrl.data.llm.utils.AdaptiveKLController``: its ``update`` expects the
mean of ``reward_kl`` values (already scaled by -coef, per token, averaged over a
[B, T] batch that includes the zeros after EOS) and recovers the KL by dividing by
-coef; it counts one entry per *batch* as n_steps (so K_beta is per batch, not per
sequence as in the paper); and it has no state_dict, so a resumed run would restart
from init_kl_coef. Ours takes per-sequence KL (summed over response tokens, in nats),
counts sequences, and saves/loads its state. Fed the same numbers (values =
-coef * kl_seq, one per sequence) both give the same update; see
tests/unit/rewards/test_kl_controllers.py.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import Tensor


class KLController(Protocol):
    coef: float

    def update(self, kl_values: Tensor | Sequence[float]) -> float: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, d: dict) -> None: ...


class ConstantKLController:
    """Fixed coefficient; ``update`` ignores its input."""

    def __init__(self, kl_coef: float):
        self.coef = float(kl_coef)

    def update(self, kl_values: Tensor | Sequence[float]) -> float:
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, d: dict) -> None:
        self.coef = float(d["coef"])


class AdaptiveKLController:
    """Ziegler et al. 2019 adaptive coefficient, driven by per-sequence KL.

    ``update(kl_values)``: kl_values [N] per-sequence KL (summed over response tokens, nats).
        KL_t = mean(kl_values); n_steps = N
        e_t  = clip(KL_t / target - 1, -0.2, 0.2)
        coef <- coef * (1 + e_t * n_steps / horizon)
    Non-finite values are dropped; an empty kl_values leaves coef unchanged.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if not target > 0:
            raise ValueError(f"target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.coef = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, kl_values: Tensor | Sequence[float]) -> float:
        kl = torch.as_tensor(kl_values, dtype=torch.float64).detach().cpu().flatten()
        kl = kl[torch.isfinite(kl)]  # a faulty rollout (NaN/inf KL) must not poison the coefficient for good
        n_steps = kl.numel()
        if n_steps == 0:
            return self.coef
        error = min(max(kl.mean().item() / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: dict) -> None:
        self.coef = float(d["coef"])
        self.target = float(d.get("target", self.target))
        self.horizon = d.get("horizon", self.horizon)
