"""Loading causal LMs: from a local dir, from a hub name already in the local cache, or a fresh GPT-2.

:func:`build_causal_lm` is what the policy, the reference and the reward model's trunk are built from
(:mod:`rlhf_train.models.policy`, :mod:`rlhf_train.models.reward_model`). Runs are offline:
:func:`check_loadable` never touches the network, and a hub name that is not in the local Hugging Face
cache fails at start with one ``ConfigError`` naming the config key (e.g. ``policy.pretrained``) to point
at a local copy. Special-token ids (EOS / pad / BOS) always come from the tokenizer, never from a
constant, so ``generate`` stops on the tokenizer's own EOS. Dropout defaults to 0: the rollout's and the
update's log-probs must come from the same deterministic policy (Huang et al. 2024, "The N+
Implementation Details of RLHF with PPO"). :func:`context_length` reads the model's maximum length.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from rlhf_train.infra.errors import ConfigError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "fp32": "float32", "bf16": "bfloat16"}


# --------------------------------------------------------------------------------------------
# Loading: local paths or hub names; offline hub names fail at start with the override to set.
# --------------------------------------------------------------------------------------------
def _is_local(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(str(path)))


def check_loadable(name_or_path: str, override: str, what: str = "model") -> str:
    """Return a local path or a hub name that is already in the local HF cache; else one clear error.

    ``override`` is the config key a user sets to point at a local copy (e.g. ``policy.pretrained``).
    A ``.gguf`` file (or ``pkg://<module>/<file>.gguf``: a file shipped inside an installed package) is
    converted once to a safetensors dir in the cache (:func:`rlhf_train.models.gguf.gguf_to_dir`), whose
    path is returned.
    """
    from rlhf_train.models.gguf import gguf_to_dir, resolve_package_path

    name_or_path = resolve_package_path(str(name_or_path), override)
    if str(name_or_path).lower().endswith(".gguf"):
        return gguf_to_dir(name_or_path, override)
    if _is_local(name_or_path):
        return os.path.expanduser(str(name_or_path))
    try:
        from huggingface_hub import snapshot_download

        # local_files_only: never touch the network here; a cached snapshot is fine
        return snapshot_download(str(name_or_path), local_files_only=True)
    except Exception:
        pass
    if os.path.exists(os.path.expanduser(str(name_or_path))):
        raise ConfigError(f"{what} path '{name_or_path}' is not a directory; set {override}=<a local model dir>")
    raise ConfigError(
        f"cannot load {what} '{name_or_path}': it is not a local directory and is not in the local "
        f"Hugging Face cache (offline?). Download it on a machine with network access and set "
        f"{override}=/path/to/local/{str(name_or_path).split('/')[-1]}"
    )


def _apply_special_tokens(config, tokenizer, keep_eos: bool = False) -> None:
    """EOS / pad / BOS ids come from the tokenizer, never from a constant. ``keep_eos`` (a generation
    config): the tokenizer's EOS first, then the EOS ids the config already lists (e.g. SmolLM2's
    ``<|im_end|>`` and ``<|endoftext|>``); responses end at the first of any."""
    if tokenizer is None:
        return
    old = getattr(config, "eos_token_id", None) if keep_eos else None
    old = [] if old is None else list(old) if isinstance(old, (list, tuple)) else [old]
    eos = [tokenizer.eos_token_id] + [int(e) for e in old if e != tokenizer.eos_token_id and e < len(tokenizer)]
    config.eos_token_id = eos if len(eos) > 1 else eos[0]
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def build_causal_lm(
    pretrained: str | None = None,
    config: dict | None = None,
    tokenizer: Any = None,
    trust_remote_code: bool = False,
    dropout: float | None = 0.0,
    override_key: str = "policy.pretrained",
    dtype: str = "float32",
) -> nn.Module:
    """A ``transformers`` causal LM: from ``pretrained`` (local dir or hub name) or built from ``config``.

    ``config`` holds ``GPT2Config`` keyword arguments (``n_layer``, ``n_embd``, ``n_head``,
    ``n_positions``), or, with a ``model_type`` key (``llama``, ``qwen2``, ...), that architecture's config
    arguments; its vocabulary size and special-token ids are taken from the tokenizer.
    ``dropout`` (default 0: RLHF wants a deterministic policy, see the N+ implementation details)
    overrides every dropout probability of the model config. ``dtype``: ``float32`` | ``bfloat16``, the
    weights' dtype. Any ``transformers`` causal LM architecture loads (GPT-2, GPT-NeoX, Llama, Qwen2, Gemma, ...).
    """
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if pretrained:
        path = check_loadable(pretrained, override_key)
        kwargs = {}
        if dropout is not None:
            kwargs = {k: dropout for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                                           "attention_dropout", "hidden_dropout")}
        from transformers import AutoConfig

        from rlhf_train.models.model_dirs import check_finite, check_model_dir, load_errors

        if os.path.isdir(path):  # a damaged dir: one line naming the key, not transformers' traceback
            check_model_dir(path, override_key, str(pretrained), trust_remote_code)
        with load_errors(override_key, str(pretrained)):
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            kwargs = {k: v for k, v in kwargs.items() if hasattr(cfg, k)}
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
        check_finite(model, path, override_key, str(pretrained))
    else:
        cfg_kwargs = dict(config or {})
        if tokenizer is not None:
            cfg_kwargs["vocab_size"] = len(tokenizer)
            cfg_kwargs["eos_token_id"] = tokenizer.eos_token_id
            cfg_kwargs["bos_token_id"] = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            cfg_kwargs["pad_token_id"] = tokenizer.pad_token_id
        model_type = cfg_kwargs.pop("model_type", "gpt2")
        if model_type == "gpt2":
            if dropout is not None:
                cfg_kwargs.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
            model = GPT2LMHeadModel(GPT2Config(**cfg_kwargs))
        else:  # any architecture by its model_type (llama, qwen2, gpt_neox, gemma, ...), random weights
            from transformers import AutoConfig

            try:
                lm_cfg = AutoConfig.for_model(model_type, **cfg_kwargs)
            except ValueError as err:
                raise ConfigError(f"{override_key.rsplit('.', 1)[0]}.config.model_type={model_type}: {err}") from None
            for key in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
                if dropout is not None and hasattr(lm_cfg, key):
                    setattr(lm_cfg, key, dropout)
            model = AutoModelForCausalLM.from_config(lm_cfg)
    _apply_special_tokens(model.config, tokenizer)
    _apply_special_tokens(model.generation_config, tokenizer, keep_eos=bool(pretrained))
    if dtype not in DTYPES:
        raise ConfigError(f"{override_key.rsplit('.', 1)[0]}.dtype={dtype} is not valid; choose one of: {', '.join(DTYPES)}")
    return model.to(getattr(torch, DTYPES[dtype]))


def context_length(lm: nn.Module) -> int | None:
    cfg = lm.config
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    return None
