"""flexmoe's modules import one another in one direction: no module reaches itself through the imports of the
modules it imports, counting the imports inside functions as well as those at the top of a module.

The graph is read from the source with ``ast`` (nothing is imported): a node per module of ``src/flexmoe``, an
edge ``a -> b`` for each ``import b`` / ``from b import x`` in ``a`` (``from p import m`` with ``m`` a module of
package ``p``: an edge to ``m``). The packages a module lives in are not edges: Python runs their ``__init__``
first whoever imports what, so they cannot close a loop that the named imports do not. Imports under
``if TYPE_CHECKING:`` are not edges either: they never run.
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


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The flexmoe modules that module ``name`` (at ``path``) imports anywhere in its body, at run time."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
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


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


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
    assert graph["flexmoe.p.c"] == {"flexmoe.p.a", "flexmoe.p"}  # not d: only for the type checker
    assert cycles(graph) == [["flexmoe.p", "flexmoe.p.a", "flexmoe.p.b", "flexmoe.p.c"]]


def test_flexmoe_has_no_import_cycle() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 50 and "flexmoe.layer" in graph["flexmoe"]  # the reader sees the real package
    found = cycles(graph)
    if found:
        pytest.fail("import cycles (each a set of modules that import one another, directly or not):\n"
                    + "\n".join(" <-> ".join(c) for c in found))
