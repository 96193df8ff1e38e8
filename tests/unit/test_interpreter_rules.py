"""The interpreter and its adapters decide nothing (docs/ARCHITECTURE.md): a check of their
source that fails when a decision appears there.

A decision is a condition (``if``, ``while``, ``x if c else y``, a comprehension's ``if``, a
``match`` guard) or a comparison anywhere (``detach = on_exit == "detach"``) that tests a
host's state, a leader's role or a policy itself:

- a state or a role: ``HostState``/``Role`` (or ``S``), a set of them (``*_STATES``,
  ``*_ROLES``), or the ``.state``/``.role``/``.shown_role`` of something;
- a policy: a ``Policy`` object (``policy``, ``health_policy``), one of its fields that
  choose behaviour (``on_exit``, ``restart_stop``, ``detach_on_exit``), or any table of the
  config read in the condition (``config.health.x``, ``self._config.run.on_exit``).

Which modules: the daemon, its adapters and the I/O it drives itself (``CHECKED``); a module
``daemon.py`` imports that is neither checked nor a core fails
``test_every_module_the_daemon_drives_is_checked``, so a new adapter cannot escape the rule.

What is allowed: asking a core a question whose answer is the decision (``Fleet.all_ready``,
``Leadership.standing_by``, ``leadership.refusal``), testing what an action or an event
says (``action.quarantine``, ``change.frozen``), and the mechanics of I/O (an exception's
type, a task that is None, a timeout).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SUPERVISOR = Path(__file__).resolve().parents[2] / "supervisor"
#: The interpreter, every adapter it routes actions to, and the I/O it drives itself.
CHECKED = (
    "daemon.py",
    "links.py",
    "rundir.py",
    "present.py",
    "commands.py",
    "shell.py",
    "probes.py",
    "process.py",
    "watch.py",
    "control.py",
    "notify.py",
)
#: What the daemon may import without it being checked: the cores (where decisions go)
#: and the config's definitions (the policies they are handed).
UNCHECKED_IMPORTS = frozenset({"fleet", "health", "leadership", "vocabulary", "config", "errors"})

STATE_NAMES = frozenset({"HostState", "Role", "S"})
STATE_ATTRS = frozenset({"state", "role", "shown_role"})
POLICY_NAMES = frozenset({"policy", "health_policy", "on_exit", "restart_stop", "detach_on_exit"})
CONFIG_NAMES = frozenset({"config", "_config"})
CONFIG_TABLES = frozenset(
    {"run", "worker", "health", "fleet", "ha", "trainer", "watch", "ssh", "control", "metrics"}
)


def _name_of(node: ast.AST) -> str | None:
    """The name a node stands for: a variable's, or an attribute's last part."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _what_it_tests(node: ast.AST) -> str | None:
    """What a state, role or policy reference in ``node`` is, or None."""
    name = _name_of(node)
    if name is None:
        return None
    if name in STATE_NAMES or name.endswith(("_STATES", "_ROLES")):
        return f"a state or role ({name})"
    if isinstance(node, ast.Attribute) and name in STATE_ATTRS:
        return f"a state or role (.{name})"
    if name in POLICY_NAMES:
        return f"a policy ({name})"
    if (
        isinstance(node, ast.Attribute)
        and name in CONFIG_TABLES
        and _name_of(node.value) in CONFIG_NAMES
    ):
        return f"a policy (config.{name})"
    return None


def _conditions(tree: ast.AST) -> list[ast.expr]:
    """Every expression that chooses a branch, and every comparison."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            out.append(node)
        elif isinstance(node, ast.If | ast.While | ast.IfExp):
            out.append(node.test)
        elif isinstance(node, ast.comprehension):
            out.extend(node.ifs)
        elif isinstance(node, ast.match_case) and node.guard is not None:
            out.append(node.guard)
    return out


def decisions(source: str, filename: str = "<source>") -> list[str]:
    """Every condition in ``source`` that tests a state, a role or a policy, as
    ``file:line: what``."""
    found: dict[int, str] = {}
    for test in _conditions(ast.parse(source, filename)):
        for node in ast.walk(test):
            what = _what_it_tests(node)
            if what is not None:
                found.setdefault(test.lineno, f"{filename}:{test.lineno}: tests {what}")
                break
    return [found[line] for line in sorted(found)]


@pytest.mark.parametrize("module", CHECKED)
def test_the_interpreter_and_its_adapters_decide_nothing(module: str) -> None:
    """No condition in the daemon or an adapter tests a host's state, a role or a policy:
    such a rule belongs in a core, which returns the action to perform."""
    path = SUPERVISOR / module
    assert decisions(path.read_text(), module) == []


def _supervisor_imports(source: str) -> set[str]:
    """The ``supervisor`` modules a source imports, by name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "supervisor":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("supervisor."):
            found.add((node.module or "").split(".")[1])
    return found


def test_every_module_the_daemon_drives_is_checked() -> None:
    """A new adapter the daemon imports is checked too (or this test names it): nothing the
    interpreter hands an action to escapes the rule."""
    imported = _supervisor_imports((SUPERVISOR / "daemon.py").read_text())
    checked = {name.removesuffix(".py") for name in CHECKED}
    assert imported - UNCHECKED_IMPORTS - checked == set()


def test_the_import_scan_sees_both_forms_of_import() -> None:
    """``from supervisor import x`` and ``from supervisor.x import y`` both name ``x``."""
    source = "from supervisor import fleet, probes\nfrom supervisor.failover import Standby\n"
    assert _supervisor_imports(source) == {"fleet", "probes", "failover"}


@pytest.mark.parametrize(
    "planted",
    [
        "if host.state is HostState.READY:\n    launch()",
        "if lead.role is Role.LEADER:\n    write()",
        "level = 'warning' if change.to in health.UNHEALTHY_STATES else 'info'",
        "detach = self._config.run.on_exit == 'detach'\nif detach: pass",
        "if self._config.run.on_exit == 'detach':\n    leave()",
        "if self._shell.config.health.restart_stop == 'kill':\n    kill()",
        "names = [n for n, h in hosts.items() if h.state is S.STOPPED]",
        "while policy.max_restarts:\n    go()",
        "match action:\n    case Terminate() if action.host.state:\n        pass",
    ],
)
def test_the_check_finds_a_planted_decision(planted: str) -> None:
    """Each kind of decision the check forbids is found when planted in a source."""
    assert len(decisions(planted)) == 1, planted


@pytest.mark.parametrize(
    "allowed",
    [
        "if core.all_ready:\n    done()",
        "if lead.standing_by:\n    show()",
        "if action.quarantine <= 0:\n    return",
        "if isinstance(exc, RemoteError):\n    note()",
        "if self._timer is not None:\n    self._timer.cancel()",
        "timeout = self._shell.config.health.evidence_timeout_s",
    ],
)
def test_the_check_lets_questions_to_the_cores_and_io_mechanics_pass(allowed: str) -> None:
    """Asking a core a question, testing what an action says, and plain I/O mechanics (a
    config value passed on, not tested) are not decisions."""
    assert decisions(allowed) == []
