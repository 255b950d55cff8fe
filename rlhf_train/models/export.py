"""The trained policy as a plain Hugging Face model dir: what a user loads without rlhf_train.

:func:`export_policy` writes ``out_dir`` (the trainer: ``<run dir>/policy/`` at the end of a run)::

    config.json, generation_config.json, model.safetensors   the causal LM (``save_pretrained``)
    tokenizer files                                           the tokenizer (``save_pretrained``)
    value_head.safetensors                                    the PPO value head (``summary.weight`` / ``.bias``)
    adapter/                                                  LoRA only: the peft adapter (``PeftModel.from_pretrained``)

It loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
``transformers.pipeline("text-generation", model=out_dir)``. With LoRA the LM is the *merged* model
(peft's ``merge_and_unload`` on a copy, so the policy in memory keeps its adapter): ``W0 + (alpha/r) B A``
in plain weights, no peft needed to run it (tied embeddings with an adapted ``lm_head`` are untied in the
merged copy: :func:`merged_copy`); the adapter alone is in ``adapter/``. ``rlhf_train_export.json`` marks
the dir as an export. Where it may be written, and how (a temp dir renamed into place, nothing of anyone
else's deleted, one line when the disk is full): :mod:`rlhf_train.infra.export_dir`.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from rlhf_train.models.lora import is_peft_model


def export_policy(policy: nn.Module, tokenizer: Any, out_dir: str | Path, state_dict: dict | None = None, *,
                  source: str = "the trained policy", sources: Iterable[str | Path] = (),
                  run_dir: str | Path | None = None, intact: str | None = None) -> Path:
    """Write ``policy`` (a :class:`~rlhf_train.models.policy.PolicyWithValue`, unwrapped) to ``out_dir``.

    ``state_dict``: the policy's full state dict when its parameters are sharded (FSDP / ZeRO-3:
    ``accelerator.get_state_dict``); by default the module's own. Not for LoRA under FSDP: the merge
    needs the adapter modules' full weights. ``out_dir`` follows :mod:`rlhf_train.infra.export_dir`'s rule
    (``sources``: dirs it may neither be nor contain nor be inside); a failed write raises ``CheckpointError``,
    one line ending in ``intact`` (default: which checkpoint of ``run_dir`` is intact).
    """
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    from rlhf_train.infra.export_dir import write_export

    state = state_dict if state_dict is not None else policy.state_dict()
    lm = policy.lm
    if intact is None and run_dir is not None:
        from rlhf_train.infra.checkpoint_files import list_checkpoints

        done = list_checkpoints(run_dir)
        intact = (f"the last complete checkpoint, {done[-1]}, is intact: free space, then run again with "
                  f"trainer.resume=auto to write the export from it" if done else "no complete checkpoint exists")

    def fill(tmp: Path) -> None:
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bars in the run's log
        try:
            if is_peft_model(lm):
                lm.save_pretrained(tmp / "adapter")
                merged = merged_copy(lm)
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

    return write_export(out_dir, fill, what=f"the export of {source}", source=source, sources=sources,
                        run_dir=run_dir, intact=intact)


def merged_copy(lm: nn.Module) -> nn.Module:
    """peft's ``merge_and_unload`` on a copy of ``lm`` (the policy in memory keeps its adapter), with the
    output embedding untied from the input embedding first when either carries an adapter.

    Why: with tied embeddings (GPT-2, SmolLM2, ...) and ``lm_head`` (or the input embedding) in
    ``target_modules`` the two share one weight tensor, and merging the head's ``(alpha/r) B A`` into it
    would also add it to the input embedding, which the trained policy never had (its forward applies the
    adapter to the head alone). The copy gets its own head weight and ``tie_word_embeddings=False``, so
    the merged model computes what the trained policy computes (as peft's own warning recommends).
    """
    model = copy.deepcopy(lm)
    base = model.get_base_model()
    out_emb, in_emb = base.get_output_embeddings(), base.get_input_embeddings()
    if out_emb is not None and in_emb is not None:
        out_layer, in_layer = getattr(out_emb, "base_layer", out_emb), getattr(in_emb, "base_layer", in_emb)
        adapted = out_layer is not out_emb or in_layer is not in_emb  # peft wraps an adapted layer
        if adapted and out_layer.weight is in_layer.weight:
            out_layer.weight = nn.Parameter(out_layer.weight.detach().clone(), requires_grad=False)
            for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
                config.tie_word_embeddings = False
    return model.merge_and_unload()
