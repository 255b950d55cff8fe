"""The source tree shows the architecture: layers import only downwards, core is pure math, files stay small.

Layers, bottom to top (the first package under ``rlhf_train/``; the top-level ``__init__.py`` and
``__main__.py`` sit above everything)::

    core < infra < models < data < generation = rewards = envs < algorithms < rollout < tasks < loop
         < pipeline < config < tools < __main__

Every import is read with :mod:`ast` (module level and inside functions, ``import x`` and
``from x import y``, relative imports resolved), so a lazy import inside a function counts too.
No two files import each other, directly or around a circle (a lazy import inside a function
included): a helper both need goes into a module below both, split by concept.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_train"

# Rank of each layer. generation and rewards share a rank: siblings, and only a strictly higher rank is forbidden.
LAYERS: dict[str, int] = {
    "core": 0,
    "infra": 1,
    "models": 2,
    "data": 3,
    "generation": 4,
    "rewards": 4,
    "envs": 4,  # environments of multi-turn episodes (their rewards are reward sources)
    "algorithms": 5,
    "rollout": 6,
    "tasks": 7,
    "compat": 7,  # torchrl's API over the product (imported by nothing in the package)
    "loop": 8,
    "pipeline": 9,
    "config": 10,
    "tools": 11,
}
TOP = "__main__"  # the package's own __init__.py / __main__.py, and `import rlhf_train` itself
LAYERS[TOP] = 12

MAX_LINES = 400
# Third-party libraries that pure tensor math in core/ must not touch (models, configs, launchers, services).
CORE_FORBIDDEN = ("transformers", "hydra", "omegaconf", "accelerate", "deepspeed", "ray", "wandb")


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    """Layer of a dotted ``rlhf_train...`` module name."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return TOP
    if parts[1] not in LAYERS:
        raise AssertionError(
            f"{module}: 'rlhf_train.{parts[1]}' is not a layer; move the module into a layer folder, "
            "or add a new layer folder to LAYERS in tests/meta/test_architecture.py"
        )
    return parts[1]


def _imports(path: Path, own: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute dotted module) of every import in ``path``, at any depth of the syntax tree.

    ``from a.b import c`` yields ``a.b.c`` (``c`` may be a submodule; when it is a name defined in
    ``a.b`` the layer is the same, since layers are decided by the first package under rlhf_train).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = own or _module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb level - 1 packages from this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.extend((node.lineno, f"{mod}.{alias.name}" if alias.name != "*" else mod) for alias in node.names)
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_layers_import_only_downwards():
    bad = []
    for path in _sources():
        importer = _module_name(path)
        own = _layer(importer)
        for line, mod in _imports(path):
            if mod != "rlhf_train" and not mod.startswith("rlhf_train."):
                continue
            other = _layer(mod)
            if LAYERS[other] > LAYERS[own]:
                bad.append(f"{_rel(path)}:{line} ({own}) imports {mod} ({other}), a layer above it")
    assert not bad, "layering violations (a module may import only its own layer or those below):\n" + "\n".join(bad)


def test_core_is_pure_math():
    bad = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for line, mod in _imports(path):
            root = mod.split(".")[0]
            if root == "rlhf_train" and _layer(mod) != "core":
                bad.append(f"{_rel(path)}:{line} imports {mod}: core may import only rlhf_train.core")
            elif root in CORE_FORBIDDEN:
                bad.append(f"{_rel(path)}:{line} imports {mod}: core is pure tensor math, no {root}")
    assert not bad, "core/ must stay pure tensor math:\n" + "\n".join(bad)


def test_no_file_over_400_lines():
    long = []
    for path in sorted(p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        try:
            n = len(path.read_text(encoding="utf-8").splitlines())
        except UnicodeDecodeError:
            continue
        if n > MAX_LINES:
            long.append(f"{_rel(path)}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines (split by concept):\n" + "\n".join(long)


@pytest.mark.parametrize(
    # every folder holding Python code, and the folders above it
    "package", sorted({_rel(d) for p in _sources() for d in p.parents if d.is_relative_to(PACKAGE)})
)
def test_package_has_docstring(package):
    init = PACKAGE.parent / package / "__init__.py"
    assert init.is_file(), f"{package}/ has no __init__.py: add one with a docstring naming its layer"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert doc and doc.strip(), f"{package}/__init__.py has no docstring: say what the layer holds and what it may import"


def test_every_package_has_a_layer():
    for path in _sources():
        _layer(_module_name(path))  # raises with the package name when a new top-level package is missing


def test_import_scanner_sees_lazy_and_relative_imports(tmp_path):
    """The scanner itself: function-level, ``from``-style and relative imports are all resolved."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..loop import trainer\n    import rlhf_train.pipeline.run\nfrom . import masked\n")
    found = sorted(m for _, m in _imports(probe, own="rlhf_train.core.probe"))
    assert found == ["rlhf_train.core.masked", "rlhf_train.loop.trainer", "rlhf_train.pipeline.run"]


def _import_circles(package: Path) -> list[list[str]]:
    """Every import circle between files of ``package`` (a dir with ``__init__.py``): the strongly
    connected components of more than one module in the graph "file A imports file B" (module-level and
    function-level imports; ``from a import b`` resolved to the module ``a.b`` when it is one, else ``a``).

    An import of the importer's own package or of a package above it is no edge (Python runs those
    ``__init__`` files first, whatever the order); an explicit import of another package is one (its
    ``__init__.py`` runs then, and may re-export).
    """
    modules: dict[str, Path] = {}
    for path in sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for importer, path in modules.items():
        for _, mod in _imports(path, own=importer):
            target = mod
            while target and target not in modules:  # ``a.b.name`` -> ``a.b``: the file that defines it
                target = target.rpartition(".")[0]
            if target and target != importer and not importer.startswith(target + "."):
                edges[importer].add(target)

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circles():
    circles = _import_circles(PACKAGE)
    assert not circles, (
        "import circles between files (a file may not import, even lazily inside a function, a file that "
        "imports it back, directly or around a circle): move what both need into a module below both, "
        "split by concept:\n" + "\n".join("  " + " <-> ".join(c) for c in circles)
    )


def test_circle_finder_sees_direct_lazy_and_relative_circles(tmp_path):
    """The circle finder itself, on a tiny package: a lazy relative import closes a circle, a chain does not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text('"""A package."""\n')
    (pkg / "a.py").write_text("from pkg.b import helper\n")
    (pkg / "b.py").write_text("def helper():\n    from . import a\n    return a\n")  # lazy, relative: a <-> b
    (pkg / "c.py").write_text("import pkg.a\nfrom pkg.sub import d\n")  # imports into the circle: not in it
    (pkg / "sub" / "d.py").write_text("from .. import sub\nfrom ..sub.e import x\n")  # own package: no edge
    (pkg / "sub" / "e.py").write_text("from pkg.sub.f import y\n")
    (pkg / "sub" / "f.py").write_text("def g():\n    from pkg.sub.e import x\n")  # e <-> f, two levels down
    assert _import_circles(pkg) == [["pkg.a", "pkg.b"], ["pkg.sub.e", "pkg.sub.f"]]
    (pkg / "b.py").write_text("def helper():\n    return 1\n")
    assert _import_circles(pkg) == [["pkg.sub.e", "pkg.sub.f"]]


def test_pipeline_reaches_tasks_only_through_config():
    """No module under ``rlhf_train/pipeline`` imports ``rlhf_train.tasks`` (at any depth, ``from rlhf_train
    import tasks`` and relative imports included) or hands a ``rlhf_train.tasks...`` path to a call
    (``importlib.import_module``, ``get_method``): a task's code is reached only through the dotted paths
    its YAML names (``sft.examples``, ``rm.pairs``, ``evaluation.judge_fn``, ``evaluation.task_check``)."""

    def names_tasks(name: str) -> bool:
        return name == "rlhf_train.tasks" or name.startswith("rlhf_train.tasks.")

    bad = []
    for path in (p for p in _sources() if _module_name(p).startswith("rlhf_train.pipeline")):
        bad += [f"{_rel(path)}:{line} imports {mod}" for line, mod in _imports(path) if names_tasks(mod)]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Call):
                bad += [f"{_rel(path)}:{node.lineno} calls with '{arg.value}'"
                        for arg in [*node.args, *(k.value for k in node.keywords)]
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and names_tasks(arg.value)]
    assert not bad, ("the pipeline names a task's module; name its function in the task's YAML instead "
                     "(rlhf_train/tasks/<task>/hooks.py):\n" + "\n".join(bad))


def test_torchrl_is_reached_only_through_compat():
    """The product path (rollout, shaping, loop) speaks the typed ``Rollout``: only ``rlhf_train/compat/``
    imports torchrl, and no module of the package imports ``rlhf_train.compat``."""
    bad = []
    for path in _sources():
        module = _module_name(path)
        if module.startswith("rlhf_train.compat"):
            continue
        bad += [f"{_rel(path)}:{line} imports {mod}" for line, mod in _imports(path)
                if mod == "torchrl" or mod.startswith("torchrl.") or mod.startswith("rlhf_train.compat")]
    assert not bad, "torchrl's API belongs in rlhf_train/compat/:\n" + "\n".join(bad)
