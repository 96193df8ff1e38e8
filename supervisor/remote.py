"""Persistent SSH to each worker host: one connection, one long-lived agent channel and
bounded one-shot commands. The only importer of asyncssh; nothing read from ``$HOME``.

Launch, probe and terminate are JSON-lines requests to the agent (``agent.py``, sent with
the module it imports, compressed, as the ``-c`` argument of the host's python:
``agent_program``), so an operation costs one round trip on an open channel instead of a
handshake or a new channel (and the remote user's rc files) each time.

One live worker per shard: the shard lock. ``launch`` starts a detached shepherd that takes
``fcntl.lockf(LOCK_EX | LOCK_NB)`` on ``ctl/shard-N.lock`` and holds it for the worker's
whole life; a second launch finds it held and is refused with ``ShardHeld``. Why lockf:

- On Linux NFS clients, ``lockf``/``fcntl`` byte-range locks go to the server (NLM for
  NFSv3, the protocol's own locks for NFSv4), so they exclude across every host mounting
  the run directory. ``flock()`` has been emulated with the same byte-range locks on NFS
  since Linux 2.6.12, and either way these locks belong to a *process* and vanish when any
  of its descriptors for the file is closed: so the long-lived shepherd takes the lock and
  never opens the file again, rather than the short-lived agent or an SSH command.
- When a host dies, the server frees its locks by lease or NLM recovery: NFSv4 locks go when
  the client's lease expires (90 s by default on Linux nfsd); NFSv3 (NLM) locks only when
  the client reboots and its statd notifies the server, or an admin clears them. Until then
  a launch of that shard on *another* host is refused (the host's own launches are moot).
- A SIGKILLed shepherd frees the lock while its worker lives on. So, as defence in depth,
  the shepherd also refuses when the pidfile names a live process that is ours (pid, and
  start time from the launch record, or the command line for the old script's workers).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import random
import re
import shlex
import time
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Final, TypeVar

import asyncssh
import structlog

from supervisor import agent as protocol
from supervisor import health
from supervisor.config import HostConfig, SshConfig
from supervisor.errors import Fenced, RemoteError, ShardHeld
from supervisor.layout import LaunchSpec
from supervisor.measured import remote_program
from supervisor.sshalgs import DEFAULT_ALGS, WEAK_HOST_KEY_ALGS

log = structlog.get_logger()

AGENT_PATH: Final = Path(__file__).with_name("agent.py")
#: What the agent imports that a host has no copy of, each sent with it and registered under
#: the name the agent imports it by.
AGENT_MODULES: Final = ((protocol.SAFEFILES_MODULE, Path(__file__).with_name("safefiles.py")),)
#: Probe and launch touch the shared filesystem and fork a python; a healthy host answers
#: in ~0.1 s, an NFS server that is failing over can take a minute (the agent itself gives
#: a shepherd 60 s to report).
RPC_TIMEOUT_S: Final = 75.0
#: Terminate may wait ``grace_s``, then 10 s for SIGKILL to be confirmed, then answer.
TERMINATE_SLACK_S: Final = 20.0
#: The agent bounds an evidence capture itself; this covers the round trip around it.
EVIDENCE_SLACK_S: Final = 1.0
#: Starting the agent: the user's shell and rc files, then python's startup and imports.
AGENT_START_TIMEOUT_S: Final = 30.0
#: A connection that stayed up this long resets the reconnect backoff; one that drops
#: sooner (auth then disconnect, a flapping link) keeps backing off.
STABLE_S: Final = 10.0
#: SSH's port, on which a known_hosts line names a host without one (OpenSSH's rule).
DEFAULT_SSH_PORT: Final = 22
#: ``wait_closed()`` can hang on a peer that never answers our close.
CLOSE_TIMEOUT_S: Final = 5.0
#: sshd frees a finished session's slot only after it has processed our close, in a later
#: turn of its loop; an open sent right behind the close can be refused with "open failed"
#: although we never exceed MaxSessions. Nothing ran, so opening again is safe.
OPEN_RETRY_DELAYS_S: Final = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
#: The agent's largest reply (a launch or probe result) is well under a kilobyte; a line
#: longer than this is not a reply, and is dropped unparsed: only its first characters are
#: kept as it is read (``_Lines``), so it bounds the memory a line takes as well as the parse.
MAX_REPLY_CHARS: Final = 64 * 1024
#: The agent's streams are read this much at a time and split into lines here, the loop let
#: run between reads. asyncssh's readline costs microseconds a line and returns without
#: yielding while lines are buffered: a host that printed a window's worth of empty lines
#: held the event loop, so every other host, for seconds.
READ_CHUNK_CHARS: Final = 16 * 1024
#: A request unanswered this long has its channel checked with a ping (``_check_channel``):
#: a probe or launch answers in ~0.1 s, so a healthy host rarely pays a ping; a terminate
#: waiting out its grace pays one, answered in a millisecond.
CHECK_AFTER_S: Final = 1.0
#: A ping answers in about a millisecond on a live channel (the agent answers it in a thread
#: of its own, whatever else it does); silence this long means a dead connection.
CHECK_TIMEOUT_S: Final = 5.0
#: Pushed exits a host may send: a burst, then one per ``PUSH_EVERY_S``. A host has one
#: worker, so even a crash loop sends a few a second; more is a hostile or broken agent,
#: whose extra pushes are dropped (and counted as noise): the exit records still tell.
PUSH_BURST: Final = 20
PUSH_EVERY_S: Final = 0.1
#: Pushed usages a host may send: its agent measures the worker it watches every
#: ``protocol.USAGE_S`` (two, for a moment, while a new worker replaces an old one); more
#: is a hostile or broken agent, whose extra pushes are dropped (and counted as noise).
USAGE_BURST: Final = 4
USAGE_EVERY_S: Final = protocol.USAGE_S / 4
#: What of a line from the host is kept for logs and error messages.
MAX_NOISE_CHARS: Final = 500
#: ``run()`` keeps at most this much of a command's stdout (and of its stderr): the commands
#: we send answer in a few kilobytes, and a host that sends more must not fill our memory.
MAX_OUTPUT_CHARS: Final = 1 << 20
#: What the agent printed is kept this far when it dies before its hello: the shell's or
#: python's error is a few lines; the rest of a flood is not read.
MAX_FAILED_START_CHARS: Final = 16 * 1024
#: Lines a host prints that are not replies (its stderr, noise on stdout) are logged at most
#: ``NOISE_BURST`` at once and one per ``NOISE_EVERY_S`` after that; the rest are counted and
#: reported once per ``NOISE_REPORT_S``. A host cannot bury the daemon's own events, and a
#: normal start (a warning or two from the user's rc files) is logged whole.
NOISE_BURST: Final = 20
NOISE_EVERY_S: Final = 3.0
NOISE_REPORT_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Started:
    """A launched worker: its pid and start time (field 22 of /proc/PID/stat)."""

    pid: int
    start_time: int


@dataclass(frozen=True, slots=True)
class CommandResult:
    """A finished one-shot command; ``exit_status`` is minus the signal number if killed."""

    exit_status: int
    stdout: str
    stderr: str


class FailureKind(StrEnum):
    """Why a connection attempt failed, for callers that act on the kind, not the words."""

    #: The host's key is not in ``known_hosts``, or differs from it.
    HOST_KEY = "host_key"
    #: The host refused our user and keys.
    LOGIN = "login"
    #: No TCP connection, key exchange or login within ``connect_timeout_s``.
    TIMEOUT = "timeout"
    #: Refused, unroutable, or the name does not resolve.
    UNREACHABLE = "unreachable"
    #: Anything else (an unreadable key file, a protocol error).
    OTHER = "other"


@cache
def agent_source() -> str:
    """The text of ``agent.py``, as sent to every host."""
    return AGENT_PATH.read_text(encoding="utf-8")


@cache
def agent_modules() -> tuple[tuple[str, str], ...]:
    """``(name, text)`` of each module sent with the agent (``AGENT_MODULES``)."""
    return tuple((name, path.read_text(encoding="utf-8")) for name, path in AGENT_MODULES)


def agent_program() -> str:
    """What a host's ``python -c`` runs to be the agent: ``packed_program`` of the agent and
    its modules (under ./dev test, the wrapper that measures their coverage instead)."""
    source = agent_source()
    program = remote_program(source, AGENT_PATH, AGENT_MODULES)
    return packed_program(source, agent_modules()) if program is source else program


def agent_command(python: str) -> str:
    """The shell command that runs the agent with ``python``."""
    return _python_command(python, agent_program())


#: Linux's limit on one argv string (``MAX_ARG_STRLEN``, 32 pages): the agent's program is
#: one, as ``python -c PROGRAM``, and so is the one it hands its launcher and shepherds.
MAX_ARG_STRLEN: Final = 128 * 1024


#: The module at the head of every program sent (``packed_program``), as plain text.
CODECACHE_PATH: Final = Path(__file__).with_name("codecache.py")
CODECACHE_MODULE: Final = "_reward_supervisor_codecache"


@cache
def packed_program(source: str, modules: tuple[tuple[str, str], ...] = ()) -> str:
    """``source`` as a ``python -c`` program that runs it, once it has run each of
    ``modules`` (``(name, text)``) as a module registered under its name in ``sys.modules``.

    The texts travel compressed (under half their size, so the agent can grow for years
    below ``MAX_ARG_STRLEN``); ``codecache.py``, sent as plain text ahead of them, loads their
    code as an earlier start on the host compiled it, or decompresses and compiles them and
    keeps the code for the next start. The agent finds this program again in its own command
    line (``agent.own_source``) for its launcher and shepherds, which run it the same way."""
    texts = [text for _, text in modules] + [source]
    if any("\0" in text for text in texts):
        raise ValueError("Python source holds no NUL byte, which separates the texts here")
    # Base64, not the slightly smaller base85: its decoder is C, base85's pure Python.
    packed = base64.b64encode(zlib.compress("\0".join(texts).encode("utf-8"), 9)).decode("ascii")
    names = tuple(name for name, _ in modules)
    cache_source = CODECACHE_PATH.read_text(encoding="utf-8")
    # The program and the code that reads the cache: another version of either is another key.
    key = hashlib.sha256(f"{packed}\0{names!r}\0{cache_source}".encode()).hexdigest()[:32]
    # The agent runs in the globals the packing's names (sys, types, _c, _m, _n, _t) are in,
    # and defines none of them.
    return (
        "import sys,types\n"
        f"_c=sys.modules[{CODECACHE_MODULE!r}]=types.ModuleType({CODECACHE_MODULE!r})\n"
        f"exec(compile({cache_source!r},'<reward-supervisor codecache>','exec'),_c.__dict__)\n"
        f"_t=_c.codes({key!r},{packed!r},{names!r})\n"
        f"for _n in {names!r}:\n"
        " _m=sys.modules[_n]=types.ModuleType(_n)\n"
        " exec(_t.pop(0),_m.__dict__)\n"
        "exec(_t.pop())"
    )


# One string per interpreter, shared by every host: each channel keeps its command for its
# whole life, and with the agent's ~90 KB of source in it, a command built per host held
# ~90 MB at 1000 hosts (tracemalloc, docs/BENCHMARKS.md).
@lru_cache(maxsize=16)
def _python_command(python: str, program: str) -> str:
    # -X utf8: paths and argv are UTF-8 on both ends whatever the remote locale says.
    return f"exec {shlex.quote(python)} -X utf8 -u -c {shlex.quote(program)} agent"


#: What JSON allows before a value.
_JSON_SPACE: Final = " \t\n\r"


def parse_reply(line: str) -> tuple[int, dict[str, Any]] | None:
    """The request id and reply that ``line`` carries; None for anything else. Never raises:
    every byte from a host is hostile input, and one bad line must not end the daemon."""
    if len(line) > MAX_REPLY_CHARS or not line.lstrip(_JSON_SPACE).startswith("{"):
        return None  # no JSON object, and cheaper told so than by json.loads's exception
    try:
        reply = json.loads(line)
    except (ValueError, RecursionError):
        # ValueError covers bad JSON and integers past the interpreter's digit limit;
        # RecursionError, nesting deeper than the stack (a line of ``[``).
        return None
    if not isinstance(reply, dict):
        return None
    rid = reply.get("id")
    # Our ids are positive ints; bool is an int subclass, and a float id (1e999) is not ours.
    if type(rid) is not int or rid <= 0:
        return None
    return rid, reply


def parse_push(line: str) -> protocol.WorkerExit | protocol.WorkerUsage | str | None:
    """The exit or usage ``line`` pushes; why it is a malformed push (a string); None when it
    is no push at all. Never raises: every byte from a host is hostile input."""
    if len(line) > MAX_REPLY_CHARS or ('"exit"' not in line and '"usage"' not in line):
        return None
    try:
        news = protocol.read_push(json.loads(line))
    except (ValueError, RecursionError) as exc:
        # ProtocolError is a ValueError: a push whose fields are wrong.
        return (
            f"malformed push: {str(exc)[:200]}" if isinstance(exc, protocol.ProtocolError) else None
        )
    if isinstance(news, protocol.WorkerUsage):
        return news if news.via in USAGE_VIAS else dataclasses.replace(news, via="unknown")
    if news is None or news.log_tail is None:
        return news
    return dataclasses.replace(news, log_tail=host_text(news.log_tail, protocol.LOG_TAIL_MAX))


#: How a usage push may say it counted (``protocol.WorkerUsage``); any other word a host
#: sends becomes "unknown", so that no text of its own reaches a status or a page.
USAGE_VIAS: Final = frozenset({"pss", "rss"})


_SURROGATES: Final = re.compile("[\ud800-\udfff]")


def host_text(value: object, limit: int = MAX_NOISE_CHARS) -> str | None:
    """A string a host sent, cut to ``limit`` and safe to encode: a lone surrogate (JSON allows
    ``"\\ud800"``) becomes U+FFFD, or it would break every UTF-8 reply that carried it, such
    as the whole fleet's ``status``. None when ``value`` is not a string."""
    if not isinstance(value, str):
        return None
    return _SURROGATES.sub("\ufffd", value[:limit])


def evidence_of(pid: int, reply: protocol.EvidenceReply) -> health.Evidence:
    """The core's record of an agent's evidence reply: every text as the host sent it, cut
    to its bound and safe to encode (``host_text``)."""
    notes = (host_text(note, protocol.TEXT_MAX) for note in reply.notes)
    return health.Evidence(
        pid=pid,
        stacks=host_text(reply.stacks, protocol.STACKS_MAX),
        stacks_via=host_text(reply.via, 40),
        log_tail=host_text(reply.log_tail, protocol.LOG_TAIL_MAX),
        notes=tuple(note for note in notes if note is not None)[: protocol.NOTES_MAX],
        elapsed_s=reply.elapsed_s,
    )


_Reply = TypeVar("_Reply", bound=protocol.Reply)


class Backoff:
    """Decorrelated jitter: each delay is uniform in [min, 3 x previous], capped at max.

    Hosts that fail together (a network blip) spread their retries out, and the delay grows
    about threefold per failure without ever collapsing back to a busy loop.
    """

    def __init__(self, min_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not a secret
        self._previous = min_s

    def next_delay(self) -> float:
        """The next delay, in seconds."""
        high = min(self.max_s, max(self.min_s, self._previous * 3))
        self._previous = self._rng.uniform(self.min_s, high)
        return self._previous

    def reset(self) -> None:
        """Start again from ``min_s`` (after a connection that stayed up)."""
        self._previous = self.min_s


class TokenBucket:
    """``burst`` tokens, one more every ``every_s`` seconds up to ``burst``; time passed in."""

    def __init__(self, burst: int, every_s: float) -> None:
        self.burst = burst
        self.every_s = every_s
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> bool:
        """Spend a token at monotonic ``now``; False (nothing spent) when there is none."""
        if self._at is not None:
            elapsed = max(0.0, now - self._at)
            self._tokens = min(float(self.burst), self._tokens + elapsed / self.every_s)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class NoiseLog:
    """What one host prints that is not a reply (agent stderr, noise on stdout), logged within
    a budget of ``NOISE_BURST`` lines and one per ``NOISE_EVERY_S``; lines over it are counted
    and reported once per ``NOISE_REPORT_S`` as ``agent.lines_dropped``."""

    def __init__(
        self,
        host: str,
        *,
        burst: int = NOISE_BURST,
        every_s: float = NOISE_EVERY_S,
        report_s: float = NOISE_REPORT_S,
    ) -> None:
        self.host = host
        self._bucket = TokenBucket(burst, every_s)
        self._report_s = report_s
        self._dropped: dict[str, int] = {}
        self._report: asyncio.TimerHandle | None = None

    def line(self, event: str, line: str) -> None:
        """Log ``line`` as ``event`` if the budget allows, else count it. Call on the loop."""
        if self._bucket.take(time.monotonic()):
            log.warning(event, host=self.host, line=line)
            return
        self._dropped[event] = self._dropped.get(event, 0) + 1
        if self._report is None:
            self._report = asyncio.get_running_loop().call_later(self._report_s, self.flush)

    def flush(self) -> None:
        """Report the lines dropped since the last report, if any, and start counting anew."""
        if self._report is not None:
            self._report.cancel()
            self._report = None
        if self._dropped:
            dropped, self._dropped = self._dropped, {}
            log.warning(
                "agent.lines_dropped",
                host=self.host,
                dropped=sum(dropped.values()),
                by_event=dropped,
                budget=f"{self._bucket.burst} lines, then 1 per {self._bucket.every_s:g}s",
            )


class RemoteHost:
    """One worker host: a persistent connection (``maintain()``) and the operations on it.

    ``on_connection(up, reason)`` is called on every transition of the connection (the first
    outcome included), never repeatedly for the same state, and not for ``aclose()``.
    Operations raise ``RemoteError(connection_lost=False)`` at once when not connected
    (nothing was sent), and ``RemoteError(connection_lost=True)`` when the connection or the
    agent went away under them (the outcome is unknown). Cancelling an operation abandons
    its reply, not the remote action: a cancelled launch may still start a worker.
    """

    def __init__(
        self,
        host: HostConfig,
        ssh: SshConfig,
        *,
        python: str,
        handshakes: asyncio.Semaphore,
        on_connection: Callable[[bool, str], None],
        on_exit: Callable[[protocol.WorkerExit], None] | None = None,
        on_agent: Callable[[], None] | None = None,
        on_usage: Callable[[protocol.WorkerUsage], None] | None = None,
    ) -> None:
        self.name = host.name
        self._host = host
        self._ssh = ssh
        self._python = python
        self._handshakes = handshakes
        self._on_connection = on_connection
        self._on_exit = on_exit
        self._on_agent = on_agent
        self._on_usage = on_usage
        self._usages = TokenBucket(USAGE_BURST, USAGE_EVERY_S)
        self._pushes = TokenBucket(PUSH_BURST, PUSH_EVERY_S)
        self._channels = asyncio.Semaphore(ssh.max_channels_per_host)
        self._noise = NoiseLog(host.name)
        self._link: _Link | None = None
        self._reported: bool | None = None
        #: Why the latest connection attempt failed; None once connected.
        self.last_failure: FailureKind | None = None
        self._closed = asyncio.Event()
        # Cuts a backoff pause short: set by update() and aclose().
        self._kick = asyncio.Event()

    @property
    def connected(self) -> bool:
        """The connection is up (operations can be sent)."""
        return self._link is not None and not self._link.ended.is_set()

    # --- connection -------------------------------------------------------------------

    async def maintain(self) -> None:
        """Connect, and reconnect with jittered backoff whenever the connection is lost;
        returns after ``aclose()``, runs until cancelled otherwise."""
        backoff = Backoff(self._ssh.reconnect_min_s, self._ssh.reconnect_max_s)
        failures = 0
        while not self._closed.is_set():
            self._kick.clear()
            ssh = self._ssh
            backoff.min_s, backoff.max_s = ssh.reconnect_min_s, ssh.reconnect_max_s
            ended = _Ended()
            try:
                conn = await self._connect(ended)
            except _ConnectFailed as failed:
                failures += 1
                delay = backoff.next_delay()
                (log.warning if failures == 1 else log.info)(
                    "ssh.connect_failed",
                    host=self.name,
                    address=self._host.address,
                    port=self._host.port,
                    attempt=failures,
                    reason=failed.reason,
                    retry_in_s=round(delay, 3),
                )
                self.last_failure = failed.kind
                self._report(False, failed.reason)
                await self._pause(delay)
                continue
            failures = 0
            self.last_failure = None
            if self._closed.is_set():
                await _close(conn)
                break
            up_at = time.monotonic()
            try:
                await self._serve(conn, ended)
            except Exception as exc:  # task root of a link: a fault ends this link, not the daemon
                log.exception("ssh.link_failed", host=self.name)
                ended.set(f"internal error on the link: {_describe(exc)}")
            if time.monotonic() - up_at >= STABLE_S:
                backoff.reset()
            if self._closed.is_set():
                break
            self._report(False, ended.reason)
            log.warning("ssh.disconnected", host=self.name, reason=ended.reason)
            if not ended.reconnect_now:
                await self._pause(backoff.next_delay())

    async def _connect(self, ended: _Ended) -> asyncssh.SSHClientConnection:
        """One attempt, within the fleet's handshake budget; raises _ConnectFailed."""
        host, ssh = self._host, self._ssh
        async with self._handshakes:
            if self._closed.is_set():
                raise _ConnectFailed("closed", FailureKind.OTHER)
            try:
                conn = await asyncssh.connect(
                    host.address,
                    host.port,
                    client_factory=lambda: _Client(ended),
                    **connect_options(host, ssh),
                )
            except (OSError, asyncssh.Error, ValueError) as exc:
                # ValueError: an unreadable or encrypted client key (asyncssh.KeyImportError).
                raise _ConnectFailed(_connect_failure(exc, host, ssh), _failure_kind(exc)) from None
            except Exception as exc:  # a broken or hostile peer costs one attempt, no more
                log.exception("ssh.connect_internal_error", host=self.name)
                raise _ConnectFailed(
                    f"internal error: {_describe(exc)}", FailureKind.OTHER
                ) from None
        return conn

    async def _serve(self, conn: asyncssh.SSHClientConnection, ended: _Ended) -> None:
        """Hold the connection until it ends; its agent and channel tasks live in here."""
        try:
            async with asyncio.TaskGroup() as tasks:
                link = _Link(self.name, conn, ended, tasks, self._noise)
                link.on_push = self._pushed
                link.on_usage = self._usage_pushed
                link.on_agent = self._agent_started
                self._link = link
                if self._on_exit is not None:
                    # The agent at once, not at the first request: it watches the worker.
                    link.spawn(self._start_agent(link))
                log.info(
                    "ssh.connected",
                    host=self.name,
                    address=self._host.address,
                    port=self._host.port,
                )
                self._report(True, f"connected to {self._host.address}:{self._host.port}")
                try:
                    await ended.wait()
                finally:
                    self._link = None
                    link.shutdown(ended.reason or "closed")
        finally:
            await _close(conn)

    def _report(self, up: bool, reason: str) -> None:
        """Call on_connection if ``up`` is a change (and we are not closing)."""
        if self._closed.is_set() or self._reported == up:
            return
        self._reported = up
        self._on_connection(up, reason)

    async def _pause(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less if update() or aclose() kicks us."""
        try:
            async with asyncio.timeout(delay):
                await self._kick.wait()
        except TimeoutError:
            pass

    def update(self, host: HostConfig, ssh: SshConfig, python: str) -> None:
        """Apply reloaded settings: a new address, port, user or key set reconnects now; a
        new keepalive applies to the live connection; a new python restarts the agent."""
        old_host, old_ssh, old_python = self._host, self._ssh, self._python
        self._host, self._ssh, self._python = host, ssh, python
        if ssh.max_channels_per_host != old_ssh.max_channels_per_host:
            # Callers holding the old semaphore release it; new ones queue on the new size.
            self._channels = asyncio.Semaphore(ssh.max_channels_per_host)
        changed = [
            name
            for name, old, new in (
                ("address", old_host.address, host.address),
                ("port", old_host.port, host.port),
                ("username", old_host.username or old_ssh.username, host.username or ssh.username),
                ("known_hosts", old_ssh.known_hosts, ssh.known_hosts),
                ("client_keys", old_ssh.client_keys, ssh.client_keys),
                ("connect_timeout_s", old_ssh.connect_timeout_s, ssh.connect_timeout_s),
                *(
                    (key, getattr(old_ssh, key), getattr(ssh, key))
                    for key in ("server_host_key_algs", *DEFAULT_ALGS)
                ),
            )
            if old != new
        ]
        link = self._link
        if changed:
            log.info("ssh.reconfigured", host=self.name, changed=changed)
            self._kick.set()
            if link is not None:
                link.ended.set(f"reconnecting: {', '.join(changed)} changed", reconnect_now=True)
            return
        if link is None:
            return
        keepalive = (ssh.keepalive_interval_s, ssh.keepalive_count_max)
        if keepalive != (old_ssh.keepalive_interval_s, old_ssh.keepalive_count_max):
            link.conn.set_keepalive(*keepalive)
        if python != old_python:
            link.retire_agent()

    async def _start_agent(self, link: _Link) -> None:
        """Start the connection's agent now, so that a worker's exit is pushed even before
        the daemon's next request; a failure here is the next request's to report."""
        with contextlib.suppress(RemoteError):
            await link.agent(self._python)

    def _agent_started(self, link: _Link, agent: _Agent) -> None:
        """A new agent watches no worker: whoever knows the worker is told (``watch``)."""
        if self._on_agent is not None:
            self._on_agent()

    async def watch(self, spec: LaunchSpec, pid: int, start_time: int | None) -> None:
        """Ask the agent to watch ``pid`` and push its exit (at once if it has ended); best
        effort: the exit record is the fallback, so a failure is only logged."""
        request = protocol.WatchRequest(spec=_watch_spec(spec), pid=pid, start_time=start_time)
        try:
            reply = await self._call(request, protocol.WatchReply, RPC_TIMEOUT_S)
        except RemoteError as exc:
            log.info("remote.watch_failed", host=self.name, pid=pid, reason=str(exc)[:200])
            return
        log.debug("remote.watching", host=self.name, pid=pid, reply=repr(reply)[:200])

    def _pushed(self, news: protocol.WorkerExit) -> None:
        """An exit the agent pushed: to the daemon, within a budget (the exit record is the
        durable truth, so a host that floods pushes loses only the fast path)."""
        if self._on_exit is None:
            return
        if not self._pushes.take(time.monotonic()):
            self._noise.line("agent.push_dropped", f"exit of pid {news.pid}")
            return
        # call_soon: a launch's reply is dispatched before its worker's exit, and the task
        # awaiting that reply (on the future itself: _Agent.call) was woken first; so the
        # daemon hears Launched, and launch() records the worker, then the exit.
        asyncio.get_running_loop().call_soon(self._deliver_exit, news)

    def _usage_pushed(self, news: protocol.WorkerUsage) -> None:
        """What the worker's session holds, as the agent measured it: to the daemon, within
        a budget (a host that floods them loses the extra ones)."""
        if self._on_usage is None:
            return
        if not self._usages.take(time.monotonic()):
            self._noise.line("agent.push_dropped", f"usage of pid {news.pid}")
            return
        self._on_usage(news)

    def _deliver_exit(self, news: protocol.WorkerExit) -> None:
        if self._on_exit is not None:
            self._on_exit(news)

    async def aclose(self) -> None:
        """Close the connection (bounded wait); ``maintain()`` then returns. Idempotent."""
        self._closed.set()
        self._kick.set()
        self._noise.flush()
        link = self._link
        if link is not None:
            link.ended.set("closed by the supervisor")
            await _close(link.conn)

    # --- operations -------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> Started:
        """Start the worker under a detached shepherd; returns once it is forked.

        Raises ShardHeld when a live worker holds the shard, RemoteError otherwise.
        """
        request = protocol.LaunchRequest(spec=_spec_json(spec))
        reply = await self._call(request, protocol.LaunchReply, RPC_TIMEOUT_S)
        started = Started(pid=reply.pid, start_time=reply.start_time)
        log.info("remote.launched", host=self.name, pid=started.pid, shard=spec.shard)
        return started

    async def terminate(
        self, spec: LaunchSpec, pid: int, *, grace_s: float, kill: bool
    ) -> int | None:
        """Stop ``pid`` (``agent.op_terminate``: SIGTERM to it, SIGKILL to its group after
        ``grace_s`` if ``kill``) and sweep its session; returns only once it is confirmed dead
        (or was not ours), with how many processes of its session were killed (None: not
        swept, or an agent that does not sweep); raises RemoteError otherwise."""
        request = protocol.TerminateRequest(
            spec=_spec_json(spec), pid=pid, grace_s=float(grace_s), kill=kill
        )
        reply = await self._call(request, protocol.TerminateReply, grace_s + TERMINATE_SLACK_S)
        outcome = host_text(reply.outcome)
        log.info("remote.terminated", host=self.name, pid=pid, outcome=outcome, reaped=reply.reaped)
        return reply.reaped

    async def evidence(
        self, spec: LaunchSpec, pid: int, *, timeout_s: float, stacks: str
    ) -> health.Evidence:
        """What ``pid`` is doing: its stacks (by ``stacks``) and its log's tail, as the agent
        captured them within ``timeout_s`` (``agent.op_evidence``); RemoteError if the
        agent did not answer in that time plus a little."""
        request = protocol.EvidenceRequest(
            spec=_spec_json(spec),
            pid=pid,
            timeout_s=float(timeout_s),
            stacks=stacks,
            log_bytes=protocol.LOG_TAIL_MAX,
        )
        reply = await self._call(request, protocol.EvidenceReply, timeout_s + EVIDENCE_SLACK_S)
        return evidence_of(pid, reply)

    async def start_agent(self) -> None:
        """Have this connection's agent running (the connection starts it, and starts it
        again here if that failed or it died): returns once it said hello, raises
        RemoteError if it cannot start. Nothing is asked of it: it watches no worker."""
        link = self._require_link("start the agent")
        await link.agent(self._python)

    async def probe(self, spec: LaunchSpec, pid: int | None) -> int | None:
        """The live worker of ``spec``'s shard on this host (``pid`` or the pidfile's), if
        any: alive, not a zombie, and ours by start time or command line."""
        request = protocol.ProbeRequest(spec=_spec_json(spec), pid=pid)
        reply = await self._call(request, protocol.ProbeReply, RPC_TIMEOUT_S)
        log.debug("remote.probed", host=self.name, pid=reply.pid)
        return reply.pid

    async def disarm_seed(
        self, spec: LaunchSpec, wrap_script: str, *, dry_run: bool
    ) -> protocol.DisarmSeedReply:
        """End the old script's respawn wrappers of this host (``wrap_script``), leaving its
        worker running; the agent's report (``agent.op_disarm_seed``)."""
        request = protocol.DisarmSeedRequest(
            spec=_spec_json(spec), wrap_script=wrap_script, dry_run=dry_run
        )
        return await self._call(request, protocol.DisarmSeedReply, RPC_TIMEOUT_S)

    async def run(
        self, argv: Sequence[str], *, timeout_s: float, input: str | None = None
    ) -> CommandResult:
        """Run one command (each argv element quoted) on its own channel; ``input``, if
        given, is its stdin (else stdin is empty). Keeps at most ``MAX_OUTPUT_CHARS`` of
        stdout and of stderr, and raises RemoteError past that.

        At most ``ssh.max_channels_per_host`` run at once; more callers queue. On timeout or
        cancellation the channel is closed and its slot stays taken until sshd confirms the
        close (sshd keeps a session whose command still runs), so callers never exceed
        ``MaxSessions``.
        """
        if not argv:
            raise ValueError("run() needs a command")
        command = shlex.join(argv)
        stdin = asyncssh.DEVNULL if input is None else asyncssh.PIPE
        self._require_link("run")
        channels = self._channels
        await channels.acquire()
        release = True
        process: asyncssh.SSHClientProcess[str] | None = None
        finished = False
        link: _Link | None = None
        try:
            link = self._require_link("run")
            try:
                async with asyncio.timeout(timeout_s):
                    process = await _open_process(link.conn, command, stdin=stdin)
                    if input is not None:
                        _send_input(process, input)
                    stdout, stderr = await _read_output(process)
                    await process.wait_closed()
                    finished = True  # the channel is closed both ways
            except TimeoutError:
                raise RemoteError(
                    self.name, f"{argv[0]!r} did not finish within {timeout_s:g}s"
                ) from None
            except _TooMuchOutput:
                raise RemoteError(
                    self.name, f"{argv[0]!r} wrote more than {MAX_OUTPUT_CHARS} characters"
                ) from None
            except asyncssh.ChannelOpenError as exc:
                # Refused before anything ran: the command was not started.
                raise RemoteError(self.name, f"cannot open a channel: {exc.reason}") from None
            except (asyncssh.Error, OSError) as exc:
                raise RemoteError(
                    self.name, f"{argv[0]!r}: {_describe(exc)}", connection_lost=True
                ) from None
            returncode = process.returncode
            if process.exit_status is None or returncode is None:
                # asyncssh reports a connection lost under a command as "no exit status".
                raise RemoteError(
                    self.name,
                    f"{argv[0]!r}: connection lost before it finished: {link.ended.reason}",
                    connection_lost=True,
                )
            return CommandResult(exit_status=returncode, stdout=stdout, stderr=stderr)
        finally:
            if process is not None and link is not None and not finished:
                # Cut off (timeout, cancellation): close, and keep the slot until sshd
                # confirms, which it does only when the command has exited.
                process.close()
                release = not link.spawn(_release_when_closed(process, channels))
            if release:
                channels.release()

    def _require_link(self, op: str) -> _Link:
        """The live connection; raises RemoteError(connection_lost=False) if there is none."""
        link = self._link
        if link is None or link.ended.is_set():
            raise RemoteError(self.name, f"{op}: not connected", connection_lost=False)
        return link

    async def _call(
        self, request: protocol.Request, expected: type[_Reply], timeout_s: float
    ) -> _Reply:
        """One agent request; its reply, checked field by field, or ShardHeld / RemoteError
        (a reply that is not one of the protocol's is the host's error)."""
        op = protocol.OP_NAMES[type(request)]
        link = self._require_link(op)
        agent = await link.agent(self._python)
        raw = await agent.call(op, request, timeout_s)
        try:
            reply = protocol.read_reply(raw, expected)
        except protocol.ProtocolError as exc:
            raise RemoteError(self.name, f"{op}: the agent's reply is malformed: {exc}") from None
        if isinstance(reply, protocol.Failure):
            error = host_text(reply.error) or "the agent gave no reason"
            if reply.kind == "refused":
                raise ShardHeld(self.name, error, holder_pid=reply.holder_pid)
            if reply.kind == "fenced":
                raise Fenced(self.name, f"{op}: {error}")
            raise RemoteError(self.name, f"{op}: {error}")
        if not isinstance(reply, expected):
            raise RemoteError(self.name, f"{op}: the agent answered with another kind of reply")
        return reply


# --- the connection and its agent -------------------------------------------------------


class _Ended:
    """Why and whether a connection ended; set once, by whoever notices first."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason = ""
        self.reconnect_now = False

    def is_set(self) -> bool:
        """The connection has ended."""
        return self._event.is_set()

    def set(self, reason: str, *, reconnect_now: bool = False) -> None:
        """End it for ``reason``; the first reason given wins."""
        if not self._event.is_set():
            self.reason = reason
            self.reconnect_now = reconnect_now
            self._event.set()

    async def wait(self) -> None:
        """Until it has ended."""
        await self._event.wait()


class _ConnectFailed(Exception):
    """A connection attempt failed; ``reason`` says why in an operator's words."""

    def __init__(self, reason: str, kind: FailureKind) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class _Client(asyncssh.SSHClient):
    """Turns asyncssh's connection-lost callback into ``_Ended``."""

    def __init__(self, ended: _Ended) -> None:
        self._ended = ended

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncssh's callback: the connection is gone, with ``exc`` as the cause."""
        self._ended.set(f"connection lost: {_describe(exc)}" if exc else "connection closed")


class _Link:
    """A live connection, the tasks that hang on it, and its agent."""

    def __init__(
        self,
        host: str,
        conn: asyncssh.SSHClientConnection,
        ended: _Ended,
        tasks: asyncio.TaskGroup,
        noise: NoiseLog,
    ) -> None:
        self.host = host
        self.conn = conn
        self.ended = ended
        self.noise = noise
        self._tasks = tasks
        self._running: set[asyncio.Task[None]] = set()
        self._agent: _Agent | None = None
        self._agent_lock = asyncio.Lock()
        #: Called with each exit an agent of this connection pushes.
        self.on_push: Callable[[protocol.WorkerExit], None] | None = None
        #: Called with each usage an agent of this connection pushes.
        self.on_usage: Callable[[protocol.WorkerUsage], None] | None = None
        #: Called with each agent started on this connection.
        self.on_agent: Callable[[_Link, _Agent], None] | None = None

    def spawn(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run ``coro`` for the life of the connection; False (and closed) if it ended."""
        if self.ended.is_set():
            coro.close()
            return False
        task = self._tasks.create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return True

    async def agent(self, python: str) -> _Agent:
        """The running agent, started first if there is none (or it died)."""
        async with self._agent_lock:
            if self._agent is not None and self._agent.accepting:
                if self._agent.python == python:
                    return self._agent
                # Started with the python of before a reload (it was starting when the
                # reload retired agents): the new python's agent takes over.
                self._agent.retire()
                self._agent = None
            if self.ended.is_set():
                raise RemoteError(self.host, f"not connected: {self.ended.reason}")
            agent = await _Agent.start(self, python)
            self._agent = agent
            if self.on_agent is not None:
                self.on_agent(self, agent)
            return agent

    def retire_agent(self) -> None:
        """New requests go to a new agent; this one finishes what it has, then exits."""
        if self._agent is not None:
            self._agent.retire()
            self._agent = None

    def shutdown(self, reason: str) -> None:
        """Fail what is in flight and stop every task of this connection."""
        if self._agent is not None:
            self._agent.close(reason)
        for task in self._running:
            task.cancel()


class _Lines:
    """The lines of one stream of a channel, without their newlines (and the last, at EOF,
    even without one), split here rather than by asyncssh's readline (``READ_CHUNK_CHARS``).
    A line is kept to ``limit + 1`` characters: the rest of a longer one is dropped as it
    comes, and what is kept is enough to tell it was too long."""

    def __init__(self, stream: asyncssh.SSHReader[str], limit: int) -> None:
        self._stream = stream
        self._limit = limit
        #: The start of the line not yet ended, and its whole length so far.
        self._head: list[str] = []
        self._length = 0
        self._eof = False
        self._full = False  # the last read filled a whole chunk
        self._ready: list[str] = []

    def unread(self, lines: list[str]) -> None:
        """Give ``lines`` back: the next ``batch()`` returns them first."""
        self._ready[:0] = lines

    async def batch(self) -> list[str] | None:
        """The next lines: those given back, else those ended by the next read (maybe none,
        as a read may end none); None at EOF. Lets the loop run before each read, so a host
        never holds it for longer than one read's lines."""
        if self._ready:
            lines, self._ready = self._ready, []
            return lines
        if self._eof:
            return None
        if self._full:
            # The last read filled the chunk, so more may be buffered, and a read of buffered
            # data returns without letting the loop run. After a shorter one the buffer is
            # empty and the read waits (yields) anyway: a reply or push is not held up.
            await asyncio.sleep(0)
        chunk = await self._stream.read(READ_CHUNK_CHARS)
        self._full = len(chunk) >= READ_CHUNK_CHARS
        if not chunk:
            self._eof = True
            return [self._end("")] if self._length else None
        pieces = chunk.split("\n")
        if len(pieces) == 1:
            self._add(chunk)
            return []
        limit = self._limit + 1
        lines = [self._end(pieces[0])]
        lines.extend(piece[:limit] for piece in pieces[1:-1])
        self._add(pieces[-1])
        return lines

    def _add(self, piece: str) -> None:
        room = self._limit + 1 - self._length
        if room > 0 and piece:
            self._head.append(piece[:room])
        self._length += len(piece)

    def _end(self, piece: str) -> str:
        self._add(piece)
        line = "".join(self._head)
        self._head, self._length = [], 0
        return line


class _Agent:
    """The agent on one channel: requests out, replies matched to them by id."""

    def __init__(self, link: _Link, process: asyncssh.SSHClientProcess[str]) -> None:
        self._link = link
        self._host = link.host
        self._process = process
        self._stdout = _Lines(process.stdout, MAX_REPLY_CHARS)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._stderr: deque[str] = deque(maxlen=20)
        self._retiring = False
        self._checking = False
        #: The interpreter it runs on (a reload may name another).
        self.python = ""
        self.closed_reason: str | None = None
        self.hello: protocol.Hello | None = None

    @property
    def accepting(self) -> bool:
        """New requests may be sent."""
        return self.closed_reason is None and not self._retiring

    @classmethod
    async def start(cls, link: _Link, python: str) -> _Agent:
        """Open the channel, run the agent and wait for its hello, all within
        ``AGENT_START_TIMEOUT_S``. A channel open left unanswered so long ends the connection:
        a server that answers keepalives but no opens would hold every request (and the
        launch slot of the fleet's budget a launch takes) for ever."""
        deadline = asyncio.get_running_loop().time() + AGENT_START_TIMEOUT_S
        try:
            async with asyncio.timeout_at(deadline):
                process = await _open_process(link.conn, agent_command(python), stdin=asyncssh.PIPE)
        except TimeoutError:
            why = (
                f"the agent's channel did not open within {AGENT_START_TIMEOUT_S:g}s:"
                " connection presumed dead"
            )
            log.warning("ssh.unresponsive", host=link.host, reason=why)
            link.ended.set(why, reconnect_now=True)
            raise RemoteError(link.host, f"cannot start the agent: {why}") from None
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(link.host, f"cannot start the agent: {_describe(exc)}") from None
        agent = cls(link, process)
        agent.python = python
        try:
            async with asyncio.timeout_at(deadline):
                message = await agent._read_hello()
        except TimeoutError:
            process.close()
            raise RemoteError(
                link.host, f"the agent did not start within {AGENT_START_TIMEOUT_S:g}s"
            ) from None
        except (asyncssh.Error, OSError, ValueError) as exc:
            process.close()
            raise RemoteError(link.host, f"the agent did not start: {_describe(exc)}") from None
        except BaseException:
            process.close()
            raise
        if message is None:
            raise RemoteError(link.host, await agent._failed_start())
        agent.hello = message
        log.info(
            "agent.started",
            host=link.host,
            python=python,
            agent_pid=message.pid,
            python_version=host_text(message.python, 100),
        )
        if not (link.spawn(agent._read_replies()) and link.spawn(agent._read_stderr())):
            agent.close(link.ended.reason)
        return agent

    async def _read_hello(self) -> protocol.Hello | None:
        """The agent's hello, skipping whatever the user's rc files print first; None at EOF."""
        while (lines := await self._stdout.batch()) is not None:
            for at, line in enumerate(lines):
                message: object = None
                if len(line) <= MAX_REPLY_CHARS:
                    with contextlib.suppress(ValueError, RecursionError):
                        message = json.loads(line)
                hello = protocol.read_hello(message)
                if hello is not None:
                    self._stdout.unread(lines[at + 1 :])  # replies and pushes, read next
                    return hello
                self._stderr.append(line.rstrip()[:MAX_NOISE_CHARS])
        return None

    async def _failed_start(self) -> str:
        """Why the agent said no hello: its exit status and what it printed."""
        self._process.close()
        try:
            async with asyncio.timeout(2.0):
                said = await self._process.stderr.read(MAX_FAILED_START_CHARS)
                self._stderr.extend(line[:MAX_NOISE_CHARS] for line in said.splitlines())
                await self._process.wait_closed()
        except (TimeoutError, asyncssh.Error, OSError):
            pass
        text = " ".join(" ".join(self._stderr).split())[-1000:]
        return f"the agent did not start (exit status {self._process.exit_status}): {text or '-'}"

    async def call(self, op: str, request: protocol.Request, timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its reply line (decoded, not yet checked)."""
        if not self.accepting:
            raise RemoteError(self._host, f"{op}: agent gone: {self.closed_reason or 'retired'}")
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = (op, future)
        # A timer, not asyncio.wait: awaiting the future itself wakes this task at the next
        # turn of the loop, ahead of an exit pushed right behind the reply (_pushed).
        check = None if op == "ping" else loop.call_later(CHECK_AFTER_S, self._check_channel)
        try:
            self._process.stdin.write(protocol.request_line(rid, request))
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise RemoteError(
                self._host, f"{op}: no reply within {timeout_s:g}s; outcome unknown"
            ) from None
        except (asyncssh.Error, OSError) as exc:
            raise RemoteError(
                self._host, f"{op}: outcome unknown: {_describe(exc)}", connection_lost=True
            ) from None
        finally:
            if check is not None:
                check.cancel()
            self._pending.pop(rid, None)
            if self._retiring and not self._pending:
                self.close("retired")

    def _check_channel(self) -> None:
        """A request is slow to answer: ping the agent (it answers each request in a thread
        of its own, so at once if the channel lives); no answer within ``CHECK_TIMEOUT_S``
        ends the connection. The keepalives may be far apart on a large fleet; this finds
        a dead connection the moment something is asked of it."""
        if self._checking or not self.accepting:
            return
        self._checking = True
        self._link.spawn(self._ping_or_end())

    async def _ping_or_end(self) -> None:
        try:
            await self.call("ping", protocol.PingRequest(), CHECK_TIMEOUT_S)
        except RemoteError as exc:
            if not exc.connection_lost and self.closed_reason is None:
                why = f"no answer to a ping within {CHECK_TIMEOUT_S:g}s: connection presumed dead"
                log.warning("ssh.unresponsive", host=self._host, reason=why)
                self._link.ended.set(why, reconnect_now=True)
        finally:
            self._checking = False

    def retire(self) -> None:
        """Take no new requests; close once the pending ones are answered."""
        self._retiring = True
        if not self._pending:
            self.close("retired")

    def close(self, reason: str) -> None:
        """Fail every pending request (outcome unknown) and close the channel."""
        if self.closed_reason is None:
            self.closed_reason = reason
        pending, self._pending = self._pending, {}
        for op, future in pending.values():
            if not future.done():
                future.set_exception(
                    RemoteError(
                        self._host, f"{op}: outcome unknown: {reason}", connection_lost=True
                    )
                )
        self._process.close()

    async def _read_replies(self) -> None:
        """Hand each reply to its caller until the channel ends; then fail the rest."""
        reason = "the agent channel closed"
        try:
            while (lines := await self._stdout.batch()) is not None:
                for line in lines:
                    self._dispatch(line)
        except (asyncssh.Error, OSError) as exc:
            reason = f"the agent channel failed: {_describe(exc)}"
        except Exception as exc:  # task root: whatever a host sends ends its agent, nothing more
            log.exception("agent.failed", host=self._host)
            reason = f"the agent channel failed: internal error: {_describe(exc)}"
        finally:
            if self._link.ended.is_set():
                reason = self._link.ended.reason
            elif self._stderr:
                reason = f"{reason}; it said: {self._stderr[-1]}"
            self.close(reason)
        if self.closed_reason not in ("retired",):
            log.warning("agent.closed", host=self._host, reason=self.closed_reason)

    def _dispatch(self, line: str) -> None:
        """Resolve the request ``line`` answers; anything else is logged as noise."""
        parsed = parse_reply(line)
        if parsed is None:
            news = parse_push(line)
            if isinstance(news, protocol.WorkerExit):
                if self._link.on_push is not None:
                    self._link.on_push(news)
            elif isinstance(news, protocol.WorkerUsage):
                if self._link.on_usage is not None:
                    self._link.on_usage(news)
            elif news is not None:
                self._link.noise.line("agent.bad_push", f"{news}: {line[:MAX_NOISE_CHARS]}")
            else:
                self._link.noise.line("agent.noise", line[:MAX_NOISE_CHARS])
            return
        rid, reply = parsed
        entry = self._pending.pop(rid, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(reply)

    async def _read_stderr(self) -> None:
        """Log what the agent says on stderr and keep the last lines for error messages."""
        try:
            stderr = _Lines(self._process.stderr, MAX_NOISE_CHARS)
            while (lines := await stderr.batch()) is not None:
                for line in lines:
                    line = line.rstrip()[:MAX_NOISE_CHARS]
                    self._stderr.append(line)
                    self._link.noise.line("agent.stderr", line)
        except (asyncssh.Error, OSError):
            return  # the stdout reader reports why the channel ended


def _send_input(process: asyncssh.SSHClientProcess[str], text: str) -> None:
    """Write a command's whole stdin, then EOF. A command that exits without reading it
    (``python`` not found: the shell's exit 127) closes the channel first; that is no lost
    connection, and its exit status, read next, says what happened."""
    try:
        process.stdin.write(text)
        process.stdin.write_eof()
    except BrokenPipeError:
        pass


async def _open_process(
    conn: asyncssh.SSHClientConnection, command: str, *, stdin: Any
) -> asyncssh.SSHClientProcess[str]:
    """A process on a new channel; retries sshd's transient "open failed" refusals."""
    for delay in OPEN_RETRY_DELAYS_S:
        try:
            process: asyncssh.SSHClientProcess[str] = await conn.create_process(
                command, stdin=stdin, encoding="utf-8", errors="replace"
            )
        except asyncssh.ChannelOpenError as exc:
            if exc.code != asyncssh.OPEN_CONNECT_FAILED:
                raise
            log.debug("ssh.open_refused", reason=exc.reason, retry_in_s=delay)
            await asyncio.sleep(delay)
        else:
            return process
    process = await conn.create_process(command, stdin=stdin, encoding="utf-8", errors="replace")
    return process


class _TooMuchOutput(Exception):
    """A command wrote more than ``MAX_OUTPUT_CHARS`` to one stream."""


async def _read_capped(stream: asyncssh.SSHReader[str]) -> str:
    """Everything ``stream`` carries until EOF; _TooMuchOutput past ``MAX_OUTPUT_CHARS``."""
    chunks: list[str] = []
    size = 0
    while chunk := await stream.read(65536):
        size += len(chunk)
        if size > MAX_OUTPUT_CHARS:
            raise _TooMuchOutput
        chunks.append(chunk)
    return "".join(chunks)


async def _read_output(process: asyncssh.SSHClientProcess[str]) -> tuple[str, str]:
    """A command's stdout and stderr, read together: a command that fills one stream while
    we wait on the other would stall on the channel's window."""
    out = asyncio.ensure_future(_read_capped(process.stdout))
    err = asyncio.ensure_future(_read_capped(process.stderr))
    try:
        stdout, stderr = await asyncio.gather(out, err)
    finally:
        out.cancel()
        err.cancel()
    return stdout, stderr


async def _release_when_closed(
    process: asyncssh.SSHClientProcess[str], channels: asyncio.Semaphore
) -> None:
    """Give a channel slot back once sshd has really closed the session."""
    try:
        await process.wait_closed()
    finally:
        channels.release()


async def _close(conn: asyncssh.SSHClientConnection) -> None:
    """Close ``conn``; abort it if the peer does not answer in time."""
    conn.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await conn.wait_closed()
    except TimeoutError:
        conn.abort()


# Parsed known_hosts and client keys, shared by every host and re-read only when a file
# changes. asyncssh parses what it is given as paths on every connect, on the event loop:
# a fleet's known_hosts has a line per host, and 1000 connects each parsing 1000 lines cost
# more CPU than the handshakes themselves (bench/bench_connect.py). One stat per connect
# keeps the old behaviour: an edited file takes effect at the next connect.
_FileStamp = tuple[int, int, int, int, int]
_known_hosts_cache: dict[Path, tuple[_FileStamp, asyncssh.SSHKnownHosts]] = {}
_client_keys_cache: dict[
    tuple[Path, ...], tuple[tuple[_FileStamp | None, ...], list[asyncssh.SSHKeyPair]]
] = {}


def _stamp(path: Path) -> _FileStamp:
    """What changes when a file is edited or replaced; raises OSError if it is unreadable."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _stamp_or_none(path: Path) -> _FileStamp | None:
    try:
        return _stamp(path)
    except OSError:
        return None


def connect_options(host: HostConfig, ssh: SshConfig) -> dict[str, Any]:
    """``asyncssh.connect``'s options for ``host`` but its address, port and client factory:
    the daemon's, which ``bench/floor.py`` shares to measure the same connections."""
    return {
        "username": host.username or ssh.username,
        "known_hosts": _trusted_hosts(ssh.known_hosts),
        "client_keys": _client_keys(ssh.client_keys),
        # Nothing from $HOME: no ~/.ssh/config, agent, default keys or CAs.
        "config": None,
        "agent_path": None,
        "x509_trusted_certs": None,
        "gss_host": None,
        **algorithm_options(ssh),
        "keepalive_interval": ssh.keepalive_interval_s,
        "keepalive_count_max": ssh.keepalive_count_max,
        "connect_timeout": ssh.connect_timeout_s,
        "login_timeout": ssh.connect_timeout_s,
    }


def algorithm_options(ssh: SshConfig) -> dict[str, Any]:
    """``asyncssh.connect``'s algorithm lists: the config's where set, else the defaults."""
    options: dict[str, Any] = {
        key: list(getattr(ssh, key) or default) for key, default in DEFAULT_ALGS.items()
    }
    # A string with a leading "-" removes from asyncssh's per-host default (OpenSSH's syntax).
    options["server_host_key_algs"] = list(ssh.server_host_key_algs or ()) or WEAK_HOST_KEY_ALGS
    return options


def _trusted_hosts(path: Path) -> Callable[[str, str, int | None], _Trusted]:
    """asyncssh's known_hosts lookup for ``path`` (parsed, from the cache while the file is
    unchanged), matching as OpenSSH matches (``known_hosts_name``)."""
    parsed = _parsed_known_hosts(path)

    def trusted(host: str, addr: str, port: int | None) -> _Trusted:
        return _trusted_keys(parsed, host, port)

    return trusted


def _parsed_known_hosts(path: Path) -> asyncssh.SSHKnownHosts:
    """``path`` parsed, from the cache while the file is unchanged."""
    stamp = _stamp(path)
    hit = _known_hosts_cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    parsed = asyncssh.read_known_hosts(str(path))
    _known_hosts_cache[path] = (stamp, parsed)
    return parsed


#: What a known_hosts lookup gives asyncssh: trusted keys, CA keys, revoked keys, then X.509
#: certificates, revoked ones, subject names and revoked ones.
_Trusted = tuple[
    Sequence[asyncssh.SSHKey],
    Sequence[asyncssh.SSHKey],
    Sequence[asyncssh.SSHKey],
    Sequence[Any],
    Sequence[Any],
    Sequence[Any],
    Sequence[Any],
]


def known_hosts_name(address: str, port: int) -> str:
    """The name a known_hosts line must carry for ``address:port``, as OpenSSH writes and
    looks it up: the bare address on port 22, ``[address]:port`` on any other."""
    return address if port == DEFAULT_SSH_PORT else f"[{address}]:{port}"


def _trusted_keys(parsed: asyncssh.SSHKnownHosts, host: str, port: int | None) -> _Trusted:
    """The keys ``parsed`` trusts for ``host`` on ``port`` (None: asyncssh's way of saying
    22), by OpenSSH's rule (``sshconnect.c``, ``check_host_key``), not asyncssh's.

    OpenSSH looks the host up under the name it was given: ``[name]:port`` on a port other
    than 22, in plain or hashed (``|1|``) lines alike; when no line has that name, it tries
    the bare name (a line written for port 22). It never trusts a key for the address the
    name resolved to (``CheckHostIP`` only adds warnings, and is off since 8.5). asyncssh
    also matches that address: a host configured as ``worker-3`` would be trusted by a line
    for ``10.0.0.13``, which OpenSSH refuses. So asyncssh is asked about the name alone,
    with no address, one name at a time. X.509 is off (``x509_trusted_certs=None``): its
    entries are not passed on.
    """
    name = known_hosts_name(host, port or DEFAULT_SSH_PORT)
    keys, ca_keys, revoked, *_ = parsed.match(name, "", None)
    if not (keys or ca_keys) and name != host:
        keys, ca_keys, bare_revoked, *_ = parsed.match(host, "", None)
        revoked = [*revoked, *bare_revoked]
    return (keys, ca_keys, revoked, (), (), (), ())


def _client_keys(paths: tuple[Path, ...]) -> list[asyncssh.SSHKeyPair] | None:
    """The key pairs (and certificates beside them, as asyncssh finds them) of ``paths``,
    from the cache while the files are unchanged; None when no key is configured."""
    if not paths:
        return None
    stamps = tuple(
        stamp
        for path in paths
        for stamp in (_stamp(path), _stamp_or_none(Path(f"{path}-cert.pub")))
    )
    hit = _client_keys_cache.get(paths)
    if hit is not None and hit[0] == stamps:
        return hit[1]
    pairs = list(asyncssh.load_keypairs([str(path) for path in paths]))
    _client_keys_cache[paths] = (stamps, pairs)
    return pairs


@dataclass(frozen=True, slots=True)
class HostKey:
    """A host's public key: its type, its text as a known_hosts line carries it, and its
    fingerprint as ``ssh-keygen -lf`` prints it on the host."""

    algorithm: str
    text: str
    fingerprint: str


def _host_key(key: asyncssh.SSHKey) -> HostKey:
    text = " ".join(key.export_public_key("openssh").decode("ascii").split()[:2])
    return HostKey(key.get_algorithm(), text, key.get_fingerprint("sha256"))


def known_host_keys(known_hosts: Path, address: str, port: int) -> list[HostKey]:
    """The host keys ``known_hosts`` trusts for ``address:port``, as a connection would
    (OpenSSH's lookup, ``_trusted_keys``). Raises OSError or ValueError for a file that
    cannot be read or parsed."""
    keys = _trusted_keys(_parsed_known_hosts(known_hosts), address, port)[0]
    return [_host_key(key) for key in keys]


#: The host key types ``scan_host_keys`` asks for, one handshake each (ssh-keyscan's too).
SCAN_KEY_ALGS: Final = ("ssh-ed25519", "ecdsa-sha2-nistp256", "rsa-sha2-512")


async def scan_host_keys(address: str, port: int, timeout_s: float) -> list[HostKey]:
    """The host keys ``address:port`` shows, one handshake per type in SCAN_KEY_ALGS (a type
    the host lacks is skipped); nothing is trusted or logged in to. Raises RemoteError when
    the host shows none (it cannot be reached, or is not an SSH server)."""
    found: list[HostKey] = []
    why = "no host key of any type asked for"
    for alg in SCAN_KEY_ALGS:
        try:
            async with asyncio.timeout(timeout_s):
                key = await asyncssh.get_server_host_key(
                    address, port, server_host_key_algs=[alg], config=None
                )
        except asyncssh.KeyExchangeFailed as exc:
            why = _describe(exc)
            continue  # the host has no key of this type
        except TimeoutError:
            why = f"no SSH handshake within {timeout_s:g}s"
            break
        except ConnectionRefusedError:
            why = "connection refused"
            break
        except OSError as exc:
            why = exc.strerror or str(exc)
            break
        except asyncssh.Error as exc:
            why = _describe(exc)
            break
        if key is not None and all(k.text != _host_key(key).text for k in found):
            found.append(_host_key(key))
    if not found:
        raise RemoteError(f"{address}:{port}", why)
    return found


def host_key_advice(known_hosts: Path, address: str, port: int) -> str:
    """What to put in ``known_hosts`` so that ``address:port`` is trusted: the line's form
    (OpenSSH's), and why a line the file has for the host does not count."""
    name = known_hosts_name(address, port)
    scan = "reward-supervisor init --scan shows the key and its fingerprint, to check on the host"
    try:
        parsed = _parsed_known_hosts(known_hosts)
    except (OSError, ValueError):
        return f"it needs a line '{name} KEYTYPE KEY'; {scan}"
    if _trusted_keys(parsed, address, port)[0]:
        return (
            f"the key it has for {address} on port {port} is not the one the host showed: the"
            " host's key changed, or this is not that host; check on the host before"
            " replacing the line (a changed key is never accepted)"
        )
    return (
        f"it has no line for '{name}' (OpenSSH's form; a line for the address a name"
        f" resolves to does not count, as in OpenSSH); {scan}"
    )


def _spec_json(spec: LaunchSpec) -> dict[str, Any]:
    """The launch spec as the agent reads it."""
    data = {f.name: getattr(spec, f.name) for f in fields(spec)}
    data["argv"] = list(spec.argv)
    data["env"] = dict(spec.env)
    return data


def _watch_spec(spec: LaunchSpec) -> dict[str, str]:
    """What of the spec a watch reads: where the worker's exit record is."""
    return {"root": spec.root, "exit_record": spec.exit_record}


def _describe(exc: BaseException | None) -> str:
    """The short reason of an exception."""
    if exc is None:
        return "closed"
    # Bounded: an asyncssh error's reason can be text the peer sent.
    if isinstance(exc, asyncssh.Error):
        return (exc.reason or type(exc).__name__)[:MAX_NOISE_CHARS]
    return (str(exc) or type(exc).__name__)[:MAX_NOISE_CHARS]


def _failure_kind(exc: BaseException) -> FailureKind:
    """The kind of a failed connection attempt (``_connect_failure`` says it in words)."""
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return FailureKind.HOST_KEY
    if isinstance(exc, asyncssh.PermissionDenied):
        return FailureKind.LOGIN
    if isinstance(exc, TimeoutError):
        return FailureKind.TIMEOUT
    # A missing or unreadable key file is ours to fix, not the network's.
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | PermissionError):
        return FailureKind.UNREACHABLE
    return FailureKind.OTHER


def _connect_failure(exc: BaseException, host: HostConfig, ssh: SshConfig) -> str:
    """One line an operator can act on."""
    where = f"{host.address}:{host.port}"
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return (
            f"host key of {where} is not trusted by {ssh.known_hosts} ({exc.reason});"
            f" {host_key_advice(ssh.known_hosts, host.address, host.port)}"
        )
    if isinstance(exc, asyncssh.PermissionDenied):
        user = host.username or ssh.username
        return f"{where} refused our keys for user {user}: {exc.reason}"
    if isinstance(exc, asyncssh.Error):
        return f"{where}: {_describe(exc)}"
    if isinstance(exc, TimeoutError):
        return f"{where}: no SSH handshake within {ssh.connect_timeout_s:g}s"
    if isinstance(exc, ConnectionRefusedError):
        return f"{where}: connection refused"
    if isinstance(exc, FileNotFoundError):
        return f"cannot read {exc.filename}: {exc.strerror}"
    if isinstance(exc, OSError):
        return f"{where}: {exc.strerror or exc}"
    return f"{where}: {type(exc).__name__}: {exc}"
