"""A checkpoint as a plain Hugging Face model dir, on request (docs/export.md).

    python -m rlhf_train.tools.export outputs/<task>/<date>/checkpoints/iter_000012 exported/

The end of a run writes ``<run dir>/policy/`` by itself; this gives the same kind of dir for any
checkpoint. A full fine-tuning checkpoint's ``policy/`` already is one (LM + tokenizer + generation
config): it is copied, with the value head beside it. A LoRA checkpoint holds the adapter only: the base
model is loaded from the checkpoint config's ``policy.pretrained``, the adapter and the value head are put
on it, and the merged model + the adapter are written by :func:`rlhf_train.models.export.export_policy`.
``out_dir`` may be new, empty or an earlier export (replaced); one that holds anything else, or that holds or
is inside the checkpoint or the LoRA base, is refused (:mod:`rlhf_train.infra.export_dir`): nothing the tool
did not write is ever deleted. Bad input (that, no such checkpoint, a damaged one, a LoRA base that was built
from ``policy.config`` rather than loaded): one ``Error:`` line, exit status 2, before any model is loaded. A
write that fails (disk full): one ``Error:`` line naming the path and the free space, exit status 1, no temp
dir left.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from rlhf_train.infra.errors import ConfigError, instantiate_or_config_error


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write checkpoint ``checkpoint``'s policy to ``out_dir`` as a plain Hugging Face model dir."""
    from rlhf_train.infra.export_dir import check_export_target, write_export
    from rlhf_train.infra.resume import verify_checkpoint

    checkpoint, out_dir = Path(checkpoint).expanduser(), Path(out_dir).expanduser()
    problem = verify_checkpoint(checkpoint)
    if problem is not None:
        raise ConfigError(f"checkpoint '{checkpoint}': {problem}; point at a complete checkpoints/iter_* dir")
    check_export_target(out_dir, [checkpoint])  # before any model is loaded
    intact = f"checkpoint {checkpoint} is untouched: free space (or give another out_dir) and export again"
    if not (checkpoint / "policy" / "adapter_config.json").is_file():  # full fine-tuning: already plain
        def fill(tmp: Path) -> None:
            shutil.copytree(checkpoint / "policy", tmp, dirs_exist_ok=True)
            if (checkpoint / "value_head.safetensors").is_file():
                shutil.copy2(checkpoint / "value_head.safetensors", tmp / "value_head.safetensors")

        return write_export(out_dir, fill, what=f"the export of {checkpoint}", source=str(checkpoint.resolve()),
                            sources=[checkpoint], intact=intact)
    return _export_lora(checkpoint, out_dir, intact)


def _export_lora(checkpoint: Path, out_dir: Path, intact: str) -> Path:
    from omegaconf import OmegaConf
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlhf_train.infra.export_dir import check_export_target
    from rlhf_train.models.export import export_policy

    cfg = OmegaConf.load(checkpoint / "config.yaml")
    if not cfg.policy.get("pretrained"):
        raise ConfigError(f"checkpoint '{checkpoint}' holds a LoRA adapter on a model built from policy.config "
                          f"(random weights of the run's seed), which is not saved anywhere: the run's own export "
                          f"(<run dir>/policy/, written at its end) holds the merged model")
    sources = [checkpoint]
    base = Path(str(cfg.policy.pretrained)).expanduser()
    if base.exists():  # a local base model: the export must not overwrite it either
        sources.append(base)
    check_export_target(out_dir, sources)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "policy")
    value_head = load_file(checkpoint / "value_head.safetensors")
    policy = instantiate_or_config_error(cfg.policy, tokenizer=tokenizer, value_head=bool(value_head))
    set_peft_model_state_dict(policy.lm, load_file(checkpoint / "policy" / "adapter_model.safetensors"))
    if value_head:
        policy.value_head.load_state_dict(value_head)
    return export_policy(policy, tokenizer, out_dir, source=str(checkpoint.resolve()), sources=sources, intact=intact)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_train.tools.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint dir: <run dir>/checkpoints/iter_NNNNNN")
    p.add_argument("out_dir", help="where to write the model dir: a new or empty dir, or an earlier export "
                                   "(replaced); never one that holds other files, or the checkpoint")
    a = p.parse_args(argv)
    from rlhf_train.infra.checkpoint import CheckpointError  # (imports torch: not for --help)

    try:
        out = export_checkpoint(a.checkpoint, a.out_dir)
    except ConfigError as err:  # bad input: nothing written, nothing deleted
        print(f"Error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # the write failed (disk full): its temp dir removed, the checkpoint intact
        print(f"Error: {err}", file=sys.stderr)
        return 1
    print(f"[rlhf_train] plain Hugging Face model dir: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
