"""The run's precision and its sampler / trainer correction, decided and checked in one place.

``trainer.precision`` (fp32 | bf16 | fp16) is the one key that sets the compute precision: it becomes
Accelerate's ``mixed_precision`` (``fp32`` -> ``no``), so the weights, the optimizer and its state stay
float32 (the master copy) while every forward pass runs under Accelerate's autocast: the update's (the
prepared policy's forward), and in the rollout the generation, the policy's scoring pass, the reference and
the reward model (:class:`rlhf_train.rollout.rollout_from_model.RolloutFromModel`'s ``autocast``). fp16
adds Accelerate's gradient scaler (GPU only). ``null`` leaves it to ``accelerate launch`` (its
``--mixed_precision`` or config file), else fp32. ``trainer.mixed_precision``, its older name with
Accelerate's values (``no`` | ``bf16`` | ``fp16``), is read as ``trainer.precision`` with one log line.
``trainer.fp32_lm_head`` keeps the LM head's matmul and log-softmax in float32 in every pass
(:func:`rlhf_train.models.scoring.set_fp32_lm_head`).

``algorithm.is_correction`` (:class:`rlhf_train.algorithms.configs.ISCorrectionConfig`) is checked here
too: it needs the sampler's log-probs (sampled generation) and a threshold around 1.
"""
from __future__ import annotations

import logging

from omegaconf import DictConfig

from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
ACCELERATE_NAMES = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}  # trainer.precision -> Accelerate's mixed_precision
OLDER_NAMES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}       # trainer.mixed_precision -> trainer.precision


def check_precision(trainer: DictConfig) -> None:
    """``trainer.precision`` / ``trainer.mixed_precision``: known values that agree (one line naming the key)."""
    p, older = trainer.get("precision"), trainer.get("mixed_precision")
    if p is not None and p not in PRECISIONS:
        raise ConfigError(f"trainer.precision='{p}' is not valid; choose one of: {', '.join(PRECISIONS)} (or null: "
                          f"what `accelerate launch` was given, else fp32)")
    if older is not None and older not in OLDER_NAMES:
        raise ConfigError(f"trainer.mixed_precision='{older}' is not valid (it is the older name of "
                          f"trainer.precision): use trainer.precision={'|'.join(PRECISIONS)}")
    if p is not None and older is not None and OLDER_NAMES[older] != p:
        raise ConfigError(f"trainer.precision={p} and trainer.mixed_precision={older} disagree: set trainer.precision "
                          f"only (trainer.mixed_precision is its older name)")


def decide_precision(trainer: DictConfig) -> str | None:
    """``trainer.precision`` (or its older name, mapped with a log line); ``None``: what ``accelerate launch``
    was given. Call after :func:`check_precision`."""
    p, older = trainer.get("precision"), trainer.get("mixed_precision")
    if older is not None:
        log.info("[rlhf_train] trainer.mixed_precision=%s is read as trainer.precision=%s (its older name)",
                 older, OLDER_NAMES[older])
        return OLDER_NAMES[older]
    return p


def check_device_precision(accelerator) -> None:
    """fp16 needs an accelerator: on a CPU Accelerate would silently run it as fp32 (no fp16 autocast, no
    gradient scaler). One line, before any model is built."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError("trainer.precision=fp16 needs a GPU (fp16 autocast with loss scaling); on a CPU use "
                          "trainer.precision=bf16 (or fp32)")


def check_is_correction(cfg: DictConfig) -> None:
    """``algorithm.is_correction``: a known level and mode, a threshold ``[low, high]`` with
    ``0 <= low <= 1 <= high`` (weights of 1, the on-policy case, are never filtered), sampled generation."""
    from rlhf_train.core.mismatch import IS_LEVELS, IS_MODES

    c = cfg.algorithm.get("is_correction")
    if c is None or c.get("level") is None:
        return
    if c.level not in IS_LEVELS:
        raise ConfigError(f"algorithm.is_correction.level='{c.level}' is not valid; choose one of: "
                          f"{', '.join(IS_LEVELS)} (or null: no correction)")
    if c.mode not in IS_MODES:
        raise ConfigError(f"algorithm.is_correction.mode='{c.mode}' is not valid; choose one of: {', '.join(IS_MODES)}")
    t = list(c.threshold)
    if len(t) != 2 or not 0 <= t[0] <= 1 <= t[1] or not t[0] < t[1]:
        raise ConfigError(f"algorithm.is_correction.threshold={t} must be [low, high] with 0 <= low <= 1 <= high and "
                          f"low < high (e.g. [0, 2]: weights above 2 clipped)")
    if not cfg.rollout.get("do_sample", True):
        raise ConfigError("algorithm.is_correction needs the sampler's log-probs, which greedy decoding does not "
                          "record: set rollout.do_sample=true (or algorithm.is_correction.level=null)")
