"""The interpreter and its adapters decide nothing (docs/ARCHITECTURE.md): a check that reads
their code, with the types mypy infers for it, and fails when a decision appears there.

A decision is a condition (``if``, ``while``, ``x if c else y``, a comprehension's ``if``, a
``match`` subject or guard) or a comparison anywhere (``detach = on_exit == "detach"``) that

- reads a *field* of state a core owns: a value of a type a core defines (``health.Host``,
  ``leadership.Leadership``, ``fleet.FleetView``, the failover, freeze, budget and pointer
  values...), other than the events and actions the cores exchange with the shell and what
  they carry; or of a policy (``health.Policy``, ``vocabulary.FleetPolicy``,
  ``leadership.Policy``, and the config tables that choose behaviour: ``run``, ``trainer``,
  ``probe``, ``failover``); or
- tests a host's state or a leader's role (a ``HostState`` or ``Role`` value, wherever it came
  from: an action's ``to`` included).

What is allowed: asking a core a question whose answer is the decision (a property, method or
function of the core: ``Fleet.all_ready``, ``Leadership.standing_by``, ``leadership.refusal``),
testing what an action or an event says (``change.frozen``, ``reply.refusal``), and the
mechanics of I/O (an exception's type, a task that is None, a connection's own state).
``ALLOWED`` lists the adapter-local verdicts that read core state anyway, each with why.

Which modules: the daemon, its adapters and the I/O it drives itself (``CHECKED``); a module
``daemon.py`` imports that is neither checked nor a core fails
``test_every_module_the_daemon_drives_is_checked``, so a new adapter cannot escape the rule.
"""

from __future__ import annotations

import ast
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mypy import build
from mypy import types as mypy_types
from mypy.modulefinder import BuildSource
from mypy.options import Options
from mypy.server.subexpr import get_subexpressions

from supervisor import health, leadership, vocabulary
from tests.unit.test_core_imports import SUB_CORES

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
#: What the daemon may import without it being checked: the cores (where decisions go), their
#: vocabulary, and the config's definitions (the policies they are handed).
UNCHECKED_IMPORTS = frozenset({"fleet", "health", "leadership", "vocabulary", "config", "errors"})
#: The modules whose types are a core's: health, leadership, the fleet and its sub-cores.
CORE_MODULES = ("health", "leadership", "fleet", *SUB_CORES)
#: The config tables that choose behaviour (the others are I/O settings: hosts, ssh, control,
#: metrics, watch, the worker's argv).
POLICY_TABLES = frozenset(
    f"supervisor.config.{name}"
    for name in ("RunConfig", "TrainerConfig", "ProbeConfig", "FailoverConfig")
)
#: The policies the cores are handed: state to the shell even where an event carries one
#: (a reload's ``Reconfigured``).
POLICIES = frozenset(
    {
        "supervisor.policies.HealthPolicy",
        "supervisor.policies.FleetPolicy",
        "supervisor.policies.HaPolicy",
        "supervisor.health.History",
    }
)
#: Types whose values are a state or a role, however they are reached.
STATE_ENUMS = frozenset({"supervisor.health.HostState", "supervisor.leadership.Role"})
#: (module, "Type.field"): adapter-local verdicts that read core state, and why each is one.
ALLOWED: dict[tuple[str, str], str] = {}


def _messages() -> frozenset[str]:
    """The cores' events and actions, and the values they carry: what an adapter may test."""
    found: set[str] = set()
    pending: list[object] = []
    for union in (health.Event, health.Action, leadership.Event, leadership.Action):
        pending += typing.get_args(union)
    pending += typing.get_args(vocabulary.Event) + typing.get_args(vocabulary.Action)
    while pending:
        kind = pending.pop()
        if not isinstance(kind, type) or not kind.__module__.startswith("supervisor."):
            continue
        name = f"{kind.__module__}.{kind.__qualname__}"
        if name in found:
            continue
        found.add(name)
        hints = typing.get_type_hints(kind)
        for hint in hints.values():
            pending += [hint, *typing.get_args(hint)]
            for arg in typing.get_args(hint):
                pending += typing.get_args(arg)
    return frozenset(found)


MESSAGES = _messages()


def _is_state(fullname: str) -> bool:
    """A type whose fields are core state or policy (not a message the shell may test)."""
    if fullname in POLICY_TABLES or fullname in POLICIES:
        return True
    module = fullname.rsplit(".", 1)[0]
    return module in {f"supervisor.{m}" for m in CORE_MODULES} and fullname not in MESSAGES


def _instances(typ: mypy_types.Type) -> Iterator[mypy_types.Instance]:
    """The class instances a (maybe union, maybe optional) type stands for."""
    proper = mypy_types.get_proper_type(typ)
    if isinstance(proper, mypy_types.Instance):
        yield proper
    elif isinstance(proper, mypy_types.UnionType):
        for item in proper.items:
            yield from _instances(item)
    elif isinstance(proper, mypy_types.LiteralType):
        yield proper.fallback


def _is_field(instance: mypy_types.Instance, attr: str) -> bool:
    """``attr`` is a stored field of the class (not a property, method or query: those are
    decorated functions; mypy marks a frozen dataclass's fields as properties, so the node's
    kind tells, not its ``is_property``)."""
    for info in instance.type.mro:
        symbol = info.names.get(attr)
        if symbol is not None:
            return type(symbol.node).__name__ == "Var"
    return False


Span = tuple[int, int, int | None, int | None]


@dataclass(frozen=True)
class Typed:
    """The types mypy inferred for one module's expressions, by their source span."""

    source: str
    types: dict[Span, mypy_types.Type]

    def type_of(self, node: ast.expr) -> mypy_types.Type | None:
        """The inferred type of an expression of this module's source."""
        return self.types.get((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset))


def infer(modules: dict[str, str]) -> dict[str, Typed]:
    """One mypy build of ``modules`` (name -> source): each one's expression types."""
    options = Options()
    options.export_types = True
    options.preserve_asts = True
    options.incremental = False
    options.python_version = (3, 11)
    sources = [BuildSource(None, name, text=text) for name, text in modules.items()]
    result = build.build(sources, options)
    out: dict[str, Typed] = {}
    for name, text in modules.items():
        tree = result.graph[name].tree
        assert tree is not None
        spans: dict[Span, mypy_types.Type] = {}
        for expr in get_subexpressions(tree):
            typ = result.types.get(expr)
            if typ is not None:
                spans[(expr.line, expr.column, expr.end_line, expr.end_column)] = typ
        out[name] = Typed(text, spans)
    return out


def _conditions(tree: ast.AST) -> Iterator[ast.expr]:
    """Every expression that chooses a branch, and every comparison."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            yield node
        elif isinstance(node, ast.If | ast.While | ast.IfExp):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, ast.Match):
            yield node.subject
        elif isinstance(node, ast.match_case) and node.guard is not None:
            yield node.guard


def decisions(module: str, typed: Typed) -> list[str]:
    """Every condition in the module that reads core state or a policy, as
    ``module:line: Type.field``, but for ``ALLOWED``."""
    found: dict[tuple[int, str], str] = {}
    for test in _conditions(ast.parse(typed.source)):
        for node in ast.walk(test):
            what = _what_it_reads(node, typed)
            if what is not None and (module, what) not in ALLOWED:
                found.setdefault((test.lineno, what), f"{module}:{test.lineno}: {what}")
    return sorted(found.values())


def _what_it_reads(node: ast.AST, typed: Typed) -> str | None:
    """The core state, policy or state value ``node`` reads, as ``Type.field``, or None."""
    if not isinstance(node, ast.expr):
        return None
    typ = typed.type_of(node)
    for instance in _instances(typ) if typ is not None else ():
        if instance.type.fullname in STATE_ENUMS:
            return f"{instance.type.name} value"
    if isinstance(node, ast.Attribute):
        base = typed.type_of(node.value)
        for instance in _instances(base) if base is not None else ():
            if _is_state(instance.type.fullname) and _is_field(instance, node.attr):
                return f"{instance.type.name}.{node.attr}"
    return None


# --- the planted sources: what the check must find, and what it must let pass --------------

_PLANTED_HEAD = """\
from __future__ import annotations
import asyncio
from collections.abc import Mapping
from supervisor import config, fleet, health, leadership, vocabulary
from supervisor.errors import RemoteError
from supervisor.health import HostState
from supervisor.health import HostState as S
from supervisor.leadership import Role


def go() -> None: ...


def planted(
    host: health.Host,
    lead: leadership.Leadership,
    change: vocabulary.HostStateChanged,
    reply: vocabulary.Reply,
    action: vocabulary.Action,
    cfg: config.Config,
    policy: health.Policy,
    hosts: Mapping[str, health.Host],
    core: fleet.Fleet,
    shown: fleet.FleetView,
    exc: Exception,
    timer: asyncio.TimerHandle | None,
) -> object:
"""

PLANTED = [
    "if host.state is HostState.READY:\n    go()",
    "if lead.role is Role.LEADER:\n    go()",
    "level = 'warning' if change.to in health.UNHEALTHY_STATES else 'info'",
    "detach = cfg.run.on_exit == 'detach'\nif detach:\n    go()",
    "if cfg.health.restart_stop == 'kill':\n    go()",
    "names = [n for n, h in hosts.items() if h.ssh_up]",
    "state = host.state\nif state is S.STOPPED:\n    go()",
    "while policy.max_restarts:\n    go()",
    "match action:\n    case vocabulary.Terminate() if host.pid:\n        go()",
    "if shown.frozen:\n    go()",
    "if cfg.trainer.heartbeat_stale_s > 10:\n    go()",
]
LETS_PASS = [
    "if core.all_ready:\n    go()",
    "if lead.standing_by:\n    go()",
    "if leadership.refusal(lead, 'command') is not None:\n    go()",
    "if core.command_refusal() is not None:\n    go()",
    "if change.cause is not None:\n    go()",
    "if reply.refusal is not None:\n    go()",
    "match action:\n    case vocabulary.Terminate(collect_evidence=True):\n        go()",
    "if isinstance(exc, RemoteError):\n    go()",
    "if timer is not None:\n    timer.cancel()",
    "timeout = cfg.health.evidence_timeout_s",
    "if cfg.metrics.listen is None:\n    go()",
]


def _planted(body: str) -> str:
    return _PLANTED_HEAD + textwrap.indent(body, "    ") + "\n    return None\n"


@pytest.fixture(scope="module")
def inferred() -> dict[str, Typed]:
    """The checked modules and every planted source, typed by one mypy build."""
    modules = {f"supervisor.{m.removesuffix('.py')}": (SUPERVISOR / m).read_text() for m in CHECKED}
    modules.update({f"planted_{i}": _planted(body) for i, body in enumerate(PLANTED)})
    modules.update({f"passing_{i}": _planted(body) for i, body in enumerate(LETS_PASS)})
    return infer(modules)


@pytest.mark.parametrize("module", CHECKED)
def test_the_interpreter_and_its_adapters_decide_nothing(
    inferred: dict[str, Typed], module: str
) -> None:
    """No condition in the daemon or an adapter reads a core's state or a policy, or tests a
    state or a role: such a rule belongs in a core, which returns the action to perform."""
    name = f"supervisor.{module.removesuffix('.py')}"
    assert decisions(module, inferred[name]) == []


@pytest.mark.parametrize("index", range(len(PLANTED)), ids=lambda i: PLANTED[i].split("\n")[0])
def test_the_check_finds_a_planted_decision(inferred: dict[str, Typed], index: int) -> None:
    """Each kind of decision the check forbids is found when planted in a source."""
    assert len(decisions("planted", inferred[f"planted_{index}"])) == 1, PLANTED[index]


@pytest.mark.parametrize("index", range(len(LETS_PASS)), ids=lambda i: LETS_PASS[i].split("\n")[0])
def test_the_check_lets_questions_to_the_cores_and_io_mechanics_pass(
    inferred: dict[str, Typed], index: int
) -> None:
    """Asking a core a question, testing what an action says, and plain I/O mechanics (a
    config value passed on, not tested) are not decisions."""
    assert decisions("passing", inferred[f"passing_{index}"]) == [], LETS_PASS[index]


def test_every_allowed_verdict_is_still_there_and_says_why(inferred: dict[str, Typed]) -> None:
    """An entry of ``ALLOWED`` names a read the check would flag, with its reason: one that no
    longer happens is taken out, so the list stays short and true."""
    for (module, what), why in ALLOWED.items():
        assert why.strip(), (module, what)
        typed = inferred[f"supervisor.{module.removesuffix('.py')}"]
        reads = {
            _what_it_reads(node, typed)
            for test in _conditions(ast.parse(typed.source))
            for node in ast.walk(test)
        }
        assert what in reads, (module, what)


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


def test_the_cores_messages_are_known_and_state_is_not_among_them() -> None:
    """What an adapter may test (events, actions and what they carry) is found from the cores'
    unions; the cores' own state types are not among it."""
    assert "supervisor.vocabulary.HostStateChanged" in MESSAGES
    assert "supervisor.health.Evidence" in MESSAGES  # carried by TerminateConfirmed
    for state in ("supervisor.health.Host", "supervisor.leadership.Leadership"):
        assert state not in MESSAGES and _is_state(state)
    assert not _is_state("supervisor.config.SshConfig")
