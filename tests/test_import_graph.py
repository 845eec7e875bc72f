"""flexmoe's modules import one another in one direction: no module reaches itself through the imports of the
modules it imports, counting the imports inside functions as well as those at the top of a module.

The graph is read from the source with ``ast`` (nothing is imported): a node per module of ``src/flexmoe``, an
edge ``a -> b`` for each ``import b`` / ``from b import x`` in ``a`` (``from p import m`` with ``m`` a module of
package ``p``: an edge to ``m``). The packages a module lives in are not edges: Python runs their ``__init__``
first whoever imports what, so they cannot close a loop that the named imports do not. Imports under
``if TYPE_CHECKING:`` are edges too: they never run, but a module that names another's type only for the type
checker still depends on it, and such an import is the usual way a loop hides (a Protocol of what is read, or a
module-level import where no loop results, replaces it).

On the same graph, two rules of levels (below): the layer's level (flexmoe.layer and what it imports, flexmoe.parallel,
flexmoe.routing) never imports flexmoe.sharding, the level above it; and no module imports the layer inside a
function (the way to dodge a cycle), beyond an allow-list of those that remain.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root / "flexmoe"`` by its dotted name (a package by its own name)."""
    names = {}
    for path in sorted((root / "flexmoe").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def imported_modules(name: str, path: Path, modules: set[str], type_only: bool = True) -> set[str]:
    """The flexmoe modules that module ``name`` (at ``path``) imports anywhere in its body (with ``type_only``
    False, only those imported at run time: not under ``if TYPE_CHECKING:``)."""
    is_package = path.name == "__init__.py"
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (ast.walk(tree) if type_only else _runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path, type_only: bool = True) -> dict[str, set[str]]:
    """Module -> the flexmoe modules it imports (``type_only``: those under ``if TYPE_CHECKING:`` included)."""
    modules = module_names(root)
    return {name: imported_modules(name, path, set(modules), type_only) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_finds_a_loop_through_function_level_and_relative_imports(tmp_path: Path) -> None:
    """A loop of three modules, one edge inside a function and one relative, and a package importing its own
    submodule (not a loop): the check above can fail."""
    pkg = tmp_path / "flexmoe" / "p"
    pkg.mkdir(parents=True)
    (tmp_path / "flexmoe" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from flexmoe.p import a\n")
    (pkg / "a.py").write_text("def f():\n    from flexmoe.p import b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("import flexmoe.p.a\nfrom flexmoe import p\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from flexmoe.p import d\n")
    (pkg / "d.py").write_text("from flexmoe.p import c\n")
    graph = import_graph(tmp_path)
    assert graph["flexmoe.p.a"] == {"flexmoe.p.b"} and graph["flexmoe.p.b"] == {"flexmoe.p.c"}
    assert graph["flexmoe.p.c"] == {"flexmoe.p.a", "flexmoe.p", "flexmoe.p.d"}  # d: for the type checker only
    assert cycles(graph) == [["flexmoe.p", "flexmoe.p.a", "flexmoe.p.b", "flexmoe.p.c", "flexmoe.p.d"]]
    runtime = import_graph(tmp_path, type_only=False)
    assert runtime["flexmoe.p.c"] == {"flexmoe.p.a", "flexmoe.p"}
    assert cycles(runtime) == [["flexmoe.p", "flexmoe.p.a", "flexmoe.p.b", "flexmoe.p.c"]]


def test_a_type_only_import_closes_a_loop(tmp_path: Path) -> None:
    """Two modules, one importing the other for annotations only: a loop all the same."""
    pkg = tmp_path / "flexmoe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layer.py").write_text("from flexmoe.stage import run\n")
    (pkg / "stage.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from flexmoe.layer import MoELayer\ndef run(layer: 'MoELayer'): ...\n")
    assert cycles(import_graph(tmp_path)) == [["flexmoe.layer", "flexmoe.stage"]]
    assert cycles(import_graph(tmp_path, type_only=False)) == []


def test_flexmoe_has_no_import_cycle() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 50 and "flexmoe.layer" in graph["flexmoe"]  # the reader sees the real package
    found = cycles(graph)
    if found:
        pytest.fail("import cycles, type-only imports included (each a set of modules that import one another, "
                    "directly or not):\n"
                    + "\n".join(" <-> ".join(c) for c in found))


# --- The layer's level and the level above it -------------------------------------------------------------------
#
# flexmoe.sharding lays whole models over ranks: it sits above flexmoe.layer and imports it at module level. Nothing
# at the layer's level imports it back, so no module needs to import the layer inside a function to dodge a cycle.

SHARDING = "flexmoe.sharding"
# flexmoe.parallel's re-export modules of the names moved to flexmoe.sharding (one release), and its package,
# which resolves those names on first use (PEP 562 __getattr__): the only modules below the layer that reach up.
REEXPORTS = {"flexmoe.parallel"} | {f"flexmoe.parallel.{m}" for m in
                                    ("fsdp", "fsdp_overlap", "ddp", "dcp", "materialize", "optim", "mesh", "memory")}

# The imports of the layer inside a function that remain, outside the model-level modules: (module, function) ->
# how many. Empty it as they go; an entry that no longer matches fails the test too, so the list only shrinks.
LAYER_IMPORTS_IN_FUNCTIONS_ALLOWED: dict[tuple[str, str], int] = {}


def _is_layer_import(node: ast.AST) -> bool:
    """``import flexmoe.layer``, ``from flexmoe.layer import ...``, ``from flexmoe import MoELayer`` (or ``layer``)."""
    if isinstance(node, ast.Import):
        return any(alias.name == "flexmoe.layer" for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return node.module == "flexmoe.layer" or (
            node.module == "flexmoe" and any(alias.name in ("MoELayer", "layer") for alias in node.names))
    return False


def layer_imports_in_functions(root: Path) -> dict[tuple[str, str], int]:
    """(module, qualified name of the innermost enclosing function) -> how many imports of the layer it holds."""
    found: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, module: str, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, module, [*scope, child.name],
                      in_function or not isinstance(child, ast.ClassDef))
                continue
            if in_function and _is_layer_import(child):
                key = (module, ".".join(scope))
                found[key] = found.get(key, 0) + 1
            visit(child, module, scope, in_function)

    for name, path in module_names(root).items():
        visit(ast.parse(path.read_text(), str(path)), name, [], False)
    return found


def test_the_in_function_reader_sees_imports_of_the_layer_at_any_depth(tmp_path: Path) -> None:
    pkg = tmp_path / "flexmoe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom flexmoe.layer import MoELayer\n"
        "if TYPE_CHECKING:\n    import flexmoe.layer\n"
        "def f():\n    if True:\n        from flexmoe import MoELayer\n    import flexmoe.layer\n"
        "class C:\n    def m(self):\n        def inner():\n            from flexmoe.layer import update_expert_biases\n"
        "        from flexmoe import routing\n")
    assert layer_imports_in_functions(tmp_path) == {("flexmoe.a", "f"): 2, ("flexmoe.a", "C.m.inner"): 1}


def test_no_module_imports_the_layer_inside_a_function_beyond_the_allow_list() -> None:
    found = layer_imports_in_functions(SRC)
    new = {k: n for k, n in found.items() if n > LAYER_IMPORTS_IN_FUNCTIONS_ALLOWED.get(k, 0)}
    gone = {k: n for k, n in LAYER_IMPORTS_IN_FUNCTIONS_ALLOWED.items() if found.get(k, 0) < n}
    assert not new, (f"imports of flexmoe.layer inside functions: {new}; import it at module level (the layer's "
                     f"level never imports the modules above it), or under `if TYPE_CHECKING:` for annotations")
    assert not gone, f"no longer there: remove from LAYER_IMPORTS_IN_FUNCTIONS_ALLOWED: {gone}"
    assert not any(module.startswith((SHARDING, "flexmoe.parallel")) for module, _ in found)


def layer_level(graph: dict[str, set[str]]) -> set[str]:
    """flexmoe.layer, every module it imports (directly or not), and every module of flexmoe.parallel and
    flexmoe.routing, but flexmoe.parallel's re-exports of flexmoe.sharding."""
    level = {"flexmoe.layer", *reachable(graph, "flexmoe.layer", avoid=REEXPORTS)}
    level |= {m for m in graph if m.startswith(("flexmoe.parallel.", "flexmoe.routing")) or m == "flexmoe.parallel"}
    return level - REEXPORTS


def reachable(graph: dict[str, set[str]], start: str, avoid: set[str]) -> dict[str, str]:
    """Every module ``start`` imports, directly or not, without passing through ``avoid`` -> the module that
    imports it on the way (a path back to ``start``)."""
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(graph[v]):
            if w not in came_from and w not in avoid and w != start:
                came_from[w] = v
                todo.append(w)
    return came_from


def test_the_layers_level_never_imports_sharding() -> None:
    graph = import_graph(SRC)
    sharding = {m for m in graph if m == SHARDING or m.startswith(SHARDING + ".")}
    assert {"flexmoe.sharding.fsdp", "flexmoe.sharding.model_experts"} <= sharding  # the reader sees the package
    assert "flexmoe.layer" in graph["flexmoe.sharding.fsdp"]  # which does import the layer
    level = layer_level(graph)
    assert {"flexmoe.parallel.strategy", "flexmoe.routing.routers", "flexmoe.experts"} <= level
    found = []
    for module in sorted(level):
        came_from = reachable(graph, module, avoid=REEXPORTS)
        for target in sorted(sharding & set(came_from)):
            path = [target]
            while path[-1] != module:
                path.append(came_from[path[-1]])
            found.append(" -> ".join(reversed(path)))
    assert not found, "the layer's level imports flexmoe.sharding (the level above it):\n" + "\n".join(found)
