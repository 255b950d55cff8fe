"""pyproject.toml's dependency ranges say what was tested (docs/installation.md, "## Lowest tested versions").

1. Every package of that table has its lower bound in pyproject.toml at the table's version, and the page's
   check command pins that version (torch: the README's CPU pin, the only CPU build of torch PyPI serves here).
2. torch has no upper bound, its lower bound admits the README's pinned torch and a GPU image's CUDA build of
   it (``2.11.0+cu130``): ``pip install -e .`` keeps such a torch instead of replacing it.

Budget: well under a second (text parsing only).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "installation.md"


def dependencies() -> dict[str, Requirement]:
    """pyproject.toml's ``[project] dependencies``, by package name."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {(r := Requirement(line)).name: r for line in project["dependencies"]}


def lower_bound(req: Requirement) -> str:
    bounds = [s.version for s in req.specifier if s.operator == ">="]
    assert len(bounds) == 1, f"{req}: one >= bound"
    return bounds[0]


def documented() -> dict[str, str]:
    """The table of docs/installation.md's "## Lowest tested versions": package -> its lowest tested version."""
    text = PAGE.read_text()
    m = re.search(r"^## Lowest tested versions\n(.*?)(?=^## |\Z)", text, flags=re.DOTALL | re.MULTILINE)
    assert m, "docs/installation.md: no '## Lowest tested versions' section"
    rows = re.findall(r"^\| `([\w.-]+)` \| ([\w.]+) \|", m.group(1), flags=re.MULTILINE)
    return dict(rows)


def check_command() -> str:
    """The page's install command of the lowest versions (continuation lines joined)."""
    text = PAGE.read_text().replace("\\\n", " ")
    lines = [ln for ln in text.splitlines() if ln.startswith("pip install torch==") and "-e" in ln.split()]
    assert len(lines) == 1, lines
    return lines[0]


def test_lower_bounds_are_the_tested_versions():
    deps, table = dependencies(), documented()
    assert {"torch", "transformers", "peft", "accelerate", "tensordict", "torchrl", "datasets"} <= set(table), table
    for name, version in table.items():
        assert name in deps, f"docs/installation.md lists {name}, which pyproject.toml does not depend on"
        assert Version(lower_bound(deps[name])) == Version(version), \
            f"pyproject.toml {deps[name]} vs docs/installation.md's lowest tested {name} {version}"


def test_the_documented_check_pins_the_tested_versions():
    pins = dict(re.findall(r"\b([\w.-]+)==([\w.+]+)", check_command()))
    readme_torch = re.search(r"pip install torch==([\w.]+)", (REPO / "README.md").read_text()).group(1)
    for name, version in documented().items():
        assert pins.get(name) == (readme_torch if name == "torch" else version), (name, pins.get(name), version)


def test_torch_range_keeps_an_installed_torch():
    torch = dependencies()["torch"]
    assert not any(s.operator in ("<", "<=", "==", "~=") for s in torch.specifier), \
        f"{torch}: an upper bound makes pip replace a newer torch that an environment already holds"
    readme_torch = re.search(r"pip install torch==([\w.]+)", (REPO / "README.md").read_text()).group(1)
    lowest = documented()["torch"]
    for installed in (readme_torch, f"{lowest}.0+cu130", f"{lowest}.0"):
        assert torch.specifier.contains(installed), (str(torch), installed)
