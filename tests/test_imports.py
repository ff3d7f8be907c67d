"""The import graph of ``loader`` and ``sclayout``, read from the sources' syntax trees.

Every import counts, including those inside functions and ``if TYPE_CHECKING`` blocks:
a cycle through a lazy import is still two modules that cannot be understood apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("loader", "sclayout")


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the two packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` of every import in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:  # `from pkg import module`
                    found.append((sub, None, node.lineno))
                else:
                    found.append((base, a.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    """Edges between the packages' own modules."""
    return {
        name: {m for m, _, _ in _imports(name, path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
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


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    # a package's __init__ that re-exports its modules is not part of a cycle with them
    graph = {
        v: {w for w in ws if not (v.startswith(w + ".") and MODULES[w].name == "__init__.py")}
        for v, ws in _graph().items()
    }
    assert _cycles(graph) == []


def test_no_private_names_imported_across_modules():
    offenders = []
    for name, path in MODULES.items():
        for module, imported, line in _imports(name, path):
            if module.split(".")[0] not in PACKAGES or imported is None:
                continue
            if imported.startswith("_") and not imported.startswith("__"):
                offenders.append(
                    f"{path.relative_to(ROOT)}:{line}: from {module} import {imported}"
                )
    assert offenders == []


@pytest.mark.parametrize("package", ["loader", "sclayout"], ids=str)
def test_runtime_never_imports_the_testing_package(package):
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for name, path in MODULES.items()
        if name.split(".")[0] == package and not name.startswith("sclayout.testing")
        for module, _, line in _imports(name, path)
        if module == "sclayout.testing" or module.startswith("sclayout.testing.")
    ]
    assert offenders == []
