"""``reward-supervisor preflight``: every host checked once, in parallel, before the first run.

Each host gets the daemon's own connection code (``RemoteHost``: ``known_hosts`` enforced,
nothing read from ``$HOME``) and one command: ``hostcheck.py`` run by the configured
``worker.python`` through the login shell the agent starts in, with ``worker.env`` sent on
stdin (never in an argv, where ``ps`` on the host would show it). On the shared
filesystem it writes only nonce files (``.preflight-<token>.nonce`` in the run root, ``ctl/``
and ``status/``) and removes them; it creates the run directories as ``run`` would.
Everything a host answers is hostile input: bounded, type-checked, never trusted for a path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any, Final

from supervisor import layout
from supervisor.config import Config, HostConfig, render_argv, spare_host
from supervisor.errors import RemoteError
from supervisor.measured import remote_program
from supervisor.remote import RemoteHost
from supervisor.terminal import terminal_text

HOSTCHECK_PATH: Final = Path(__file__).with_name("hostcheck.py")
#: The agent (and so the daemon) needs this on the worker hosts (agent.py's docstring).
MIN_PYTHON: Final = (3, 7)
#: The longest line of a host's reply we parse; a real one is well under 4 KiB.
MAX_REPLY_LINE: Final = 64 * 1024
#: What of a host's text (stderr, an error) is kept for the report.
MAX_TEXT: Final = 400
#: Time kept back from the host's budget when telling hostcheck how long the module check
#: may take, so that a slow import is reported by hostcheck itself, not as a hung host.
MODULE_MARGIN_S: Final = 2.0
#: Shown with the clock offsets (human and JSON).
CLOCK_NOTE: Final = (
    "clock: the host's clock minus ours, ± what one command cannot tell apart (mostly the"
    " login shell's start). For information:"
    " health never compares clocks (a heartbeat counts when it changes, timed on our clock),"
    " so an offset cannot make a worker look stale or fresh; it shifts the times the worker"
    " writes (heartbeat_at, its log) against ours."
)


class Status(StrEnum):
    """The outcome of one check on one host."""

    OK = "ok"
    FAIL = "fail"
    #: Measured and shown, never a failure (the clock offset).
    INFO = "info"
    #: Not checked, because an earlier check failed (the row says which).
    SKIP = "skip"


class CheckName(StrEnum):
    """The checks, in table order; these names are the JSON keys and appear in failures."""

    SSH = "ssh"
    PYTHON = "python"
    MODULE = "module"
    REWARD_FN = "reward_fn"
    RUN_ROOT = "run_root"
    WRITABLE = "writable"
    CLOCK = "clock"
    DISK = "disk"


#: Column headings of the table.
TITLES: Final[Mapping[CheckName, str]] = {
    CheckName.SSH: "SSH",
    CheckName.PYTHON: "PYTHON",
    CheckName.MODULE: "MODULE",
    CheckName.REWARD_FN: "REWARD FN",
    CheckName.RUN_ROOT: "RUN ROOT",
    CheckName.WRITABLE: "STATUS/ CTL/",
    CheckName.CLOCK: "CLOCK",
    CheckName.DISK: "FREE DISK",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One check on one host: a short cell for the table, a sentence for the details."""

    name: CheckName
    status: Status
    cell: str
    detail: str
    #: A stable reason code beside the sentence (``host_key``, ``login``, ``hung``, ...).
    code: str | None = None
    #: Measured values for ``--json`` (``version``, ``offset_s``, ``free_bytes``, ...).
    values: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostReport:
    """Every check of one host."""

    host: str
    address: str
    user: str
    checks: tuple[Check, ...]
    elapsed_s: float

    @property
    def failed(self) -> list[Check]:
        """The failing checks."""
        return [c for c in self.checks if c.status is Status.FAIL]


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What the command line chose."""

    #: Per host, from the start (waiting for a handshake slot included) to the answer.
    host_timeout_s: float = 20.0
    #: The whole run: hosts still unanswered then are reported as hung.
    timeout_s: float = 60.0
    min_free_bytes: int = 1 << 30
    #: Import the worker's module and ``run.reward_fn``'s instead of only locating them (and
    #: then the reward function must be in its module, and callable).
    import_module: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """The outcome of a preflight run."""

    root: str
    hosts: tuple[HostReport, ...]
    elapsed_s: float
    #: Run directories that did not exist and were created here (as ``run`` would).
    created: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No host has a failing check."""
        return not any(h.failed for h in self.hosts)


class LocalProblem(Exception):
    """Preflight cannot start here (the run root cannot be created or written)."""


#: The ``-c`` program each host runs first, in a syntax every Python 3 parses; hostcheck.py's
#: text follows as its last argument. A host too old for hostcheck.py (3.6 cannot even parse
#: it) still answers with its version, which the supervisor reports as too old.
_BOOTSTRAP: Final = (
    "import sys\n"
    f"if sys.version_info < {MIN_PYTHON!r}:\n"
    "    import json\n"
    "    sys.stdout.write(json.dumps({'preflight': 1, 'executable': sys.executable,"
    " 'python': '.'.join(map(str, sys.version_info[:3])), 'hostcheck': False}) + '\\n')\n"
    "else:\n"
    "    exec(compile(sys.argv.pop(), 'hostcheck.py', 'exec'), {'__name__': '__main__'})\n"
)


@cache
def hostcheck_source() -> str:
    """The text of ``hostcheck.py``, as sent to every host."""
    return HOSTCHECK_PATH.read_text(encoding="utf-8")


# --- pure: what the worker argv asks for, and what a host's answer means ---------------------


#: Python's options that take their value as the next argument (``python -X utf8 -m w``).
_PYTHON_OPTIONS_WITH_VALUE: Final = frozenset({"-X", "-W", "--check-hash-based-pycs"})


def module_target(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """The interpreter argv (with its options) and the module of ``python ... -m MODULE``;
    for an argv without ``-m``, ``([argv[0]], None)``: only the executable is checked."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return (list(argv[:i]), argv[i + 1]) if i + 1 < len(argv) else ([argv[0]], None)
        if arg in _PYTHON_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if not arg.startswith("-") or arg in ("-c", "-", "--"):
            break  # a script, a command or the program's own arguments: python's end here
        i += 1
    return [argv[0]], None


def parse_reply(stdout: str) -> dict[str, Any] | None:
    """hostcheck's JSON answer: the last line that is one (rc files may print before it)."""
    for line in reversed(stdout.splitlines()):
        if len(line) > MAX_REPLY_LINE:
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict) and value.get("preflight") == 1:
            return value
    return None


def connect_failed(kind: str | None, reason: str) -> list[Check]:
    """The row of a host we could not log in to."""
    return [
        Check(name=CheckName.SSH, status=Status.FAIL, cell="FAIL", detail=reason, code=kind),
        *_skipped(CheckName.SSH),
    ]


def hung(
    phase: str, waited_s: float, *, overall: bool, connected: bool, address: str
) -> list[Check]:
    """The row of a host that did not answer in time."""
    which = "the overall --timeout" if overall else "--host-timeout"
    detail = f"no answer within {which} ({waited_s:.1f}s) while {phase} ({address})"
    name = CheckName.PYTHON if connected else CheckName.SSH
    checks = [Check(name=name, status=Status.FAIL, cell="HUNG", detail=detail, code="hung")]
    if connected:
        checks.insert(0, _ssh_ok(address))
    return [*checks, *_skipped(name)]


def command_failed(python: str, exit_status: int, stdout: str, stderr: str) -> str:
    """Why ``python`` could not run hostcheck, from its exit status and output."""
    said = _short(stderr) or _short(stdout) or "-"
    if exit_status == 127:
        return f"{python!r} not found on the host (exit 127): {said}"
    if exit_status == 126:
        return f"{python!r} is not executable on the host (exit 126): {said}"
    return f"{python!r} could not run the check (exit {exit_status}): {said}"


def evaluate(
    reply: Mapping[str, Any],
    *,
    address: str,
    module: str | None,
    module_argv: Sequence[str],
    sent_wall: float,
    answered_wall: float,
    options: Options,
    reward_fn: str = "",
) -> list[Check]:
    """Every check of a host that answered; ``sent_wall``/``answered_wall`` are our wall-clock
    times around the command (the host read its clock in between)."""
    python = _python(reply)
    if reply.get("hostcheck") is False:  # the bootstrap's answer: too old to run hostcheck.py
        return [_ssh_ok(address), python, *_skipped(CheckName.PYTHON)]
    checks = [_ssh_ok(address), python]
    checks.append(_module(reply, module, module_argv, options))
    checks.append(_reward_fn(reply, reward_fn, options))
    root = _run_root(reply)
    checks.append(root)
    if root.status is Status.OK:
        checks.append(_writable(reply))
    else:
        checks.append(_skip(CheckName.WRITABLE, "the host does not see the run root"))
    checks.append(_clock(reply, sent_wall, answered_wall))
    if root.status is Status.OK:
        checks.append(_disk(reply, options.min_free_bytes))
    else:
        checks.append(_skip(CheckName.DISK, "the host does not see the run root"))
    return checks


def _ssh_ok(address: str) -> Check:
    return Check(
        name=CheckName.SSH,
        status=Status.OK,
        cell="ok",
        detail=f"{address}: host key verified against known_hosts, logged in",
    )


def _python(reply: Mapping[str, Any]) -> Check:
    version = _str(reply.get("python"))
    executable = _str(reply.get("executable"))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    values = {"version": version, "executable": executable}
    if len(parts) < 2 or parts < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check(
            name=CheckName.PYTHON,
            status=Status.FAIL,
            cell=version or "FAIL",
            detail=f"Python {version or '?'} at {executable or '?'}: the agent needs {need}+",
            code="too_old",
            values=values,
        )
    return Check(
        name=CheckName.PYTHON,
        status=Status.OK,
        cell=version,
        detail=f"Python {version} at {executable}",
        values=values,
    )


def _module(
    reply: Mapping[str, Any], module: str | None, module_argv: Sequence[str], options: Options
) -> Check:
    raw = reply.get("module")
    result: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    interpreter = " ".join(module_argv)
    how = "imported" if options.import_module else "located (not imported)"
    what = f"{module} by {interpreter}" if module else f"{interpreter} (no -m in worker.argv)"
    values: dict[str, Any] = {"module": module, "interpreter": list(module_argv)}
    if result.get("found") is True:
        origin = _str(result.get("origin")) or "?"
        done = how if module else "found on PATH"
        values["origin"] = origin
        return Check(
            name=CheckName.MODULE,
            status=Status.OK,
            cell="ok",
            detail=f"{what}: {done}, {origin}",
            values=values,
        )
    error = _str(result.get("error")) or "no answer from the module check"
    if result.get("hung") is True:
        code = "hung"
    elif result.get("raised") is True:
        code = "import_failed"  # found, but its code (or a package's above it) raised
    else:
        code = "not_found"
    return Check(
        name=CheckName.MODULE,
        status=Status.FAIL,
        cell="HUNG" if code == "hung" else "FAIL",
        detail=f"{what}, with worker.env: {error}",
        code=code,
        values=values,
    )


def _reward_fn(reply: Mapping[str, Any], reward_fn: str, options: Options) -> Check:
    """``run.reward_fn``: its module found by the worker's interpreter (with ``worker.env``,
    in the run root), or imported and the function in it, with ``--import-module``."""
    raw = reply.get("reward_fn")
    result: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    values: dict[str, Any] = {"reward_fn": reward_fn}
    how = "imported, the function found" if options.import_module else "module located"
    if result.get("found") is True:
        origin = _str(result.get("origin")) or "?"
        values["origin"] = origin
        detail = f"run.reward_fn {reward_fn}: {how}, {origin}"
        return Check(
            name=CheckName.REWARD_FN, status=Status.OK, cell="ok", detail=detail, values=values
        )
    error = _str(result.get("error")) or "no answer from the reward fn check"
    values["error"] = error
    if result.get("hung") is True:
        code = "hung"
    elif result.get("no_function") is True:
        code = "no_function"  # the module imports, but has no such callable
    elif result.get("raised") is True:
        code = "import_failed"
    else:
        code = "not_found"
    return Check(
        name=CheckName.REWARD_FN,
        status=Status.FAIL,
        cell="HUNG" if code == "hung" else "FAIL",
        detail=f"run.reward_fn {reward_fn}: {error} (the worker's interpreter, with"
        " worker.env): every task naming it would be answered with an error",
        code=code,
        values=values,
    )


def _run_root(reply: Mapping[str, Any]) -> Check:
    raw = reply.get("dirs")
    dirs: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    wrong = {name: _str(dirs.get(name)) or "no answer" for name in (".", "ctl", "status")}
    wrong = {name: seen for name, seen in wrong.items() if seen != "match"}
    if not wrong:
        return Check(
            name=CheckName.RUN_ROOT,
            status=Status.OK,
            cell="ok",
            detail="the host reads the nonce files written here in the run root, ctl/, status/",
        )
    if reply.get("root_exists") is False:
        detail = "the run root does not exist on the host: is the shared filesystem mounted?"
        code = "missing"
    else:
        listed = ", ".join(f"{'run root' if n == '.' else n + '/'}: {s}" for n, s in wrong.items())
        detail = (
            "the host sees a different directory at this path (another filesystem, or not"
            f" the shared one): nonce files written here are not there ({listed})"
        )
        code = "different"
    return Check(name=CheckName.RUN_ROOT, status=Status.FAIL, cell="FAIL", detail=detail, code=code)


def _writable(reply: Mapping[str, Any]) -> Check:
    raw = reply.get("writable")
    dirs: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    results = {name: _str(dirs.get(name)) or "no answer" for name in ("status", "ctl")}
    failing = {name: seen for name, seen in results.items() if seen != "ok"}
    if not failing:
        return Check(
            name=CheckName.WRITABLE,
            status=Status.OK,
            cell="ok",
            detail="a file was created, synced and removed in status/ and ctl/ by the host",
        )
    listed = "; ".join(f"{name}/: {seen}" for name, seen in failing.items())
    return Check(
        name=CheckName.WRITABLE,
        status=Status.FAIL,
        cell="FAIL",
        detail=f"the host cannot write {listed}",
        code="not_writable",
        values={"failing": sorted(failing)},
    )


def _clock(reply: Mapping[str, Any], sent_wall: float, answered_wall: float) -> Check:
    remote_wall, work_s = _number(reply.get("time")), _number(reply.get("elapsed_s"))
    if remote_wall is None or work_s is None:
        return Check(name=CheckName.CLOCK, status=Status.INFO, cell="?", detail="no clock reading")
    # The host read its clock at the end of its work: after our send plus that work, and
    # before our receipt. The login shell's start is all that is left in between. (A host
    # claiming more work than the round trip is held to the round trip.)
    work_s = min(max(work_s, 0.0), answered_wall - sent_wall)
    low, high = remote_wall - answered_wall, remote_wall - sent_wall - work_s
    offset, within = (low + high) / 2, (high - low) / 2
    return Check(
        name=CheckName.CLOCK,
        status=Status.INFO,
        cell=f"{offset:+.2f}±{within:.2f}s",
        detail=f"host clock {offset:+.3f}s ±{within:.3f}s from ours",
        values={"offset_s": round(offset, 4), "within_s": round(within, 4)},
    )


def _number(value: object) -> float | None:
    """A finite number from a host's reply, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if abs(number) < float("inf") else None


def _disk(reply: Mapping[str, Any], min_free_bytes: int) -> Check:
    raw = reply.get("disk")
    disk: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    free = disk.get("free_bytes")
    if type(free) is not int:
        error = _str(disk.get("error")) or "no answer"
        return Check(
            name=CheckName.DISK,
            status=Status.FAIL,
            cell="FAIL",
            detail=f"cannot read the run root's free space on the host: {error}",
            code="unknown",
        )
    inodes = disk.get("free_inodes")
    values = {"free_bytes": free, "free_inodes": inodes if type(inodes) is int else None}
    if free < min_free_bytes:
        return Check(
            name=CheckName.DISK,
            status=Status.FAIL,
            cell=_bytes(free),
            detail=f"{_bytes(free)} free on the run root, below --min-free-mb"
            f" ({_bytes(min_free_bytes)}): worker logs and results need room",
            code="low",
            values=values,
        )
    return Check(
        name=CheckName.DISK,
        status=Status.OK,
        cell=_bytes(free),
        detail=f"{_bytes(free)} free on the run root",
        values=values,
    )


def _skip(name: CheckName, why: str) -> Check:
    return Check(name=name, status=Status.SKIP, cell="-", detail=f"not checked: {why}")


def _skipped(after: CheckName) -> list[Check]:
    """Every check after ``after``, not run because it failed."""
    names = list(CheckName)
    why = f"{after.value} failed"
    return [_skip(n, why) for n in names[names.index(after) + 1 :]]


def _str(value: object) -> str:
    """A host's string, bounded and on one line; empty for anything else."""
    return _short(value) if isinstance(value, str) else ""


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_TEXT else "..." + flat[-MAX_TEXT:]


def _bytes(n: int) -> str:
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


# --- pure: presentation ---------------------------------------------------------------------


def failures(report: Report) -> list[str]:
    """``HOST: CHECK`` for every failing check, in host order."""
    return [f"{h.host}: {c.name.value}" for h in report.hosts for c in h.failed]


def render(report: Report, options: Options) -> str:
    """The table, the details of every failure, the notes and a verdict line, for a
    terminal: what a host said (a version, an error) is escaped (``terminal_text``), so it
    cannot drive the screen."""
    names = list(CheckName)
    header = ("HOST", "ADDRESS", *(TITLES[n] for n in names))
    rows = [header]
    for h in report.hosts:
        cells = {c.name: c.cell for c in h.checks}
        raw = (h.host, h.address, *(cells.get(n, "-") for n in names))
        rows.append(tuple(terminal_text(cell) for cell in raw))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    problems = [(h.host, c) for h in report.hosts for c in h.checks if c.status is Status.FAIL]
    if problems:
        lines += ["", "failing checks:"]
        lines += [terminal_text(f"  {host}: {c.name.value}: {c.detail}") for host, c in problems]
    lines += ["", *(terminal_text(note) for note in _notes(report, options))]
    bad = [h for h in report.hosts if h.failed]
    took = f"{report.elapsed_s:.1f}s"
    if not bad:
        lines.append(f"preflight: all {len(report.hosts)} hosts ok ({took})")
    else:
        named = ", ".join(f"{h.host} ({', '.join(c.name.value for c in h.failed)})" for h in bad)
        lines.append(f"preflight: {len(bad)} of {len(report.hosts)} hosts failed ({took}): {named}")
    return "\n".join(lines)


def _notes(report: Report, options: Options) -> list[str]:
    how = "imported" if options.import_module else "located with importlib, not imported"
    notes = [
        CLOCK_NOTE,
        f"module: the module after -m in worker.argv, {how}, by the worker's interpreter with"
        " worker.env in the run root (as the launch does); without -m, argv[0] on PATH.",
        "reward fn: run.reward_fn's module "
        + (
            "imported and the function found in it"
            if options.import_module
            else "located, not imported (--import-module imports it and finds the function)"
        )
        + ", the same way.",
        f"run root {report.root}: nonce files written here, read on each host, then removed.",
    ]
    if report.created:
        notes.append(f"created (as run would): {created_text(report.root, report.created)}")
    return notes


def created_text(root: str, created: Sequence[str]) -> str:
    """The directories created, briefly: those under the run root relative to it, and the
    shards' inboxes as ranges (a thousand shards are one phrase, not a thousand paths)."""
    named: list[str] = []
    shards: list[int] = []
    inbox = os.path.join(root, "inbox") + os.sep
    for path in created:
        tail = path.removeprefix(inbox)
        if tail != path and tail.isdigit():
            shards.append(int(tail))
        elif path.startswith(root + os.sep):
            named.append(os.path.relpath(path, root) + "/")
        else:
            named.append(path)
    if shards:
        named.append(f"inbox/N/ for shard{'s' * (len(shards) > 1)} {_ranges(sorted(shards))}")
    return ", ".join(named)


def _ranges(numbers: Sequence[int]) -> str:
    """``0-3, 7`` for ``[0, 1, 2, 3, 7]``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def as_json(report: Report, options: Options) -> dict[str, Any]:
    """The report as JSON: per host and check, status, detail, code and values."""
    return {
        "ok": report.ok,
        "root": report.root,
        "elapsed_s": round(report.elapsed_s, 3),
        "created": list(report.created),
        "failures": [
            {"host": h.host, "check": c.name.value, "code": c.code, "detail": c.detail}
            for h in report.hosts
            for c in h.failed
        ],
        "hosts": {
            h.host: {
                "ok": not h.failed,
                "address": h.address,
                "user": h.user,
                "elapsed_s": round(h.elapsed_s, 3),
                "checks": {
                    c.name.value: {
                        "status": c.status.value,
                        "detail": c.detail,
                        "code": c.code,
                        **c.values,
                    }
                    for c in h.checks
                },
            }
            for h in report.hosts
        },
        "notes": {
            "clock": CLOCK_NOTE,
            "module": "imported" if options.import_module else "located, not imported",
            "reward_fn": "imported" if options.import_module else "located, not imported",
            "min_free_bytes": options.min_free_bytes,
        },
    }


# --- on this machine (check-config) ---------------------------------------------------------

#: How long check-config waits for the worker's interpreter here to find the reward fn.
HERE_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Here:
    """``run.reward_fn`` checked on this machine: the check, or why it could not be."""

    check: Check | None
    python: str
    not_checked: str = ""

    @property
    def problem(self) -> str | None:
        """What check-config warns of: the reward fn is not found here; None otherwise."""
        if self.check is None or self.check.status is not Status.FAIL:
            return None
        fn, error = self.check.values["reward_fn"], self.check.values["error"]
        return (
            f"{fn}: {error} (by {self.python} here, with worker.env): every task naming it"
            " would be answered with an error; preflight checks every host"
        )

    @property
    def line(self) -> str:
        """What check-config says of it when it is no warning."""
        if self.check is None:
            return f"note: run.reward_fn not checked here: {self.not_checked}"
        return f"{self.check.detail} (by {self.python} here; preflight checks every host)"

    def as_json(self) -> dict[str, Any]:
        """check-config's ``reward_fn``: checked here or not, and what was found."""
        if self.check is None:
            return {"checked": False, "python": self.python, "detail": self.not_checked}
        return {
            "checked": True,
            "python": self.python,
            "ok": self.check.status is Status.OK,
            "code": self.check.code,
            "detail": self.check.detail,
            **self.check.values,
        }


def reward_fn_here(config: Config, timeout_s: float = HERE_TIMEOUT_S) -> Here:
    """``run.reward_fn``'s module located by the worker's interpreter on this machine, with
    ``worker.env``, as preflight locates it on a host (hostcheck's module checks alone);
    not checked when that interpreter is not here (preflight checks every host)."""
    import shutil
    import subprocess

    host = (*config.hosts, *(spare_host(s) for s in config.spares))[0]
    payload = _payload(config, host, "", "", "", Options(host_timeout_s=timeout_s))
    argv = payload["module_argv"] if payload["module"] else payload["reward_argv"]
    env = {**os.environ, **config.worker.env}
    python = str(argv[0])
    found = shutil.which(python, path=env.get("PATH", os.defpath))
    if found is None:
        why = f"worker.python {python} is not on this machine; preflight checks every host"
        return Here(check=None, python=python, not_checked=why)
    program = remote_program(hostcheck_source(), HOSTCHECK_PATH)
    try:
        done = subprocess.run(
            [python, "-S", "-X", "utf8", "-c", _BOOTSTRAP, "hostcheck", program],
            input=json.dumps({**payload, "modules_only": True}),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s + MODULE_MARGIN_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Here(check=None, python=python, not_checked=f"{python} did not answer: {exc}")
    reply = parse_reply(done.stdout)
    if reply is None:
        why = command_failed(python, done.returncode, done.stdout, done.stderr)
        return Here(check=None, python=python, not_checked=why)
    if reply.get("hostcheck") is False:
        why = f"{python} is Python {_str(reply.get('python')) or '?'}, too old to check it"
        return Here(check=None, python=python, not_checked=why)
    return Here(check=_reward_fn(reply, config.run.reward_fn, Options()), python=python)


# --- the run --------------------------------------------------------------------------------


def run(config: Config, options: Options) -> Report:
    """Check every host (raises LocalProblem if the run root cannot be used here)."""
    return asyncio.run(check_fleet(config, options))


async def check_fleet(config: Config, options: Options) -> Report:
    """Check every host and every spare at once, within the per-host and overall timeouts."""
    started = time.monotonic()
    # A spare must be able to serve any shard the moment it is needed: checked the same way.
    machines = (*config.hosts, *(spare_host(s) for s in config.spares))
    run_dir = layout.layout_of(config)
    created = await asyncio.to_thread(_prepare, config)
    token = secrets.token_hex(16)
    nonce_name = f".preflight-{token}.nonce"
    written: list[Path] = []
    try:
        await asyncio.to_thread(_write_nonces, run_dir, nonce_name, token, written)
        handshakes = asyncio.Semaphore(config.ssh.max_concurrent_handshakes)
        overall_at = started + options.timeout_s
        reports: dict[str, HostReport] = {}
        async with asyncio.TaskGroup() as tasks:
            for host in machines:
                probe_name = f".preflight-{token}-{host.name}.probe"
                payload = _payload(config, host, nonce_name, token, probe_name, options)
                tasks.create_task(
                    _check_host(config, host, payload, handshakes, overall_at, options, reports)
                )
    finally:
        # Not in a thread: this must run even when the run is being cancelled (Ctrl-C).
        _remove(run_dir, written, token, machines)
    return Report(
        root=str(config.run.root),
        hosts=tuple(reports[h.name] for h in machines),
        elapsed_s=time.monotonic() - started,
        created=tuple(created),
    )


def _prepare(config: Config) -> list[str]:
    """Create the run directories ``run`` would; every directory that was missing, the run
    root's missing parents included, parents first."""
    root = config.run.root
    wanted = [*reversed(root.parents), root, *layout.run_dirs(config)]
    missing = [str(p) for p in wanted if not os.path.lexists(p)]
    try:
        layout.ensure_run_dirs(config)
    except OSError as exc:
        raise LocalProblem(f"cannot create the run directories here: {exc}") from None
    return missing


def _write_nonces(run_dir: layout.RunLayout, name: str, token: str, written: list[Path]) -> None:
    """The nonce file in the run root, ``ctl/`` and ``status/``; appends each to ``written``."""
    for directory in (run_dir.root, run_dir.ctl, run_dir.status_dir):
        path = directory / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise LocalProblem(f"cannot write {path} here: {exc.strerror or exc}") from None
        written.append(path)
        try:
            os.write(fd, f"{token}\n".encode("ascii"))
            # Another client of a network filesystem reads it only once it reached the server.
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(
    run_dir: layout.RunLayout, written: list[Path], token: str, hosts: Sequence[HostConfig]
) -> None:
    """Our nonce files, and probe files a host could not remove (it was cut off): exact
    names inside the run root only; unlink never follows a symlink."""
    leftovers = [
        directory / f".preflight-{token}-{h.name}.probe"
        for h in hosts
        for directory in (run_dir.ctl, run_dir.status_dir)
    ]
    for path in [*written, *leftovers]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _payload(
    config: Config,
    host: HostConfig,
    nonce_name: str,
    token: str,
    probe_name: str,
    options: Options,
) -> dict[str, Any]:
    """hostcheck's request for ``host``."""
    module_argv, module = module_target(render_argv(config, host))
    return {
        "root": str(config.run.root),
        "nonce_name": nonce_name,
        "nonce": token,
        "probe_name": probe_name,
        "module_argv": module_argv,
        "module": module,
        "reward_fn": config.run.reward_fn,
        # Without -m the worker's argv names no interpreter to ask: worker.python is asked.
        "reward_argv": module_argv if module else [config.worker.python],
        "env": dict(config.worker.env),
        "import_module": options.import_module,
        "module_timeout_s": max(1.0, options.host_timeout_s - MODULE_MARGIN_S),
    }


async def _check_host(
    config: Config,
    host: HostConfig,
    payload: dict[str, Any],
    handshakes: asyncio.Semaphore,
    overall_at: float,
    options: Options,
    reports: dict[str, HostReport],
) -> None:
    """Connect, run hostcheck, and put the host's report in ``reports``; never raises but
    for cancellation. The host's own time (``host_timeout_s``) starts once it has a slot
    in the fleet's handshake budget: a big fleet's queue is not a hung host."""
    address = f"{host.address}:{host.port}"
    user = host.username or config.ssh.username
    outcome: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

    def on_connection(up: bool, reason: str) -> None:
        if not outcome.done():
            outcome.set_result((up, reason))

    remote = RemoteHost(
        host,
        config.ssh,
        python=config.worker.python,
        # The fleet's budget is taken below, around the first outcome; this one only
        # serialises the host's own retries, which never happen before we close it.
        handshakes=asyncio.Semaphore(1),
        on_connection=on_connection,
    )
    started = time.monotonic()
    deadline = overall_at
    phase = "waiting for a handshake slot"
    connected = False
    keeper: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout_at(_loop_time(overall_at)) as budget:
            async with handshakes:
                started = time.monotonic()
                deadline = min(started + options.host_timeout_s, overall_at)
                budget.reschedule(_loop_time(deadline))
                phase = "connecting"
                keeper = asyncio.create_task(remote.maintain())
                up, reason = await outcome
            if not up:
                kind = remote.last_failure
                checks = connect_failed(None if kind is None else kind.value, reason)
            else:
                connected = True
                phase = "running the checks"
                checks = await _run_hostcheck(config, remote, payload, address, options)
    except TimeoutError:
        checks = hung(
            phase,
            time.monotonic() - started,
            overall=deadline == overall_at,
            connected=connected,
            address=address,
        )
    except Exception as exc:  # noqa: BLE001 - a task root: one host's surprise is its row
        checks = connect_failed("error", f"internal error: {type(exc).__name__}: {exc}")
    finally:
        await remote.aclose()
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
    reports[host.name] = HostReport(
        host=host.name,
        address=address,
        user=user,
        checks=tuple(checks),
        elapsed_s=time.monotonic() - started,
    )


def _loop_time(monotonic_at: float) -> float:
    """A ``time.monotonic()`` instant on the event loop's clock (the same clock, today)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_at - time.monotonic())


async def _run_hostcheck(
    config: Config,
    remote: RemoteHost,
    payload: dict[str, Any],
    address: str,
    options: Options,
) -> list[Check]:
    """Run hostcheck on a connected host and read its answer."""
    python = config.worker.python
    # -S: hostcheck needs only the stdlib, and site's .pth files cost every host a few ms;
    # the module check runs the worker's interpreter as the worker would, site and all.
    # The source, but in ./dev test a wrapper that measures it (supervisor/measured.py).
    program = remote_program(hostcheck_source(), HOSTCHECK_PATH)
    argv = [python, "-S", "-X", "utf8", "-c", _BOOTSTRAP, "hostcheck", program]
    sent_wall = time.time()
    try:
        # The enclosing deadline bounds this; the timeout here only has to be longer.
        result = await remote.run(argv, timeout_s=options.timeout_s, input=json.dumps(payload))
    except RemoteError as exc:
        return [
            _ssh_ok(address),
            Check(
                name=CheckName.PYTHON,
                status=Status.FAIL,
                cell="FAIL",
                detail=f"running {python!r}: {exc.reason}",
                code="lost" if exc.connection_lost else "error",
            ),
            *_skipped(CheckName.PYTHON),
        ]
    answered_wall = time.time()
    reply = parse_reply(result.stdout) if result.exit_status == 0 else None
    if reply is None:
        reason = command_failed(python, result.exit_status, result.stdout, result.stderr)
        code = "not_found" if result.exit_status == 127 else "failed"
        return [
            _ssh_ok(address),
            Check(name=CheckName.PYTHON, status=Status.FAIL, cell="FAIL", detail=reason, code=code),
            *_skipped(CheckName.PYTHON),
        ]
    return evaluate(
        reply,
        address=address,
        module=payload["module"],
        module_argv=payload["module_argv"],
        sent_wall=sent_wall,
        answered_wall=answered_wall,
        options=options,
        reward_fn=payload["reward_fn"],
    )
