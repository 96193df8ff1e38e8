"""The I/O shell: turns files, SSH, timers, signals and operators into events for health.step.

It performs the actions the core returns and re-arms one timer per host. It decides nothing
about health: every "should we" lives in ``health.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, assert_never

import structlog

from supervisor import config as config_mod
from supervisor import fleet, health, layout, view
from supervisor.config import Config, HostConfig, SshConfig
from supervisor.control import ControlServer, EventHub, EventSubscription
from supervisor.errors import ConfigError, ControlError, LaunchRefused, RemoteError
from supervisor.layout import LaunchSpec
from supervisor.metrics import Metrics, restart_reason, snapshot_on_loop
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
# Extra time start-up waits beyond one connect timeout for probes and launches to answer
# before READY=1 goes out anyway (a host that cannot be reached must not block the others).
STARTUP_SLACK_S: Final = 10.0
# Shutdown must finish before systemd's TimeoutStopSec (stop_grace_s + 30 in our unit).
SHUTDOWN_SLACK_S: Final = 15.0
# STATUS= is for people; one summary per 0.1 s of changes is as current as anyone reads it.
STATUS_COALESCE_S: Final = 0.1
# A statvfs of a healthy mount answers in milliseconds; one this slow is a hung mount.
FS_CHECK_TIMEOUT_S: Final = 5.0
#: How often the whole heap is collected, on our schedule (``_collect_loop``).
FULL_COLLECTION_INTERVAL_S: Final = 3600.0


class RemoteLike(Protocol):
    """What the daemon needs of one host's SSH side (``remote.RemoteHost`` fits)."""

    @property
    def connected(self) -> bool: ...

    async def maintain(self) -> None: ...

    def update(self, host: HostConfig, ssh: SshConfig, python: str) -> None: ...

    async def launch(self, spec: LaunchSpec) -> Any: ...

    async def terminate(
        self, spec: LaunchSpec, pid: int, *, grace_s: float, kill: bool
    ) -> None: ...

    async def probe(self, spec: LaunchSpec, pid: int | None) -> int | None: ...

    async def aclose(self) -> None: ...


RemoteFactory = Callable[
    [HostConfig, SshConfig, str, asyncio.Semaphore, Callable[[bool, str], None]], RemoteLike
]
WatcherFactory = Callable[[Config], WatcherProtocol]


def default_remote_factory(
    host: HostConfig,
    ssh: SshConfig,
    python: str,
    handshakes: asyncio.Semaphore,
    on_connection: Callable[[bool, str], None],
) -> RemoteLike:
    """A real ``RemoteHost`` over asyncssh."""
    from supervisor.remote import RemoteHost

    return RemoteHost(host, ssh, python=python, handshakes=handshakes, on_connection=on_connection)


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


@dataclass
class _Member:
    """One host of the fleet as the shell holds it: config, core state, remote, tasks."""

    cfg: HostConfig
    host: health.Host
    remote: RemoteLike
    maintain: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    connect_attempted: bool = False
    retiring: bool = False
    ops: set[asyncio.Task[None]] = field(default_factory=set)


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
        self._members: dict[str, _Member] = {}
        self._waiting: dict[str, HostConfig] = {}  # hosts waiting for their shard to be free
        self._watcher = watcher_factory(config)
        self._handshakes = asyncio.Semaphore(config.ssh.max_concurrent_handshakes)
        self._events = EventHub()
        self._stop = asyncio.Event()
        self._reload_wanted = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._settled = asyncio.Event()
        self._unsettled: set[str] = set()  # hosts whose start-up is not done yet
        self._publish_pending = False
        self._change = asyncio.Event()
        self._history_dirty = asyncio.Event()  # set when restart history needs saving
        self._summary = ""
        self._started_wall = time.time()
        self._started_at = 0.0
        self._ready = False
        self._reloads = 0
        self._last_reload_error: list[str] = []
        self._tg: asyncio.TaskGroup | None = None
        self._run_lock: int | None = None
        self._freeze = fleet.Freeze()
        self._budget = fleet.Budget()
        self._fleet_timer: asyncio.TimerHandle | None = None
        self._freeze_finding: str | None = None  # what the run filesystem said at the freeze
        self._diagnosis: asyncio.Task[None] | None = None
        self._state_changes = 0  # host state transitions so far (tells batches that matter)
        self._tearing_down = False
        self._metrics: Metrics | None = None

    # ------------------------------------------------------------------------------------
    # Life cycle

    async def run(self) -> int:
        """Serve until asked to stop; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        log.info(
            "daemon.starting",
            version=__version__,
            config=str(self._config.source),
            root=str(self._config.run.root),
            hosts=len(self._config.hosts),
            pid=os.getpid(),
        )
        try:
            await asyncio.to_thread(self._prepare_run_directory)
        except (OSError, ControlError) as exc:
            log.error("daemon.cannot_start", reason=str(exc))
            return 1
        control = ControlServer(self._config.control.socket, self)
        try:
            await control.start()
        except ControlError as exc:
            log.error("daemon.cannot_start", reason=str(exc))
            self._release_run_lock()
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
            self._release_run_lock()
            log.info("daemon.stopped")
        return 0

    async def _serve(self) -> None:
        history = await asyncio.to_thread(self._load_history)
        initial = await self._watcher.scan_all()
        sentinels = {o.host for o in initial if isinstance(o, SentinelObserved) and o.present}
        for cfg in self._config.hosts:
            self._add_member(cfg, history.get(cfg.name), cfg.name in sentinels)
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._on_observations(initial)  # baselines: every file read once before SSH
            for member in self._members.values():
                self._start_member(member)
            background = [
                tg.create_task(self._watcher.run(self._on_observations), name="watcher"),
                tg.create_task(self._watchdog_loop(), name="watchdog"),
                tg.create_task(self._persist_loop(), name="persist"),
                tg.create_task(self._reload_loop(), name="reload"),
            ]
            await self._wait_for_startup()
            self._ready = True
            self._notifier.ready()
            self._publish_status()
            log.info("daemon.ready", summary=self._summary, watch_mode=self._watcher.mode)
            background.append(tg.create_task(self._collect_loop(), name="gc"))
            await self._stop.wait()
            await self._shut_down()
            self._tearing_down = True  # from here on nothing new may start in the group
            for task in background:
                task.cancel()
            if self._fleet_timer is not None:
                self._fleet_timer.cancel()
            if self._diagnosis is not None:
                self._diagnosis.cancel()
            for member in self._members.values():
                self._stop_member_tasks(member)
        self._tg = None
        await self._close_remotes()
        snapshot = self._history_snapshot(time.time() - asyncio.get_running_loop().time())
        try:
            await asyncio.to_thread(self._write_history, snapshot)
        except OSError as exc:
            log.error("history.not_saved", reason=str(exc))

    def _start_metrics(self, loop: asyncio.AbstractEventLoop) -> None:
        listen = self._config.metrics.listen
        if listen is None:
            return
        host, port = config_mod.split_host_port(listen)
        metrics = Metrics(snapshot_on_loop(loop, self.status))
        try:
            metrics.start(host, port)
        except OSError as exc:
            # Supervision matters more than its dashboard: run on, and say so loudly.
            log.error("metrics.not_started", listen=listen, reason=str(exc))
            return
        self._metrics = metrics

    def _prepare_run_directory(self) -> None:
        layout.ensure_run_dirs(self._config)
        self._run_lock = _lock_run(layout.layout_of(self._config).ctl / "supervisor.lock")
        layout.write_run_files(self._config)

    def _release_run_lock(self) -> None:
        if self._run_lock is not None:
            os.close(self._run_lock)
            self._run_lock = None

    async def _wait_for_startup(self) -> None:
        timeout = self._config.ssh.connect_timeout_s + STARTUP_SLACK_S
        self._check_settled()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.wait(
                    [
                        asyncio.ensure_future(self._settled.wait()),
                        asyncio.ensure_future(self._stop.wait()),
                    ],
                    return_when=asyncio.FIRST_COMPLETED,
                )
        if not self._settled.is_set():
            slow = [m.cfg.name for m in self._members.values() if not _settled(m)]
            log.warning("daemon.ready_without", hosts=slow, waited_s=timeout)

    async def _shut_down(self) -> None:
        self._notifier.stopping()
        on_exit = self._config.run.on_exit
        log.info("daemon.stopping", on_exit=on_exit)
        if on_exit == "detach":
            return  # workers keep running; the next daemon adopts them
        for name in list(self._members):
            self._feed(name, health.StopRequested(reason="daemon shutdown", cause="shutdown"))
        deadline = self._config.health.stop_grace_s + SHUTDOWN_SLACK_S
        try:
            async with asyncio.timeout(deadline):
                while not all(_stop_done(m) for m in self._members.values()):
                    await self._changed()
        except TimeoutError:
            left = [m.cfg.name for m in self._members.values() if not _stop_done(m)]
            log.error("daemon.stop_incomplete", hosts=left, waited_s=deadline)
            return
        # A host we cannot reach cannot be stopped: say so, or on_exit = "stop" would read as
        # a promise kept for workers that may well run on.
        unreachable = [
            m.cfg.name
            for m in self._members.values()
            if m.host.state is not health.HostState.STOPPED
        ]
        if unreachable:
            log.error(
                "daemon.stop_incomplete",
                hosts=unreachable,
                reason=(
                    "unreachable over SSH: their workers may still run; the next daemon adopts them"
                ),
            )

    async def _changed(self) -> None:
        """Wait until some host changes (an op finishes, SSH moves)."""
        self._change.clear()
        await self._change.wait()

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    def _remove_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)

    def request_stop(self, why: str = "request") -> None:
        """Begin a graceful stop (SIGTERM, SIGINT, ``stop`` command)."""
        if not self._stop.is_set():
            log.info("daemon.stop_requested", by=why)
            self._stop.set()

    def request_reload(self) -> None:
        """Re-read the config soon (SIGHUP); repeated requests converge to the last file."""
        self._reload_wanted.set()

    # ------------------------------------------------------------------------------------
    # Members

    def _group(self) -> asyncio.TaskGroup:
        if self._tg is None or self._tearing_down:
            raise RuntimeError("hosts act only while the daemon's task group runs")
        return self._tg

    def _add_member(
        self, cfg: HostConfig, history: health.History | None, sentinel: bool
    ) -> _Member:
        now = asyncio.get_running_loop().time()
        name = cfg.name
        remote = self._remote_factory(
            cfg,
            self._config.ssh,
            self._config.worker.python,
            self._handshakes,
            lambda up, reason: self._on_connection(name, up, reason),
        )
        host = health.new_host(name, now, stop_sentinel=sentinel, history=history)
        if self._freeze.frozen:
            host, _ = health.step(
                host, health.FleetFrozen(reason=self._freeze.reason), now, self._config.health
            )
        member = _Member(cfg=cfg, host=host, remote=remote)
        self._members[name] = member
        self._watcher.set_hosts(self._members)
        if not self._ready and not _settled(member):
            self._unsettled.add(name)
        return member

    def _start_member(self, member: _Member) -> None:
        member.maintain = self._group().create_task(
            member.remote.maintain(), name=f"ssh:{member.cfg.name}"
        )

    def _stop_member_tasks(self, member: _Member) -> None:
        if member.maintain is not None:
            member.maintain.cancel()
        for task in member.ops:
            task.cancel()
        if member.timer is not None:
            member.timer.cancel()
            member.timer = None

    async def _close_remotes(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for member in self._members.values():
                tg.create_task(_aclose_quietly(member.remote, member.cfg.name))

    # ------------------------------------------------------------------------------------
    # Events in

    def _feed(self, name: str, event: health.Event) -> None:
        member = self._members.get(name)
        if member is None:
            return
        loop = asyncio.get_running_loop()
        before = member.host
        host, actions = health.step(before, event, loop.time(), self._config.health)
        member.host = host
        for action in actions:
            self._perform(member, action)
        self._arm_timer(member, host.deadline_at)
        if health.history_changed(before, host):
            self._history_dirty.set()
        if host.state is not before.state:
            self._state_changes += 1
        if host.state is not before.state or host.ssh_up != before.ssh_up or host.op != before.op:
            self._after_change(member)

    def _after_change(self, member: _Member) -> None:
        if member.host.state is not health.HostState.STARTING:
            self._cancel_queued_launch(member)
        self._publish_status_soon()
        self._change.set()
        if member.retiring and member.host.state is health.HostState.STOPPED:
            self._drop_member(member)
        if not self._ready:
            self._check_settled(member)

    def _check_settled(self, member: _Member | None = None) -> None:
        """Start-up is over once no host is unsettled; ``member`` is the host that changed."""
        # Tracked host by host as each changes: re-checking all N hosts on every change made
        # start-up quadratic (seconds of CPU at 1000 hosts, docs/BENCHMARKS.md).
        if member is not None and self._members.get(member.cfg.name) is member:
            if _settled(member):
                self._unsettled.discard(member.cfg.name)
            else:
                self._unsettled.add(member.cfg.name)
        if not self._unsettled:
            self._settled.set()

    def _on_observations(self, observations: list[Observation]) -> None:
        changes = self._state_changes
        for obs in observations:
            event = _event_of(obs)
            if event is not None:
                self._feed(obs.host, event)
        # The fleet is assessed on its own timer as silences grow. A batch matters to it only
        # if the fleet is frozen (heartbeats thaw it) or a host changed state (the count of
        # hosts that should run sets the threshold): heartbeats alone only shorten silences,
        # so they cannot freeze it. Assessing all N hosts after every batch of heartbeats
        # cost ~5% of a core at 1000 hosts (docs/BENCHMARKS.md).
        if self._freeze.frozen or self._state_changes != changes:
            self._assess_fleet()

    # ------------------------------------------------------------------------------------
    # Fleet: common-mode freeze and launch budget (decided in fleet.py)

    def _fleet_policy(self) -> fleet.FleetPolicy:
        f = self._config.fleet
        return fleet.FleetPolicy(
            freeze_fraction=f.freeze_fraction,
            freeze_window_s=f.freeze_window_s,
            heartbeat_stale_s=self._config.health.heartbeat_stale_s,
            max_concurrent_launches=f.max_concurrent_launches,
            max_launches_per_minute=f.max_launches_per_minute,
        )

    def _assess_fleet(self) -> None:
        now = asyncio.get_running_loop().time()
        hosts = [m.host for m in self._members.values()]
        self._freeze, change = fleet.assess(self._freeze, hosts, now, self._fleet_policy())
        if change is not None:
            self._apply_freeze(change)
        self._arm_fleet_timer()

    def _apply_freeze(self, change: fleet.FreezeChanged) -> None:
        self._freeze_finding = None
        if change.frozen:
            log.error("fleet.frozen", reason=change.reason, hosts=sorted(self._freeze.hosts))
            if self._tg is not None and not self._tearing_down:
                if self._diagnosis is not None:
                    self._diagnosis.cancel()
                self._diagnosis = self._tg.create_task(
                    self._diagnose_freeze(), name="freeze-diagnosis"
                )
        else:
            log.warning("fleet.thawed", reason=change.reason)
        self._events.publish(
            {
                "event": "fleet.frozen" if change.frozen else "fleet.thawed",
                "timestamp": _utc_now(),
                "reason": change.reason,
            }
        )
        event: health.Event = (
            health.FleetFrozen(reason=change.reason) if change.frozen else health.FleetThawed()
        )
        for name in list(self._members):
            self._feed(name, event)
        self._summary = ""  # force a fresh STATUS= line
        self._publish_status()

    async def _diagnose_freeze(self) -> None:
        """Tell the operator whether the run root itself is hung or full, the two causes this
        node can check, instead of only "suspect the shared filesystem"."""
        check = await check_filesystem(self._config.run.root, FS_CHECK_TIMEOUT_S)
        if not self._freeze.frozen:
            return  # thawed meanwhile: old news
        self._freeze_finding = check.finding
        log.error("fleet.freeze_finding", finding=check.finding, free_bytes=check.free_bytes)
        self._events.publish(
            {"event": "fleet.freeze_finding", "timestamp": _utc_now(), "reason": check.finding}
        )
        self._summary = ""
        self._publish_status()

    def _arm_fleet_timer(self) -> None:
        loop = asyncio.get_running_loop()
        hosts = [m.host for m in self._members.values()]
        policy = self._fleet_policy()
        now = loop.time()
        times = [
            t
            for t in (
                fleet.next_assessment_at(self._freeze, hosts, now, policy),
                fleet.next_grant_at(self._budget, policy),
            )
            if t is not None
        ]
        when = min(times) if times else None
        if self._fleet_timer is not None:
            if when is not None and self._fleet_timer.when() == when:
                return
            self._fleet_timer.cancel()
            self._fleet_timer = None
        if when is not None:
            self._fleet_timer = loop.call_at(when, self._fleet_timer_fired)

    def _fleet_timer_fired(self) -> None:
        self._fleet_timer = None
        if self._tg is None or self._tearing_down:
            return
        self._grant_launches()
        self._assess_fleet()

    def _on_connection(self, name: str, up: bool, reason: str) -> None:
        member = self._members.get(name)
        if member is not None:
            member.connect_attempted = True
        log.info("ssh.up" if up else "ssh.down", host=name, reason=reason)
        self._feed(name, health.SshRestored() if up else health.SshLost(reason=reason))
        if member is not None and not self._ready:
            self._check_settled(member)

    def _arm_timer(self, member: _Member, deadline_at: float | None) -> None:
        if member.timer is not None:
            # A timer due no later than the deadline is kept: every heartbeat moves a ready
            # host's deadline, and an early wake-up only makes the core say when to come back.
            if deadline_at is not None and member.timer.when() <= deadline_at:
                return
            member.timer.cancel()
            member.timer = None
        if deadline_at is not None:
            loop = asyncio.get_running_loop()
            name = member.cfg.name
            member.timer = loop.call_at(deadline_at, self._deadline_fired, name)

    def _deadline_fired(self, name: str) -> None:
        member = self._members.get(name)
        if member is not None:
            member.timer = None
            self._feed(name, health.DeadlinePassed())

    # ------------------------------------------------------------------------------------
    # Actions out

    def _perform(self, member: _Member, action: health.Action) -> None:
        name = member.cfg.name
        match action:
            case health.StateChanged():
                self._log_state_change(member, action)
            case health.Launch():
                log.info("host.launch", host=name, reason=action.reason, restart=action.is_restart)
                if action.is_restart and self._metrics is not None:
                    reason = restart_reason(action.reason)
                    self._metrics.restarts.labels(host=name, reason=reason).inc()
                now = asyncio.get_running_loop().time()
                self._budget = fleet.want_launch(self._budget, name, now)
                self._grant_launches()
            case health.Terminate():
                log.info("host.terminate", host=name, pid=action.pid, grace_s=action.grace_s)
                self._spawn(member, self._terminate(member, action), "terminate")
            case health.Probe():
                self._spawn(member, self._probe(member, action), "probe")

    def _spawn(self, member: _Member, coro: Any, what: str) -> None:
        task = self._group().create_task(coro, name=f"{what}:{member.cfg.name}")
        member.ops.add(task)
        task.add_done_callback(member.ops.discard)

    def _log_state_change(self, member: _Member, change: health.StateChanged) -> None:
        host = member.host
        fields = {
            "host": member.cfg.name,
            "from": change.from_.value,
            "to": change.to.value,
            "reason": change.reason,
            "pid": host.pid if host.pid is not None else host.last_pid,
        }
        level = "warning" if change.to in health.UNHEALTHY_STATES else "info"
        getattr(log, level)("host.state", **fields)
        self._events.publish({"event": "host.state", "timestamp": _utc_now(), **fields})

    def _grant_launches(self) -> None:
        """Start the queued launches the fleet budget allows now (longest waiting first)."""
        now = asyncio.get_running_loop().time()
        self._budget, granted = fleet.grant(self._budget, now, self._fleet_policy())
        for name in granted:
            member = self._members.get(name)
            if member is None:
                self._budget = fleet.launch_done(self._budget, name)
                continue
            log.info("host.launch_begin", host=name)
            self._feed(name, health.LaunchBegan())
            self._spawn(member, self._launch(member), "launch")
        if self._budget.waiting:
            log.info("fleet.launches_queued", waiting=len(self._budget.waiting))
        self._arm_fleet_timer()

    def _cancel_queued_launch(self, member: _Member) -> None:
        """A host that left ``starting`` while its launch waited in the queue gives it up."""
        name = member.cfg.name
        if not any(n == name for n, _ in self._budget.waiting):
            return
        self._budget = fleet.launch_done(self._budget, name)
        self._feed(name, health.LaunchFailed(reason="cancelled before it began"))

    async def _launch(self, member: _Member) -> None:
        try:
            event = await self._launch_now(member)
        finally:
            self._budget = fleet.launch_done(self._budget, member.cfg.name)
            if self._tg is not None and not self._tearing_down:
                self._grant_launches()
        # Only now, with the slot given back: a relaunch the core asks for at once (the first
        # failure after a healthy spell) would otherwise find this launch still in flight,
        # count as a duplicate request, and be dropped, leaving the host waiting forever.
        self._feed(member.cfg.name, event)

    async def _launch_now(self, member: _Member) -> health.Event:
        """Run one launch; the event that answers it (fed by the caller)."""
        name, spec = member.cfg.name, self._spec(member)
        started = time.monotonic()
        event: health.Event
        try:
            result = await member.remote.launch(spec)
        except LaunchRefused as exc:
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
        return event

    async def _terminate(self, member: _Member, action: health.Terminate) -> None:
        name, spec = member.cfg.name, self._spec(member)
        started = time.monotonic()
        event: health.Event
        try:
            await member.remote.terminate(
                spec, action.pid, grace_s=action.grace_s, kill=action.kill
            )
        except RemoteError as exc:
            log.error("host.terminate_failed", host=name, pid=action.pid, reason=exc.reason)
            event = health.TerminateFailed(pid=action.pid, reason=exc.reason)
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("host.terminate_failed", host=name, pid=action.pid)
            event = health.TerminateFailed(pid=action.pid, reason=f"internal error: {exc!r}")
        else:
            elapsed = time.monotonic() - started
            if self._metrics is not None:
                self._metrics.terminate_seconds.observe(elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info("host.terminated", host=name, pid=action.pid, elapsed_ms=elapsed_ms)
            event = health.TerminateConfirmed(pid=action.pid)
        self._feed(name, event)

    async def _probe(self, member: _Member, action: health.Probe) -> None:
        name, spec = member.cfg.name, self._spec(member)
        event: health.Event
        try:
            pid = await member.remote.probe(spec, action.pid)
        except RemoteError as exc:
            log.warning("host.probe_failed", host=name, reason=exc.reason)
            event = health.ProbeFailed(reason=exc.reason)
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("host.probe_failed", host=name)
            event = health.ProbeFailed(reason=f"internal error: {exc!r}")
        else:
            log.info("host.probe", host=name, found_pid=pid)
            event = health.ProbeResult(pid=pid)
        self._feed(name, event)

    def _spec(self, member: _Member) -> LaunchSpec:
        return layout.launch_spec(self._config, member.cfg)

    # ------------------------------------------------------------------------------------
    # Reload

    async def _reload_loop(self) -> None:
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()
            await self.reload()

    async def reload(self) -> dict[str, Any]:
        """Re-read and validate the config; apply it, or keep the old one and say why.

        Request ``{"cmd": "reload"}``; response ``{"reloaded": bool, "errors": [...],
        "added": [...], "removed": [...], "restarted": [...]}``.
        """
        async with self._reload_lock:
            self._notifier.reloading()
            try:
                new = await asyncio.to_thread(config_mod.load, self._config.source)
            except ConfigError as exc:
                errors = [str(p) for p in exc.problems]
                self._last_reload_error = errors
                log.error("config.reload_failed", errors=errors, kept=str(self._config.source))
                if self._metrics is not None:
                    self._metrics.reloads.labels(result="error").inc()
                self._notifier.ready()
                return {"reloaded": False, "errors": errors}
            result = await self._apply(new)
            self._reloads += 1
            if self._metrics is not None:
                self._metrics.reloads.labels(result="ok").inc()
            self._last_reload_error = []
            self._notifier.ready()
            log.info("config.reloaded", **result)
            return {"reloaded": True, "errors": [], **result}

    async def _apply(self, new: Config) -> dict[str, list[str]]:
        old = self._config
        plan = config_mod.plan_reload(old, new)
        self._config = new
        try:
            await asyncio.to_thread(layout.write_run_files, new)
        except OSError as exc:
            log.error("run.files_not_written", reason=str(exc))
        for name in plan.removed:
            # A host still waiting for its shard or name never started: forget it, or it
            # would start later although no config has it any more.
            self._waiting.pop(name, None)
            self._retire(name, "removed from config by reload")
        for name in plan.updated:
            cfg = new.host(name)
            if name in self._waiting and cfg is not None:
                # Not started yet; a member of that name is its retiring predecessor, which
                # must not be touched. It will start with these settings.
                self._waiting[name] = cfg
                continue
            member = self._members[name]
            member.cfg = cfg or member.cfg
            member.remote.update(member.cfg, new.ssh, new.worker.python)
        for name in plan.restarted:
            if name not in self._waiting:
                reason = "launch parameters changed by reload"
                self._feed(name, health.RestartRequested(reason=reason))
        for name in plan.added:
            cfg = new.host(name)
            if cfg is not None:
                self._waiting[name] = cfg
        self._admit_waiting()
        for name in list(self._members):
            self._feed(name, health.DeadlinePassed())  # new timings: recompute every deadline
        return {
            "added": list(plan.added),
            "removed": list(plan.removed),
            "restarted": list(plan.restarted),
            "updated": list(plan.updated),
        }

    def _retire(self, name: str, reason: str) -> None:
        member = self._members.get(name)
        if member is None:
            return
        member.retiring = True
        self._feed(name, health.StopRequested(reason=reason, cause="removed"))
        if member.host.state is health.HostState.STOPPED and name in self._members:
            self._drop_member(member)

    def _drop_member(self, member: _Member) -> None:
        name = member.cfg.name
        if self._members.get(name) is not member:
            return
        del self._members[name]
        self._watcher.set_hosts(self._members)
        self._unsettled.discard(name)
        self._stop_member_tasks(member)
        if self._tg is not None:
            self._tg.create_task(_aclose_quietly(member.remote, name), name=f"close:{name}")
        log.info("host.removed", host=name)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Add hosts whose shard no retiring host still holds (one worker per shard), and whose
        name no retiring host still holds (a host re-added while its old self is stopping
        waits for it: replacing the member would orphan its tasks and connection)."""
        busy = {m.cfg.shard for m in self._members.values()}
        for name, cfg in list(self._waiting.items()):
            if cfg.shard in busy or name in self._members:
                continue
            del self._waiting[name]
            sentinel = layout.layout_of(self._config).stop_sentinel(name).exists()
            member = self._add_member(cfg, None, sentinel)
            busy.add(cfg.shard)
            if self._tg is not None:
                self._start_member(member)
            log.info("host.added", host=name, shard=cfg.shard)

    # ------------------------------------------------------------------------------------
    # Background loops

    async def _watchdog_loop(self) -> None:
        interval = self._notifier.watchdog_interval_s()
        if interval is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            if self._watcher.healthy(loop.time()):
                self._notifier.watchdog()
            else:
                log.warning("daemon.watchdog_withheld", reason="file watcher not healthy")
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
            loop = asyncio.get_running_loop()
            snapshot = self._history_snapshot(time.time() - loop.time())
            try:
                await asyncio.to_thread(self._write_history, snapshot)
            except OSError as exc:
                self._history_dirty.set()
                log.error("history.not_saved", reason=str(exc))

    def _history_snapshot(self, wall_minus_mono: float) -> dict[str, Any]:
        """Every host's restart history with instants converted to wall-clock time."""
        hosts: dict[str, Any] = {}
        for name, member in self._members.items():
            hist = health.history_of(member.host)
            nxt = hist.next_restart_at
            hosts[name] = {
                "failures": hist.failures,
                "restarts": hist.restarts,
                "restart_times": [t + wall_minus_mono for t in hist.restart_times_at],
                "next_restart_at": None if nxt is None else nxt + wall_minus_mono,
                "cause": hist.cause,
                "failed": hist.failed,
            }
        return {
            "version": layout.STATE_VERSION,
            "saved_at": time.time(),
            "hostname": socket.gethostname(),
            "hosts": hosts,
        }

    def _write_history(self, snapshot: dict[str, Any]) -> None:
        layout.write_json_atomic(layout.layout_of(self._config).state_file, snapshot)

    def _load_history(self) -> dict[str, health.History]:
        path = layout.layout_of(self._config).state_file
        try:
            raw = layout.read_json(path)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("history.unreadable", path=str(path), reason=str(exc))
            return {}
        offset = time.monotonic() - time.time()  # wall clock + offset = monotonic
        return history_from_json(raw, offset)

    # ------------------------------------------------------------------------------------
    # Status

    def _publish_status_soon(self) -> None:
        """``_publish_status`` within STATUS_COALESCE_S, once however many hosts change
        meanwhile: the summary counts all N hosts, and start-up changes thousands."""
        if not self._publish_pending:
            self._publish_pending = True
            asyncio.get_running_loop().call_later(STATUS_COALESCE_S, self._publish_status)

    def _publish_status(self) -> None:
        self._publish_pending = False
        text = view.summary(m.host.state.value for m in self._members.values())
        if self._freeze.frozen:
            finding = f"{self._freeze_finding}; " if self._freeze_finding else ""
            text = f"FROZEN ({finding}restarts held: {self._freeze.reason}); {text}"
        if text != self._summary:
            self._summary = text
            if self._ready:
                self._notifier.status(text)

    # ------------------------------------------------------------------------------------
    # Commands (control socket)

    def status(self) -> dict[str, Any]:
        """Request ``{"cmd": "status"}``; response ``{"daemon": {...}, "hosts": {...}}``."""
        self._publish_status()  # the summary as of now, not as of the last coalesced update
        now = asyncio.get_running_loop().time()
        hosts = {
            name: view.host_row(m.host, m.cfg, now, self._config.health)
            for name, m in self._members.items()
        }
        for name, cfg in self._waiting.items():
            hosts[name] = {"state": "waiting", "shard": cfg.shard, "last_reason": "shard busy"}
        return {
            "daemon": {
                "running": True,
                "pid": os.getpid(),
                "version": __version__,
                "config": str(self._config.source),
                "root": str(self._config.run.root),
                "uptime_s": round(now - self._started_at, 3),
                "started_at": self._started_wall,
                "ready": self._ready,
                "stopping": self._stop.is_set(),
                "summary": self._summary,
                "watch_mode": self._watcher.mode,
                "on_exit": self._config.run.on_exit,
                "stop_grace_s": self._config.health.stop_grace_s,
                "reloads": self._reloads,
                "last_reload_errors": self._last_reload_error,
                "frozen": self._freeze.frozen,
                "frozen_reason": self._freeze.reason or None,
                "freeze_finding": self._freeze_finding,
                "launches_waiting": len(self._budget.waiting),
                "launches_in_flight": len(self._budget.in_flight),
                "status_parse_errors": getattr(self._watcher, "parse_errors", 0),
            },
            "hosts": hosts,
        }

    async def restart_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "restart-host", "host": H}``; response the host's new row."""
        member = self._member(host)
        if member.host.stop_sentinel:
            raise ControlError(
                f"host {host!r} is held stopped by its stop sentinel; use start-host"
            )
        self._feed(host, health.RestartRequested(reason="operator restart"))
        return self._row(host)

    async def stop_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "stop-host", "host": H}``: writes ``ctl/H.stop``, so it stays so."""
        self._member(host)
        path = layout.layout_of(self._config).stop_sentinel(host)
        await asyncio.to_thread(_touch, path)
        self._feed(host, health.StopSentinelAppeared())
        return self._row(host)

    async def start_host(self, host: str) -> dict[str, Any]:
        """Request ``{"cmd": "start-host", "host": H}``: removes the sentinel, clears ``failed``."""
        self._member(host)
        path = layout.layout_of(self._config).stop_sentinel(host)
        await asyncio.to_thread(_unlink_missing_ok, path)
        self._feed(host, health.StopSentinelRemoved())
        self._feed(host, health.StartRequested(reason="operator start"))
        return self._row(host)

    async def stop(self) -> dict[str, Any]:
        """Request ``{"cmd": "stop"}``: stop every worker (or detach), then the daemon."""
        self.request_stop("control socket")
        return {"stopping": True, "on_exit": self._config.run.on_exit}

    async def unfreeze(self) -> dict[str, Any]:
        """Request ``{"cmd": "unfreeze"}``; response ``{"frozen": false, "was_frozen": bool}``."""
        was = self._freeze.frozen
        now = asyncio.get_running_loop().time()
        self._freeze, change = fleet.unfreeze(self._freeze, now)
        if change is not None:
            self._apply_freeze(change)
        return {"frozen": False, "was_frozen": was}

    def subscribe(self) -> EventSubscription:
        """A live stream of ``host.state`` events for ``reward-supervisor events``."""
        return self._events.subscribe()

    def _member(self, host: str) -> _Member:
        member = self._members.get(host)
        if member is None or member.retiring:
            known = ", ".join(sorted(self._members)) or "none"
            raise ControlError(f"unknown host {host!r} (known: {known})")
        return member

    def _row(self, host: str) -> dict[str, Any]:
        member = self._members[host]
        now = asyncio.get_running_loop().time()
        return {"host": host, **view.host_row(member.host, member.cfg, now, self._config.health)}


# ----------------------------------------------------------------------------------------


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
            )
        case ExitObserved(record=ExitRecord() as r):
            return health.WorkerExited(pid=r.pid, exit_code=r.exit_code, signal=r.signal)
        case ExitObserved():
            return None  # the record went away: nothing died
        case SentinelObserved(present=present):
            return health.StopSentinelAppeared() if present else health.StopSentinelRemoved()
        case _:
            assert_never(obs)


def _settled(member: _Member) -> bool:
    """Start-up is done for this host: it answered (adopted, launched) or cannot be reached."""
    host = member.host
    if not member.connect_attempted:
        return False
    if not host.ssh_up:
        return True
    return not host.needs_probe and host.op not in ("probe", "launch")


def _stop_done(member: _Member) -> bool:
    host = member.host
    return host.state is health.HostState.STOPPED or (not host.ssh_up and host.op is None)


def history_from_json(raw: Any, offset: float) -> dict[str, health.History]:
    """Parse ``ctl/supervisor-state.json``; wall-clock instants + ``offset`` = monotonic."""
    out: dict[str, health.History] = {}
    hosts = raw.get("hosts") if isinstance(raw, dict) else None
    if not isinstance(hosts, dict):
        return out
    for name, h in hosts.items():
        if not isinstance(h, dict):
            continue
        try:
            times = tuple(float(t) + offset for t in h.get("restart_times") or ())
            nxt = h.get("next_restart_at")
            out[str(name)] = health.History(
                failures=int(h.get("failures") or 0),
                restarts=int(h.get("restarts") or 0),
                restart_times_at=times,
                next_restart_at=None if nxt is None else float(nxt) + offset,
                cause=h.get("cause") if isinstance(h.get("cause"), str) else None,
                failed=h.get("failed") if isinstance(h.get("failed"), str) else None,
            )
        except (TypeError, ValueError):
            log.warning("history.bad_entry", host=name)
    return out


def _lock_run(path: Path) -> int:
    """Hold ``ctl/supervisor.lock`` for our lifetime: one supervisor per run, even across
    nodes (lockf on NFS is a server-side lock)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_text(fd)
        os.close(fd)
        who = holder or "unknown"
        raise ControlError(
            f"another reward-supervisor already runs this run ({path} is locked by {who})"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
    return fd


def _read_text(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 200).decode(errors="replace").strip()
    except OSError:
        return ""


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"stopped by reward-supervisor stop-host at {_utc_now()}\n", encoding="utf-8")


def _unlink_missing_ok(path: Path) -> None:
    path.unlink(missing_ok=True)


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def _aclose_quietly(remote: RemoteLike, name: str) -> None:
    try:
        async with asyncio.timeout(5):
            await remote.aclose()
    except (OSError, RemoteError, TimeoutError) as exc:  # closing is best effort
        log.warning("ssh.close_failed", host=name, reason=repr(exc))
