"""The trained policy as a plain Hugging Face model dir: what a user loads without rlhf_train.

:func:`export_policy` writes ``out_dir`` (the trainer: ``<run dir>/policy/`` at the end of a run)::

    config.json, generation_config.json, model.safetensors   the causal LM (``save_pretrained``)
    tokenizer files                                           the tokenizer (``save_pretrained``)
    value_head.safetensors                                    the PPO value head (``summary.weight`` / ``.bias``)
    adapter/                                                  LoRA only: the peft adapter (``PeftModel.from_pretrained``)

It loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
``transformers.pipeline("text-generation", model=out_dir)``. With LoRA the LM is the *merged* model
(peft's ``merge_and_unload`` on a copy, so the policy in memory keeps its adapter): ``W0 + (alpha/r) B A``
in plain weights, no peft needed to run it; the adapter alone is in ``adapter/``. The dir is written
next to ``out_dir`` and renamed into place, so a crash never leaves half an export under that name.
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from rlhf_train.models.lora import is_peft_model


def export_policy(policy: nn.Module, tokenizer: Any, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Write ``policy`` (a :class:`~rlhf_train.models.policy.PolicyWithValue`, unwrapped) to ``out_dir``.

    ``state_dict``: the policy's full state dict when its parameters are sharded (FSDP / ZeRO-3:
    ``accelerator.get_state_dict``); by default the module's own. Not for LoRA under FSDP: the merge
    needs the adapter modules' full weights.
    """
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    from rlhf_train.infra.checkpoint import apply_umask

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = state_dict if state_dict is not None else policy.state_dict()
    lm = policy.lm
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in the run's log
    try:
        if is_peft_model(lm):
            lm.save_pretrained(tmp / "adapter")
            merged = copy.deepcopy(lm).merge_and_unload()  # a copy: the policy in memory keeps its adapter
            merged.save_pretrained(tmp, safe_serialization=True)
            del merged
        else:
            lm_state = {k[len("lm."):]: v for k, v in state.items() if k.startswith("lm.")}
            lm.save_pretrained(tmp, state_dict=lm_state, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
        if is_peft_model(lm):
            tokenizer.save_pretrained(tmp / "adapter")
    vh = {k[len("value_head."):]: v.detach().contiguous().cpu() for k, v in state.items()
          if k.startswith("value_head.")}
    if vh:
        save_file(vh, tmp / "value_head.safetensors")
    apply_umask(tmp)  # safetensors writes 0600: give the files the modes of every other file
    old = out_dir.with_name(f".old-{out_dir.name}")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
