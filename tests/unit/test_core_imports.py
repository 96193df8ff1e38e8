"""The cores stay pure: health.py and leadership.py import only a few stdlib modules and, of
ours, the leaf modules of plain values (policies.py, refusals.py, records.py: stdlib only
themselves, but for policies.py's records);
the fleet core and its sub-cores (and their vocabulary) those, health.py and each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import supervisor.fleet
import supervisor.health
import supervisor.leadership
import supervisor.policies
import supervisor.records
import supervisor.refusals

ALLOWED = {"__future__", "dataclasses", "enum", "typing", "math", "collections.abc"}
#: Plain values the cores share with the config and the CLI, defined apart so that reading a
#: config or a refusal imports no core.
LEAVES = {"supervisor.policies", "supervisor.refusals", "supervisor.records"}
CORE_ALLOWED = ALLOWED | LEAVES
#: The fleet's sub-cores and their vocabulary: the fleet core is a coordinator of these.
SUB_CORES = (
    "vocabulary",
    "failover",
    "signatures",
    "freeze",
    "budget",
    "pointer",
    "lifecycle",
    "rewards",
)
#: The fleet core adds a heap for its one timer, regular expressions for crash signatures,
#: the per-host core it drives and its sub-cores.
FLEET_ALLOWED = (
    CORE_ALLOWED
    | {"heapq", "re", "supervisor", "supervisor.health"}
    | {f"supervisor.{name}" for name in SUB_CORES}
)
PACKAGE = Path(supervisor.health.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module a source file imports (relative ones as dots)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_health_imports_only_allowed_stdlib_modules() -> None:
    """No asyncio, time, os, logging, structlog or supervisor.* import sneaks into the core."""
    path = Path(supervisor.health.__file__)
    assert _imports(path) <= CORE_ALLOWED, _imports(path) - CORE_ALLOWED


@pytest.mark.parametrize("module", ["fleet", *SUB_CORES])
def test_the_fleet_and_its_sub_cores_import_only_each_other_and_the_host_core(
    module: str,
) -> None:
    """No I/O, clock or asyncio in the fleet core or a sub-core either; of ours, only
    health.py, the leaf modules and each other."""
    path = PACKAGE / f"{module}.py"
    assert _imports(path) <= FLEET_ALLOWED, _imports(path) - FLEET_ALLOWED


def test_leadership_imports_only_allowed_stdlib_modules() -> None:
    """The leadership core has no clock, no I/O and nothing of ours: the shell takes the lock,
    reads the epoch and sleeps until its deadline."""
    path = Path(supervisor.leadership.__file__)
    assert _imports(path) <= CORE_ALLOWED, _imports(path) - CORE_ALLOWED


def test_the_leaf_modules_the_cores_import_are_stdlib_only() -> None:
    """policies.py, refusals.py and records.py, which the cores import, import no stdlib
    module a core may not, and of ours only records.py (policies' records): the cores stay
    pure through them."""
    for module in (supervisor.policies, supervisor.refusals, supervisor.records):
        path = Path(module.__file__ or "")
        allowed = ALLOWED | {"supervisor.records"}
        assert _imports(path) <= allowed, (path.name, _imports(path) - allowed)


def test_import_checker_sees_forbidden_imports(tmp_path: Path) -> None:
    """The checker itself flags the imports it exists to forbid."""
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\nfrom time import monotonic\nfrom . import remote\n")
    assert _imports(bad) - ALLOWED == {"asyncio", "time", "."}


def _imports_demo(name: str) -> bool:
    """Whether an imported module name is the demo package or a module in it."""
    return name == "supervisor.demo" or name.startswith("supervisor.demo.")


def test_the_supervisor_imports_the_demo_package_only_from_the_cli() -> None:
    """The demo, its SSH server and the reference worker are not part of the supervisor: of
    the top-level modules only cli.py reaches them (for ``demo`` and ``worker``)."""
    package = Path(supervisor.health.__file__).parent
    importers = {
        path.name
        for path in package.glob("*.py")
        if any(_imports_demo(name) for name in _imports(path))
    }
    assert importers == {"cli.py"}
