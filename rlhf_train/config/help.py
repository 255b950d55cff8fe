"""The parts of ``python -m rlhf_train --help`` that must not drift from the files in ``conf/``.

Hydra prints the help page from ``hydra.help.template`` (``conf/hydra/help/rlhf_train.yaml``). Two pieces of
it are read from the config tree when the page is printed, through the OmegaConf resolver ``rlhf_help``
(registered by :func:`register_help_resolver`, called in :mod:`rlhf_train.__main__`):

* ``${rlhf_help:recipes}``: one entry per ``conf/recipe/*.yaml``, described by the first sentence of the
  file's leading comment block;
* ``${rlhf_help:groups,${hydra:runtime.choices}}``: the config groups of the primary config's defaults list
  (``conf/config.yaml``), each with what it sets (:data:`GROUP_HELP`) and its options (the ``*.yaml`` files
  of its folder), the one this command line selects starred. Hydra's own ``$APP_CONFIG_GROUPS`` would also list
  the structured-config schema entries (``*_schema``), which are not choices.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[2] / "conf"
NAME_WIDTH = 16  # the column the descriptions start at, after two spaces of indent
WIDTH = 100      # wrap descriptions at this many characters


def _first_sentence(comment_lines: list[str]) -> str:
    text = " ".join(line.strip() for line in comment_lines)
    match = re.search(r"[.!?](\s+(?=[A-Z`(])|$)", text)
    return (text[: match.start() + 1] if match else text).strip()


def leading_comment(path: Path) -> list[str]:
    """The comment lines at the top of a yaml file, without ``#`` and without a ``# @package`` directive."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package"):
            lines.append(text)
    return lines


def _entry(name: str, text: str) -> str:
    """``  name            text``, the text wrapped at WIDTH and indented under its first line."""
    head = f"  {name:<{NAME_WIDTH}}" if len(name) < NAME_WIDTH else f"  {name} "
    if not text:
        return head.rstrip()
    return textwrap.fill(text, WIDTH, initial_indent=head, subsequent_indent=" " * (NAME_WIDTH + 2))


def recipe_names(conf: Path = CONF) -> list[str]:
    return sorted(p.stem for p in (conf / "recipe").glob("*.yaml"))


def recipes_text(conf: Path = CONF) -> str:
    """One entry per recipe: its name and the first sentence of its leading comment."""
    return "\n".join(_entry(name, _first_sentence(leading_comment(conf / "recipe" / f"{name}.yaml")))
                     for name in recipe_names(conf))


# what each config group sets, for the help page (a group missing here is listed without a description)
GROUP_HELP = {
    "tokenizer": "the tokenizer (a Hugging Face one, or a BPE trained on the task's data)",
    "policy": "the policy LM and its value head",
    "ref_model": "the frozen reference policy of the KL penalty",
    "reward_model": "the reward model that scores responses",
    "kl_controller": "the KL coefficient: constant, or adaptive (Ziegler et al. 2019)",
    "transforms": "the reward-shaping stack: score shaping -> KL -> per-token reward",
    "data": "the prompts (and their reference responses, when the task has them)",
    "rollout": "how responses are sampled: length, temperature, top-k / top-p",
    "generation": "the generation backend (static_cache: compiled, for GPUs; auto: it on CUDA)",
    "env": "a multi-turn environment with tools (none: one prompt, one completion)",
    "update": "the minibatch update's keys (epochs, minibatches, clip, grad norm)",
    "algorithm": "PPO, GRPO, RLOO or REINFORCE++: advantages, loss, KL place, GAE",
    "optimizer": "the optimizer of the policy and value head",
    "scheduler": "the learning-rate schedule",
    "trainer": "iterations, seed, checkpoints, resume, faults, precision",
    "logger": "where metrics go: W&B, metrics.csv, or nowhere",
    "sft": "stage 1 of the pipeline: supervised fine-tuning (stage=sft or pipeline)",
    "rm": "stage 2 of the pipeline: reward-model training (stage=rm or pipeline)",
    "evaluation": "after the RL stage: the before/after table, summary.json and plot",
}


def config_groups(conf: Path = CONF) -> list[str]:
    """The groups of ``conf/config.yaml``'s defaults list, in its order (``override hydra/...`` entries left out)."""
    import yaml

    defaults = yaml.safe_load((conf / "config.yaml").read_text(encoding="utf-8"))["defaults"]
    return [group for entry in defaults if isinstance(entry, dict)
            for group in entry if not group.startswith("override ")]


def group_options(group: str, conf: Path = CONF) -> list[str]:
    return sorted(p.stem for p in (conf / group).glob("*.yaml"))


def groups_text(choices=None, conf: Path = CONF) -> str:
    """Two lines per config group: what it sets, then its options (the one selected starred)."""
    choices = OmegaConf.to_container(choices) if OmegaConf.is_config(choices) else dict(choices or {})
    out = []
    for group in config_groups(conf):
        opts = ", ".join(o + ("*" if choices.get(group) == o else "") for o in group_options(group, conf))
        out.append(_entry(group, GROUP_HELP.get(group, "")) + "\n" + _entry("", opts))
    return "\n".join(out)


def help_section(what: str, choices=None) -> str:
    """The resolver ``rlhf_help``: ``recipes`` or ``groups``. ``$`` is doubled: Hydra runs the page through
    :class:`string.Template` after OmegaConf has resolved it."""
    text = recipes_text() if what == "recipes" else groups_text(choices) if what == "groups" else None
    if text is None:
        raise ValueError(f"rlhf_help: unknown section '{what}'; use recipes or groups")
    return text.replace("$", "$$")


def register_help_resolver() -> None:
    if not OmegaConf.has_resolver("rlhf_help"):
        OmegaConf.register_new_resolver("rlhf_help", help_section)
