"""The package's modules import one another without a cycle, lazy imports included: a module
can then be read, tested and imported on its own (``config.py`` without ``remote.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import supervisor

PACKAGE = Path(supervisor.__file__).parent


def _module_name(path: Path) -> str:
    """``supervisor.demo.run`` for ``supervisor/demo/run.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports, anywhere."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
                # `from supervisor import config` imports the module supervisor.config.
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in imported if m in modules and m not in ("supervisor", name)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as the modules along it, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for dep in sorted(graph[name]):
            found = visit(dep, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    """No chain of imports, top-level or inside a function, leads a module back to itself."""
    assert _cycle(_graph()) is None


def test_the_cycle_finder_finds_a_cycle() -> None:
    """A graph with a loop through three modules is reported with that loop."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
