"""LoRA adapters on the policy LM through ``peft``, and the reference model they give for free.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): each adapted
linear map ``h = W0 x`` becomes ``h = W0 x + (alpha / r) B A x`` with ``A [r, in]``, ``B [out, r]``;
``W0`` is frozen, ``A`` and ``B`` train, and ``B`` starts at zero, so the adapted model starts *equal*
to the base model. With ``policy.lora.r > 0``, :func:`apply_lora` wraps the policy's causal LM in peft's
``PeftModelForCausalLM`` (``get_peft_model``; the value head trains in full beside it).

The reference π_ref of the KL penalty is the initial policy, i.e. the base model: the same network with
the adapter switched off (peft's ``disable_adapter()``, as TRL does). :func:`adapter_disabled` runs a
scoring function under it, so one copy of the weights serves policy and reference, and since the
policy's and the reference's log-probs then come from the same one-pass code
(:func:`rlhf_train.models.scoring.sequence_logprobs`) the first iteration's KL is exactly 0.

Why peft and not our own low-rank layers: it covers every ``transformers`` architecture (``all-linear``
finds the linear layers of each, GPT-2's ``Conv1D`` included, ``fan_in_fan_out`` set for them), and
its adapter format is what users load (``PeftModel.from_pretrained``).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from torch import nn

from rlhf_train.infra.errors import ConfigError

LORA_KEYS = ("r", "alpha", "dropout", "target_modules")


def lora_settings(lora: Any, key: str = "policy.lora") -> dict | None:
    """The ``policy.lora`` (or ``sft.lora``: ``key``) section as a plain dict, checked; ``None`` when ``r``
    is 0 (full fine-tuning)."""
    if lora is None:
        return None
    if hasattr(lora, "items") and not isinstance(lora, dict):  # a DictConfig
        from omegaconf import OmegaConf

        lora = OmegaConf.to_container(lora, resolve=True)
    lora = dict(lora)
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a LoRA setting; the keys are {', '.join(LORA_KEYS)}")
    r = int(lora.get("r") or 0)
    if r < 0:
        raise ConfigError(f"{key}.r={r} must be >= 0 (0 = full fine-tuning, e.g. 8 or 16 for LoRA)")
    if r == 0:
        return None
    alpha, dropout = float(lora.get("alpha", 16)), float(lora.get("dropout", 0.0))
    if alpha <= 0:
        raise ConfigError(f"{key}.alpha={alpha:g} must be positive (the adapter's scale is alpha / r)")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{key}.dropout={dropout:g} must be in [0, 1)")
    target = lora.get("target_modules") or "all-linear"
    if not isinstance(target, str):
        target = [str(t) for t in target]
    return {"r": r, "alpha": alpha, "dropout": dropout, "target_modules": target}


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft model (carries adapters that ``disable_adapter()`` can switch off)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def apply_lora(lm: nn.Module, lora: Any, gradient_checkpointing: bool = False, key: str = "policy.lora") -> nn.Module:
    """``lm`` itself when ``policy.lora.r`` is 0; else ``get_peft_model(lm, LoraConfig(...))``: base
    weights frozen, a fresh adapter (``B = 0``) on ``target_modules``. Matching no module is a
    :class:`ConfigError` naming ``policy.lora.target_modules``."""
    settings = lora_settings(lora, key)
    if settings is None:
        return lm
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    check_targets(lm, settings, key)
    # GPT-2's Conv1D stores its weight transposed: peft must know (it would set it, with a warning)
    fan_in_fan_out = any(isinstance(m, Conv1D) for m in lm.modules())
    config = LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                        target_modules=settings["target_modules"], fan_in_fan_out=fan_in_fan_out,
                        task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft asks transformers 5 a deprecated attribute: not the user's business
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(lm, config)
    except ValueError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}.target_modules={settings['target_modules']!r} does not fit this model "
                          f"({first}); use all-linear or names of its linear layers (e.g. [q_proj, v_proj])") from None
    if gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return model


def _linear_layers(lm: nn.Module) -> dict[str, tuple[int, int]]:
    """``{module name: (in features, out features)}`` of every linear layer (``nn.Linear``, GPT-2's ``Conv1D``)."""
    from transformers.pytorch_utils import Conv1D

    out = {}
    for name, m in lm.named_modules():
        if isinstance(m, nn.Linear):
            out[name] = (m.in_features, m.out_features)
        elif isinstance(m, Conv1D):  # weight [in, out]
            out[name] = tuple(m.weight.shape)
    return out


def check_targets(lm: nn.Module, settings: dict, key: str = "policy.lora") -> None:
    """Before any adapter is built: every name in a ``target_modules`` list matches a module (peft refuses
    only a list that matches nothing, and silently skips the names that match nothing), and ``r`` is at most
    the width of every adapted layer (an adapter ``B A`` on a layer of width ``d`` has rank at most ``d``:
    a larger ``r`` only costs memory). One :class:`ConfigError` naming the key, listing the model's linear
    layers. The matching is peft's: a name matches a module whose name is it or ends with ``.<name>``."""
    import re

    linear, target = _linear_layers(lm), settings["target_modules"]
    if isinstance(target, list):
        names = [n for n, _ in lm.named_modules()]
        unknown = [t for t in target if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:
            available = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ConfigError(f"{key}.target_modules: {', '.join(unknown)} match no module of this model; its linear "
                              f"layers are {', '.join(available)} (or use all-linear)")
        adapted = {n: w for n, w in linear.items() if any(n == t or n.endswith("." + t) for t in target)}
    elif target == "all-linear":  # peft leaves the output layer out
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        adapted = {n: w for n, w in linear.items() if lm.get_submodule(n) is not head}
    else:  # a regular expression over the full module names (peft: re.fullmatch)
        adapted = {n: w for n, w in linear.items() if re.fullmatch(target, n)}
    if adapted:
        name, (d_in, d_out) = min(adapted.items(), key=lambda item: min(item[1]))
        if settings["r"] > min(d_in, d_out):
            raise ConfigError(f"{key}.r={settings['r']} exceeds the width of the adapted layer {name} ({d_in} in, "
                              f"{d_out} out): its adapter has rank at most {min(d_in, d_out)}; choose "
                              f"{key}.r <= {min(d_in, d_out)}")


def adapter_disabled(fn: Callable, lm: nn.Module) -> Callable:
    """``fn`` (e.g. the reference log-prob pass over ``lm``) run with ``lm``'s adapter switched off:
    the base model, i.e. the initial policy π_ref."""

    def with_adapter_off(*args, **kwargs):
        with lm.disable_adapter():
            return fn(*args, **kwargs)

    with_adapter_off.__name__ = f"adapter_disabled_{getattr(fn, '__name__', 'fn')}"
    return with_adapter_off
