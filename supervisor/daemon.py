"""The interpreter: turns files, SSH, timers, signals and operators into events for the
cores, and has the adapters perform the actions the cores return.

Everything for the fleet goes through one queue (``_Inbox``): inputs and the results of
actions alike. One task takes what is queued as a batch, hands it to ``Fleet.step`` and
routes each action, by its type, to the adapter that performs it (``_routes``); an adapter
never calls a core, it queues its result. So the core is entered by one caller, one batch
at a time, and decides everything.

Leadership (the run lock, the epoch, a standby's wait, the handover) is the third core's,
``leadership.py``: ``_lead`` feeds it one event at a time (an event that comes while its
actions are performed waits its turn), its one timer wakes it at ``deadline_at``, and its
actions are routed the same way (``_lead_routes``). It outlives the fleet at both ends (a
standby has no fleet yet; a handover holds off after the fleet is gone), so it is not fed
through the fleet's queue; the fleet hears of it by events (``Booted``, ``LeadershipEnded``).

The adapters, one per outside world, each given this daemon as its ``shell.Shell``:
``links.Links`` (SSH), ``rundir.RunDirectory`` (the run root and its watcher),
``present.Presenter`` (logs, ``STATUS=``, metrics, events, status answers),
``probes.Prober`` (reward probes through the shards' queues) and
``commands.Operator`` (the control socket and reload). This module has no ``if`` about a
host's state, a role or a policy: ``tests/unit/test_interpreter_rules.py`` checks it
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final

import structlog

from supervisor import config as config_mod
from supervisor import fleet, leadership, vocabulary
from supervisor.commands import Operator
from supervisor.config import Config
from supervisor.control import ControlServer
from supervisor.errors import ControlError
from supervisor.links import Links, RemoteFactory, default_remote_factory
from supervisor.notify import Notifier, NotifierProtocol
from supervisor.present import Facts, Presenter, __version__
from supervisor.probes import Prober
from supervisor.process import raise_open_file_limit, run_process
from supervisor.rundir import RunDirectory
from supervisor.watch import Watcher, WatcherProtocol

log = structlog.get_logger("supervisor.daemon")

__all__ = ["Daemon", "__version__", "raise_open_file_limit", "run_process"]

#: How often the whole heap is collected, on our schedule (``_collect_loop``).
FULL_COLLECTION_INTERVAL_S: Final = 3600.0

WatcherFactory = Callable[[Config], WatcherProtocol]


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
        self._items: deque[vocabulary.Event] = deque()
        self._ready = asyncio.Event()

    def put(self, event: vocabulary.Event) -> None:
        """Queue one event."""
        self._items.append(event)
        self._ready.set()

    def put_all(self, events: Iterable[vocabulary.Event]) -> None:
        """Queue events to be taken in this order, in one batch where possible."""
        self._items.extend(events)
        self._ready.set()

    async def take(self) -> list[vocabulary.Event]:
        """Everything queued so far (waits for at least one event)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        batch = list(self._items)
        self._items.clear()
        return batch


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
        self._fleet = fleet.Fleet(
            config_mod.members(config),
            config.health,
            config.fleet,
            spares=tuple(s.name for s in config.spares),
        )
        self._leadership = leadership.new()
        self._inbox = _Inbox()
        self._timer: asyncio.TimerHandle | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._tearing_down = False
        self._open_file_limit = 0  # known once run() has raised it
        self._facts = Facts()
        self._collector: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []
        # The leadership core: what it is fed while its actions are performed, its timer.
        self._lead_queue: deque[leadership.Event] = deque()
        self._lead_stepping = False
        self._lead_timer: asyncio.TimerHandle | None = None
        self._lead_over = asyncio.Event()
        # The adapters, one per outside world.
        notifier = notifier or Notifier()
        self.links = Links(
            self,
            remote_factory=remote_factory,
            timed=lambda op, seconds: self.present.timed(op, seconds),
        )
        self.rundir = RunDirectory(
            self,
            watcher_factory(config),
            histories=self._fleet.histories,
            seats=self._fleet.saved_seats,
        )
        self.present = Presenter(
            self,
            notifier=notifier,
            core=self._fleet,
            leading=lambda: self._leadership,
            links=self.links,
            rundir=self.rundir,
            facts=self._facts,
        )
        self.commands = Operator(
            self,
            presenter=self.present,
            notifier=notifier,
            facts=self._facts,
            leading=lambda: self._leadership,
            refusal=self._command_refusal,
            request_stop=self.request_stop,
            apply_config=self._apply_config,
        )
        self.probes = Prober(self)
        self._routes = self._fleet_routes()
        self._lead_routes = self._leadership_routes()

    # ------------------------------------------------------------------------------------
    # The routing tables: each action type to the adapter that performs it.

    def _fleet_routes(self) -> dict[type[Any], Callable[[Any], None]]:
        links, rundir, present, commands = self.links, self.rundir, self.present, self.commands
        return {
            vocabulary.HostStateChanged: present.state_changed,
            vocabulary.HistoryChanged: rundir.history_changed,
            vocabulary.WritePointer: rundir.write_pointer,
            vocabulary.PointerNotWritten: present.pointer_not_written,
            vocabulary.Probe: links.probe,
            vocabulary.RecheckStatus: rundir.recheck,
            vocabulary.SendRewardProbe: self.probes.send,
            vocabulary.LaunchAsked: present.launch_asked,
            vocabulary.Launch: links.launch,
            vocabulary.Terminate: links.terminate,
            vocabulary.Watch: links.watch,
            vocabulary.Quarantine: rundir.quarantine,
            vocabulary.ProbeReported: present.probe_reported,
            vocabulary.LaunchesWaiting: present.launches_waiting,
            vocabulary.ScanFiles: rundir.scan,
            vocabulary.Connect: links.connect,
            vocabulary.Disconnect: links.disconnect,
            vocabulary.Release: links.release,
            vocabulary.Reconnect: links.reconnect,
            vocabulary.WriteStopSentinel: rundir.write_sentinel,
            vocabulary.DeleteStopSentinel: rundir.delete_sentinel,
            vocabulary.Reply: commands.replied,
            vocabulary.FreezeChanged: self._freeze_changed,
            vocabulary.DiagnoseFilesystem: rundir.diagnose,
            vocabulary.FreezeExplained: present.freeze_explained,
            vocabulary.CrashSignatureFound: present.crash_signature_found,
            vocabulary.CrashSignatureCleared: present.crash_signature_cleared,
            vocabulary.Settled: self._settled,
            vocabulary.Failover: self._failed_over,
            vocabulary.KillLeftovers: links.kill_leftovers,
            vocabulary.NoFreeSpare: present.no_free_spare,
            vocabulary.ExitReported: present.exit_reported,
            vocabulary.KeepSpare: links.keep_spare,
            vocabulary.ShutdownBegan: present.shutdown_began,
            vocabulary.ShutdownDone: present.shutdown_done,
            vocabulary.LyingHostNamed: present.lying_host_named,
            vocabulary.LyingHostKept: present.lying_host_kept,
            vocabulary.LyingHostCleared: present.lying_host_cleared,
            vocabulary.RewardSignatureFound: present.reward_signature_found,
            vocabulary.RewardSignatureCleared: present.reward_signature_cleared,
        }

    def _leadership_routes(self) -> dict[type[Any], Callable[[Any], None]]:
        rundir, present = self.rundir, self.present
        return {
            leadership.TryLock: rundir.lock_io,
            leadership.CheckLock: rundir.lock_io,
            leadership.ReadView: rundir.look_io,
            leadership.LookAtLock: rundir.look_io,
            leadership.StandBy: self._stand_by,
            leadership.LeaderChanged: present.leader_changed,
            leadership.TakeoverFailed: present.takeover_failed,
            leadership.Leading: present.leading,
            leadership.Lead: self._lead_the_fleet,
            leadership.Announce: present.announce,
            leadership.InCharge: present.in_charge,
            leadership.StandDown: self._stand_down,
            leadership.Deposed: self._deposed,
            leadership.HandOver: self._hand_over,
            leadership.HandedOver: present.handed_over,
            leadership.HandoverUnclaimed: present.handover_unclaimed,
            leadership.Reply: self.commands.lead_replied,
            leadership.CannotStart: present.cannot_start,
            leadership.PingWatchdog: present.ping_watchdog,
            leadership.WithholdWatchdog: present.withhold_watchdog,
            leadership.RoleChanged: present.role_changed,
        }

    def _command_refusal(self) -> vocabulary.Refusal | None:
        """Why no command can be served now: the fleet core's answer, or no task group to
        act in yet (or any more)."""
        if self._tg is None or self._tearing_down:
            return vocabulary.Refusal.UNAVAILABLE
        return self._fleet.command_refusal()

    # ------------------------------------------------------------------------------------
    # shell.Shell: what the adapters are given

    @property
    def config(self) -> Config:
        """The config in force."""
        return self._config

    @property
    def epoch(self) -> int:
        """This leadership's epoch (0 until we lead)."""
        return self._leadership.epoch

    def emit(self, event: vocabulary.Event) -> None:
        """Queue one event for the fleet core."""
        self._inbox.put(event)

    def emit_all(self, events: Iterable[vocabulary.Event]) -> None:
        """Queue events for the fleet core, in order."""
        self._inbox.put_all(events)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``coro`` in the daemon's task group (only while it serves)."""
        if self._tg is None or self._tearing_down:
            coro.close()
            raise RuntimeError("hosts act only while the daemon's task group runs")
        return self._tg.create_task(coro, name=name)

    # ------------------------------------------------------------------------------------
    # Life cycle: start-up, the main loop, shutdown

    async def run(self) -> int:
        """Serve until asked to stop; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._facts.started_at = loop.time()
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
            tried = await asyncio.to_thread(self.rundir.prepare)
        except OSError as exc:
            log.error("daemon.cannot_start", reason=str(exc))
            return leadership.EXIT_CANNOT_START
        self._lead(tried)  # the core: we lead, we stand by, or we may not start
        if self._leadership.finished:
            return self._leadership.exit_code
        control = ControlServer(self._config.control.socket, self.commands)
        try:
            await control.start()
        except ControlError as exc:
            log.error("daemon.cannot_start", reason=str(exc))
            await self.rundir.let_go_of_run_lock()
            return 1
        self._install_signal_handlers(loop)
        self.present.start_metrics(loop, self.commands.status)
        try:
            await self._serve()
        finally:
            self._remove_signal_handlers(loop)
            await self.present.stop_metrics()
            await control.aclose()
            self.present.close_events()
            await self.rundir.let_go_of_run_lock()
            self._lead(leadership.LockReleased())
            await self._lead_over.wait()  # after a handover, the hold-off; else at once
            self._end_leadership()
        # daemon.stopped is logged by the process as it ends (process.run_process).
        return self._leadership.exit_code

    @property
    def shown_role(self) -> str:
        """The role ``status`` and the logs show (``leader``, ``standby``, ...)."""
        return self._leadership.shown_role

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
                for task in (*self._background, self._collector):
                    if task is not None:
                        task.cancel()
                self.rundir.end_diagnosis()
                if self._timer is not None:
                    self._timer.cancel()
                self.links.cancel_tasks()
                self.commands.abandon()
        self._tg = None
        await self.links.aclose()
        if self._fleet.history_is_ours:  # else the leader's: a standby leaves it alone
            await self.rundir.save_history()
            # Reached only when the stop ran to its end (an error skips it): offline
            # ``status`` tells a clean stop from a crash by this record.
            await self.rundir.record_stop(self._fleet.last_states())

    async def _interpret(self) -> None:
        """Feed what is queued to the core, a batch at a time, and route what it says."""
        loop = asyncio.get_running_loop()
        routes = self._routes
        while not self._fleet.finished:
            batch = await self._inbox.take()
            for action in self._fleet.step(batch, loop.time()):
                routes[type(action)](action)
            # O(1) unless the core's names changed: they are a new frozenset when they do.
            self.rundir.watcher.set_hosts(self._fleet.names)
            self._arm_timer()

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
        self._inbox.put(vocabulary.DeadlinePassed())

    # ------------------------------------------------------------------------------------
    # The leadership core, fed directly

    def lead(self, event: leadership.Event) -> None:
        """Feed the leadership core one event (``shell.Shell``)."""
        self._lead(event)

    def _lead(self, event: leadership.Event) -> None:
        """Feed the leadership core ``event`` and route what it says. An event fed while
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
                    self._lead_routes[type(action)](action)
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

    def _end_leadership(self) -> None:
        """Drop the leadership core's timer and abandon its I/O (the process exits)."""
        if self._lead_timer is not None:
            self._lead_timer.cancel()
        self.rundir.abandon_lock_io()

    def _stand_by(self, action: leadership.StandBy) -> None:
        """Wait as a standby: every host's connection warm, READY for systemd."""
        for cfg in self._config.hosts:
            self.links.warm_up(cfg)
        self.present.stood_by(action)

    def _lead_the_fleet(self, action: leadership.Lead) -> None:
        self._background.append(self.spawn(self._boot(), "boot"))

    async def _boot(self) -> None:
        """Lead: the restart history a previous daemon left, then the fleet and the tasks
        that serve it."""
        histories, seats = await asyncio.to_thread(self.rundir.load_state)
        await self.probes.sweep()  # what a daemon killed mid-probe left, before any probe
        self._inbox.put(vocabulary.Booted(histories=histories, seats=seats))
        self._background += [
            self.spawn(self.rundir.watcher.run(self.rundir.on_observations), "watcher"),
            self.spawn(self.rundir.persist_loop(), "persist"),
            self.spawn(self.commands.reload_loop(), "reload"),
        ]

    def _stand_down(self, action: leadership.StandDown) -> None:
        self.present.stood_down(action)
        self._inbox.put(vocabulary.LeadershipEnded())

    def _deposed(self, action: leadership.Deposed) -> None:
        """Stop acting at once: abandon every operation, write nothing, exit non-zero."""
        self.links.abandon_operations()
        self._inbox.put(vocabulary.LeadershipEnded())
        self.present.deposed(action)

    def _hand_over(self, action: leadership.HandOver) -> None:
        self.present.handover(action)
        self.request_stop("handover", detach=True)

    # ------------------------------------------------------------------------------------
    # The fleet's life-cycle actions

    def _settled(self, action: vocabulary.Settled) -> None:
        self.present.settled(action)
        self._lead(leadership.FleetSettled())  # after a takeover: in charge
        self._collector = self.spawn(self._collect_loop(), "gc")

    def _failed_over(self, action: vocabulary.Failover) -> None:
        self.links.move(action)
        self.present.failed_over(action)

    def _freeze_changed(self, change: vocabulary.FreezeChanged) -> None:
        if not change.frozen:
            self.rundir.end_diagnosis()  # the freeze is over: its diagnosis is moot
        self.present.freeze_changed(change)

    def _apply_config(self, new: Config) -> None:
        """A reload validated ``new``: it is the config from now on."""
        self._config = new
        self.links.remember(new.hosts)
        self._warn_about_config(new)

    def _warn_about_config(self, config: Config) -> None:
        for event, fields in config_mod.open_file_limit_warnings(config, self._open_file_limit):
            log.warning(event, **fields)
        # check-config says the same; the journal must too, for a config nobody checked.
        for key, why in config_mod.trainer_warnings(config):
            log.warning("config.cannot_beat_trainer", key=key, reason=why)

    # ------------------------------------------------------------------------------------
    # Signals

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.commands.request_reload)

    def _remove_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)

    def request_stop(self, why: str = "request", *, detach: bool | None = None) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT, ``stop`` command); a standby just exits.
        Whether the workers are stopped or left running is the fleet core's (``run.on_exit``,
        or ``detach`` for a handover); a stop asked again is the same stop."""
        if leadership.asked_to_stop(self._leadership):
            return
        log.info("daemon.stop_requested", by=why, role=self._leadership.shown_role)
        self._inbox.put(vocabulary.ShutdownRequested(detach=detach))
        self._lead(leadership.StopAsked())

    # ------------------------------------------------------------------------------------
    # Background loops

    async def _watchdog_loop(self) -> None:
        """Ping the watchdog when the leadership core says we are healthy."""
        interval = self.present.notifier.watchdog_interval_s()
        if interval is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            healthy = self.rundir.watcher.healthy(loop.time())
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
