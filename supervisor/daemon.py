"""The I/O shell: turns files, SSH, timers, signals and operators into events for the fleet
core, and performs the actions it returns.

Everything goes through one queue (``_Inbox``): inputs and the results of actions alike. One
task, the interpreter, takes what is queued as a batch, hands it to ``Fleet.step`` and
performs the actions in order; an adapter never calls the core, it queues its result. So
the core is entered by one caller, one batch at a time, and decides everything: this module
has no ``if`` about health or the fleet (docs/ARCHITECTURE.md).

Leadership (the run lock, the epoch, a standby's wait, the handover) is the third core's,
``leadership.py``: ``_lead`` feeds it one event at a time (an event that comes while its
actions are performed waits its turn), its one timer wakes it at ``deadline_at``, and its
I/O runs in tasks that answer with events. It outlives the fleet at both ends (a standby
has no fleet yet; a handover holds off after the fleet is gone), so it is not fed through
the fleet's queue; the fleet hears of it by events (``Booted``, ``LeadershipEnded``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol, assert_never

import structlog

from supervisor import config as config_mod
from supervisor import fleet, health, layout, leadership, logs, page, runfiles, tasks, view
from supervisor.agent import WorkerExit
from supervisor.config import Config, HostConfig, SshConfig
from supervisor.control import ControlServer, EventHub, EventSubscription
from supervisor.errors import (
    ConfigError,
    ControlError,
    Fenced,
    RemoteError,
    RunLocked,
    ShardHeld,
)
from supervisor.layout import LaunchSpec
from supervisor.metrics import Metrics, detail_on_loop, snapshot_on_loop
from supervisor.mounts import check_filesystem
from supervisor.notify import Notifier, NotifierProtocol
from supervisor.statusfiles import (
    ExitObserved,
    ExitRecord,
    Observation,
    SentinelObserved,
    StatusObserved,
    StatusProblem,
)
from supervisor.watch import Watcher, WatcherProtocol

log = structlog.get_logger("supervisor.daemon")

__version__: Final = "0.1.0"

# How often dirty restart history is written to ctl/: often enough that a SIGKILL loses at
# most this much backoff state, rarely enough to cost nothing on NFS.
PERSIST_INTERVAL_S: Final = 0.5
# STATUS= is for people; one summary per 0.1 s of changes is as current as anyone reads it.
STATUS_COALESCE_S: Final = 0.1
# A statvfs of a healthy mount answers in milliseconds; one this slow is a hung mount.
FS_CHECK_TIMEOUT_S: Final = 5.0
#: How often the whole heap is collected, on our schedule (``_collect_loop``).
FULL_COLLECTION_INTERVAL_S: Final = 3600.0
#: A connection task that failed (a bug, not a network fault: those it handles itself) is
#: started again after this pause, so one host's fault never becomes a busy loop.
MAINTAIN_RETRY_S: Final = 5.0
#: A failed read of a joining host's files is tried again after this pause: the host must
#: not join before its stop sentinel is known.
SCAN_RETRY_S: Final = 1.0
#: What the stopping daemon waits for one file operation on the run root (its history, its
#: lock), and the exiting process for its I/O threads: on a hung mount (a dead NFS server,
#: a stopped FUSE server) they never return, and a stop must still end the process.
SHUTDOWN_IO_TIMEOUT_S: Final = 5.0
#: The names of the threads ``asyncio.to_thread`` runs file operations in (``run_process``).
IO_THREAD_PREFIX: Final = "rs-io"
#: A standby's agent that failed to start (the host's python broken, say) is started again
#: after this pause, while its connection is up.
WARM_RETRY_S: Final = 5.0
#: The agent bounds an evidence capture itself; this covers the round trip around it, so a
#: host that never answers holds the terminate back no longer than the capture could.
EVIDENCE_SLACK_S: Final = 2.0


class RemoteLike(Protocol):
    """What the daemon needs of one host's SSH side (``remote.RemoteHost`` fits)."""

    @property
    def connected(self) -> bool: ...

    async def maintain(self) -> None: ...

    def update(self, host: HostConfig, ssh: SshConfig, python: str) -> None: ...

    async def launch(self, spec: LaunchSpec) -> Any: ...

    async def terminate(
        self, spec: LaunchSpec, pid: int, *, grace_s: float, kill: bool
    ) -> int | None: ...

    async def start_agent(self) -> None: ...

    async def probe(self, spec: LaunchSpec, pid: int | None) -> int | None: ...

    async def evidence(
        self, spec: LaunchSpec, pid: int, *, timeout_s: float, stacks: str
    ) -> health.Evidence: ...

    async def aclose(self) -> None: ...


RemoteFactory = Callable[
    [
        HostConfig,
        SshConfig,
        str,
        asyncio.Semaphore,
        Callable[[bool, str], None],
        Callable[[WorkerExit], None],
    ],
    RemoteLike,
]
WatcherFactory = Callable[[Config], WatcherProtocol]


def default_remote_factory(
    host: HostConfig,
    ssh: SshConfig,
    python: str,
    handshakes: asyncio.Semaphore,
    on_connection: Callable[[bool, str], None],
    on_exit: Callable[[WorkerExit], None],
) -> RemoteLike:
    """A real ``RemoteHost`` over asyncssh."""
    from supervisor.remote import RemoteHost

    return RemoteHost(
        host,
        ssh,
        python=python,
        handshakes=handshakes,
        on_connection=on_connection,
        on_exit=on_exit,
    )


def default_watcher_factory(config: Config) -> Watcher:
    """A real watchfiles-backed ``Watcher`` on the run root, watching no host yet."""
    w = config.watch
    return Watcher(
        config.run.root,
        (),
        mode=w.mode,
        poll_interval_s=w.poll_interval_s,
        debounce_ms=w.debounce_ms,
        rescan_interval_s=w.rescan_interval_s,
    )


class _Inbox:
    """The one queue of events: every input and every action's result goes through it."""

    def __init__(self) -> None:
        self._items: deque[fleet.Event] = deque()
        self._ready = asyncio.Event()

    def put(self, event: fleet.Event) -> None:
        """Queue one event."""
        self._items.append(event)
        self._ready.set()

    def put_all(self, events: Iterable[fleet.Event]) -> None:
        """Queue events to be taken in this order, in one batch where possible."""
        self._items.extend(events)
        self._ready.set()

    async def take(self) -> list[fleet.Event]:
        """Everything queued so far (waits for at least one event)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        batch = list(self._items)
        self._items.clear()
        return batch


@dataclass
class _Link:
    """One member's outside world: its config, connection, and the tasks acting for it."""

    cfg: HostConfig
    remote: RemoteLike
    maintain: asyncio.Task[None] | None = None
    ops: set[asyncio.Task[None]] = field(default_factory=set)

    def cancel_tasks(self) -> None:
        """Stop everything that acts for this host."""
        if self.maintain is not None:
            self.maintain.cancel()
        for task in self.ops:
            task.cancel()


@dataclass
class _Warm:
    """A standby's connection to one host, kept ready for the takeover: connected and its
    agent started, so that taking over costs no SSH handshake and no agent start. Nothing
    is asked of the agent: a probe's answer would be stale by the takeover (whose own probe
    is what counts), and the agent would watch the leader's worker and push its exit here."""

    cfg: HostConfig
    remote: RemoteLike
    maintain: asyncio.Task[None] | None = None
    warmer: asyncio.Task[None] | None = None
    #: The connection's last reported state (None: no outcome yet) and why.
    up: bool | None = None
    reason: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Its agent has started (and said hello) on some connection.
    agent_started: bool = False

    def cancel_tasks(self) -> None:
        """Stop everything that acts for this host."""
        for task in (self.maintain, self.warmer):
            if task is not None:
                task.cancel()


class Daemon:
    """``reward-supervisor run``: one run, many hosts, until SIGTERM."""

    def __init__(
        self,
        config: Config,
        *,
        notifier: NotifierProtocol | None = None,
        remote_factory: RemoteFactory = default_remote_factory,
        watcher_factory: WatcherFactory = default_watcher_factory,
    ) -> None:
        self._config = config
        self._notifier: NotifierProtocol = notifier or Notifier()
        self._remote_factory = remote_factory
        self._fleet = fleet.Fleet(config_mod.members(config), config.health, config.fleet)
        self._links: dict[str, _Link] = {}
        # Every host of every config loaded: a host joins (Connect) with the settings of
        # the config the core admitted it under, even while a newer one is being applied.
        self._host_configs: dict[str, HostConfig] = {h.name: h for h in config.hosts}
        self._watcher = watcher_factory(config)
        self._handshakes = asyncio.Semaphore(config.ssh.max_concurrent_handshakes)
        self._inbox = _Inbox()
        self._timer: asyncio.TimerHandle | None = None
        self._tokens = itertools.count(1)
        self._replies: dict[int, asyncio.Future[fleet.Reply]] = {}
        self._events = EventHub()
        self._stop_requested = False
        self._reload_wanted = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._publish_pending = False
        self._history_dirty = asyncio.Event()  # set when restart history needs saving
        self._history_encoder = runfiles.HistoryEncoder()
        self._summary = ""
        self._started_wall = time.time()
        self._started_at = 0.0
        self._open_file_limit = 0  # known once run() has raised it
        self._ready = False
        self._reloads = 0
        self._last_reload_error: list[str] = []
        self._tg: asyncio.TaskGroup | None = None
        self._tearing_down = False
        self._run_lock: int | None = None
        self._diagnosis: asyncio.Task[None] | None = None
        self._collector: asyncio.Task[None] | None = None
        self._metrics: Metrics | None = None
        self._pointer_written_wall: float | None = None
        # High availability (docs/OPERATIONS.md): the leadership core, what it is fed while
        # its actions are performed, its timer, its I/O and its answers to commands.
        self._leadership = leadership.new()
        self._lead_queue: deque[leadership.Event] = deque()
        self._lead_stepping = False
        self._lead_timer: asyncio.TimerHandle | None = None
        self._lead_ops: set[asyncio.Task[None]] = set()
        self._lead_replies: dict[int, leadership.Reply] = {}
        self._lead_over = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        # A standby's warm connections and its view of the run directory.
        self._warm: dict[str, _Warm] = {}
        self._standby_view: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------
    # Life cycle

    async def run(self) -> int:
        """Serve until asked to stop; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        self._open_file_limit = raise_open_file_limit()
        log.info(
            "daemon.starting",
            version=__version__,
            config=str(self._config.source),
            root=str(self._config.run.root),
            hosts=len(self._config.hosts),
            pid=os.getpid(),
            standby=self._config.ha.standby,
            open_file_limit=self._open_file_limit,
        )
        for event, fields in config_mod.privilege_warnings(self._config, os.geteuid()):
            log.warning(event, **fields)
        self._warn_about_config(self._config)
        try:
            tried = await asyncio.to_thread(self._prepare_run_directory)
        except OSError as exc:
            log.error("daemon.cannot_start", reason=str(exc))
            return leadership.EXIT_CANNOT_START
        self._lead(tried)  # the core: we lead, we stand by, or we may not start
        if self._leadership.finished:
            return self._leadership.exit_code
        control = ControlServer(self._config.control.socket, self)
        try:
            await control.start()
        except ControlError as exc:
            log.error("daemon.cannot_start", reason=str(exc))
            await self._let_go_of_run_lock()
            return 1
        self._install_signal_handlers(loop)
        self._start_metrics(loop)
        try:
            await self._serve()
        finally:
            self._remove_signal_handlers(loop)
            if self._metrics is not None:
                await asyncio.to_thread(self._metrics.stop)
            await control.aclose()
            self._events.close()
            await self._let_go_of_run_lock()
            self._lead(leadership.LockReleased())
            await self._lead_over.wait()  # after a handover, the hold-off; else at once
            self._end_leadership()
            log.info(
                "daemon.stopped",
                exit_code=self._leadership.exit_code,
                role=self._leadership.shown_role,
            )
        return self._leadership.exit_code

    def _warn_about_config(self, config: Config) -> None:
        for event, fields in config_mod.open_file_limit_warnings(config, self._open_file_limit):
            log.warning(event, **fields)
        # check-config says the same; the journal must too, for a config nobody checked.
        for key, why in config_mod.trainer_warnings(config):
            log.warning("config.cannot_beat_trainer", key=key, reason=why)

    async def _serve(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._background = [tg.create_task(self._watchdog_loop(), name="watchdog")]
            try:
                self._lead(leadership.Serving())  # the core: boot the fleet, or stand by
                await self._interpret()
            finally:
                self._tearing_down = True  # from here on nothing new may start in the group
                self._lead(leadership.ServingEnded())
                for task in (*self._background, self._diagnosis, self._collector):
                    if task is not None:
                        task.cancel()
                if self._timer is not None:
                    self._timer.cancel()
                for link in self._links.values():
                    link.cancel_tasks()
                for warm in self._warm.values():
                    warm.cancel_tasks()
                for future in self._replies.values():
                    if not future.done():
                        future.set_exception(ControlError("the daemon is stopping"))
        self._tg = None
        await self._close_remotes()
        if not self._fleet.history_is_ours:
            return  # the history is the leader's: a standby or a deposed one leaves it alone
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                await asyncio.to_thread(
                    self._write_history, self._history_file(), self._leadership.epoch
                )
        except OSError as exc:
            log.error("history.not_saved", reason=str(exc))
        except TimeoutError:
            log.error(
                "history.not_saved",
                reason=f"the run root did not answer within {SHUTDOWN_IO_TIMEOUT_S:g}s",
            )

    async def _interpret(self) -> None:
        """Feed what is queued to the core, a batch at a time, and perform what it says."""
        loop = asyncio.get_running_loop()
        while not self._fleet.finished:
            batch = await self._inbox.take()
            for action in self._fleet.step(batch, loop.time()):
                self._perform(action)
            # O(1) unless the core's names changed: they are a new frozenset when they do.
            self._watcher.set_hosts(self._fleet.names)
            self._arm_timer()

    # ------------------------------------------------------------------------------------
    # High availability: the leadership core's shell (leadership.py decides)

    def _lead(self, event: leadership.Event) -> None:
        """Feed the leadership core ``event`` and perform what it says. An event fed while
        its actions are being performed (a handover's stop) waits its turn, so the core is
        never entered twice at once."""
        self._lead_queue.append(event)
        if self._lead_stepping:
            return
        self._lead_stepping = True
        try:
            loop = asyncio.get_running_loop()
            while self._lead_queue:
                self._leadership, actions = leadership.step(
                    self._leadership, self._lead_queue.popleft(), loop.time(), self._config.ha
                )
                for action in actions:
                    self._perform_leadership(action)
            if self._lead_timer is not None:
                self._lead_timer.cancel()
                self._lead_timer = None
            when = self._leadership.deadline_at
            if when is not None:
                self._lead_timer = loop.call_at(when, self._lead, leadership.DeadlinePassed())
            if self._leadership.finished:
                self._lead_over.set()
        finally:
            self._lead_stepping = False

    def _perform_leadership(self, action: leadership.Action) -> None:
        match action:
            case leadership.TryLock():
                self._lead_io(self._try_lock, lambda why: leadership.LockFailed(reason=why))
            case leadership.CheckLock():
                self._lead_io(self._check_lock, _lock_unknown)
            case leadership.ReadView():
                self._lead_io(self._read_view, lambda why: leadership.ViewRead(epoch_on_disk=None))
            case leadership.LookAtLock():
                self._lead_io(self._look_at_lock, lambda why: leadership.LockLooked(holder=""))
            case leadership.StandBy():
                self._stand_by(action)
            case leadership.LeaderChanged():
                log.info("ha.leader_changed", leader=action.leader)
            case leadership.TakeoverFailed():
                log.error("ha.takeover_failed", reason=action.reason, retry_in_s=action.retry_in_s)
            case leadership.Leading():
                self._leading(action)
            case leadership.Lead():
                self._background.append(self._spawn(self._boot(), "boot"))
            case leadership.Announce():
                self._notifier.status(action.text)
            case leadership.InCharge():
                log.info(
                    "ha.in_charge",
                    epoch=action.epoch,
                    since_lock_s=action.since_lock_s,
                    since_lock_free_s=action.since_lock_free_s,
                    adopted=sum(1 for h in self._fleet.hosts.values() if h.pid is not None),
                    hosts=len(self._fleet.hosts),
                )
            case leadership.StandDown():
                self._notifier.stopping()
                self._inbox.put(fleet.LeadershipEnded())
            case leadership.Deposed():
                self._deposed(action)
            case leadership.HandOver():
                log.info("ha.handover", epoch=action.epoch, hold_s=action.hold_s)
                self.request_stop("handover", detach=True)
            case leadership.HandedOver():
                log.info("ha.handed_over", leader=action.leader)
            case leadership.HandoverUnclaimed():
                log.warning("ha.handover_unclaimed", waited_s=action.waited_s)
            case leadership.Reply():
                self._lead_replies[action.token] = action
            case leadership.CannotStart():
                log.error("daemon.cannot_start", reason=action.reason)
            case leadership.PingWatchdog():
                self._notifier.watchdog()
            case leadership.WithholdWatchdog():
                log.warning("daemon.watchdog_withheld", reason=action.reason)
            case leadership.RoleChanged():
                log.info(
                    "ha.role",
                    **{"from": action.from_.value, "to": action.to.value},
                    reason=action.reason,
                )
            case _:
                assert_never(action)

    def _lead_io(
        self,
        work: Callable[[], leadership.Event],
        failed: Callable[[str], leadership.Event],
    ) -> None:
        """Run one of the leadership core's I/O actions in a thread and feed it the answer
        (``failed(why)`` if ``work`` raised: a bug, logged). Not in the task group: the
        first try comes before it, and a handover's looks after it."""

        async def answer() -> None:
            try:
                event = await asyncio.to_thread(work)
            except Exception as exc:  # task root: the core must hear an answer
                log.exception("ha.io_failed", op=getattr(work, "__name__", "?"))
                event = failed(f"internal error: {exc!r}")
            self._lead(event)

        task = asyncio.get_running_loop().create_task(answer())
        self._lead_ops.add(task)
        task.add_done_callback(self._lead_ops.discard)

    def _end_leadership(self) -> None:
        """Drop the leadership core's timer and abandon its I/O (the process exits)."""
        if self._lead_timer is not None:
            self._lead_timer.cancel()
        for task in self._lead_ops:
            task.cancel()

    def _stand_by(self, action: leadership.StandBy) -> None:
        """Wait as a standby: every host's connection warm, READY for systemd."""
        log.info("ha.standby", leader=action.leader, poll_interval_s=action.poll_interval_s)
        for cfg in self._config.hosts:
            self._warm_up(cfg)
        self._notifier.status(action.summary)
        self._notifier.ready()

    def _leading(self, action: leadership.Leading) -> None:
        fields: dict[str, Any] = {"epoch": action.epoch, "leader": action.leader}
        if action.took_over:
            warm = self._warm.values()
            fields["warm"] = sum(1 for w in warm if w.up)
            fields["probed"] = sum(1 for w in warm if w.agent_started)
            fields["hosts"] = len(self._warm)
        log.info("ha.leading", **fields)

    async def _boot(self) -> None:
        """Lead: the restart history a previous daemon left, then the fleet and the tasks
        that serve it."""
        histories = await asyncio.to_thread(self._load_history)
        self._inbox.put(fleet.Booted(histories=histories))
        self._background += [
            self._spawn(self._watcher.run(self._on_observations), "watcher"),
            self._spawn(self._persist_loop(), "persist"),
            self._spawn(self._reload_loop(), "reload"),
        ]

    def _warm_up(self, cfg: HostConfig) -> None:
        """Connect to ``cfg``'s host and keep its agent started."""
        warm = _Warm(cfg=cfg, remote=self._new_remote(cfg))
        self._warm[cfg.name] = warm
        warm.maintain = self._spawn(self._maintain(cfg.name, warm.remote), f"ssh:{cfg.name}")
        warm.warmer = self._spawn(self._keep_warm(warm), f"warm:{cfg.name}")

    async def _keep_warm(self, warm: _Warm) -> None:
        """Have the agent started once per connection: the connection starts it too, but
        says nothing of a failure, and a takeover's first request must find it running."""
        started_up = False
        while True:
            await warm.changed.wait()
            warm.changed.clear()
            if not warm.up:
                started_up = False
                continue
            if started_up:
                continue
            try:
                await warm.remote.start_agent()
            except Exception as exc:  # task root: a standby's warm-up is only a warm-up
                if isinstance(exc, RemoteError):
                    log.info("ha.warm_probe_failed", host=warm.cfg.name, reason=exc.reason)
                else:
                    log.exception("ha.warm_probe_failed", host=warm.cfg.name)
                await asyncio.sleep(WARM_RETRY_S)
                warm.changed.set()  # try again while the connection is up
                continue
            warm.agent_started = started_up = True
            log.debug("ha.warm", host=warm.cfg.name)

    def _read_view(self) -> leadership.ViewRead:
        """The fleet as the run directory shows it, for a standby's status, and the epoch
        there (in a thread)."""
        run = layout.layout_of(self._config)
        epoch = runfiles.read_epoch(run.epoch_file, root=run.root)
        self._standby_view = view.offline_status(self._config)
        return leadership.ViewRead(epoch_on_disk=epoch)

    def _check_lock(self) -> leadership.LockChecked:
        """Whether we still hold the run lock (why not), and the epoch on disk (in a thread)."""
        run = layout.layout_of(self._config)
        fd = self._run_lock
        reason = "the run lock was released" if fd is None else None
        if fd is not None:
            reason = runfiles.check_lock(fd, run.lock_file, root=run.root)
        epoch = runfiles.read_epoch(run.epoch_file, root=run.root)
        return leadership.LockChecked(held=reason is None, epoch_on_disk=epoch, reason=reason or "")

    def _look_at_lock(self) -> leadership.LockLooked:
        """Who holds the run lock now (in a thread)."""
        run = layout.layout_of(self._config)
        return leadership.LockLooked(holder=runfiles.current_holder(run.lock_file, root=run.root))

    def _deposed(self, action: leadership.Deposed) -> None:
        """Stop acting at once: abandon every operation, write nothing, exit non-zero."""
        for link in self._links.values():
            for task in link.ops:
                task.cancel()
        self._inbox.put(fleet.LeadershipEnded())
        log.error(
            "ha.deposed",
            epoch=action.epoch,
            epoch_on_disk=action.epoch_on_disk,
            reason=action.reason,
            exit_code=leadership.EXIT_DEPOSED,
        )
        self._publish_event("ha.deposed", action.reason)
        self._notifier.stopping()

    async def handover(self) -> dict[str, Any]:
        """Request ``{"cmd": "handover"}``: leave every worker running, release the run lock
        and stay off it for ``[ha] handover_hold_s`` so that a standby takes it."""
        token = next(self._tokens)
        self._lead(leadership.HandoverAsked(token=token))
        reply = self._lead_replies.pop(token)
        if reply.refusal is not None:
            raise ControlError(reply.message)
        return dict(reply.result or {})

    def _start_metrics(self, loop: asyncio.AbstractEventLoop) -> None:
        listen = self._config.metrics.listen
        if listen is None:
            return
        host, port = config_mod.split_host_port(listen)
        metrics = Metrics(
            snapshot_on_loop(loop, self.status),
            host_detail=detail_on_loop(loop, self.host_status),
            # Read in the endpoint's own reader thread, never on the loop: the log is a file
            # under the run root (bounded, never through a symlink: view.log_lines).
            log_tail=lambda host: view.log_lines(self._config, host, page.LOG_LINES),
        )
        try:
            metrics.start(host, port)
        except OSError as exc:
            # Supervision matters more than its dashboard: run on, and say so loudly.
            log.error("metrics.not_started", listen=listen, reason=str(exc))
            return
        self._metrics = metrics

    def _prepare_run_directory(
        self,
    ) -> leadership.LockTaken | leadership.LockBusy | leadership.LockFailed:
        """Create the run directory, then try the run lock (in a thread)."""
        layout.ensure_run_dirs(self._config)
        return self._try_lock()

    def _try_lock(self) -> leadership.LockTaken | leadership.LockBusy | leadership.LockFailed:
        """Take the run lock if it is free, then write the next epoch and the run files
        under it (in a thread)."""
        run = layout.layout_of(self._config)
        try:
            fd = runfiles.lock_run(run.lock_file, root=run.root)
        except RunLocked as exc:
            return leadership.LockBusy(holder=exc.holder, lock_file=str(run.lock_file))
        except OSError as exc:
            return leadership.LockFailed(reason=str(exc))
        locked_at = time.monotonic()
        try:
            # Under the lock: the lock orders the bumps, so every leadership's epoch is new.
            epoch = runfiles.bump_epoch(run.epoch_file, root=run.root)
            layout.write_run_files(self._config)
        except OSError as exc:
            os.close(fd)
            return leadership.LockFailed(reason=str(exc))
        except BaseException:
            os.close(fd)
            raise
        self._run_lock = fd
        return leadership.LockTaken(epoch=epoch, leader=_identity(), locked_at=locked_at)

    async def _let_go_of_run_lock(self) -> None:
        """Close the run lock off the loop, waiting a bounded time: on NFS or FUSE a close asks
        the server (to flush, to drop the lock), and a hung one never answers. Abandoned,
        the lock goes with the process."""
        fd, self._run_lock = self._run_lock, None
        if fd is None:
            return
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                await asyncio.to_thread(os.close, fd)
        except TimeoutError:
            log.warning("run.lock_release_slow", waited_s=SHUTDOWN_IO_TIMEOUT_S)

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    def _remove_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)

    def request_stop(self, why: str = "request", *, detach: bool | None = None) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT, ``stop`` command); a standby just exits."""
        if not self._stop_requested:
            self._stop_requested = True
            log.info("daemon.stop_requested", by=why, role=self._leadership.shown_role)
            if detach is None:
                detach = self._config.run.on_exit == "detach"
            self._inbox.put(fleet.ShutdownRequested(detach=detach))
            self._lead(leadership.StopAsked())

    def request_reload(self) -> None:
        """Re-read the config soon (SIGHUP); repeated requests converge to the last file."""
        self._reload_wanted.set()

    # ------------------------------------------------------------------------------------
    # Inputs: everything becomes an event in the inbox.

    def _on_observations(self, observations: list[Observation]) -> None:
        for obs in observations:
            if isinstance(obs, ExitObserved) and obs.record is not None:
                # Rare (one per exit) and the fact behind a restart: worth a line, like the
                # agent's report of the same exit.
                record = obs.record
                log.info(
                    "worker.exit_reported",
                    host=obs.host,
                    pid=record.pid,
                    exit_code=record.exit_code,
                    signal=record.signal,
                    reaped=record.reaped,
                    via="record",
                )
        self._inbox.put_all(_events_of(observations))

    def _on_connection(self, name: str, up: bool, reason: str) -> None:
        log.info("ssh.up" if up else "ssh.down", host=name, reason=reason)
        warm = self._warm.get(name)
        if warm is not None and name not in self._links:
            # A standby's warm connection: remembered, told to the core once it adopts it.
            warm.up, warm.reason = up, reason
            warm.changed.set()
            return
        event = health.SshRestored() if up else health.SshLost(reason=reason)
        self._inbox.put(fleet.HostObserved(name, event))

    def _on_exit_pushed(self, name: str, news: WorkerExit) -> None:
        """The host's agent saw a worker end: the same fact as its exit record, sooner; the
        core acts on whichever comes first and takes the other as old news."""
        log.info(
            "worker.exit_reported",
            host=name,
            pid=news.pid,
            exit_code=news.exit_code,
            signal=news.signal,
            reaped=news.reaped,
            via="agent",
        )
        event = health.WorkerExited(
            pid=news.pid,
            exit_code=news.exit_code,
            signal=news.signal,
            log_tail=news.log_tail,
            reaped=news.reaped,
        )
        self._inbox.put(fleet.HostObserved(name, event))

    def _arm_timer(self) -> None:
        """One timer for the whole fleet, at the core's next deadline."""
        when = self._fleet.deadline_at
        if self._timer is not None:
            # A timer due no later than the deadline is kept: an early wake-up only makes
            # the core say when to come back.
            if when is not None and self._timer.when() <= when:
                return
            self._timer.cancel()
            self._timer = None
        if when is not None:
            self._timer = asyncio.get_running_loop().call_at(when, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self._inbox.put(fleet.DeadlinePassed())

    async def _ask(self, make: Callable[[int], fleet.Event]) -> fleet.Reply:
        """Queue an operator command and wait for the core's answer to it."""
        refused = leadership.refusal(self._leadership, "command")
        if refused is not None:
            raise ControlError(refused)
        if self._fleet.finished or self._tg is None:
            raise ControlError("the daemon is not serving commands (starting or stopping)")
        token = next(self._tokens)
        future: asyncio.Future[fleet.Reply] = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        try:
            self._inbox.put(make(token))
            reply = await future
        finally:
            self._replies.pop(token, None)
        if reply.refusal is not None:
            raise ControlError(reply.message)
        return reply

    # ------------------------------------------------------------------------------------
    # Actions out: each adapter does I/O and queues the result; none decides.

    def _perform(self, action: fleet.Action) -> None:
        match action:
            case fleet.HostStateChanged():
                self._log_state_change(action)
            case fleet.HistoryChanged():
                self._history_dirty.set()
            case fleet.WritePointer():
                self._spawn(self._write_pointer(action.path), "pointer")
            case fleet.PointerNotWritten():
                log.error(
                    "pointer.not_written",
                    path=action.path,
                    reason=action.reason,
                    attempt=action.attempt,
                    retry_in_s=round(action.retry_at - asyncio.get_running_loop().time(), 3),
                )
            case fleet.Probe():
                self._spawn_op(action.host, self._probe(action), "probe")
            case fleet.RecheckStatus():
                self._spawn(self._recheck(action), f"recheck:{action.host}")
            case fleet.LaunchAsked():
                self._launch_asked(action)
            case fleet.Launch():
                log.info("host.launch_begin", host=action.host)
                self._spawn_op(action.host, self._launch(action.host), "launch")
            case fleet.Terminate():
                log.info("host.terminate", host=action.host, pid=action.pid, grace_s=action.grace_s)
                self._spawn_op(action.host, self._terminate(action), "terminate")
            case fleet.LaunchesWaiting():
                log.info("fleet.launches_queued", waiting=action.waiting)
            case fleet.ScanFiles():
                self._spawn(self._scan(action.hosts), "scan")
            case fleet.Connect():
                self._connect(action)
            case fleet.Disconnect():
                self._disconnect(action.host)
            case fleet.Reconnect():
                self._reconnect(action.host)
            case fleet.WriteStopSentinel():
                self._spawn(self._write_sentinel(action), f"stop-host:{action.host}")
            case fleet.DeleteStopSentinel():
                self._spawn(self._delete_sentinel(action), f"start-host:{action.host}")
            case fleet.Reply():
                future = self._replies.get(action.token)
                if future is not None and not future.done():
                    future.set_result(action)
            case fleet.FreezeChanged():
                self._freeze_changed(action)
            case fleet.DiagnoseFilesystem():
                if self._diagnosis is not None:
                    self._diagnosis.cancel()
                self._diagnosis = self._spawn(self._diagnose(), "freeze-diagnosis")
            case fleet.FreezeExplained():
                log.error(
                    "fleet.freeze_finding", finding=action.finding, free_bytes=action.free_bytes
                )
                self._publish_event("fleet.freeze_finding", reason=action.finding)
                self._publish_status(force=True)
            case fleet.CrashSignatureFound():
                log.error(
                    "fleet.crash_signature",
                    signature=action.signature,
                    hosts=list(action.hosts),
                    canary=action.canary,
                    log_tail=action.log_tail,
                )
                self._publish_event("fleet.crash_signature", reason=action.signature)
                self._publish_status(force=True)
            case fleet.CrashSignatureCleared():
                log.warning(
                    "fleet.crash_signature_cleared",
                    signature=action.signature,
                    reason=action.reason,
                    released=list(action.released),
                )
                self._publish_event("fleet.crash_signature_cleared", reason=action.reason)
                self._publish_status(force=True)
            case fleet.Settled():
                self._settled(action)
            case fleet.ShutdownBegan():
                self._notifier.stopping()
                log.info("daemon.stopping", on_exit=self._config.run.on_exit)
            case fleet.ShutdownDone():
                self._shutdown_done(action)
            case _:
                assert_never(action)

    def _group(self) -> asyncio.TaskGroup:
        if self._tg is None or self._tearing_down:
            raise RuntimeError("hosts act only while the daemon's task group runs")
        return self._tg

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._group().create_task(coro, name=name)

    def _spawn_op(self, name: str, coro: Coroutine[Any, Any, None], what: str) -> None:
        link = self._links[name]
        task = self._spawn(coro, f"{what}:{name}")
        link.ops.add(task)
        task.add_done_callback(link.ops.discard)

    def _log_state_change(self, change: fleet.HostStateChanged) -> None:
        fields: dict[str, Any] = {
            "host": change.host,
            "from": change.from_.value,
            "to": change.to.value,
            "reason": change.reason,
            "pid": change.pid,
        }
        if change.cause is not None:
            fields["cause"] = change.cause.value
        if change.evidence is not None:
            fields["evidence"] = view.evidence_row(change.evidence)
        level = "warning" if change.to in health.UNHEALTHY_STATES else "info"
        getattr(log, level)("host.state", **fields)
        self._events.publish({"event": "host.state", "timestamp": _utc_now(), **fields})
        self._publish_status_soon()

    def _launch_asked(self, action: fleet.LaunchAsked) -> None:
        log.info("host.launch", host=action.host, reason=action.reason, restart=action.is_restart)
        if action.is_restart and self._metrics is not None:
            reason = action.cause.value if action.cause is not None else "other"
            self._metrics.restarts.labels(host=action.host, reason=reason).inc()

    def _connect(self, action: fleet.Connect) -> None:
        name = action.host
        cfg = self._host_configs[name]
        warm = self._warm.pop(name, None)
        if warm is not None and warm.cfg == cfg and warm.maintain is not None:
            # Taken over with this host's connection warm: adopt it as it is, and tell the
            # core what the standby saw of it (a state is reported only when it changes).
            if warm.warmer is not None:
                warm.warmer.cancel()
            self._links[name] = _Link(cfg=cfg, remote=warm.remote, maintain=warm.maintain)
            if warm.up is not None:
                event = health.SshRestored() if warm.up else health.SshLost(reason=warm.reason)
                self._inbox.put(fleet.HostObserved(name, event))
            return
        if warm is not None:  # its settings changed meanwhile: a connection of its own
            warm.cancel_tasks()
            self._spawn(_aclose_quietly(warm.remote, name), f"close:{name}")
        remote = self._new_remote(cfg)
        link = _Link(cfg=cfg, remote=remote)
        self._links[name] = link
        link.maintain = self._spawn(self._maintain(name, remote), f"ssh:{name}")
        if action.added:
            log.info("host.added", host=name, shard=action.shard)

    def _new_remote(self, cfg: HostConfig) -> RemoteLike:
        name = cfg.name
        return self._remote_factory(
            cfg,
            self._fleet_ssh(),
            self._config.worker.python,
            self._handshakes,
            lambda up, reason: self._on_connection(name, up, reason),
            lambda news: self._on_exit_pushed(name, news),
        )

    async def _maintain(self, name: str, remote: RemoteLike) -> None:
        """The host's connection for as long as it is a member; its faults stay its own."""
        while True:
            try:
                await remote.maintain()
            except Exception:  # task root: a fault of one host's link must not end the daemon
                log.exception("ssh.maintain_failed", host=name, retry_in_s=MAINTAIN_RETRY_S)
                await asyncio.sleep(MAINTAIN_RETRY_S)
            else:
                return

    def _disconnect(self, name: str) -> None:
        link = self._links.pop(name)
        link.cancel_tasks()
        self._spawn(_aclose_quietly(link.remote, name), f"close:{name}")
        log.info("host.removed", host=name)

    def _reconnect(self, name: str) -> None:
        link = self._links[name]
        cfg = self._config.host(name)
        link.cfg = cfg or link.cfg
        link.remote.update(link.cfg, self._fleet_ssh(), self._config.worker.python)

    def _fleet_ssh(self) -> SshConfig:
        """The SSH settings each connection uses: keepalives spread over the whole fleet."""
        return config_mod.fleet_ssh(self._config.ssh, len(self._config.hosts))

    async def _close_remotes(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for name, link in self._links.items():
                tg.create_task(_aclose_quietly(link.remote, name))
            for name, warm in self._warm.items():
                tg.create_task(_aclose_quietly(warm.remote, name))

    async def _scan(self, hosts: tuple[str, ...]) -> None:
        """Read joining hosts' files; the core hears the sentinels first, then the rest."""
        while True:
            try:
                observations = await self._watcher.scan(hosts)
            except Exception:  # task root: a host must not join before its sentinel is known
                log.exception("watch.scan_failed", hosts=len(hosts), retry_in_s=SCAN_RETRY_S)
                await asyncio.sleep(SCAN_RETRY_S)
            else:
                break
        sentinels = frozenset(
            o.host for o in observations if isinstance(o, SentinelObserved) and o.present
        )
        scanned = fleet.FilesScanned(hosts=frozenset(hosts), sentinels=sentinels)
        self._inbox.put_all([scanned, *_events_of(observations)])

    async def _launch(self, name: str) -> None:
        link = self._links[name]
        spec = self._spec(link)
        started = time.monotonic()
        event: health.Event
        try:
            result = await link.remote.launch(spec)
        except Fenced as exc:
            log.error("host.fenced", host=name, op="launch", reason=exc.reason)
            self._lead(leadership.Fenced(host=name, reason=exc.reason))
            return
        except ShardHeld as exc:
            log.warning(
                "host.launch_refused", host=name, holder_pid=exc.holder_pid, reason=exc.reason
            )
            event = health.LaunchRefused(holder_pid=exc.holder_pid, reason=exc.reason)
        except RemoteError as exc:
            log.error(
                "host.launch_failed", host=name, reason=exc.reason, uncertain=exc.connection_lost
            )
            event = health.LaunchFailed(reason=exc.reason, uncertain=exc.connection_lost)
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("host.launch_failed", host=name, reason=repr(exc))
            event = health.LaunchFailed(reason=f"internal error: {exc!r}", uncertain=True)
        else:
            elapsed = time.monotonic() - started
            if self._metrics is not None:
                self._metrics.launch_seconds.observe(elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info("host.launched", host=name, pid=result.pid, elapsed_ms=elapsed_ms)
            event = health.Launched(pid=result.pid)
        self._inbox.put(fleet.HostObserved(name, event))

    async def _terminate(self, action: fleet.Terminate) -> None:
        name = action.host
        link = self._links[name]
        evidence = await self._evidence(action) if action.collect_evidence else None
        started = time.monotonic()
        event: health.Event
        try:
            reaped = await link.remote.terminate(
                self._spec(link), action.pid, grace_s=action.grace_s, kill=action.kill
            )
        except Fenced as exc:
            log.error("host.fenced", host=name, op="terminate", pid=action.pid, reason=exc.reason)
            self._lead(leadership.Fenced(host=name, reason=exc.reason))
            return
        except RemoteError as exc:
            log.error("host.terminate_failed", host=name, pid=action.pid, reason=exc.reason)
            event = health.TerminateFailed(pid=action.pid, reason=exc.reason, evidence=evidence)
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("host.terminate_failed", host=name, pid=action.pid)
            event = health.TerminateFailed(
                pid=action.pid, reason=f"internal error: {exc!r}", evidence=evidence
            )
        else:
            elapsed = time.monotonic() - started
            if self._metrics is not None:
                self._metrics.terminate_seconds.observe(elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info(
                "host.terminated",
                host=name,
                pid=action.pid,
                elapsed_ms=elapsed_ms,
                reaped=reaped,
            )
            # Before the core hears it is dead, so before its successor can start.
            await self._quarantine(action, link.cfg)
            event = health.TerminateConfirmed(pid=action.pid, evidence=evidence, reaped=reaped)
        self._inbox.put(fleet.HostObserved(name, event))

    async def _quarantine(self, action: fleet.Terminate, cfg: HostConfig) -> None:
        """Take the tasks a stuck worker hung on out of its shard's inbox, each answered with
        an error result (``tasks.quarantine_stuck``); never raises, bounded in time."""
        if action.quarantine <= 0:
            return
        stale_s = self._config.health.progress_stale_s
        reason = (
            f"reward call stuck: {cfg.name} (shard {cfg.shard}) finished no task in"
            f" {stale_s:g}s with {action.quarantine} in flight and was replaced; this task"
            f" was quarantined by reward-supervisor in ctl/quarantine/{cfg.shard}/"
        )
        try:
            async with asyncio.timeout(SHUTDOWN_IO_TIMEOUT_S):
                done = await asyncio.to_thread(
                    tasks.quarantine_stuck,
                    self._config.run.root,
                    cfg.shard,
                    cfg.name,
                    count=action.quarantine,
                    older_than_s=stale_s,
                    reason=reason,
                )
        except (OSError, TimeoutError) as exc:
            why = str(exc) or "the run root did not answer in time"
            log.error("tasks.quarantine_failed", host=cfg.name, shard=cfg.shard, reason=why)
            return
        except Exception:  # task root of the quarantine: the restart must go on
            log.exception("tasks.quarantine_failed", host=cfg.name, shard=cfg.shard)
            return
        log.warning(
            "tasks.quarantined",
            host=cfg.name,
            shard=cfg.shard,
            asked=action.quarantine,
            task_ids=list(done.task_ids[:50]),
            count=len(done.task_ids),
            unanswered=done.unanswered,
            note=done.note,
        )

    async def _evidence(self, action: fleet.Terminate) -> health.Evidence:
        """The worker's stacks and log tail, from its host's agent, within
        ``health.evidence_timeout_s`` (plus a round trip): never raises, never holds the
        terminate back longer; what went wrong is a note."""
        name, pid = action.host, action.pid
        link = self._links[name]
        policy = self._config.health
        started = time.monotonic()
        try:
            async with asyncio.timeout(policy.evidence_timeout_s + EVIDENCE_SLACK_S):
                evidence = await link.remote.evidence(
                    self._spec(link),
                    pid,
                    timeout_s=policy.evidence_timeout_s,
                    stacks=policy.evidence_stacks,
                )
        except (RemoteError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, RemoteError) else "no answer in time"
            log.warning("host.evidence_failed", host=name, pid=pid, reason=reason)
            notes: tuple[str, ...] = (f"not collected: {reason}",)
            return health.Evidence(pid=pid, notes=notes, elapsed_s=_since(started))
        except Exception as exc:  # task root of the capture: the terminate must go on
            log.exception("host.evidence_failed", host=name, pid=pid)
            notes = (f"not collected: internal error: {exc!r}",)
            return health.Evidence(pid=pid, notes=notes, elapsed_s=_since(started))
        log.info(
            "host.evidence",
            host=name,
            pid=pid,
            via=evidence.stacks_via,
            stacks_chars=len(evidence.stacks or ""),
            notes=list(evidence.notes),
            elapsed_ms=round(1000 * _since(started), 1),
        )
        return evidence

    async def _recheck(self, action: fleet.RecheckStatus) -> None:
        """Read a host's files afresh before a verdict from silence: the core hears the
        status as ``StatusRechecked`` (None when the read failed or took too long), with
        the count of its shard's old task files when that was asked."""
        name = action.host
        beat: health.HeartbeatSeen | health.StatusMissing | None = None
        others: list[Observation] = []
        try:
            async with asyncio.timeout(health.RECHECK_TIMEOUT_S):
                observations = await self._watcher.scan((name,))
        except TimeoutError:
            log.warning("host.recheck_failed", host=name, reason="no answer in time")
        except Exception:  # task root: the verdict must not wait on a broken read
            log.exception("host.recheck_failed", host=name)
        else:
            for obs in observations:
                event = _event_of(obs) if isinstance(obs, StatusObserved) else None
                if isinstance(event, health.HeartbeatSeen | health.StatusMissing):
                    beat = event
                else:
                    others.append(obs)
        old_tasks = None
        if action.tasks_older_than_s is not None:
            old_tasks = await self._count_old_tasks(name, action.tasks_older_than_s)
        recheck = health.StatusRechecked(beat=beat, old_tasks=old_tasks)
        self._inbox.put_all([*_events_of(others), fleet.HostObserved(name, recheck)])

    async def _count_old_tasks(self, name: str, older_than_s: float) -> int | None:
        """Task files of ``name``'s shard at least ``older_than_s`` old (None: not known)."""
        shard = self._host_configs[name].shard
        try:
            async with asyncio.timeout(health.RECHECK_TIMEOUT_S):
                return await asyncio.to_thread(
                    tasks.count_older,
                    self._config.run.root,
                    shard,
                    name,
                    older_than_s=older_than_s,
                )
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or "no answer in time"
            log.warning("host.tasks_not_counted", host=name, shard=shard, reason=reason)
        except Exception:  # task root: the verdict must not wait on a broken listing
            log.exception("host.tasks_not_counted", host=name, shard=shard)
        return None

    async def _probe(self, action: fleet.Probe) -> None:
        name = action.host
        link = self._links[name]
        event: health.Event
        try:
            pid = await link.remote.probe(self._spec(link), action.pid)
        except RemoteError as exc:
            log.warning("host.probe_failed", host=name, reason=exc.reason)
            event = health.ProbeFailed(reason=exc.reason)
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("host.probe_failed", host=name)
            event = health.ProbeFailed(reason=f"internal error: {exc!r}")
        else:
            log.info("host.probe", host=name, found_pid=pid)
            event = health.ProbeResult(pid=pid)
        self._inbox.put(fleet.HostObserved(name, event))

    def _spec(self, link: _Link) -> LaunchSpec:
        # Every launch and terminate carries this leadership's epoch: the agent refuses one
        # lower than the run directory's (fencing a deposed leader).
        return replace(layout.launch_spec(self._config, link.cfg), epoch=self._leadership.epoch)

    async def _write_sentinel(self, action: fleet.WriteStopSentinel) -> None:
        run = layout.layout_of(self._config)
        error: str | None = None
        try:
            await asyncio.to_thread(
                runfiles.write_stop_sentinel, run.stop_sentinel(action.host), root=run.root
            )
        except OSError as exc:
            error = str(exc)
        self._inbox.put(
            fleet.StopSentinelWritten(host=action.host, token=action.token, error=error)
        )

    async def _delete_sentinel(self, action: fleet.DeleteStopSentinel) -> None:
        run = layout.layout_of(self._config)
        error: str | None = None
        try:
            await asyncio.to_thread(runfiles.remove, run.stop_sentinel(action.host), root=run.root)
        except OSError as exc:
            error = str(exc)
        self._inbox.put(
            fleet.StopSentinelDeleted(host=action.host, token=action.token, error=error)
        )

    async def _write_pointer(self, path: str) -> None:
        error: str | None = None
        try:
            await asyncio.to_thread(
                layout.write_pointer,
                Path(path),
                layout.launch_meta(self._config),
                root=self._config.run.root,
            )
        except Exception as exc:  # task root: a pointer must never end the daemon
            error = str(exc) or type(exc).__name__
            if not isinstance(exc, OSError):
                log.exception("pointer.write_failed", path=path)
        else:
            self._pointer_written_wall = time.time()
            log.info("pointer.written", path=path)
        self._inbox.put(fleet.PointerWritten(path=path, error=error))

    def _freeze_changed(self, change: fleet.FreezeChanged) -> None:
        if change.frozen:
            log.error("fleet.frozen", reason=change.reason, hosts=list(change.hosts))
        else:
            log.warning("fleet.thawed", reason=change.reason)
            if self._diagnosis is not None:
                self._diagnosis.cancel()
        self._publish_event("fleet.frozen" if change.frozen else "fleet.thawed", change.reason)
        self._publish_status(force=True)

    async def _diagnose(self) -> None:
        """Tell the operator whether the run root itself is hung or full, the two causes this
        node can check, instead of only "suspect the shared filesystem"."""
        check = await check_filesystem(self._config.run.root, FS_CHECK_TIMEOUT_S)
        self._inbox.put(
            fleet.FilesystemDiagnosed(finding=check.finding, free_bytes=check.free_bytes)
        )

    def _settled(self, action: fleet.Settled) -> None:
        if action.slow:
            waited = self._config.fleet.startup_timeout_s
            log.warning("daemon.ready_without", hosts=list(action.slow), waited_s=waited)
        self._ready = True
        self._notifier.ready()
        self._publish_status()
        log.info("daemon.ready", summary=self._summary, watch_mode=self._watcher.mode)
        self._lead(leadership.FleetSettled())  # after a takeover: in charge
        self._collector = self._spawn(self._collect_loop(), "gc")

    def _shutdown_done(self, done: fleet.ShutdownDone) -> None:
        if done.incomplete:
            log.error(
                "daemon.stop_incomplete",
                hosts=list(done.incomplete),
                waited_s=self._config.fleet.shutdown_timeout_s,
            )
        elif done.unreachable:
            log.error(
                "daemon.stop_incomplete",
                hosts=list(done.unreachable),
                reason=(
                    "unreachable over SSH: their workers may still run; the next daemon adopts them"
                ),
            )

    # ------------------------------------------------------------------------------------
    # Background loops

    async def _watchdog_loop(self) -> None:
        """Ping the watchdog when the leadership core says we are healthy."""
        interval = self._notifier.watchdog_interval_s()
        if interval is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            healthy = self._watcher.healthy(loop.time())
            self._lead(leadership.WatchdogDue(watcher_healthy=healthy))
            await asyncio.sleep(interval)

    async def _collect_loop(self) -> None:
        """Full garbage collections when we choose, not when the interpreter does.

        At a thousand hosts the heap holds about a million objects the collector tracks, and
        CPython's own full collection, at a moment its heuristics pick, stopped the event
        loop for 140-280 ms, every few minutes (docs/BENCHMARKS.md): every state change
        waiting behind it was that late. After start-up everything alive is frozen out of
        the collector, so its automatic collections walk only what was made since. Once
        an interval the frozen objects are thawed and one full collection frees the cycles
        that died among them (a reconnected host's old connection), logged with its pause.
        """
        try:
            while True:
                started = time.perf_counter()
                gc.unfreeze()
                collected = gc.collect()
                gc.freeze()
                log.info(
                    "daemon.gc",
                    collected=collected,
                    frozen=gc.get_freeze_count(),
                    pause_ms=round(1000 * (time.perf_counter() - started), 1),
                )
                await asyncio.sleep(FULL_COLLECTION_INTERVAL_S)
        finally:
            gc.unfreeze()  # the shutdown's garbage is the collector's again

    async def _persist_loop(self) -> None:
        # Asleep until history changes (no wake-ups in a quiet fleet), then at most one
        # write per PERSIST_INTERVAL_S however many hosts change meanwhile.
        while True:
            await self._history_dirty.wait()
            await asyncio.sleep(PERSIST_INTERVAL_S)
            self._history_dirty.clear()
            try:
                saved = await asyncio.to_thread(
                    self._write_history, self._history_file(), self._leadership.epoch
                )
            except OSError as exc:
                self._history_dirty.set()
                self._lead(leadership.CheckAsked())  # an I/O error on the run root: still ours?
                log.error("history.not_saved", reason=str(exc))
            else:
                if not saved:
                    self._lead(leadership.CheckAsked())  # another epoch on disk

    def _history_file(self) -> bytes:
        """Every host's restart history as the state file's bytes (``HistoryEncoder``)."""
        wall = time.time()
        return self._history_encoder.encode(
            self._fleet.histories(),
            wall_minus_mono=wall - asyncio.get_running_loop().time(),
            saved_at=wall,
            hostname=socket.gethostname(),
            version=layout.STATE_VERSION,
        )

    def _write_history(self, data: bytes, epoch: int) -> bool:
        """Save the restart history, unless another leadership's epoch is on disk (then it
        owns the file: False). In a thread."""
        run = layout.layout_of(self._config)
        why = leadership.not_ours(epoch, runfiles.read_epoch(run.epoch_file, root=run.root))
        if why is not None:
            log.error("history.not_saved", reason=f"{why}: another supervisor leads")
            return False
        runfiles.write_atomic(run.state_file, data, root=run.root)
        return True

    def _load_history(self) -> dict[str, health.History]:
        run = layout.layout_of(self._config)
        return runfiles.load_history(run.state_file, root=run.root, policy=self._config.health)

    # ------------------------------------------------------------------------------------
    # Status

    def _publish_status_soon(self) -> None:
        """``_publish_status`` within STATUS_COALESCE_S, once however many hosts change
        meanwhile: the summary counts all N hosts, and start-up changes thousands."""
        if not self._publish_pending:
            self._publish_pending = True
            asyncio.get_running_loop().call_later(STATUS_COALESCE_S, self._publish_status)

    def _publish_status(self, *, force: bool = False) -> None:
        self._publish_pending = False
        text = view.status_line(self._fleet)
        if text != self._summary or force:
            self._summary = text
            if self._ready:
                self._notifier.status(text)

    def _publish_event(self, event: str, reason: str) -> None:
        self._events.publish({"event": event, "timestamp": _utc_now(), "reason": reason})

    # ------------------------------------------------------------------------------------
    # Commands (control socket)

    def status(self) -> dict[str, Any]:
        """Request ``{"cmd": "status"}``; response ``{"daemon": {...}, "hosts": {...}}``."""
        if self._leadership.standing_by:
            return self._standby_status()
        self._publish_status()  # the summary as of now, not as of the last coalesced update
        now = asyncio.get_running_loop().time()
        core = self._fleet
        policy = core.health_policy
        hosts = {
            name: view.host_row(host, self._links[name].cfg, now, policy)
            for name, host in core.hosts.items()
            if name in self._links
        }
        for name in core.joining:
            # Its files are being read: shown as the host it is about to become.
            joining = health.new_host(name, now, history=core.history(name))
            hosts[name] = view.host_row(joining, self._host_configs[name], now, policy)
        for name, member in core.waiting.items():
            hosts[name] = {"state": "waiting", "shard": member.shard, "last_reason": "shard busy"}
        return {"daemon": self._daemon_row(now), "hosts": hosts}

    def host_status(self, name: str) -> dict[str, Any]:
        """Request ``{"cmd": "status", "host": H}``; response ``{"daemon": {...}, "host": H,
        ...}``, the host's row with its progress, restarts, last exit and evidence in full."""
        refused = leadership.refusal(self._leadership, "command")
        if refused is not None:
            raise ControlError(refused)
        self._publish_status()
        now = asyncio.get_running_loop().time()
        core = self._fleet
        policy = core.health_policy
        host = core.hosts.get(name)
        if host is not None and name in self._links:
            cfg = self._links[name].cfg
            detail = view.host_detail(host, cfg, now, policy, wall_now=time.time())
        elif name in core.joining:
            joining = health.new_host(name, now, history=core.history(name))
            cfg = self._host_configs[name]
            detail = view.host_detail(joining, cfg, now, policy, wall_now=time.time())
        elif name in core.waiting:
            detail = {
                "state": "waiting",
                "shard": core.waiting[name].shard,
                "last_reason": "shard busy",
            }
        else:
            raise ControlError(f"unknown host {name!r}")
        return {"daemon": self._daemon_row(now), "host": name, **detail}

    def _identity(self, now: float) -> dict[str, Any]:
        """The fields of a status's ``daemon`` row that a leader and a standby share."""
        return {
            "running": True,
            "pid": os.getpid(),
            "version": __version__,
            "config": str(self._config.source),
            "root": str(self._config.run.root),
            "uptime_s": round(now - self._started_at, 3),
            "started_at": self._started_wall,
            "stopping": self._stop_requested,
            "log_lines_dropped": logs.dropped_lines(),
            "on_exit": self._config.run.on_exit,
            "stop_grace_s": self._config.health.stop_grace_s,
        }

    def _daemon_row(self, now: float) -> dict[str, Any]:
        core = self._fleet
        return {
            **self._identity(now),
            "role": self._leadership.shown_role,
            "leader": self._leadership.leader,
            "epoch": self._leadership.epoch,
            "ready": self._ready,
            "summary": self._summary,
            "watch_mode": self._watcher.mode,
            "reloads": self._reloads,
            "last_reload_errors": self._last_reload_error,
            "frozen": core.freeze.frozen,
            "frozen_reason": core.freeze.reason or None,
            "freeze_finding": core.finding,
            "crash_signatures": [
                {
                    "signature": sig.signature,
                    "since_s": round(now - sig.since_at, 3),
                    "hosts": sorted(sig.hosts),
                    "canary": sig.canary,
                    "held": sorted(n for n, s in core.held.items() if s == sig.signature),
                }
                for sig in core.signatures.values()
            ],
            "launches_waiting": len(core.budget.waiting),
            "launches_in_flight": len(core.budget.in_flight),
            "status_parse_errors": getattr(self._watcher, "parse_errors", 0),
            "pointer": view.pointer_row(
                self._config.run.pointer_file, core.pointer, self._pointer_written_wall, now
            ),
        }

    def _standby_status(self) -> dict[str, Any]:
        """A standby's status: who leads, the epoch, its warm connections, and the hosts as
        the run directory shows them (re-read every STANDBY_VIEW_INTERVAL_S)."""
        now = asyncio.get_running_loop().time()
        self._lead(leadership.StatusAsked())
        core = self._leadership
        hosts = dict(self._standby_view.get("hosts", {}))
        leader = core.leader or "unknown"
        return {
            "daemon": {
                **self._identity(now),
                "role": "standby",
                "leader": leader,
                "epoch": core.epoch_on_disk,
                "ready": True,
                "summary": f"standby, leader: {leader}",
                "warm": {
                    "hosts": len(self._warm),
                    "connected": sum(1 for w in self._warm.values() if w.up),
                    "probed": sum(1 for w in self._warm.values() if w.agent_started),
                },
                "note": "standby: hosts as the run directory shows them; the leader acts",
                "view_age_s": round(now - (core.view_at or self._started_at), 3),
            },
            "hosts": hosts,
        }

    async def restart_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "restart-host", "host": H}``; response the host's new row."""
        await self._ask(lambda token: fleet.RestartHostRequested(host=host, token=token))
        return self._row(host)

    async def stop_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "stop-host", "host": H}``: writes ``ctl/H.stop``, so it stays so."""
        await self._ask(lambda token: fleet.StopHostRequested(host=host, token=token))
        return self._row(host)

    async def start_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "start-host", "host": H}``: removes the sentinel, clears ``failed``."""
        await self._ask(lambda token: fleet.StartHostRequested(host=host, token=token))
        return self._row(host)

    async def stop(self) -> dict[str, Any]:
        """Request ``{"cmd": "stop"}``: stop every worker (or detach), then the daemon."""
        self.request_stop("control socket")
        return {"stopping": True, "on_exit": self._config.run.on_exit}

    async def unfreeze(self) -> dict[str, Any]:
        """Request ``{"cmd": "unfreeze"}``; response ``{"frozen": false, "was_frozen": bool}``."""
        reply = await self._ask(lambda token: fleet.UnfreezeRequested(token=token))
        return dict(reply.result or {})

    def subscribe(self) -> EventSubscription:
        """A live stream of ``host.state`` events for ``reward-supervisor events``."""
        return self._events.subscribe()

    def _row(self, host: str) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        core = self._fleet
        row = view.host_row(core.hosts[host], self._links[host].cfg, now, core.health_policy)
        return {"host": host, **row}

    # ------------------------------------------------------------------------------------
    # Reload

    async def _reload_loop(self) -> None:
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()
            try:
                await self.reload()
            except ControlError as exc:
                log.warning("config.reload_skipped", reason=str(exc))
            except Exception:  # task root: a failed reload must not end the daemon
                log.exception("config.reload_failed_internally", kept=str(self._config.source))

    async def reload(self) -> dict[str, Any]:
        """Re-read and validate the config; apply it, or keep the old one and say why.

        A standby only checks the file: it applies the config as it is when it takes over.

        Request ``{"cmd": "reload"}``; response ``{"reloaded": bool, "errors": [...],
        "added": [...], "removed": [...], "restarted": [...], "updated": [...]}``.
        """
        refused = leadership.refusal(self._leadership, "reload")
        if refused is not None:
            raise ControlError(refused)
        async with self._reload_lock:
            self._notifier.reloading()
            try:
                return await self._reload()
            finally:
                # RELOADING=1 leaves systemd showing "reloading" until READY=1, however the
                # reload ended.
                self._notifier.ready()

    async def _reload(self) -> dict[str, Any]:
        """``reload`` under its lock, between RELOADING=1 and READY=1."""
        try:
            new = await asyncio.to_thread(config_mod.load, self._config.source)
        except ConfigError as exc:
            errors = [str(p) for p in exc.problems]
            self._last_reload_error = errors
            log.error("config.reload_failed", errors=errors, kept=str(self._config.source))
            if self._metrics is not None:
                self._metrics.reloads.labels(result="error").inc()
            return {"reloaded": False, "errors": errors}
        self._config = new
        self._host_configs.update((h.name, h) for h in new.hosts)
        self._warn_about_config(new)
        try:
            await asyncio.to_thread(layout.write_run_files, new)
        except OSError as exc:
            log.error("run.files_not_written", reason=str(exc))
        members = config_mod.members(new)
        reply = await self._ask(
            lambda token: fleet.Reconfigured(
                members=members, health=new.health, policy=new.fleet, token=token
            )
        )
        result = dict(reply.result or {})
        self._reloads += 1
        if self._metrics is not None:
            self._metrics.reloads.labels(result="ok").inc()
        self._last_reload_error = []
        log.info("config.reloaded", **result)
        return {"reloaded": True, "errors": [], **result}


# ----------------------------------------------------------------------------------------


def _events_of(observations: Iterable[Observation]) -> list[fleet.Event]:
    """The events that observations stand for, each about its host."""
    out: list[fleet.Event] = []
    for obs in observations:
        event = _event_of(obs)
        if event is not None:
            out.append(fleet.HostObserved(obs.host, event))
    return out


def _event_of(obs: Observation) -> health.Event | None:
    """The state-machine event an observation stands for (None: nothing to tell)."""
    match obs:
        case StatusObserved(record=record):
            if isinstance(record, StatusProblem):
                return health.StatusMissing(reason=record.reason)
            return health.HeartbeatSeen(
                pid=record.pid,
                ready=record.ready,
                remote_heartbeat_at=record.heartbeat_at,
                remote_seq=record.seq,
                processed=record.processed,
                in_flight=record.in_flight,
                stats=record.stats,
            )
        case ExitObserved(record=ExitRecord() as r):
            return health.WorkerExited(
                pid=r.pid,
                exit_code=r.exit_code,
                signal=r.signal,
                log_tail=r.log_tail,
                reaped=r.reaped,
            )
        case ExitObserved():
            return None  # the record went away: nothing died
        case SentinelObserved(present=present):
            return health.StopSentinelAppeared() if present else health.StopSentinelRemoved()
        case _:
            assert_never(obs)


#: Open files we raise our soft limit to when the hard limit allows: far past any fleet one
#: daemon serves, without asking the kernel for a table sized to a million descriptors.
OPEN_FILE_LIMIT_WANTED: Final = 65536


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files towards the hard one; the soft limit now.

    systemd starts services at a soft limit of 1024 (hard 524288) and expects a program
    that needs more to raise its own. We hold one SSH connection a host, so a fleet of ~800
    would run short; and a daemon out of descriptors fails its leadership check and deposes
    itself. Safe for us: asyncio and asyncssh wait with epoll, never select().
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:  # (-1 here) not on Linux, which caps at fs.nr_open
        return OPEN_FILE_LIMIT_WANTED
    target = OPEN_FILE_LIMIT_WANTED
    if hard != resource.RLIM_INFINITY:
        target = min(hard, target)
    if soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):  # a sandbox that refuses: run with what we have
        return soft
    return target


class _IoExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``) for ``run_process``: its shutdown
    waits for running jobs at most SHUTDOWN_IO_TIMEOUT_S, where asyncio's own waits for ever
    (3.11) or five minutes (3.12+)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel what has not started; with ``wait``, give what runs a bounded time."""
        super().shutdown(wait=False, cancel_futures=True)
        if wait:
            deadline = time.monotonic() + SHUTDOWN_IO_TIMEOUT_S
            for thread in _io_threads():
                thread.join(max(0.0, deadline - time.monotonic()))


def _io_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith(IO_THREAD_PREFIX) and t.is_alive()
    ]


def run_process(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main`` (the daemon) to its end in a new event loop; its exit code.

    A thread still inside a file operation after that (a hung run root) would hold the
    process open for as long as the mount hangs: the interpreter joins such threads at exit.
    Then the process ends at once, with the same code, after saying so.
    """
    with asyncio.Runner() as runner:
        runner.get_loop().set_default_executor(_IoExecutor(thread_name_prefix=IO_THREAD_PREFIX))
        code = runner.run(main())
    stuck = _io_threads()
    if stuck:
        log.error(
            "daemon.exit_forced",
            exit_code=code,
            stuck_threads=len(stuck),
            reason="file operations that never returned (the run root hangs)",
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    return code


def _identity() -> str:
    """How this daemon names itself in the run lock (``runfiles.lock_run`` writes it)."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def _lock_unknown(why: str) -> leadership.LockChecked:
    """A check that could not be made: the lock is not known to be ours."""
    return leadership.LockChecked(held=False, epoch_on_disk=None, reason=why)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def _aclose_quietly(remote: RemoteLike, name: str) -> None:
    try:
        async with asyncio.timeout(5):
            await remote.aclose()
    except (OSError, RemoteError, TimeoutError) as exc:  # closing is best effort
        log.warning("ssh.close_failed", host=name, reason=repr(exc))
