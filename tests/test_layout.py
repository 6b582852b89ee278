"""The layout is the architecture: dependencies point one way (docs/architecture.md: the packages
and their order).

Every import counts: at module level, inside a function (lazy imports still tie modules together)
and under `if TYPE_CHECKING:` (a type-only import is a dependency all the same: a reader needs the
other module to follow this one, and two modules that name each other's types are one module).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("arr_coc", "pipeline", "sources", "sinks", "evaluation")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Modules of this repository that `module` imports (resolved to the longest known name)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)
    visit(tree)
    resolved = set()
    for name in found:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            resolved.add(name)
    return resolved


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    return {m: _imports(p, m, known) for m, p in files.items()}


GRAPH = _graph()


def _edges(module: str) -> list[str]:
    """Imports between modules: a package and its own submodules importing each other is not one."""
    return sorted(d for d in GRAPH[module]
                  if d in GRAPH and not d.startswith(module + ".") and not module.startswith(d + "."))


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v); on_stack.add(v)  # noqa: E702
        for w in _edges(v):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop(); on_stack.discard(w); component.append(w)  # noqa: E702
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for module in sorted(GRAPH):
        if module not in index:
            connect(module)
    return found


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "modules that import each other (directly or through others):\n" + \
        "\n".join(", ".join(c) for c in cycles)


def test_nothing_imports_a_command_module():
    commands = {m for m in GRAPH if m.startswith("pipeline.commands.")}
    shared = {"pipeline.commands.common"}
    bad = sorted(f"{m} imports {c}" for m, deps in GRAPH.items() for c in deps & (commands - shared)
                 if m != "pipeline.commands.cli" and m != "pipeline.__main__")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package, forbidden", [
    ("arr_coc", ("pipeline", "sources", "sinks", "evaluation")),   # the model: torch only, no I/O
    ("sources", ("pipeline", "evaluation")),
    ("sinks", ("pipeline", "evaluation")),
    ("evaluation", ("pipeline",)),                   # datasets, fixtures, baselines, metrics: below training
    # below the graph and the engine: CUDA helpers, sockets, the request types; then the configs
    ("pipeline.runtime", ("pipeline.config", "pipeline.vlm_config", "pipeline.configio", "pipeline.budget",
                          "pipeline.core",
                          "pipeline.vlm", "pipeline.runners", "pipeline.serve", "pipeline.api",
                          "pipeline.commands", "pipeline.training")),
    ("pipeline.vlm_config", ("pipeline.config", "pipeline.core", "pipeline.vlm", "pipeline.runners",
                             "pipeline.serve", "pipeline.api", "pipeline.commands", "pipeline.training")),
    ("pipeline.config", ("pipeline.budget", "pipeline.core", "pipeline.vlm", "pipeline.runners", "pipeline.serve",
                         "pipeline.api", "pipeline.commands", "pipeline.training")),
    ("pipeline.budget", ("pipeline.core", "pipeline.vlm", "pipeline.runners", "pipeline.serve", "pipeline.api",
                         "pipeline.commands", "pipeline.training")),
    # the graph (core) and the engine (vlm) side by side: neither imports the other
    ("pipeline.vlm", ("pipeline.core", "pipeline.runners", "pipeline.commands", "pipeline.training",
                      "pipeline.serve", "pipeline.api")),
    ("pipeline.core", ("pipeline.vlm", "pipeline.runners", "pipeline.commands", "pipeline.training",
                       "pipeline.serve", "pipeline.api")),
    ("pipeline.runners", ("pipeline.commands", "pipeline.serve")),
    ("pipeline.serve", ("pipeline.commands", "pipeline.training")),
])
def test_dependencies_point_one_way(package, forbidden):
    bad = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if m == package or m.startswith(package + ".")
                 for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))
    assert not bad, "\n".join(bad)


# what may import evaluation/ (it is never imported at run time): training, the commands, itself
EVALUATION_USERS = ("evaluation", "pipeline.training", "pipeline.commands")


def test_runtime_never_imports_evaluation():
    bad = sorted(f"{m} imports {d}" for m, deps in GRAPH.items()
                 if not any(m == u or m.startswith(u + ".") for u in EVALUATION_USERS)
                 for d in deps if d == "evaluation" or d.startswith("evaluation."))
    assert not bad, "\n".join(bad)


def test_the_walker_sees_imports():
    """The checks above are only as good as the import walk: it must see lazy and relative imports."""
    assert "pipeline.core.setup" in GRAPH["pipeline.runners.run"]
    assert "pipeline.runners.ray_batch" in GRAPH["pipeline.api"]      # a lazy import
    assert "pipeline.runtime.cuda" in GRAPH["pipeline.vlm.decoding"]
    GRAPH["pipeline.core.graph"].add("pipeline.runners.run")   # a planted cycle is found
    try:
        assert any("pipeline.core.graph" in c for c in _cycles())
    finally:
        GRAPH["pipeline.core.graph"].discard("pipeline.runners.run")


def test_test_modules_have_unique_basenames():
    """tests/ has no package __init__ files, so pytest imports each test module by its basename:
    two files of one name stop the whole collection ('import file mismatch')."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_runtime_module_over_600_lines():
    """A module a newcomer can read in one sitting: the runtime packages keep each file under 600 lines."""
    long = {str(p.relative_to(ROOT)): n for pkg in ("arr_coc", "pipeline", "sources", "sinks")
            for p in (ROOT / pkg).rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_readme_stays_for_users():
    """README.md is for users (issue 35): at most 400 lines; figures and history live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400
