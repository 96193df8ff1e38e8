"""The remote side: an agent serving JSON-lines requests on one SSH channel, its launcher (a
fork server), and the shepherd that launches, holds the shard lock for, and reaps one worker.

``remote.py`` sends its text, with that of ``safefiles.py`` (its files under the run root),
as the ``-c`` argument of the worker host's python. So both are stdlib-only and run on Python
>= 3.7 (no ``match``, no runtime ``X | Y``, nothing newer unless guarded). Three modes:

``python -X utf8 -u -c SRC agent``
    Reads one JSON request per line on stdin, ``{"id": N, "op": OP, ...}``, serves each in its
    own thread (a terminate waiting out its grace does not hold up a probe) and answers one
    line ``{"id": N, "ok": true, "result": {...}}`` or ``{"id": N, "ok": false, "kind":
    "error"|"refused", "error": TEXT, "holder_pid": PID|null}``. The first line it writes is
    ``{"hello": {...}}``. It exits at EOF. Ops: ``ping``, ``probe``, ``launch``, ``terminate``,
    ``disarm_seed``, ``evidence`` (a worker's stacks and log tail, before a terminate).
    Unasked, it pushes ``{"exit": {...}}`` when a worker it watches ends, and ``{"usage":
    {...}}``, the memory its session holds, every ``USAGE_S``.
    At start it starts its launcher (or, in-process callers, the first launch does).

``python -X utf8 -c SRC launcher``
    The agent's fork server, so that a launch costs a fork, not a new interpreter (the agent,
    being multithreaded, must not fork itself). Single-threaded; fd 0 is a SEQPACKET socket
    from the agent carrying one launch order per message, with the write end of that launch's
    report pipe attached. For each it forks a middle child, which starts a new session and
    forks the shepherd and exits (reaped at once: no zombies, and the shepherd is a child of
    init, outside the agent's tree); it confirms the fork to the agent, which then reads the
    shepherd's report (or EOF, if the shepherd died first) from the pipe. It exits at EOF,
    leaving its shepherds running. A launch never depends on it: when it cannot be started,
    has died or does not confirm within ``LAUNCHER_ACK_S``, the agent kills it, starts a new
    one for the next launch, and launches this one through a fresh interpreter; the reply's
    ``via`` (and the worker log's "starting worker" line) says which way a launch went.

``python -X utf8 -c SRC shepherd``
    The fresh-interpreter launch: started by ``launch`` with the launch order on stdin; detaches
    (new session, double fork) and becomes the shepherd, as a launcher-forked one does.

The shepherd (``rs-shepherd`` in ``ps -o comm``) takes the shard lock, starts the worker in its
own session, writes the pidfile and launch record, reports ``{pid, start_time}`` on the report
pipe and closes it, then waits for the worker, kills what it left in its session (``sweep``)
and writes the exit record. It ignores SIGTERM/SIGINT/SIGHUP (by a handler, so the worker gets
default dispositions) so the exit is always recorded.

Processes are identified by pid *and* start time (field 22 of ``/proc/PID/stat``, clock ticks
since boot); a process in state ``Z`` (zombie) or ``X`` is dead.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import io
import json
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Union

#: The name under which the program sent to a host (``remote.packed_program``) registers the
#: text of ``safefiles.py`` it carries: a host has no ``supervisor`` package, and one it may
#: have (another version, another project's) must not be imported in its place.
SAFEFILES_MODULE = "_reward_supervisor_safefiles"

if TYPE_CHECKING:
    from supervisor import safefiles
else:
    safefiles = sys.modules.get(SAFEFILES_MODULE)
    if safefiles is None:  # imported, not sent: in the daemon, the tests, the simulator
        from supervisor import safefiles

PROTOCOL = 1
#: How often terminate looks at /proc while waiting for a pid to die: fast enough that a
#: confirmed death is reported within a few tens of ms, cheap enough to be invisible.
POLL_S = 0.02
#: After SIGKILL a process dies at once unless it is in uninterruptible sleep (a hung NFS
#: read): give it this long, then report it as still alive rather than lie.
KILL_CONFIRM_S = 10.0
#: A shepherd reports within milliseconds; this bounds a shared filesystem that hangs.
SHEPHERD_REPORT_S = 60.0
#: The launcher confirms a fork within a millisecond or two, or, just started, once python is
#: up (~50 ms, seconds on a box in trouble). Silence this long means it is wedged (stopped,
#: swapped out): it is killed, and the launch goes to a fresh interpreter.
LAUNCHER_ACK_S = 5.0
#: The largest message from the agent to its launcher: a launch spec is a few KiB, and the
#: whole source must fit one argv string (128 KiB), so no spec comes near this.
LAUNCHER_MESSAGE_MAX = 1 << 20


class OpError(Exception):
    """A request that could not be served; ``kind`` tells the daemon how to read it."""

    kind = "error"

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class Refused(OpError):
    """A launch refused because a live worker holds the shard."""

    kind = "refused"


class Fenced(OpError):
    """A launch or terminate refused because the run directory's epoch
    (``ctl/supervisor.epoch``) is higher than the request's: another supervisor leads."""

    kind = "fenced"


def fence(spec: dict[str, Any]) -> None:
    """Raise Fenced when the spec's epoch is lower than the run directory's.

    A spec without an epoch file or epoch (an in-process caller, an old daemon) is not
    fenced; nor is one when the file is missing or unreadable, as the daemon reads it (the
    lock is the election, the epoch only the fence: a garbled file must not stop every
    launch of the run).
    """
    path = spec.get("epoch_file")
    epoch = spec.get("epoch")
    if not isinstance(path, str) or not path or type(epoch) is not int:
        return
    current = safefiles.read_epoch(path, spec.get("root"))
    if current is not None and current > epoch:
        raise Fenced(
            f"fenced: the run directory's epoch is {current}, this request's {epoch}:"
            " another reward-supervisor leads this run"
        )


# --- the protocol -----------------------------------------------------------------------
# Every message of the protocol, each way, is one of the classes below: the agent reads
# requests and writes replies with them, and ``remote.py`` imports this module to write the
# requests and read the replies with the same classes. On the wire each is one JSON object
# per line: a request ``{"id": N, "op": OP, ...its fields}``, a reply ``{"id": N, "ok": true,
# "result": {...its fields}}`` or a ``Failure`` ``{"id": N, "ok": false, "kind", "error",
# "holder_pid"}``, and first of all ``{"hello": {...}}``. Reading checks every field's type
# and range: whatever the other side sends, a bad message is a ProtocolError, never a crash.
# (Python 3.7's dataclasses: annotations below are text, and Optional/Dict are from typing.)

#: The largest pid Linux can hand out (PID_MAX_LIMIT on 64-bit).
PID_MAX = 4 * 1024 * 1024
#: Memory a session may be said to hold, at most (2**50 bytes: a petabyte, past any host).
RSS_MAX = 1 << 50
#: /proc/PID/stat's start time is an unsigned 64-bit count of clock ticks.
START_TIME_MAX = 2**64 - 1
#: A reply's text fields (errors, outcomes) are cut here.
TEXT_MAX = 4096
#: Evidence: the stacks of a worker with dozens of threads fit in this (py-spy prints a
#: few hundred bytes a thread); the log tail is its last lines. Both go into one log line of
#: the daemon, which must stay under journald's 48 KiB ``LineMax`` to stay one JSON object.
STACKS_MAX = 24 * 1024
LOG_TAIL_MAX = 4096
NOTES_MAX = 10
#: Capturing evidence holds a restart back; the daemon never asks for more than this.
EVIDENCE_TIMEOUT_MAX = 30.0
#: Text fields with limits of their own.
_TEXT_LIMITS = {"stacks": STACKS_MAX, "log_tail": LOG_TAIL_MAX}


class ProtocolError(ValueError):
    """A message that is not one of the protocol's: a wrong shape or a field's wrong type;
    ``rid`` is its id when it had a usable one (a request so is still answered)."""

    def __init__(self, message: str, rid: int | None = None) -> None:
        super().__init__(message)
        self.rid = rid


@dataclass(frozen=True)
class ProbeRequest:
    """Which live worker of ``spec``'s shard runs here: ``pid``, or the pidfile's."""

    spec: dict[str, Any]
    pid: int | None = None


@dataclass(frozen=True)
class LaunchRequest:
    """Start ``spec``'s worker under a detached shepherd."""

    spec: dict[str, Any]


@dataclass(frozen=True)
class TerminateRequest:
    """Stop ``pid`` (TERM, ``grace_s``, KILL if ``kill``); answer once it is confirmed dead."""

    spec: dict[str, Any]
    pid: int
    grace_s: float
    kill: bool


@dataclass(frozen=True)
class WatchRequest:
    """Watch ``pid`` (of ``start_time``, when known) and push its exit; at once if it is
    already dead (it died while no agent watched it)."""

    spec: dict[str, Any]
    pid: int
    start_time: int | None = None


@dataclass(frozen=True)
class PingRequest:
    """Is the agent there? Answered with a Hello."""


@dataclass(frozen=True)
class DisarmSeedRequest:
    """End the old script's respawn wrappers (``wrap_script``), leaving the worker."""

    spec: dict[str, Any]
    wrap_script: str
    dry_run: bool = False


@dataclass(frozen=True)
class EvidenceRequest:
    """Capture what ``pid`` is doing (stacks, by ``stacks``: auto, py-spy, signal or none)
    and the last ``log_bytes`` of its log, all within ``timeout_s``."""

    spec: dict[str, Any]
    pid: int
    timeout_s: float
    stacks: str = "auto"
    log_bytes: int = 4096


# Union, not X | Y: this line runs, and hosts may have Python 3.7.
Request = Union[  # noqa: UP007
    ProbeRequest,
    LaunchRequest,
    TerminateRequest,
    PingRequest,
    DisarmSeedRequest,
    WatchRequest,
    EvidenceRequest,
]
#: The op name of each request on the wire.
OP_NAMES = {
    ProbeRequest: "probe",
    LaunchRequest: "launch",
    TerminateRequest: "terminate",
    PingRequest: "ping",
    DisarmSeedRequest: "disarm_seed",
    WatchRequest: "watch",
    EvidenceRequest: "evidence",
}
_REQUEST_OF = {name: cls for cls, name in OP_NAMES.items()}


@dataclass(frozen=True)
class Hello:
    """The agent's first line, and its answer to a ping."""

    pid: int
    python: str
    protocol: int = 0
    boot_id: str = ""


@dataclass(frozen=True)
class ProbeReply:
    """The live worker found (None: none), and each candidate's verdict."""

    pid: int | None
    checked: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class LaunchReply:
    """The worker started: its pid and start time, and how it was forked (``via``)."""

    pid: int
    start_time: int
    via: str = ""


@dataclass(frozen=True)
class TerminateReply:
    """How the pid ended: terminated, killed, dead, gone or reused (it was not ours); and how
    many processes of its session it left that were killed (None: its session not swept)."""

    outcome: str
    reaped: int | None = None


@dataclass(frozen=True)
class DisarmSeedReply:
    """What ``disarm_seed`` found and did."""

    wrappers: list[int]
    killed: bool
    workers: list[int]
    pidfile_was: int | None
    pidfile_now: int | None


@dataclass(frozen=True)
class WatchReply:
    """Whether the pid lives and is watched now (False: it is dead, and its exit pushed)."""

    watching: bool


@dataclass(frozen=True)
class WorkerExit:
    """Pushed unasked, one line ``{"exit": {...}}``: a worker this agent launched, found or
    was asked to watch has ended. ``exit_code``/``signal`` when known (from the zombie, or
    the shepherd's exit record); ``exited_at`` is the host's clock, for people only."""

    pid: int
    start_time: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    exited_at: float = 0.0
    #: The end of the worker's log as the shepherd's exit record will carry it: the crash
    #: signature of a pushed exit must be the one its record would give.
    log_tail: str | None = None
    #: Processes of its session this agent killed after it (``sweep``); None: not swept.
    reaped: int | None = None


@dataclass(frozen=True)
class WorkerUsage:
    """Pushed unasked every ``USAGE_S``, one line ``{"usage": {...}}``: the memory a watched
    worker's session (the worker and every process it started) holds now, as this host
    measures it: ``rss_bytes`` over ``processes`` processes, ``via`` "pss" (the sum of their
    proportional set sizes: a page shared by n of them counts 1/n to each, so the sum is
    what the session holds) or "rss" (a process whose smaps_rollup could not be read counted
    by its resident set, shared pages in full)."""

    pid: int
    start_time: int | None = None
    rss_bytes: int = 0
    processes: int = 0
    via: str = ""


@dataclass(frozen=True)
class EvidenceReply:
    """What was captured: the stacks and how (``via``), the log's tail, and ``notes`` on what
    could not be had."""

    stacks: str | None = None
    via: str | None = None
    log_tail: str | None = None
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Failure:
    """A request not served: ``kind`` "refused" (a live worker holds the shard, maybe
    ``holder_pid``) or "error"."""

    kind: str = "error"
    error: str = ""
    holder_pid: int | None = None


Reply = Union[  # noqa: UP007
    Hello,
    ProbeReply,
    LaunchReply,
    TerminateReply,
    DisarmSeedReply,
    WatchReply,
    EvidenceReply,
]
#: The reply each request is answered with.
REPLY_TO = {
    ProbeRequest: ProbeReply,
    LaunchRequest: LaunchReply,
    TerminateRequest: TerminateReply,
    PingRequest: Hello,
    DisarmSeedRequest: DisarmSeedReply,
    WatchRequest: WatchReply,
    EvidenceRequest: EvidenceReply,
}


def request_line(rid: int, request: Request) -> str:
    """The wire form of ``request`` with id ``rid``."""
    return _line({"id": rid, "op": OP_NAMES[type(request)], **asdict(request)})


def read_request(obj: object) -> tuple[int | None, Request]:
    """The id and request in a decoded JSON line; ProtocolError if it is not one (with the
    id, when there is one to answer)."""
    if not isinstance(obj, dict):
        raise ProtocolError("not a JSON object")
    rid = obj.get("id")
    rid = rid if type(rid) is int else None
    cls = _REQUEST_OF.get(obj.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown op {str(obj.get('op'))[:100]!r}", rid)
    try:
        return rid, _build(cls, obj)
    except ProtocolError as exc:
        raise ProtocolError(str(exc), rid) from None


def reply_message(rid: int | None, reply: Reply | Failure) -> dict[str, Any]:
    """The wire form of ``reply`` to request ``rid``, before encoding."""
    if isinstance(reply, Failure):
        return {"id": rid, "ok": False, **asdict(reply)}
    return {"id": rid, "ok": True, "result": asdict(reply)}


def read_reply(obj: dict[str, Any], expected: type) -> Reply | Failure:
    """The reply in a decoded line, as ``expected`` (or a Failure); ProtocolError if the
    host sent anything else."""
    reply: Reply | Failure
    if obj.get("ok") is True:
        result = obj.get("result")
        if not isinstance(result, dict):
            raise ProtocolError("a reply without a result")
        reply = _build(expected, result)
    elif obj.get("ok") is False:
        reply = _build(Failure, obj)
    else:
        raise ProtocolError("a reply that is neither ok nor not")
    return reply


def read_hello(obj: object) -> Hello | None:
    """The Hello in a decoded line, or None if the line is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("hello"), dict):
        return None
    try:
        hello: Hello = _build(Hello, obj["hello"])
    except ProtocolError:
        return None
    return hello


def push_line(news: WorkerExit | WorkerUsage) -> str:
    """The wire form of a pushed exit or usage."""
    return _line({_PUSH_KEY[type(news)]: asdict(news)})


#: The key of each kind of push on the wire.
_PUSH_KEY = {WorkerExit: "exit", WorkerUsage: "usage"}


def read_push(obj: object) -> WorkerExit | WorkerUsage | None:
    """The pushed exit or usage in a decoded line; None if the line is no push,
    ProtocolError if it is a malformed one."""
    if not isinstance(obj, dict) or "id" in obj:
        return None
    for cls, key in _PUSH_KEY.items():
        if key in obj:
            body = obj[key]
            if not isinstance(body, dict):
                raise ProtocolError(f"a pushed {key} that is not an object")
            news: WorkerExit | WorkerUsage = _build(cls, body)
            return news
    return None


def _line(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":")) + "\n"


#: How each field is checked when a message is read: its type, and for numbers a range.
_CHECKS: dict[str, tuple[Any, ...]] = {
    "pid": (int, 1, PID_MAX),
    "holder_pid": (int, 1, PID_MAX),
    "pidfile_was": (int, 1, PID_MAX),
    "pidfile_now": (int, 1, PID_MAX),
    "start_time": (int, 0, START_TIME_MAX),
    "exit_code": (int, 0, 255),
    "signal": (int, 1, 127),
    "exited_at": (float, 0.0, 1e12),
    "reaped": (int, 0, PID_MAX),
    "rss_bytes": (int, 0, RSS_MAX),
    "processes": (int, 0, PID_MAX),
    "watching": (bool,),
    "protocol": (int, 0, 1 << 31),
    "grace_s": (float, 0.0, 1e9),
    "timeout_s": (float, 0.0, EVIDENCE_TIMEOUT_MAX),
    "elapsed_s": (float, 0.0, 1e9),
    "log_bytes": (int, 0, LOG_TAIL_MAX),
    "notes": (list,),
    "kill": (bool,),
    "killed": (bool,),
    "dry_run": (bool,),
    "spec": (dict,),
    "checked": (list,),
    "wrappers": (list,),
    "workers": (list,),
}


def _build(cls: Any, obj: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` from ``obj``'s fields, each checked; ProtocolError
    names the first bad one."""
    values = {}
    for f in fields(cls):
        if f.name not in obj:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{cls.__name__} lacks {f.name!r}")
            continue
        optional = str(f.type).endswith("| None")
        values[f.name] = _checked(f.name, obj[f.name], optional)
    return cls(**values)


def _checked(name: str, value: Any, optional: bool) -> Any:
    if value is None and optional:
        return None
    kind, *bounds = _CHECKS.get(name, (str,))
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise ProtocolError(f"{name!r} is not a {kind.__name__}")
    if bounds and not bounds[0] <= value <= bounds[1]:
        raise ProtocolError(f"{name!r} is out of range")
    if kind is str:
        return value[: _TEXT_LIMITS.get(name, TEXT_MAX)]
    if name == "notes":
        if not all(isinstance(note, str) for note in value):
            raise ProtocolError("'notes' holds something that is not a string")
        return [note[:TEXT_MAX] for note in value[:NOTES_MAX]]
    if name in ("wrappers", "workers") and not all(
        type(pid) is int and 0 < pid <= PID_MAX for pid in value
    ):
        raise ProtocolError(f"{name!r} holds something that is not a pid")
    return value


# --- /proc ------------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, pgid, start_time)`` of ``pid``, or None if there is no such process."""
    ids = proc_ids(pid)
    return None if ids is None else (ids[0], ids[1], ids[3])


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (``[0]`` is field 3), or None
    if there is no such process; any other OSError (hidepid) is raised."""
    try:
        # os.read, not open(): half the cost, and a sweep reads every process's.
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.ESRCH, errno.ENOENT):
            return None
        raise
    # The command name (field 2) is in parentheses and may itself contain ") ".
    return data[data.rindex(b")") + 2 :].split()


def proc_ids(pid: int) -> tuple[str, int, int, int] | None:
    """``(state, pgid, sid, start_time)`` of ``pid``, or None if there is no such process."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    # fields[0] is field 3 (state), [2] field 5 (pgrp), [3] field 6 (session), [19] field 22
    # (starttime).
    return fields[0].decode("ascii"), int(fields[2]), int(fields[3]), int(fields[19])


def is_dead(stat: tuple[Any, ...] | None) -> bool:
    """Gone, or a zombie that only waits to be reaped (its code can no longer run)."""
    return stat is None or stat[0] in ("Z", "X", "x")


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` (empty for a zombie or a vanished process)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            data = f.read()
    except OSError:
        return []
    return [os.fsdecode(arg) for arg in data.split(b"\0")[:-1]]


_BOOT_ID: list[str] = []


def boot_id() -> str:
    """This boot of this host: a launch record from another boot names another process."""
    if not _BOOT_ID:
        with open("/proc/sys/kernel/random/boot_id") as f:
            _BOOT_ID.append(f.read().strip())
    return _BOOT_ID[0]


# --- files under the run root -----------------------------------------------------------
# Whoever can write the shared run root can plant a symlink, a FIFO or a hard link under any
# name there, or swap a directory for a symlink: every open below the root goes through
# ``safefiles`` (sent with this program), as the daemon's do.

#: A launch record or exit record is a few hundred bytes.
RECORD_MAX = 1 << 20


def read_json(path: str, root: str | None = None) -> dict[str, Any] | None:
    """A small JSON object from a file, or None when missing, unsafe or not an object."""
    try:
        value = safefiles.read_json(path, RECORD_MAX, root)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# --- identity ---------------------------------------------------------------------------


def argv_matches(spec: dict[str, Any], args: list[str]) -> bool:
    """``args`` is a run of the spec's worker: the elements after the interpreter appear in
    order, and the host name appears as a whole argument (when the template has one)."""
    if not args:
        return False
    wanted = list(spec["argv"][1:])
    rest = iter(args[1:])
    if not all(any(arg == want for arg in rest) for want in wanted):
        return False
    host = spec["host"]
    return host not in spec["argv"] or host in args[1:]


def identify(spec: dict[str, Any], pid: int) -> str:
    """What ``pid`` is to this shard: ``ours``, ``dead``, ``zombie``, ``reused``, ``foreign``.

    When the launch record (of this boot) names ``pid``, pid + start time is the identity and
    decides alone: it survives a reload that changed the argv, and tells a reused pid from
    ours. Without one (a worker started by the old script), the command line must match.
    """
    stat = proc_stat(pid)
    if stat is None:
        return "dead"
    if is_dead(stat):
        return "zombie"
    record = read_json(spec["launch_record"], spec.get("root"))
    if record is not None and record.get("pid") == pid and record.get("boot_id") == boot_id():
        return "ours" if record.get("start_time") == stat[2] else "reused"
    return "ours" if argv_matches(spec, cmdline(pid)) else "foreign"


# --- ops --------------------------------------------------------------------------------


def op_ping(request: PingRequest) -> Hello:
    """Liveness and facts about this agent."""
    return hello()


def op_probe(request: ProbeRequest) -> ProbeReply:
    """The live worker of the shard among the given pid and the pidfile's, or null."""
    spec = request.spec
    candidates: list[int] = []
    if request.pid is not None:
        candidates.append(request.pid)
    recorded = safefiles.read_pid(spec["pidfile"], spec.get("root"))
    if recorded is not None and recorded not in candidates:
        candidates.append(recorded)
    checked = []
    for pid in candidates:
        verdict = identify(spec, pid)
        checked.append([pid, verdict])
        if verdict == "ours":
            return ProbeReply(pid=pid, checked=checked)
    return ProbeReply(pid=None, checked=checked)


def op_terminate(request: TerminateRequest) -> TerminateReply:
    """SIGTERM the worker alone (the AReaL worker drains what its pool holds), SIGCONT its
    group, wait ``grace_s``, SIGKILL the group if ``kill`` (at once when ``grace_s`` is 0);
    once it is confirmed dead (else OpError), sweep its session."""
    spec, pid, grace_s, kill = request.spec, request.pid, request.grace_s, request.kill
    fence(spec)
    verdict = identify(spec, pid)
    ids = proc_ids(pid)
    if verdict != "ours" or ids is None or is_dead(ids):
        # Gone, a zombie, or a pid now used by an unrelated process: ours is dead either way.
        return TerminateReply("dead" if verdict == "ours" else verdict, _reap_late(spec, pid))
    start_time = ids[3]
    # A worker not leading its group (the old script's nohup) is signalled alone, never its
    # parent's group; one not leading a session has none of its own to sweep.
    group, leader = ids[1] == pid, ids[2] == pid
    outcome = ""
    if grace_s > 0 or not kill:
        _signal(pid, False, signal.SIGTERM)
        _signal(pid, group, signal.SIGCONT)  # a stopped process acts on no SIGTERM
        if _wait_dead(pid, start_time, grace_s):
            outcome = "terminated"
        elif not kill:
            raise OpError(f"pid {pid} still alive after {grace_s:g}s; kill_after_grace=false")
    # What its session holds when it is killed counts as reaped, whoever's SIGKILL ends it.
    members = session_members(pid) if leader and not outcome else {}
    if not outcome:
        _signal(pid, group, signal.SIGKILL)
        if not _wait_dead(pid, start_time, KILL_CONFIRM_S):
            state = proc_stat(pid)
            raise OpError(
                f"pid {pid} still alive {KILL_CONFIRM_S:g}s after SIGKILL"
                f" (state {state[0] if state else '?'})"
            )
        outcome = "killed"
    if not leader:
        return TerminateReply(outcome, None)
    reaped = sweep_count(request.spec, pid, start_time, shepherd_of(pid, start_time))
    # Its session at the SIGKILL counted, and the sweep's: mostly the same processes (the
    # sweep kills those the group's SIGKILL missed), so the larger count, not the sum.
    return TerminateReply(outcome, None if reaped is None else max(len(members), reaped))


def _reap_late(spec: dict[str, Any], pid: int) -> int | None:
    """Sweep for a worker of ours found dead whose shepherd wrote no exit record (it was
    killed first, so did not sweep); how many were killed."""
    launched = read_json(spec["launch_record"], spec.get("root")) or {}
    ended = read_json(spec["exit_record"], spec.get("root")) or {}
    start = launched.get("start_time")
    if (launched.get("pid"), launched.get("boot_id")) != (pid, boot_id()) or type(start) is not int:
        return None  # not started by a shepherd here: no session of its own
    swept = sweep(pid, start) if ended.get("pid") != pid else None
    return None if swept is None else len(swept[0])


def _signal(pid: int, group: bool, sig: int) -> None:
    """Send ``sig`` to ``pid`` or its process group; a vanished target is not an error."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise OpError(f"not permitted to signal pid {pid}: {exc}") from None


def _wait_dead(pid: int, start_time: int, timeout_s: float) -> bool:
    """Until ``pid`` (of ``start_time``) is gone or a zombie; False on timeout.

    Where the kernel gives a pidfd (Linux >= 5.3, Python >= 3.9) it says when the process
    exits, so a death is confirmed at once instead of at the next look at /proc, POLL_S
    later: that wait was half of a restart's own overhead (docs/BENCHMARKS.md). Elsewhere
    /proc is polled. The pidfd is opened before the first look, so a pid reused meanwhile
    shows its new start time there and counts as our process gone.
    """
    deadline = time.monotonic() + timeout_s
    pidfd = _open_pidfd(pid)
    poller = None
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once it exited (zombie or reaped)
    try:
        while True:
            stat = proc_stat(pid)
            if is_dead(stat) or (stat is not None and stat[2] != start_time):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if poller is None:
                time.sleep(min(POLL_S, remaining))
            else:
                poller.poll(max(1, int(remaining * 1000)))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``, or None where there is none (old kernel or Python, pid gone)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return int(pidfd_open(pid))
    except OSError:
        return None


# --- sweeping a dead worker's session ---------------------------------------------------
# A worker leads a session of its own, and what it starts (a process pool and its resource
# tracker, in its group or not) stays in it unless it calls setsid(); they outlive it as
# children of init, until a sweep kills them. No pid is reused while a process has it as its
# session or group id, so the members found are the dead worker's while its pid is no live
# process (gone, or its own zombie): a live one is a reuse, made once the session was empty.

#: A sweep ends within this; a process still alive then (a hung NFS read) is reported.
SWEEP_S = 2.0


def sweep_safe(ids: tuple[str, int, int, int] | None, start_time: int | None) -> bool:
    """Whether a dead worker's session may be swept, given ``proc_ids`` of its pid now."""
    return ids is None or (is_dead(ids) and ids[3] == start_time)


def session_members(pid: int) -> dict[int, int]:
    """``{pid: start_time}`` of live processes of session or group ``pid``, but ``pid``."""
    found = {}
    for other in _live_pids():
        try:
            ids = None if other == pid else proc_ids(other)
        except OSError:  # another user's, under hidepid: not ours to kill anyway
            continue
        if ids is not None and pid in (ids[1], ids[2]) and not is_dead(ids):
            found[other] = ids[3]
    return found


def sweep(pid: int, start_time: int | None) -> tuple[dict[int, int], list[int]] | None:
    """SIGKILL what dead worker ``pid`` left in its session, look again until none is new,
    wait for them, within SWEEP_S: ``({pid: start} killed, pids still alive)``; None if
    unsafe (``sweep_safe``). It looks in full before it kills, so of sweeps racing (the
    shepherd's, the agent's), the first to finish looking saw all: the largest count is right.
    """
    deadline = time.monotonic() + SWEEP_S
    seen: dict[int, int] = {}
    killed: dict[int, int] = {}
    try:
        while sweep_safe(proc_ids(pid), start_time):
            fresh = {p: t for p, t in session_members(pid).items() if seen.get(p) != t}
            if not fresh or time.monotonic() > deadline:
                break
            seen.update(fresh)
            killed.update((p, t) for p, t in fresh.items() if _kill_exact(p, t))
        else:
            if not seen:
                return None
        alive = [p for p, t in seen.items() if not _wait_dead(p, t, deadline - time.monotonic())]
    except OSError:
        return None
    return killed, sorted(alive)


def _kill_exact(pid: int, start_time: int) -> bool:
    """SIGKILL ``pid`` if it started at ``start_time``, by pidfd where there are pidfds (a
    number reused meanwhile is never hit)."""
    pidfd = _open_pidfd(pid)
    ids = proc_ids(pid)
    try:
        if ids is None or ids[3] != start_time:
            return False
        if pidfd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return True


# The shepherd sweeps its worker's session before it writes the exit record and reaps the
# zombie, and hands the shard lock over only after that (``_take_shard_lock``): no
# replacement starts beside what the worker left. A sweep of the agent's own on top of it (on
# a pushed exit, after a terminate) looked through all of /proc again: three looks per
# death, at every process of the host, which made a stop of 50 workers on one box 40 % slower
# (docs/BENCHMARKS.md). The agent now leaves the sweep to a live shepherd, and looks itself
# only where none is there to do it, or it ends without its record.

#: A shepherd's process name (``/proc/PID/comm``): the agent knows its workers' parents by it.
SHEPHERD_NAME = "rs-shepherd"
#: How long the agent waits for a live shepherd to finish with its dead worker: as long as a
#: launch waits for the shard lock it holds meanwhile.
SHEPHERD_DONE_S = SWEEP_S + 2.0


def shepherd_of(pid: int, start_time: int | None) -> tuple[int, int] | None:
    """``(pid, start_time)`` of the shepherd still holding dead worker ``pid`` (of
    ``start_time``) as its zombie, which it sweeps after; None where there is none (the
    worker alive, reaped, adopted from another supervisor, or its parent is not one)."""
    if start_time is None:
        return None
    try:
        fields = stat_fields(pid)
        # fields[0] is field 3 (state), [1] field 4 (ppid), [19] field 22 (starttime).
        if fields is None or fields[0] != b"Z" or int(fields[19]) != start_time:
            return None
        parent = int(fields[1])
        if parent <= 1:
            return None
        with open(f"/proc/{parent}/comm", "rb") as f:
            comm = f.read().strip()
        ids = proc_ids(parent)
    except OSError:
        return None
    if comm != SHEPHERD_NAME.encode() or ids is None or is_dead(ids):
        return None
    return parent, ids[3]


def recorded_sweep(spec: dict[str, Any], pid: int, start_time: int) -> tuple[bool, int | None]:
    """``(True, reaped)`` where worker ``pid`` (of ``start_time``)'s exit record is written:
    its shepherd swept (``reaped`` killed; None: unsafe to) before it wrote it."""
    record = read_json(spec["exit_record"], spec.get("root")) or {}
    reaped = record.get("reaped")
    if (record.get("pid"), record.get("start_time")) != (pid, start_time):
        return False, None
    return (True, reaped) if reaped is None or type(reaped) is int else (False, None)


def sweep_count(
    spec: dict[str, Any], pid: int, start_time: int, shepherd: tuple[int, int] | None = None
) -> int | None:
    """How many processes dead worker ``pid`` left in its session were killed: by its
    shepherd, as its exit record says (once the live ``shepherd``, if one is given, has
    ended: SHEPHERD_DONE_S at most), else by the agent now (no live shepherd, it hung, or it
    ended without its record). None: not swept (``sweep_safe``)."""
    if shepherd is not None:
        _wait_dead(shepherd[0], shepherd[1], SHEPHERD_DONE_S)
    recorded, reaped = recorded_sweep(spec, pid, start_time)
    if recorded:
        return reaped
    swept = sweep(pid, start_time)
    return None if swept is None else len(swept[0])


def op_watch(request: WatchRequest) -> WatchReply:
    """Whether ``pid`` lives; the watch itself is set up once this reply is sent
    (``watch_target``), so the push of its exit always follows the reply."""
    stat = proc_stat(request.pid)
    alive = not is_dead(stat) and (
        request.start_time is None or (stat is not None and stat[2] == request.start_time)
    )
    return WatchReply(watching=alive)


# --- exits, pushed ----------------------------------------------------------------------
# The agent watches every worker it launched, found by a probe or was asked to watch, and
# tells the daemon the moment one ends, on the channel it answers on: the daemon then needs
# no file event (NFS gives none) to learn of a crash. The shepherd's exit record stays the
# durable truth; this is the fast path.

#: Without a pidfd (Linux < 5.3 or Python < 3.9) /proc is looked at this often: a crash is
#: pushed within this, at a few microseconds of CPU per look per watched worker.
WATCH_POLL_S = 0.02
#: A daemon asks to watch one worker per host at a time; an agent keeps at most this many
#: (the oldest is dropped: its exit record still tells).
WATCH_MAX = 64


def wait_status_exit(status: int) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` of a ``waitpid`` status word."""
    if status & 0x7F == 0:
        return (status >> 8) & 0xFF, None
    return None, status & 0x7F


def exit_status(
    spec: dict[str, Any], pid: int, start_time: int | None
) -> tuple[int | None, int | None]:
    """How ``pid`` ended, if this host can still tell: from its zombie (field 52 of
    /proc/PID/stat, the status its parent will reap; the shepherd keeps the zombie until
    its exit record is written), else from that record; ``(None, None)`` when neither says."""
    try:
        fields_ = stat_fields(pid)
    except OSError:
        fields_ = None
    if fields_ is not None:
        same = start_time is None or int(fields_[19]) == start_time
        if same and fields_[0] in (b"Z", b"X") and len(fields_) > 49:
            return wait_status_exit(int(fields_[49]))
    record = read_json(spec["exit_record"], spec.get("root")) if spec.get("exit_record") else None
    if record is None or record.get("pid") != pid:
        return None, None
    if start_time and record.get("start_time") not in (start_time, 0, None):
        return None, None  # an earlier worker that had the same pid
    code, sig = record.get("exit_code"), record.get("signal")
    code = code if type(code) is int and 0 <= code <= 255 else None
    sig = sig if type(sig) is int and 0 < sig < 128 else None
    return code, sig


class _Watched:
    """One watched worker: whom to tell, and how to see it end."""

    def __init__(
        self, spec: dict[str, Any], pid: int, start_time: int, send: Callable[[str], None]
    ) -> None:
        self.spec = spec
        self.pid = pid
        self.start_time = start_time
        self.send = send
        self.pidfd: int | None = None
        #: It leads its own session: sweep it when it ends.
        self.leader = False


class ExitWatch:
    """Watches workers and pushes each one's exit (``WorkerExit``) through the ``send`` it
    was registered with; one thread, a pidfd per worker where the kernel has them.

    The pidfds sit in one epoll set, so a wake costs what became ready, not what is
    watched: a host watches one or two workers, but the fleet simulator's one process
    watches a thousand, and rebuilding a poll set of all of them at every exit put a
    millisecond of its own into every crash it timed. Without pidfds, /proc is looked at
    every ``WATCH_POLL_S`` for those workers only.
    """

    def __init__(self, limit: int = WATCH_MAX) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}
        #: pidfd -> its entry, for the ones in the epoll set; the rest are looked at in /proc.
        self._by_fd: dict[int, _Watched] = {}
        self._polled: dict[int, _Watched] = {}
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread: threading.Thread | None = None

    def watch(
        self,
        spec: dict[str, Any],
        pid: int,
        start_time: int | None,
        send: Callable[[str], None],
    ) -> bool:
        """Push ``pid``'s exit through ``send`` when it ends; False (and the exit pushed now)
        if it has ended already."""
        pidfd = _open_pidfd(pid)  # before the look: a pid reused after it is no longer ours
        ids = proc_ids(pid)
        ended = is_dead(ids) or (
            start_time is not None and ids is not None and ids[3] != start_time
        )
        if ended or ids is None:
            if pidfd is not None:
                os.close(pidfd)
            # Its zombie (known by its start time) still holds its session: swept. Gone, its
            # session is its shepherd's to sweep: after a while its number may be another's.
            entry = _Watched(spec, pid, start_time or 0, send)
            entry.leader = ids is not None and is_dead(ids) and ids[2] == pid
            self._push(entry, start_time)
            return False
        entry = _Watched(spec, pid, ids[3], send)
        entry.leader = ids[2] == pid
        entry.pidfd = pidfd
        with self._lock:
            old = self._watched.pop(pid, None)
            if old is not None:
                self._forget(old)
            self._watched[pid] = entry
            if pidfd is not None:
                self._by_fd[pidfd] = entry
                self._epoll.register(pidfd, select.EPOLLIN)
            else:
                self._polled[pid] = entry
            while len(self._watched) > self._limit:
                self._forget(self._watched.pop(next(iter(self._watched))))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exits", daemon=True)
                self._thread.start()
        if pidfd is None:
            # The thread may be asleep with no timeout: it must start looking at /proc.
            with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
                os.write(self._wake_w, b"w")
        return True

    def watched(self) -> list[int]:
        """The pids watched now."""
        with self._lock:
            return list(self._watched)

    def _forget(self, entry: _Watched) -> None:
        """Stop watching ``entry`` (its pid already out of ``_watched``); under the lock."""
        if self._polled.get(entry.pid) is entry:
            del self._polled[entry.pid]
        fd = entry.pidfd
        if fd is None:
            return
        entry.pidfd = None
        self._by_fd.pop(fd, None)
        # Out of the set before the close, so a reused descriptor number cannot alias it.
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        os.close(fd)

    def _run(self) -> None:
        while True:
            with self._lock:
                polled = bool(self._polled)
            events = self._epoll.poll(WATCH_POLL_S if polled else -1)
            with self._lock:
                candidates = [self._by_fd[fd] for fd, _ in events if fd in self._by_fd]
                candidates += self._polled.values()
            if any(fd == self._wake_r for fd, _ in events):
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            for entry in candidates:
                stat = proc_stat(entry.pid)
                if not is_dead(stat) and stat is not None and stat[2] == entry.start_time:
                    continue
                with self._lock:
                    if self._watched.get(entry.pid) is not entry:
                        continue  # replaced or dropped meanwhile
                    del self._watched[entry.pid]
                    self._forget(entry)
                self._push(entry, entry.start_time)

    @staticmethod
    def _push(entry: _Watched, start_time: int | None) -> None:
        exited_at = time.time()
        # A live shepherd sweeps before it hands the shard over: the exit is pushed at once,
        # and what it killed follows (_push_swept). Without one, the session is swept first:
        # the daemon launches the replacement the moment it hears of the exit.
        shepherd = shepherd_of(entry.pid, entry.start_time) if entry.leader else None
        reaped = None
        if entry.leader and shepherd is None:
            reaped = sweep_count(entry.spec, entry.pid, entry.start_time)
        code, sig = exit_status(entry.spec, entry.pid, start_time)
        news = WorkerExit(
            pid=entry.pid,
            start_time=start_time or None,
            exit_code=code,
            signal=sig,
            exited_at=exited_at,
            log_tail=exit_log_tail(entry.spec, entry.pid),
            reaped=reaped,
        )
        with contextlib.suppress(Exception):  # a channel gone is the daemon's loss, not ours
            entry.send(push_line(news))
        if shepherd is not None:
            threading.Thread(
                target=ExitWatch._push_swept, args=(entry, news, shepherd), daemon=True
            ).start()

    @staticmethod
    def _push_swept(entry: _Watched, news: WorkerExit, shepherd: tuple[int, int]) -> None:
        """Once the shepherd is done, the exit again with the count it (or, failing it, the
        agent) swept: the daemon keeps the larger count of the copies of one exit."""
        reaped = sweep_count(entry.spec, entry.pid, entry.start_time, shepherd)
        if reaped:
            with contextlib.suppress(Exception):
                entry.send(push_line(replace(news, reaped=reaped)))


def watch_target(
    message: object, reply: dict[str, Any]
) -> tuple[dict[str, Any], int, int | None] | None:
    """What to watch after answering ``message`` with ``reply``: the worker a launch started,
    a probe found or a watch named; None for anything else."""
    if reply.get("ok") is not True or not isinstance(message, dict):
        return None
    result = reply.get("result") or {}
    op = message.get("op")
    spec = message.get("spec")
    if not isinstance(spec, dict):
        return None
    if op == "launch":
        return spec, result["pid"], result["start_time"]
    if op == "probe" and result.get("pid") is not None:
        return spec, result["pid"], None
    if op == "watch":
        start_time = message.get("start_time")
        return spec, message["pid"], start_time if type(start_time) is int else None
    return None


# --- memory, pushed ----------------------------------------------------------------------
# A worker's own figure for its memory may be wrong (the AReaL worker's ``rss_gib`` is its
# peak ru_maxrss, in KiB, divided by 1024**3: 1024 times too small) and covers one process
# of the many it runs (its pool): the agent measures the worker's whole session itself and
# pushes what it found, on the channel it answers on.

#: Each watched worker's session is measured this often: memory grows over minutes (a leak,
#: a large batch), and a look costs a /proc listing and about 0.1 ms per process it finds.
USAGE_S = 10.0
#: /proc/PID/smaps_rollup and /proc/PID/status are 1-2 KiB; more is not one of them.
PROC_READ_MAX = 16 * 1024


def _proc_text(pid: int, name: str) -> bytes | None:
    """``/proc/PID/NAME``, bounded; None if it cannot be read (gone, another user's)."""
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, PROC_READ_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)


def _kib_field(text: bytes | None, name: bytes) -> int | None:
    """The value of a ``Name:   N kB`` line, in bytes; None if there is none."""
    for line in (text or b"").splitlines():
        if line.startswith(name + b":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def process_memory(pid: int) -> tuple[int, str] | None:
    """What ``pid`` holds in memory, in bytes, and how it was counted: its Pss (its share
    of every page it maps) from smaps_rollup, else its VmRSS; None if neither can be read."""
    pss = _kib_field(_proc_text(pid, "smaps_rollup"), b"Pss")
    if pss is not None:
        return pss, "pss"
    rss = _kib_field(_proc_text(pid, "status"), b"VmRSS")
    return None if rss is None else (rss, "rss")


def session_usage(pid: int, start_time: int | None) -> WorkerUsage | None:
    """The memory worker ``pid`` (of ``start_time``, when known) and its session hold now;
    None when it is dead or is another process now."""
    ids = proc_ids(pid)
    if is_dead(ids) or ids is None or (start_time is not None and ids[3] != start_time):
        return None
    total, ways, count = 0, set(), 0
    for member in [pid, *session_members(pid)]:
        found = process_memory(member)
        if found is not None:
            total += found[0]
            ways.add(found[1])
            count += 1
    via = "pss" if ways == {"pss"} else "rss"
    return WorkerUsage(pid=pid, start_time=ids[3], rss_bytes=total, processes=count, via=via)


class UsageWatch:
    """Measures each watched worker's session every ``interval_s`` and pushes it
    (``WorkerUsage``) through the ``send`` it was registered with; one thread, started by
    the first watch. A worker found dead (or its pid another process's) is forgotten."""

    def __init__(self, interval_s: float = USAGE_S, limit: int = WATCH_MAX) -> None:
        self._interval_s = interval_s
        self._limit = limit
        self._lock = threading.Lock()
        #: pid -> (its start time, when known; whom to tell)
        self._watched: dict[int, tuple[int | None, Callable[[str], None]]] = {}
        self._thread: threading.Thread | None = None

    def watch(self, pid: int, start_time: int | None, send: Callable[[str], None]) -> None:
        """Measure ``pid``'s session from the next round on, and push each measure."""
        with self._lock:
            self._watched.pop(pid, None)
            self._watched[pid] = (start_time, send)
            while len(self._watched) > self._limit:
                del self._watched[next(iter(self._watched))]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="usage", daemon=True)
                self._thread.start()

    def watched(self) -> list[int]:
        """The pids measured now."""
        with self._lock:
            return list(self._watched)

    def _run(self) -> None:
        while True:
            time.sleep(self._interval_s)
            with self._lock:
                round_ = list(self._watched.items())
            for pid, (start_time, send) in round_:
                usage = session_usage(pid, start_time)
                if usage is None:
                    with self._lock:
                        if self._watched.get(pid, (None, None))[1] is send:
                            del self._watched[pid]
                    continue
                with contextlib.suppress(Exception):  # a channel gone is the daemon's loss
                    send(push_line(usage))


# --- evidence ---------------------------------------------------------------------------

#: The signal a worker answers by writing every thread's stack to its log: the reference
#: worker registers ``faulthandler`` for it. Sent only to a worker that catches it (its
#: default action would kill the worker before we have its stacks).
STACKS_SIGNAL = signal.SIGUSR1
#: faulthandler writes all threads' stacks in one burst from its signal handler: once the
#: log has grown and then stayed still this long, the dump is over.
STACKS_QUIET_S = 0.2
#: In "auto" mode py-spy leaves this much of the time for the signal, should it fail.
SIGNAL_RESERVE_S = 1.0
#: Stacks are read up to this, then threads with the same stack are folded into one (a
#: pool's idle threads are dozens of copies) and the result cut to STACKS_MAX.
STACKS_READ_MAX = 4 * STACKS_MAX
#: Thread headers: py-spy's ``Thread 123 (idle): "name"``, faulthandler's ``Thread 0x7f..
#: (most recent call first):`` and ``Current thread 0x7f.. (most recent call first):``.
_THREAD_HEADS = ("Thread ", "Current thread ")


def op_evidence(request: EvidenceRequest) -> EvidenceReply:
    """The log's tail, then the worker's stacks (py-spy, else the signal), within the
    request's time; what could not be had is said in ``notes``, never raised."""
    started = time.monotonic()
    deadline = started + request.timeout_s
    spec, pid = request.spec, request.pid
    notes: list[str] = []
    # First the tail: what the worker said before the stacks are appended to the same log.
    log_tail = log_tail_of(spec["log"], spec.get("root"), request.log_bytes, notes)
    stacks, via = None, None
    verdict = identify(spec, pid)
    if verdict != "ours":
        notes.append(f"pid {pid} is {verdict}: no stacks to take")
    elif request.stacks != "none":
        stacks, via = take_stacks(spec, pid, request.stacks, deadline, notes)
    if stacks is not None:
        stacks = compact_stacks(stacks)
    return EvidenceReply(
        stacks=stacks,
        via=via,
        log_tail=log_tail,
        notes=notes[:NOTES_MAX],
        elapsed_s=round(time.monotonic() - started, 3),
    )


def compact_stacks(text: str) -> str:
    """``text`` with the threads that share a stack shown once, under the first one's header
    and a line counting the others, cut to STACKS_MAX. Lines before the first thread (py-spy's
    process line) stay first; unindented lines among the threads (another thread's log line
    written meanwhile) go last."""
    head: list[str] = []
    tail: list[str] = []
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(_THREAD_HEADS):
            threads.append((line, []))
        elif not threads:
            head.append(line)
        elif line[:1].isspace():
            threads[-1][1].append(line)
        elif line.strip():
            tail.append(line)
    same: dict[tuple[str, ...], list[str]] = {}
    for header, frames in threads:
        same.setdefault(tuple(frames), []).append(header)
    out = list(head)
    for stack, headers in same.items():
        out.append(headers[0])
        if len(headers) > 1:
            out.append(f"  (and {len(headers) - 1} more threads with this same stack)")
        out.extend(stack)
    out.extend(tail)
    compact = "\n".join(out) + "\n"
    if len(compact) > STACKS_MAX:
        marker = f"\n[cut: {len(compact)} characters, the first {STACKS_MAX} shown]\n"
        compact = compact[: STACKS_MAX - len(marker)] + marker
    return compact


def log_tail_of(path: str, root: str | None, limit: int, notes: list[str]) -> str | None:
    """The last ``limit`` bytes of the log at ``path`` from its first whole line, decoded
    with errors replaced; None (and a note) when it cannot be read."""
    try:
        fd = safefiles.open_file(path, os.O_RDONLY, root)
    except OSError as exc:
        notes.append(f"log: {exc}"[:TEXT_MAX])
        return None
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - limit)
        data = os.pread(fd, limit, start)
    except OSError as exc:
        notes.append(f"log: {exc}"[:TEXT_MAX])
        return None
    finally:
        os.close(fd)
    if start > 0 and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]  # the first line was cut: drop its end
    return data.decode("utf-8", "replace")


def take_stacks(
    spec: dict[str, Any], pid: int, mode: str, deadline: float, notes: list[str]
) -> tuple[str | None, str | None]:
    """Every thread's Python stack of ``pid`` and how it was taken: py-spy where ``mode``
    allows and the host has it, else the signal where the worker handles it."""
    handles = catches_signal(pid, STACKS_SIGNAL)
    if mode in ("auto", "py-spy"):
        spy = find_py_spy(spec)
        if spy is None:
            notes.append("py-spy: not found beside the worker's python or on PATH")
        else:
            reserve = SIGNAL_RESERVE_S if mode == "auto" and handles else 0.0
            # py-spy pauses its target to read a consistent stack, and cannot pause one that
            # is stopped already (SIGSTOP, a debugger): that one it reads as it is.
            stat = proc_stat(pid)
            stopped = stat is not None and stat[0] in ("T", "t")
            text, trouble = py_spy_dump(spy, pid, deadline - reserve, nonblocking=stopped)
            if text is not None:
                return text, "py-spy"
            notes.append(f"py-spy: {trouble}"[:TEXT_MAX])
    if mode in ("auto", "signal"):
        if not handles:
            notes.append(
                f"the worker does not handle {STACKS_SIGNAL.name} (faulthandler.register):"
                " no signal sent"
            )
            return None, None
        text, trouble = signal_dump(spec, pid, deadline)
        if text is not None:
            return text, "faulthandler"
        notes.append(f"faulthandler: {trouble}"[:TEXT_MAX])
    elif mode != "py-spy":
        notes.append(f"unknown way to take stacks {mode[:40]!r}: none taken")
    return None, None


def catches_signal(pid: int, sig: int) -> bool:
    """``pid`` has a handler for ``sig`` (its ``SigCgt`` mask in /proc says so)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def find_py_spy(spec: dict[str, Any]) -> str | None:
    """py-spy beside the worker's python (its venv), beside ours, or on the worker's or our
    PATH; None where the host has none."""
    dirs = []
    for python in (spec.get("python") or "", sys.executable or ""):
        if os.sep in python:
            dirs.append(os.path.dirname(python))
    for path in ((spec.get("env") or {}).get("PATH"), os.environ.get("PATH")):
        if isinstance(path, str):
            dirs += [d for d in path.split(os.pathsep) if os.path.isabs(d)]
    for directory in dirs:
        candidate = os.path.join(directory, "py-spy")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def py_spy_dump(
    spy: str, pid: int, deadline: float, nonblocking: bool = False
) -> tuple[str | None, str]:
    """``py-spy dump --pid PID --subprocesses``'s output (a pool's reward calls run in the
    worker's children), or None and why (it failed, or was killed at ``deadline``); at most
    STACKS_MAX bytes are read."""
    timeout_s = deadline - time.monotonic()
    if timeout_s <= 0:
        return None, "no time left"
    try:
        dump = subprocess.Popen(
            [spy, "dump", "--pid", str(pid), "--subprocesses"]
            + (["--nonblocking"] if nonblocking else []),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/",
            close_fds=True,
            start_new_session=True,
        )
    except OSError as exc:
        return None, f"cannot run {spy}: {exc}"
    stdout = dump.stdout
    try:
        if stdout is None:  # stdout=PIPE always gives one; mypy cannot know
            raise OpError("py-spy has no output pipe")
        data, complete = read_bounded(stdout.fileno(), timeout_s, STACKS_READ_MAX)
    finally:
        if stdout is not None:
            stdout.close()
        if dump.poll() is None:
            dump.kill()
        code = dump.wait()
    text = data.decode("utf-8", "replace")
    if not complete:
        return None, f"no answer within {timeout_s:.1f}s"
    if code != 0:
        last = text.strip().splitlines()[-1:] or ["-"]
        return None, f"exited {code}: {last[0][:500]}"
    return text, ""


def read_bounded(fd: int, timeout_s: float, limit: int) -> tuple[bytes, bool]:
    """What the pipe ``fd`` carries until EOF, at most ``limit`` bytes, and whether EOF came
    within ``timeout_s`` (past the limit, the rest is read and dropped)."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return b"".join(chunks), False
        if not poller.poll(remaining_s * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), True
        if size < limit:
            chunks.append(chunk[: limit - size])
            size += len(chunks[-1])


def signal_dump(spec: dict[str, Any], pid: int, deadline: float) -> tuple[str | None, str]:
    """Send the stacks signal and read back what the worker appended to its log, until it
    stops growing (or ``deadline``); at most STACKS_MAX bytes."""
    try:
        fd = safefiles.open_file(spec["log"], os.O_RDONLY, spec.get("root"))
    except OSError as exc:
        return None, f"cannot read the log: {exc}"
    try:
        start = last = os.fstat(fd).st_size
        stat = proc_stat(pid)
        if stat is not None and stat[0] in ("T", "t"):
            return None, "the worker is stopped (SIGSTOP or a debugger): it cannot answer"
        if deadline - time.monotonic() < STACKS_QUIET_S:
            # Its answer could not be read in time; asked anyway, it would land in the log
            # with nobody to collect it.
            return None, "no time left to ask"
        _signal(pid, False, STACKS_SIGNAL)
        grown_at = None
        while True:
            now = time.monotonic()
            size = os.fstat(fd).st_size
            if size < start:
                return None, "the log was truncated meanwhile"
            if size != last:
                last, grown_at = size, now
            if grown_at is not None and now - grown_at >= STACKS_QUIET_S:
                break
            if now >= deadline:
                break
            time.sleep(POLL_S)
        if last == start:
            return None, f"nothing was written to the log after {STACKS_SIGNAL.name}"
        data = os.pread(fd, min(last - start, STACKS_READ_MAX), start)
    except (OSError, OpError) as exc:
        return None, str(exc)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace"), ""


_SOURCE: list[str] = []


def own_source() -> str:
    """This program's text: the argument after ``-c`` in our own command line."""
    if not _SOURCE:
        args = cmdline(os.getpid())
        if "-c" not in args or args.index("-c") + 1 >= len(args):
            raise OpError("cannot find the agent source in /proc/self/cmdline")
        _SOURCE.append(args[args.index("-c") + 1])
    return _SOURCE[0]


def op_launch(request: LaunchRequest) -> LaunchReply:
    """Start a shepherd for the spec and return the worker's ``{pid, start_time, via}``.

    The launcher forks it when it can; when it cannot (it failed to start, died, or is
    wedged), a fresh interpreter does, so a launch never fails for want of a launcher.
    ``via`` says which, and why.
    """
    spec = request.spec
    fence(spec)
    python = sys.executable or spec["python"]
    with _LAUNCHER_LOCK:
        report_fd, via, trouble = _hand_to_launcher(python, spec)
    if report_fd is not None:
        output = _read_to_eof(report_fd, SHEPHERD_REPORT_S)
        if output is None:
            raise OpError(f"the shepherd did not report within {SHEPHERD_REPORT_S:g}s")
        if trouble is None:
            return _launch_result(_parse_report(output, "", "exited"), via)
        if output:
            # The launcher forked the shepherd, then failed to confirm it.
            return _launch_result(_parse_report(output, "", "exited"), f"{via}; {trouble}")
        # Nothing on the pipe and no fork confirmed: the launcher went down before forking,
        # so no shepherd exists and a fresh one is no second launch.
    via = f"fresh interpreter; {trouble or via}"
    return _launch_result(_launch_fresh(python, spec, via), via)


def _launch_result(report: dict[str, Any], via: str) -> LaunchReply:
    """The reply to a launch from the shepherd's report; raises its refusal or error."""
    if report.get("ok"):
        return LaunchReply(pid=report["pid"], start_time=report["start_time"], via=via)
    if report.get("kind") == "refused":
        raise Refused(report["error"], report.get("holder_pid"))
    if report.get("kind") == "fenced":
        raise Fenced(report["error"])
    raise OpError(report["error"])


def _parse_report(out: str, err: str, how: str) -> dict[str, Any]:
    """The shepherd's report, the last line of ``out``; OpError quoting ``err`` (or the
    output itself) when there is none."""
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        report = None
    if not isinstance(report, dict):
        tail = (err or out).strip()[-2000:]
        raise OpError(f"the shepherd {how} without a report: {tail or '-'}")
    return report


def _launch_fresh(python: str, spec: dict[str, Any], via: str) -> dict[str, Any]:
    """Start a shepherd as a new interpreter (``shepherd`` mode); return its report."""
    shepherd = subprocess.Popen(
        [python, "-X", "utf8", "-c", own_source(), "shepherd"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
        close_fds=True,
        start_new_session=True,
    )
    order = json.dumps({"spec": spec, "via": via}).encode("utf-8")
    try:
        out, err = shepherd.communicate(order, SHEPHERD_REPORT_S)
    except subprocess.TimeoutExpired:
        # The detached shepherd still holds the pipes: close our ends rather than wait.
        for pipe in (shepherd.stdin, shepherd.stdout, shepherd.stderr):
            if pipe is not None:
                pipe.close()
        shepherd.kill()
        shepherd.wait()
        raise OpError(f"the shepherd did not report within {SHEPHERD_REPORT_S:g}s") from None
    return _parse_report(
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
        f"exited {shepherd.returncode}",
    )


def _read_to_eof(fd: int, timeout_s: float) -> str | None:
    """Everything written to the pipe ``fd`` until its last writer closes it, or None after
    ``timeout_s``; closes ``fd`` either way (a late writer then gets EPIPE)."""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    # poll, not select: select cannot watch a descriptor numbered 1024 or above.
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return None
            if not poller.poll(remaining_s * 1000):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks).decode("utf-8", "replace")
            chunks.append(chunk)
    finally:
        os.close(fd)


# --- the launcher, seen from the agent ---------------------------------------------------


class _Launcher:
    """The agent's fork server: this file in ``launcher`` mode, a single-threaded python
    that forks shepherds, which the multithreaded agent cannot safely do itself."""

    def __init__(self, python: str) -> None:
        # SEQPACKET: one message per spec with the pipe attached, and EOF when either dies.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process: subprocess.Popen[bytes] | _ForkedLauncher
        try:
            if threading.active_count() == 1:
                # The agent is still single-threaded (serve() starts it before reading a
                # request): fork it, as safe as the fresh interpreter and with nothing to
                # start, decompress and compile again (docs/BENCHMARKS.md, issue 33).
                self.process = _ForkedLauncher(theirs.fileno())
            else:
                self.process = subprocess.Popen(
                    [python, "-X", "utf8", "-c", own_source(), "launcher"],
                    stdin=theirs.fileno(),
                    stdout=subprocess.DEVNULL,  # its stderr is ours: a traceback reaches us
                    cwd="/",
                    close_fds=True,
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.channel = ours
        self.channel.settimeout(LAUNCHER_ACK_S)

    def hand_over(self, spec: dict[str, Any], via: str, report_fd: int) -> str | None:
        """Have a shepherd forked for ``spec``, reporting on ``report_fd``; None once the
        launcher confirms the fork, else why it did not."""
        order = json.dumps({"spec": spec, "via": via}).encode("utf-8")
        fds = array.array("i", [report_fd])
        try:
            self.channel.sendmsg([order], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            reply = self.channel.recv(65536)
        except socket.timeout:  # noqa: UP041 - on Python < 3.10 it is no TimeoutError
            return f"did not answer within {LAUNCHER_ACK_S:g}s"
        except OSError as exc:
            return f"is gone ({exc.strerror or exc})"
        if not reply:
            return "is gone"
        try:
            answer = json.loads(reply.decode("utf-8"))
        except ValueError:
            answer = {"error": f"unreadable answer {reply[:200]!r}"}
        return None if "forked" in answer else f"could not fork: {answer.get('error')}"

    def discard(self) -> str:
        """Kill and reap the launcher; what became of it. Its shepherds live on (each in
        its own session, a child of init)."""
        self.channel.close()
        with contextlib.suppress(OSError):
            self.process.kill()
        # SIGKILL ends even a stopped process at once; only a hung disk read could delay it.
        code = self.process.wait()
        return f"exited {code}" if code >= 0 else f"died of signal {-code}"


class _ForkedLauncher:
    """The launcher forked from the still single-threaded agent: what ``launcher`` mode
    would be, without another interpreter's start. Its stdin is ``channel_fd``, its stdout
    /dev/null, its stderr the agent's; no other descriptor of the agent stays open in it."""

    def __init__(self, channel_fd: int) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            pid = os.fork()
        except BaseException:
            os.close(devnull)
            raise
        if pid == 0:  # the launcher
            code = 1
            try:
                os.dup2(channel_fd, 0)
                os.dup2(devnull, 1)
                os.closerange(3, _max_fd())
                os.chdir("/")
                # sys.stdio as a fresh interpreter's (-u): what a forked shepherd prints
                # before its report (a traceback) must reach fd 2, the report pipe, at once.
                sys.stdin = None
                sys.stdout, sys.stderr = (
                    io.TextIOWrapper(
                        open(fd, "wb", buffering=0, closefd=False),  # noqa: SIM115
                        errors="backslashreplace",
                        write_through=True,
                    )
                    for fd in (1, 2)
                )
                code = launcher()
            finally:
                os._exit(code)  # never back into the agent's loop, no buffers flushed
        os.close(devnull)
        self.pid = pid
        self._code: int | None = None

    def kill(self) -> None:
        """SIGKILL it (unless already reaped)."""
        if self._code is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        """Reap it: its exit code, or minus the signal that ended it, as Popen says it."""
        if self._code is None:
            _, status = os.waitpid(self.pid, 0)
            self._code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return self._code


def _max_fd() -> int:
    """One past the highest descriptor number a process may have here."""
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


#: Serializes use of the launcher: the agent serves each request in its own thread.
_LAUNCHER_LOCK = threading.Lock()
#: The running launcher, if any (a list so that no function needs ``global``).
_LAUNCHER: list[_Launcher] = []


def start_launcher(python: str) -> str:
    """Start the launcher unless one runs (call with ``_LAUNCHER_LOCK`` held); returns what
    was done, for the launch reply. Never raises: without a launcher, launches go fresh."""
    if _LAUNCHER:
        return f"launcher pid {_LAUNCHER[0].process.pid}"
    try:
        launcher = _Launcher(python)
    except (OSError, OpError) as exc:
        return f"no launcher (cannot start one: {exc})"
    _LAUNCHER.append(launcher)
    return f"launcher pid {launcher.process.pid} (started now)"


def _hand_to_launcher(python: str, spec: dict[str, Any]) -> tuple[int | None, str, str | None]:
    """Pass the launch to the launcher (call with ``_LAUNCHER_LOCK`` held). Returns the read
    end of the shepherd's report pipe (None if there is no launcher to hand it to), which
    launcher it went to, and what went wrong with it (None once it confirmed the fork)."""
    via = start_launcher(python)
    if not _LAUNCHER:
        return None, via, None
    launcher = _LAUNCHER[0]
    read_fd, write_fd = os.pipe()
    try:
        trouble = launcher.hand_over(spec, via, write_fd)
    finally:
        # Only the shepherd may hold the write end: its exit is the EOF we wait for.
        os.close(write_fd)
    if trouble is None:
        return read_fd, via, None
    _LAUNCHER.clear()
    fate = launcher.discard()
    # Restart it now, so the next launch finds one up; whether this launch was forked
    # before the trouble only its report pipe can tell.
    restarted = start_launcher(python)
    return (
        read_fd,
        via,
        f"launcher pid {launcher.process.pid} {trouble}, {fate}; restarted: {restarted}",
    )


# --- the old script's respawn wrappers --------------------------------------------------

#: A SIGSTOP takes effect when the target next runs; seconds only for one asleep in the
#: kernel (a hung NFS read). Freezing every wrapper of a host must finish within this.
FREEZE_DEADLINE_S = 20.0


def op_disarm_seed(request: DisarmSeedRequest) -> DisarmSeedReply:
    """End the old script's respawn wrappers for one host, leaving its worker running.

    ``reward_workers_ctl.py start`` runs ``bash <root>/ctl/<host>.wrap.sh``, a loop that starts
    the worker again whenever it exits: it would restart a worker the daemon replaced, and
    two workers would share the shard. Every process running that script (the loop, and any
    subshell it forked, whose command line is the loop's until it execs) is frozen with
    SIGSTOP until a look at /proc finds none still running, so none can start a worker
    between our look and our kill; then all are SIGKILLed. The worker, a child of the loop,
    lives on (reparented to init). Then: the live workers of the spec (command line match),
    and the pidfile pointed at the one worker if it named another pid. ``dry_run``: look only.
    """
    spec, script, dry_run = request.spec, request.wrap_script, request.dry_run
    wrappers = sorted(_wrapper_pids(script))
    if wrappers and not dry_run:
        frozen = _freeze_wrappers(script)
        for pid in frozen:
            _signal(pid, False, signal.SIGKILL)
        alive = [pid for pid, start in frozen.items() if not _wait_dead(pid, start, KILL_CONFIRM_S)]
        if alive:
            raise OpError(f"wrapper pid(s) {alive} still alive {KILL_CONFIRM_S:g}s after SIGKILL")
        wrappers = sorted(frozen)
    workers = sorted(_spec_workers(spec))
    recorded = safefiles.read_pid(spec["pidfile"], spec.get("root"))
    now = recorded
    if len(workers) == 1 and recorded != workers[0] and not dry_run:
        safefiles.write_atomic(spec["pidfile"], f"{workers[0]}\n".encode(), spec.get("root"))
        now = workers[0]
    return DisarmSeedReply(
        wrappers=wrappers,
        killed=not dry_run,
        workers=workers,
        pidfile_was=recorded,
        pidfile_now=now,
    )


def _live_pids() -> list[int]:
    """Every process on this host but ourselves."""
    me = os.getpid()
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != me]


class _Script:
    """A shell script on this host, recognised in command lines by path or by file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(path)
        try:
            st = os.stat(path)
            self.file: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            self.file = None

    def run_by(self, pid: int) -> bool:
        """``pid`` is alive and runs this script (an argument names it, as the same text or
        as a path, relative to the process's working directory, to the same file)."""
        args = cmdline(pid)[1:]
        return any(self._names(pid, arg) for arg in args) and not is_dead(proc_stat(pid))

    def _names(self, pid: int, arg: str) -> bool:
        if arg == self.path:
            return True
        if self.file is None or os.path.basename(arg) != self.name:
            return False
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            st = os.stat(arg if os.path.isabs(arg) else os.path.join(cwd, arg))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.file


def _wrapper_pids(script: str) -> list[int]:
    """Live processes that run ``script``."""
    wrapper = _Script(script)
    return [pid for pid in _live_pids() if wrapper.run_by(pid)]


def _freeze_wrappers(script: str) -> dict[int, int]:
    """SIGSTOP every process running ``script`` until none runs unfrozen; ``{pid: start}``.

    On failure every frozen one is continued, so the host is left as it was found.
    """
    frozen: dict[int, int] = {}
    try:
        _freeze_rounds(_Script(script), frozen, time.monotonic() + FREEZE_DEADLINE_S)
    except BaseException:
        for pid in frozen:
            _signal(pid, False, signal.SIGCONT)
        raise
    return frozen


def _freeze_rounds(wrapper: _Script, frozen: dict[int, int], deadline: float) -> None:
    """Look, stop what runs, look again, until a look finds nothing new (a stopped loop
    forks nothing). A process that exec'd something else between our look and its stop (a
    subshell that became the worker) is continued and left out."""
    while True:
        fresh = [pid for pid in _live_pids() if pid not in frozen and wrapper.run_by(pid)]
        if not fresh:
            return
        if time.monotonic() > deadline:
            raise OpError(f"wrappers of {wrapper.path} kept appearing")
        for pid in fresh:
            stat = proc_stat(pid)
            if stat is None or is_dead(stat):
                continue
            _signal(pid, False, signal.SIGSTOP)
            frozen[pid] = stat[2]
        for pid in fresh:
            if pid not in frozen:
                continue
            if not _wait_stopped(pid, deadline):
                raise OpError(f"wrapper pid {pid} did not stop within {FREEZE_DEADLINE_S:g}s")
            if not wrapper.run_by(pid):
                _signal(pid, False, signal.SIGCONT)
                del frozen[pid]


def _wait_stopped(pid: int, deadline: float) -> bool:
    """Until ``pid`` is stopped (state T) or dead; False at ``deadline``."""
    while True:
        stat = proc_stat(pid)
        if stat is None or is_dead(stat) or stat[0] in ("T", "t"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def _spec_workers(spec: dict[str, Any]) -> list[int]:
    """Live processes whose command line is a run of the spec's worker (``argv_matches``)."""
    return [
        pid
        for pid in _live_pids()
        if argv_matches(spec, cmdline(pid)) and not is_dead(proc_stat(pid))
    ]


def answer(message: object) -> dict[str, Any]:
    """The reply to one request (a decoded JSON line; the fleet simulator calls this in
    process); never raises, so every request gets an answer: one we cannot read is
    answered as a Failure, with its id when it has one."""
    rid: int | None = None
    try:
        rid, request = read_request(message)
        reply: Any = OPS[type(request)](request)
    except OpError as exc:
        reply = Failure(kind=exc.kind, error=str(exc), holder_pid=exc.holder_pid)
    except safefiles.UnsafeFile as exc:  # its text names the file and says what it is
        reply = Failure(kind="error", error=str(exc))
    except ProtocolError as exc:
        rid = exc.rid
        reply = Failure(kind="error", error=f"bad request: {exc}")
    except Exception as exc:  # noqa: BLE001 - a request's root: the caller must hear back
        reply = Failure(kind="error", error=f"{type(exc).__name__}: {exc}")
    return reply_message(rid, reply)


def answer_line(line: bytes) -> str:
    """The reply line to one request line (as ``answer``, for bytes off the channel)."""
    try:
        message: object = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        message = {"op": None, "error": str(exc)}
    return _line(answer(message))


OPS: dict[type, Callable[[Any], Any]] = {
    PingRequest: op_ping,
    ProbeRequest: op_probe,
    LaunchRequest: op_launch,
    TerminateRequest: op_terminate,
    DisarmSeedRequest: op_disarm_seed,
    WatchRequest: op_watch,
    EvidenceRequest: op_evidence,
}


def hello() -> Hello:
    """What the agent says first: enough to tell which python and host answered."""
    return Hello(
        protocol=PROTOCOL,
        pid=os.getpid(),
        python=".".join(str(n) for n in sys.version_info[:3]),
        boot_id=boot_id(),
    )


# --- agent ------------------------------------------------------------------------------


def serve() -> int:
    """Answer requests from stdin until EOF."""
    out = sys.stdout.buffer
    lock = threading.Lock()

    def send(text: str) -> None:
        data = text.encode("utf-8")
        try:
            with lock:
                out.write(data)
                out.flush()
        except (BrokenPipeError, ValueError):
            # The channel is gone; nobody can hear the answer, and nobody will ask again.
            os._exit(0)

    def handle(line: bytes) -> None:
        try:
            message: object = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            message = {"op": None, "error": str(exc)}
        reply = answer(message)
        send(_line(reply))
        target = watch_target(message, reply)
        if target is not None:
            exits.watch(*target, send)
            usage.watch(target[1], target[2], send)

    exits = ExitWatch()
    usage = UsageWatch()

    if sys.executable:
        # Now, so that it boots while the daemon is still busy with the hello.
        with _LAUNCHER_LOCK:
            start_launcher(sys.executable)
    send(_line({"hello": asdict(hello())}))
    for line in sys.stdin.buffer:
        threading.Thread(target=handle, args=(line,), daemon=True).start()
    return 0


# --- shepherd ---------------------------------------------------------------------------


def _ignore(signum: int, frame: object) -> None:
    """A handler, not SIG_IGN: handlers reset to the default on exec, so the worker gets
    ordinary signal dispositions while the shepherd shrugs them off."""


def shepherd() -> int:
    """``shepherd`` mode: read the launch order on stdin, detach, and be its shepherd."""
    order: dict[str, Any] = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    # Double fork: the launching agent reaps the first child at once, and the shepherd, not a
    # session leader, is a child of init that survives the channel, connection and daemon.
    # (Popen's start_new_session made the first child a session leader.)
    if os.fork() > 0:
        os._exit(0)
    return _shepherd(order["spec"], order["via"])


def _shepherd(spec: dict[str, Any], via: str) -> int:
    """Launch the worker, report, wait, record its exit: the shepherd's one body, however
    it was started. Detached already; fd 1 is the report pipe, fd 2 its stderr."""
    _name_process(SHEPHERD_NAME)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        lock_fd, log_fd, worker, log_from = _start(spec, via)
    except OpError as exc:
        _report({"ok": False, "kind": exc.kind, "error": str(exc), "holder_pid": exc.holder_pid})
        return 1
    except safefiles.UnsafeFile as exc:
        _report({"ok": False, "kind": "error", "error": str(exc)})
        return 1
    except Exception as exc:  # noqa: BLE001 - process root: the agent must hear why
        _report({"ok": False, "kind": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    stat = proc_stat(worker.pid)
    start_time = stat[2] if stat else 0
    heard = _report({"ok": True, "pid": worker.pid, "start_time": start_time})
    # From here on our own words go to the worker's log; the agent's pipe reads EOF.
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    if not heard:
        _log(log_fd, f"the launching agent was gone; worker pid {worker.pid} runs unreported")
    # Learn of the exit but leave the zombie until the record is written: an agent that
    # sees the worker end (its pidfd) reads the status from the zombie, or, once it is
    # reaped, from the record, never from neither.
    exit_code, signum = _await_exit(worker)
    exited_at = time.time()
    status = exit_code if exit_code is not None else -(signum or 0)
    # Before the record (on which the daemon launches a replacement) and while its zombie
    # keeps the worker's number from being another session's: kill what it left behind.
    swept = sweep(worker.pid, start_time)
    record = {
        "pid": worker.pid,
        "start_time": start_time,
        "exit_code": exit_code,
        "signal": signum,
        "exited_at": exited_at,
        "host": spec["host"],
        "shard": spec["shard"],
        "log_tail": _log_tail(log_fd, log_from),
        "reaped": None if swept is None else len(swept[0]),
    }
    if swept and swept[1]:
        record["survivors"] = swept[1]
    try:
        safefiles.write_atomic(spec["exit_record"], _json_line(record), spec["root"])
    finally:
        worker.wait()  # reap it now that the record tells how it ended
        _log(
            log_fd,
            f"worker pid {worker.pid} exited"
            f" ({f'code {status}' if status >= 0 else f'signal {-status}'})"
            + (f"; killed {record['reaped']} left in its session" if record["reaped"] else "")
            + (f"; alive after SIGKILL: {swept[1]}" if swept and swept[1] else ""),
        )
        os.close(lock_fd)  # releases the shard lock (the process exit would too)
    return 0


def _await_exit(worker: subprocess.Popen[bytes]) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` of ``worker`` once it has ended, leaving it unreaped."""
    try:
        info = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
    except (AttributeError, OSError):  # no waitid: reap it, the status is what matters
        info = None
    if info is None:
        status = worker.wait()
        return (status, None) if status >= 0 else (None, -status)
    if info.si_code == os.CLD_EXITED:
        return info.si_status, None
    return None, info.si_status


#: An exit record carries at most this much of the log's end: enough for a traceback's last
#: lines, which is what a crash signature and a permanent exit's reason quote.
LOG_TAIL_BYTES = 4096


def _log_tail(log_fd: int, since: int = 0) -> str | None:
    """The end of what the worker wrote to its log, from the descriptor it wrote to (None if
    unreadable, or if it wrote nothing): only what follows offset ``since`` (where its
    output began: the log is appended to by every worker of the host, and an earlier one's
    last words are not this one's), at most LOG_TAIL_BYTES, a line cut by that limit
    dropped, the shepherds' own lines left out (they can land after the worker's last
    words, and say nothing about why it ended), undecodable bytes replaced."""
    try:
        size = os.fstat(log_fd).st_size
        start = max(since, size - LOG_TAIL_BYTES)
        data = os.pread(log_fd, min(LOG_TAIL_BYTES, max(0, size - start)), start)
    except OSError:
        return None
    if start > since:
        data = data.partition(b"\n")[2]
    lines = data.splitlines(keepends=True)
    kept = b"".join(line for line in lines if not line.startswith(_SHEPHERD_LINE))
    return kept.decode("utf-8", "replace") or None


def exit_log_tail(spec: dict[str, Any], pid: int) -> str | None:
    """The log's end as ``_log_tail`` gives it to the exit record of worker ``pid``, read by
    path (the agent holds no descriptor of the log), from where its output began as its
    launch record says; None when there is none or it cannot be read, or when the log is no
    longer the file it wrote to. A launch record without that offset (a shepherd of an
    earlier version) gives the log's end, as that shepherd's exit record does."""
    path = spec.get("log")
    if not isinstance(path, str):
        return None
    launch = spec.get("launch_record")
    record = read_json(launch, spec.get("root")) if isinstance(launch, str) else None
    since, inode = 0, None
    if record is not None and record.get("pid") == pid:
        offset, ino = record.get("log_offset"), record.get("log_inode")
        if type(offset) is int and type(ino) is int and offset >= 0:
            since, inode = offset, ino
    try:
        fd = safefiles.open_file(path, os.O_RDONLY, spec.get("root"))
    except OSError:
        return None
    try:
        if inode is not None and os.fstat(fd).st_ino != inode:
            return None  # rotated since: what it wrote is in a backup, under another name
        return _log_tail(fd, since)
    except OSError:
        return None
    finally:
        os.close(fd)


def _name_process(name: str) -> None:
    """Set the name ``ps -o comm``, ``top`` and ``pgrep`` show (argv stays python's)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name)


def _report(message: dict[str, Any]) -> bool:
    """Tell the launching agent (one line on stdout), then let go of its pipe; False if the
    agent was gone (its connection dropped mid-launch), which must not end the shepherd:
    the worker runs either way and still needs its exit recorded and its lock held."""
    try:
        os.write(1, (json.dumps(message) + "\n").encode("utf-8"))
        heard = True
    except OSError:  # EPIPE: nobody reads the pipe any more
        heard = False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    return heard


def _log(fd: int, text: str) -> None:
    """One line from the shepherd in the worker's log."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.write(fd, f"{_SHEPHERD_LINE.decode()}{os.getpid()} {stamp}] {text}\n".encode())


#: How the shepherd's own lines in a worker's log begin.
_SHEPHERD_LINE = b"[shepherd "


def _start(spec: dict[str, Any], via: str) -> tuple[int, int, subprocess.Popen[bytes], int]:
    """Lock the shard, check the pidfile, rotate the log, start the worker and record it;
    the shard lock's and the log's descriptors, the worker, and the log's offset where its
    output begins."""
    root = spec["root"]
    # fcntl/lockf locks are per process and released by *any* close of the file in this
    # process, so the lock file is opened once, here, and never elsewhere in the shepherd.
    # It is rewritten in place below, so it must be a file of its own (single_link).
    lock_fd = safefiles.open_file(spec["lock"], os.O_RDWR | os.O_CREAT, root, single_link=True)
    try:
        _take_shard_lock(lock_fd)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        holder = _lock_holder(lock_fd)
        raise Refused(
            f"shard {spec['shard']} is locked by a live shepherd ({_describe_holder(holder)})",
            holder.get("pid") if holder.get("alive") else None,
        ) from None
    # Again, holding the shard: a takeover may have come while this launch was on its way.
    fence(spec)
    recorded = safefiles.read_pid(spec["pidfile"], root)
    if recorded is not None and identify(spec, recorded) == "ours":
        # The lock was free but a worker of ours runs: its shepherd was killed (SIGKILL,
        # OOM). Starting another would put two workers on one shard.
        raise Refused(
            f"pid {recorded} from {spec['pidfile']} is alive and ours,"
            " but no shepherd holds the shard lock",
            recorded,
        )
    _rotate(spec["log"], int(spec["log_max_bytes"]), int(spec["log_backups"]), root)
    # Read-write: at the worker's exit the shepherd reads the log's end back from it.
    log_fd = safefiles.open_file(
        spec["log"], os.O_RDWR | os.O_APPEND | os.O_CREAT, root, single_link=True
    )
    # The worker inherits it as stdout: a plain blocking descriptor, as it expects.
    fcntl.fcntl(log_fd, fcntl.F_SETFL, fcntl.fcntl(log_fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    env = dict(os.environ)
    env.update(spec["env"])
    _log(log_fd, f"starting worker (via {via}): {json.dumps(spec['argv'])}")
    # Everything after this in the log is this worker's (or a shepherd line, left out of
    # its tail): nobody else writes to it until its shepherd releases the shard.
    log_stat = os.fstat(log_fd)
    try:
        worker = subprocess.Popen(
            spec["argv"],
            env=env,
            cwd=worker_cwd(env, root),
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            close_fds=True,
            # Its own session and group: whatever it starts is killed with it (``sweep``).
            start_new_session=True,
        )
    except OSError as exc:
        _log(log_fd, f"cannot start worker: {exc}")
        raise OpError(f"cannot start worker {spec['argv'][0]}: {exc}") from None
    stat = proc_stat(worker.pid)
    start_time = stat[2] if stat else 0
    record = {
        "pid": worker.pid,
        "start_time": start_time,
        "boot_id": boot_id(),
        "argv": spec["argv"],
        "host": spec["host"],
        "shard": spec["shard"],
        "shepherd_pid": os.getpid(),
        "launched_at": time.time(),
        # Where its output begins in the log (the agent's pushed exit reads its tail).
        "log_offset": log_stat.st_size,
        "log_inode": log_stat.st_ino,
    }
    try:
        safefiles.write_atomic(spec["pidfile"], f"{worker.pid}\n".encode(), root)
        safefiles.write_atomic(spec["launch_record"], _json_line(record), root)
    except OSError as exc:
        # Unrecorded (a full disk, say), the worker would run unknown to every probe and the
        # next launch would start a second one beside it: end it before reporting failure.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        with contextlib.suppress(OSError):
            _log(log_fd, f"cannot record worker pid {worker.pid}: {exc}; killed it")
        raise OpError(f"cannot record the worker's pid ({exc}); it was killed") from None
    holder = {
        "pid": worker.pid,
        "host": spec["host"],
        "boot_id": boot_id(),
        "shepherd_pid": os.getpid(),
    }
    # From here the worker is recorded and ours to watch: what follows is only a courtesy
    # (the holder's name in refusals, a log line) and must not end the shepherd if it fails.
    with contextlib.suppress(OSError):
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, (json.dumps(holder) + "\n").encode("utf-8"), 0)
    with contextlib.suppress(OSError):
        _log(log_fd, f"worker pid {worker.pid} started")
    return lock_fd, log_fd, worker, log_stat.st_size


def _json_line(record: dict[str, Any]) -> bytes:
    """A record as written to disk: sorted JSON and a newline."""
    return (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")


#: A shepherd whose worker is dead holds the shard a little longer: it sweeps the worker's
#: session and writes the exit record first. A launch that comes meanwhile (the agent pushed
#: the exit at once) waits for it that long, instead of being refused and probed.
LOCK_HANDOVER_S = SWEEP_S + 2.0


def _take_shard_lock(lock_fd: int) -> None:
    """Take the shard lock, waiting while its holder is a shepherd on this host whose worker
    has died (it is finishing up); raises the lock's OSError otherwise, or once that is over."""
    deadline = time.monotonic() + LOCK_HANDOVER_S
    while True:
        try:
            fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _lock_holder(lock_fd) if exc.errno in (errno.EACCES, errno.EAGAIN) else {}
            if not holder.get("here") or holder.get("alive") or time.monotonic() > deadline:
                raise
        else:
            return
        time.sleep(POLL_S / 4)


def _lock_holder(lock_fd: int) -> dict[str, Any]:
    """Who holds the lock, from what the holder wrote into the lock file."""
    try:
        data = os.pread(lock_fd, 4096, 0)
        holder = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return {}
    # On a shared filesystem the holder may run on another machine, where our /proc can
    # say nothing about its pid.
    holder["here"] = holder.get("boot_id") == boot_id()
    holder["alive"] = holder["here"] and not is_dead(proc_stat(holder["pid"]))
    return holder


def _describe_holder(holder: dict[str, Any]) -> str:
    """The lock holder, for the refusal message."""
    if not holder:
        return "holder unknown"
    if not holder["here"]:
        return f"worker pid {holder['pid']} on {holder.get('host', '?')}, another machine"
    state = "alive" if holder["alive"] else "exiting"
    return f"worker pid {holder['pid']} on {holder.get('host', '?')}, {state}"


def _rotate(path: str, max_bytes: int, backups: int, root: str | None) -> None:
    """``log`` -> ``log.1`` -> ... -> ``log.N`` when ``log`` is over ``max_bytes``; renames
    and the truncation go by the log directory's descriptor (a rename moves a planted
    symlink, never what it points to). A log that is no regular file is left for the open
    that follows to refuse, naming it."""
    dir_fd, name = safefiles.open_parent(path, root, create=True)
    try:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
            return
        if backups <= 0:
            fd = safefiles.open_at(dir_fd, name, os.O_WRONLY, path=path, single_link=True)
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)
            return
        for i in range(backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                _rename_at(dir_fd, f"{name}.{i}", f"{name}.{i + 1}", f"{path}.{i + 1}")
        _rename_at(dir_fd, name, f"{name}.1", f"{path}.1")
    finally:
        os.close(dir_fd)


def _rename_at(dir_fd: int, source: str, target: str, target_path: str) -> None:
    """Rename within ``dir_fd``; an error names ``target_path`` whole."""
    try:
        os.replace(source, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        raise safefiles.named(exc, target_path) from None


def worker_cwd(env: dict[str, str], root: str) -> str:
    """Where the worker starts: its HOME, as the old script ran it, but never the run root
    or a directory in it. ``python -m`` puts its working directory first on ``sys.path``,
    and anyone who can write the run root could plant a package there (``areal/``)."""
    try:
        account_home: str | None = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid with no passwd entry (a container's)
        account_home = None
    top = os.path.realpath(root).rstrip("/") + "/"
    for candidate in (env.get("HOME"), account_home):
        if not candidate or not os.path.isabs(candidate) or not os.path.isdir(candidate):
            continue
        if not os.access(candidate, os.X_OK):  # a HOME inherited from another user
            continue
        if not (os.path.realpath(candidate).rstrip("/") + "/").startswith(top):
            return candidate
    return "/"


# --- launcher ---------------------------------------------------------------------------


def launcher() -> int:
    """``launcher`` mode: fork a shepherd for each order the agent sends on fd 0 (a
    SEQPACKET socket, the report pipe attached), confirm each fork, exit at EOF."""
    _name_process("rs-launcher")
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, 0, 0)
    fd_space = socket.CMSG_SPACE(4 * array.array("i").itemsize)
    # The received pipe must not leak into the next order's fork in the meantime.
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while True:
        try:
            order, ancillary, _, _ = channel.recvmsg(LAUNCHER_MESSAGE_MAX, fd_space, flags)
        except ConnectionResetError:
            order, ancillary = b"", []
        fds = _received_fds(ancillary)
        if not order:
            # The agent is gone. The shepherds are not our children (double fork) and live
            # in their own sessions: they carry on without us.
            for fd in fds:
                os.close(fd)
            return 0
        try:
            child = _fork_shepherd(channel, order, fds)
            answer: dict[str, Any] = {"forked": child}
        except Exception as exc:  # noqa: BLE001 - one bad order must not end the launcher
            child, answer = 0, {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            channel.send(json.dumps(answer).encode("utf-8"))
        except OSError:
            return 0  # the agent is gone
        if child:
            # The middle child exits right after forking the shepherd: reap it, so no
            # zombie stays behind (PID 1 would be no help: it is our child, not an orphan).
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors that came with a message (SCM_RIGHTS)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _fork_shepherd(channel: socket.socket, order: bytes, fds: list[int]) -> int:
    """Fork the middle child, which starts a session and forks the shepherd; its pid."""
    if len(fds) != 1:
        raise OpError(f"an order came with {len(fds)} descriptors, not 1")
    report_fd = fds[0]
    child = os.fork()
    if child > 0:
        return child
    code = 1
    try:
        channel.detach()  # fd 0 is about to be replaced; the socket must not close it later
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        _become_shepherd(report_fd)
        launch = json.loads(order.decode("utf-8"))
        code = _shepherd(launch["spec"], launch["via"])
    except BaseException:  # noqa: BLE001 - a forked child must never return into the loop
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(code)


def _become_shepherd(report_fd: int) -> None:
    """Drop what the launcher gave its forked child: its stdio (the agent's socket and
    stderr) for /dev/null and the report pipe.

    Its signal state it keeps: the launcher never changes its own, so it is what a fresh
    interpreter started by the agent has (SIGPIPE and SIGXFSZ ignored, so a closed pipe is
    EPIPE, which ``_report`` relies on; SIGCHLD as it came, so the shepherd can wait for its
    worker; and whatever the agent inherited ignored). tests/integration/test_launcher.py
    compares both paths, so a handler added to the launcher would have to be undone here.
    """
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(report_fd, 1)
    os.dup2(report_fd, 2)
    os.close(devnull)
    os.close(report_fd)  # or the shepherd would hold the pipe open and the agent see no EOF


#: ``rt_sigaction``'s system call number, on the 64-bit Linux architectures where we know it
#: (arm64 and riscv64 share the generic table).
_RT_SIGACTION = {"x86_64": 13, "aarch64": 134, "riscv64": 134}
#: The kernel's first real-time signal: from here up to the C library's ``SIGRTMIN`` (32 and
#: 33 on glibc, 32 to 34 on musl) the signals are the C library's own.
_KERNEL_SIGRTMIN = 32


def reset_reserved_signals() -> None:
    """Give the C library's reserved signals their default action when our parent left them
    ignored, so no launcher, shepherd or worker inherits that.

    glibc's and musl's ``posix_spawn`` set them to SIG_IGN in the child (Python 3.13's
    subprocess spawns that way, and so does the embedded SSH server), and an ignored signal
    stays ignored across exec. ``sigaction()`` refuses these numbers, hence the raw system
    call; on an architecture not in ``_RT_SIGACTION``, or without ctypes, they stay ignored.
    """
    reserved = range(_KERNEL_SIGRTMIN, int(getattr(signal, "SIGRTMIN", _KERNEL_SIGRTMIN)))
    try:
        with open("/proc/self/status") as f:
            ignored = int(next(ln for ln in f if ln.startswith("SigIgn:")).split()[1], 16)
    except (OSError, StopIteration, ValueError, IndexError):
        return
    todo = [sig for sig in reserved if ignored & (1 << (sig - 1))]
    number = _RT_SIGACTION.get(os.uname().machine)
    if not todo or number is None or sys.maxsize < 1 << 32:  # a 32-bit process: other table
        return
    try:
        import ctypes  # here: its import costs milliseconds, and it is rarely needed

        libc = ctypes.CDLL(None, use_errno=True)
        # An all-zero struct sigaction of any layout: SIG_DFL, no flags, nothing blocked.
        default = ctypes.create_string_buffer(64)
        for sig in todo:
            # The last argument is the size of the kernel's sigset_t: 64 signals, 8 bytes.
            libc.syscall(ctypes.c_long(number), ctypes.c_long(sig), default, None, ctypes.c_long(8))
    except (ImportError, OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    """``agent`` (the default), ``launcher`` or ``shepherd``."""
    reset_reserved_signals()
    mode = argv[0] if argv else "agent"
    if mode == "shepherd":
        return shepherd()
    if mode == "launcher":
        return launcher()
    if mode == "agent":
        return serve()
    sys.stderr.write("usage: agent | launcher | shepherd\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
