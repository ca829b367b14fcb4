"""The layering the architecture rests on (docs/architecture.md), checked from the code's own
imports: no import cycles among the project's modules (imports inside functions count), and only
the assembly layer (with the command line above it) reads `axrl.config`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("axrl", "replay", "axrl_debug")

# The modules of `axrl/` allowed to import `axrl.config`: the config itself, the assembly layer
# that maps it onto settings objects, and the commands that load a config file.
CONFIG_READERS = ("axrl.config", "axrl.assembly", "axrl.cli", "axrl.cli.export")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """{module: project modules it imports}, every import statement counted (module level or
    inside a function), except those under `if TYPE_CHECKING:`."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".")[: len(mod.split(".")) - node.level + is_pkg]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` depends on the submodule when there is one
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


@lru_cache(maxsize=None)
def fresh_import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """`import_graph` computed in a fresh interpreter. Before 3.11.8, CPython's `ast.parse` keeps its
    recursion counter in state shared by the process's threads (gh-106905) and can raise
    `SystemError: AST constructor recursion depth mismatch` once earlier tests' threads have left
    it off (seen once in a full suite run); a new process keeps the check about the code."""
    out = subprocess.run([sys.executable, __file__, str(root), *packages], check=True,
                         capture_output=True, text=True)
    return {mod: set(deps) for mod, deps in json.loads(out.stdout).items()}


def cycles(graph: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module, leaving out those that close only
    through a package's own `__init__` re-exporting its submodules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan, iterative enough for this depth
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len([m for m in comp if m not in packages]) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def packages_of(root: Path, packages: tuple[str, ...] = PACKAGES) -> set[str]:
    return {module_name(p, root) for pkg in packages for p in (root / pkg).rglob("__init__.py")}


def test_the_project_has_no_import_cycles() -> None:
    graph = fresh_import_graph(ROOT)
    assert len(graph) > 100  # the walk really read the project
    assert cycles(graph, packages_of(ROOT)) == []


def test_only_the_assembly_layer_reads_the_config() -> None:
    graph = fresh_import_graph(ROOT)
    readers = sorted(m for m, deps in graph.items()
                     if m.startswith("axrl.") and "axrl.config" in deps
                     and not any(m == r or m.startswith(r + ".") for r in CONFIG_READERS))
    assert readers == [], f"below the assembly layer, these import axrl.config: {readers}"
    assert "axrl.config" in graph["axrl.assembly.settings"]  # the check sees a real reader


@pytest.mark.parametrize("function_level", [False, True])
def test_the_checks_catch_a_cycle_and_a_config_reader(tmp_path: Path, function_level: bool) -> None:
    """The checker itself: a two-module cycle (also when one side imports inside a function) and
    a low module importing the config are found."""
    pkg = tmp_path / "axrl"
    (pkg / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("X = 1\n")
    (pkg / "algo" / "__init__.py").write_text("")
    (pkg / "algo" / "a.py").write_text("from axrl.algo import b\n")
    inner = "def f():\n    from axrl.algo.a import f\n" if function_level else "from axrl.algo.a import f\n"
    (pkg / "algo" / "b.py").write_text(inner + "import axrl.config\n")
    graph = fresh_import_graph(tmp_path, ("axrl",))
    assert cycles(graph, packages_of(tmp_path, ("axrl",))) == [["axrl.algo.a", "axrl.algo.b"]]
    assert "axrl.config" in graph["axrl.algo.b"]


if __name__ == "__main__":  # fresh_import_graph's child: ROOT PACKAGE... -> the graph as JSON
    print(json.dumps({mod: sorted(deps) for mod, deps in import_graph(Path(sys.argv[1]), tuple(sys.argv[2:])).items()}))
