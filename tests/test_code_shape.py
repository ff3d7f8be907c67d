"""The shape of the code, read from the sources' syntax trees: no function is longer than
a reader can hold at once.

A function counts from its ``def`` line to its last line (a decorator's lines, such as
click's options, do not count), docstring and comments included. Nested functions and
methods are counted on their own too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("loader", "sclayout", "benchmarks", "examples")
MAX_LINES = 80

ALLOWED: set[str] = set()
"""Functions still over :data:`MAX_LINES`, each with the reason; the second test fails
once one of them is short, so the list only shrinks."""


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of every function and method in ``path``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


@functools.cache
def _long_functions() -> dict[str, int]:
    """``"path:name" -> lines`` of every function over :data:`MAX_LINES` in the folders."""
    return {
        f"{path.relative_to(ROOT).as_posix()}:{name}": n
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, _, n in _functions(path)
        if n > MAX_LINES
    }


def test_the_counter_counts_from_def_to_the_last_line_without_decorators(tmp_path):
    src = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    src.write_text(
        "import functools\n\n"
        "@functools.cache\n"
        "@functools.wraps(print)\n"
        f"def long():\n{body}\n\n"
        "class C:\n"
        "    def short(self):\n"
        "        def inner():\n"
        "            return 1\n"
        "        return inner\n"
    )
    assert {name: n for name, _, n in _functions(src)} == {
        "long": MAX_LINES + 1,
        "C.short": 4,
        "C.short.inner": 2,
    }


def test_no_function_is_over_80_lines():
    long = _long_functions()
    over = {k: n for k, n in long.items() if k not in ALLOWED}
    assert over == {}, "split these into named steps: " + ", ".join(
        f"{k} ({n} lines)" for k, n in sorted(over.items())
    )


def test_every_allowed_function_is_still_long():
    """A function split (or renamed, or moved) since it was allowed leaves the list."""
    assert ALLOWED - set(_long_functions()) == set(), "remove these from ALLOWED"
