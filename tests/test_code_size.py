"""Size limits of the source (issue 40): no function of ``src/flexmoe`` over 100 lines, no module of
``src/flexmoe/apps`` over 450 lines, so that each stays readable in one sitting.

Read with ``ast`` (nothing is imported): a function's lines are ``end_lineno - lineno + 1`` (its ``def`` line to its
last line, decorators not counted; nested functions count inside their parent and on their own), a module's lines
are its line count. ``ALLOWED`` lists the offenders left to fix, each by name; the lead empties it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FUNCTION_LINES = 100
MAX_APPS_MODULE_LINES = 450

# Offenders still allowed, as the tests below name them: "flexmoe/x.py:Class.function" or "flexmoe/apps/x.py".
ALLOWED: frozenset[str] = frozenset()


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """``{"path:qualified.name": lines}`` of every function or method under ``root`` longer than ``limit``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        todo: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text(), str(path)), "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}."
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert child.end_lineno is not None
                    lines = child.end_lineno - child.lineno + 1
                    if lines > limit:
                        found[f"{rel}:{name[:-1]}"] = lines
                todo.append((child, name))
    return found


def long_modules(root: Path, limit: int) -> dict[str, int]:
    """``{"path": lines}`` of every module under ``root`` longer than ``limit`` lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found[path.relative_to(root.parents[1]).as_posix()] = lines
    return found


def test_the_counters_find_a_long_function_and_a_long_module(tmp_path: Path) -> None:
    """The counters on a package written here: a 101-line method and a 100-line function (the limit itself is
    fine), a nested function counted on its own, and modules of 451 and 450 lines."""
    pkg = tmp_path / "src" / "pkg"
    (pkg / "apps").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(99))  # a def line + 99 body lines = 100 lines
    (pkg / "short.py").write_text(f"def ok():\n{body}")
    nested = "".join(f"        y{i} = {i}\n" for i in range(100))
    (pkg / "long.py").write_text(f"class C:\n    @staticmethod\n    def too_long():\n{nested}"
                                 f"\n\ndef outer():\n    def inner():\n{nested}")
    assert long_functions(pkg, 100) == {"pkg/long.py:C.too_long": 101, "pkg/long.py:outer": 102,
                                        "pkg/long.py:outer.inner": 101}
    (pkg / "apps" / "big.py").write_text("x = 1\n" * 451)
    (pkg / "apps" / "fits.py").write_text("x = 1\n" * 450)
    assert long_modules(pkg / "apps", 450) == {"pkg/apps/big.py": 451}


def test_no_function_over_100_lines() -> None:
    found = long_functions(SRC / "flexmoe", MAX_FUNCTION_LINES)
    offenders = {name: n for name, n in found.items() if name not in ALLOWED}
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (split them into smaller ones): "
                           + ", ".join(f"{name} ({n} lines)" for name, n in sorted(offenders.items())))
    # An allowed function that is fixed (or renamed) leaves the list, so that the entry cannot hide a new one.
    stale = sorted(name for name in ALLOWED if ":" in name and name not in found)
    assert not stale, f"within the limit now, remove from ALLOWED: {stale}"


def test_no_apps_module_over_450_lines() -> None:
    found = long_modules(SRC / "flexmoe" / "apps", MAX_APPS_MODULE_LINES)
    offenders = {name: n for name, n in found.items() if name not in ALLOWED}
    assert not offenders, (f"modules of flexmoe.apps over {MAX_APPS_MODULE_LINES} lines (split them by what they "
                           "hold): " + ", ".join(f"{name} ({n} lines)" for name, n in sorted(offenders.items())))
    stale = sorted(name for name in ALLOWED if ":" not in name and name not in found)
    assert not stale, f"within the limit now, remove from ALLOWED: {stale}"
