"""The layering the architecture rests on (docs/architecture.md), checked from the code's own
imports: no import cycles among the project's modules (imports inside functions count), and only
the assembly layer (with the command line above it) reads `axrl.config`. And calls are typed: no
method is dispatched by a name held in a string (`getattr(obj, name)(…)`, `.call("method", …)`
and their other spellings), since a typo or a changed signature would then fail only at run
time, on the far side of a pipe or an actor boundary."""

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


# ---------------------------------------------------------------- calls dispatched by a string

# Names of call helpers whose first argument (or `method=` keyword) names the method to run: a
# string literal there is a call typed by name only. Leading underscores do not matter (a private
# wrapper such as `_call("optimizer_step")` is the same dispatch), nor what follows `call_`.
DISPATCHERS = frozenset({"call", "each", "on_critic", "on_critic_with", "dispatch", "run_method", "remote"})


def _is_dispatcher(name: str | None) -> bool:
    bare = (name or "").lstrip("_")
    return bare in DISPATCHERS or bare.startswith("call_")
METHOD_KEYWORDS = frozenset({"method", "method_name", "fn_name", "func_name"})


def _is_str(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _callee_name(fn: ast.AST) -> str | None:
    return fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None


def _is_lookup(node: ast.AST, *, literal_too: bool) -> bool:
    """A method looked up by name: `getattr(obj, name)` (any name when `literal_too`), or
    `obj.__getattribute__(…)`, `vars(obj)[…]`, `obj.__dict__[…]`."""
    if isinstance(node, ast.Call):
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id == "getattr" and len(node.args) >= 2:
            return literal_too or not isinstance(node.args[1], ast.Constant)
        return isinstance(fn, ast.Attribute) and fn.attr == "__getattribute__"
    if isinstance(node, ast.Subscript):
        v = node.value
        return ((isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "vars")
                or (isinstance(v, ast.Attribute) and v.attr == "__dict__"))
    return False


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of `scope` outside the functions and classes nested in it (a name there is
    another scope's: a nested function's parameter is not the outer function's local)."""
    out, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _names_bound_to_lookups(nodes: list[ast.AST]) -> set[str]:
    """Local names assigned a method looked up by a non-literal name (`fn = getattr(obj, name)`)."""
    return {t.id for node in nodes if isinstance(node, ast.Assign) and _is_lookup(node.value, literal_too=False)
            for t in node.targets if isinstance(t, ast.Name)}


def _string_dispatch(node: ast.Call, looked_up: set[str]) -> str | None:
    """Why this call dispatches by a method name held in a string, or None."""
    fn = node.func
    if _is_lookup(fn, literal_too=True):
        return "calls a method looked up by name"
    if isinstance(fn, ast.Attribute) and _is_lookup(fn.value, literal_too=False):
        return f"calls .{fn.attr} of a method looked up by name"
    if isinstance(fn, ast.Name) and fn.id in looked_up:
        return f"calls {fn.id}, a method looked up by name"
    if any(isinstance(n, ast.Attribute) and n.attr == "__getattribute__" for n in ast.walk(fn)):
        return "looks a method up with __getattribute__"
    name = _callee_name(fn)
    if name == "methodcaller" and node.args:
        return "operator.methodcaller"
    if name == "remote" and isinstance(fn, ast.Attribute) and _is_dispatcher(_callee_name(fn.value)):
        name = _callee_name(fn.value)  # actor.call.remote("method", …)
    if _is_dispatcher(name):
        if node.args and _is_str(node.args[0]) and node.args[0].value.isidentifier():
            return f"{name}({node.args[0].value!r}, …)"
        for kw in node.keywords:
            if kw.arg in METHOD_KEYWORDS and _is_str(kw.value) and kw.value.value.isidentifier():
                return f"{name}({kw.arg}={kw.value.value!r})"
    return None


def string_dispatches(source: str, filename: str = "<snippet>") -> list[str]:
    """'file:line: why' for every call in `source` that dispatches by a method name in a string."""
    tree = ast.parse(source, filename)
    found = set()
    for scope in (n for n in ast.walk(tree) if isinstance(n, _SCOPES)):
        nodes = _own_nodes(scope)
        looked_up = _names_bound_to_lookups(nodes)
        for node in nodes:
            why = _string_dispatch(node, looked_up) if isinstance(node, ast.Call) else None
            if why:
                found.add((node.lineno, why))
    return [f"{filename}:{line}: {why}" for line, why in sorted(found)]


def all_string_dispatches(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    return [hit for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
            for hit in string_dispatches(p.read_text(encoding="utf-8"), str(p.relative_to(root)))]


@lru_cache(maxsize=None)
def fresh_string_dispatches(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`all_string_dispatches` in a fresh interpreter (see `fresh_import_graph`)."""
    out = subprocess.run([sys.executable, __file__, "--dispatch", str(root), *packages], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def test_no_call_is_dispatched_by_a_method_name_in_a_string() -> None:
    """Rank calls (and every other call) name the method itself: `group.call(MegatronRank.zero_grad)`,
    checked where it is made, never `group.call("zero_grad")` ending in `getattr(rank, name)(…)`."""
    assert fresh_string_dispatches(ROOT) == []


OLD_FORMS = {  # spellings of the string dispatch, the first three as the Megatron ranks had them
    "getattr(state, msg[0])(*msg[1])": "calls a method looked up by name",
    "self._group.call('optimizer_step', _SLOT, lr)": "call('optimizer_step', …)",
    "a.call.remote(method, ref) if 0 else a.call.remote('zero_grad', ref)": "call('zero_grad', …)",
    "getattr(rank, 'zero_grad')()": "calls a method looked up by name",
    "group.call(method='optimizer_step')": "call(method='optimizer_step')",
    "group.call_each('forward', works, r3)": "call_each('forward', …)",
    "call_method('zero_grad')": "call_method('zero_grad', …)",
    "self._call('optimizer_step', _SLOT, lr)": "_call('optimizer_step', …)",
    "self._call_with_shares('forward', batch, r3)": "_call_with_shares('forward', …)",
    "self._each('value_forward', batch)": "_each('value_forward', …)",
    "ray.get(actor.__getattribute__(name).remote())": "__getattribute__",
    "getattr(actor, name).remote(*args)": "calls .remote of a method looked up by name",
    "operator.methodcaller('zero_grad')(rank)": "operator.methodcaller",
    "vars(type(rank))[name](rank)": "calls a method looked up by name",
    "def serve(state, name, args):\n    fn = getattr(state, name)\n    return fn(*args)": "calls fn, a method",
}


@pytest.mark.parametrize("snippet", list(OLD_FORMS))
def test_the_check_catches_every_spelling_of_a_string_dispatch(snippet: str) -> None:
    hits = string_dispatches(snippet)
    assert len(hits) >= 1 and OLD_FORMS[snippet] in "\n".join(hits), hits


def test_the_check_lets_typed_calls_and_plain_lookups_pass() -> None:
    typed = ("group.call(MegatronRank.optimizer_step, _SLOT, lr)\n"
             "group.call_each(MegatronRank.forward, works, r3)\n"
             "actor.call.remote(ref)\n"
             "a.attach.remote('/tmp/run')\n"          # a Ray method named by attribute, a string argument
             "RANK_METHODS[call.method](rank, *call.args)\n"
             "dtype = getattr(torch, name)\n"         # an attribute read, not a dispatch
             "subprocess.call('ls -l', shell=True)\n")
    assert string_dispatches(typed) == []


if __name__ == "__main__" and sys.argv[1] == "--dispatch":  # fresh_string_dispatches' child
    print(json.dumps(all_string_dispatches(Path(sys.argv[2]), tuple(sys.argv[3:]))))
elif __name__ == "__main__":  # fresh_import_graph's child: ROOT PACKAGE... -> the graph as JSON
    print(json.dumps({mod: sorted(deps) for mod, deps in import_graph(Path(sys.argv[1]), tuple(sys.argv[2:])).items()}))
