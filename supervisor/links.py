"""The SSH links adapter: one connection and one agent per host, and the remote actions the
cores ask for (connect, disconnect, launch, terminate, evidence, probe), each answered with
an event. A standby's warm connections live here too, adopted as they are at a takeover.

It decides nothing: what to do, and when, comes from the cores' actions; what happened goes
back as events through the ``Shell`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final, Protocol

import structlog

from supervisor import config as config_mod
from supervisor import fleet, health, layout, leadership
from supervisor.agent import WorkerExit, WorkerUsage
from supervisor.config import HostConfig, SshConfig
from supervisor.errors import Fenced, RemoteError, ShardHeld
from supervisor.layout import LaunchSpec
from supervisor.shell import Shell

log = structlog.get_logger("supervisor.daemon")

#: A connection task that failed (a bug, not a network fault: those it handles itself) is
#: started again after this pause, so one host's fault never becomes a busy loop.
MAINTAIN_RETRY_S: Final = 5.0
#: A standby's agent that failed to start (the host's python broken, say) is started again
#: after this pause, while its connection is up.
WARM_RETRY_S: Final = 5.0
#: The agent bounds an evidence capture itself; this covers the round trip around it, so a
#: host that never answers holds the terminate back no longer than the capture could.
EVIDENCE_SLACK_S: Final = 2.0
#: How long closing one connection may take at the end.
CLOSE_TIMEOUT_S: Final = 5.0


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
        Callable[[WorkerUsage], None],
    ],
    RemoteLike,
]
#: Work done after a worker is confirmed dead and before the core hears it (the stuck-task
#: quarantine), so before its successor can start.
AfterTerminate = Callable[[fleet.Terminate, HostConfig], Awaitable[None]]
#: Told how long a launch or a terminate took (``"launch"``/``"terminate"``, seconds).
Timed = Callable[[str, float], None]


def default_remote_factory(
    host: HostConfig,
    ssh: SshConfig,
    python: str,
    handshakes: asyncio.Semaphore,
    on_connection: Callable[[bool, str], None],
    on_exit: Callable[[WorkerExit], None],
    on_usage: Callable[[WorkerUsage], None],
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
        on_usage=on_usage,
    )


@dataclass(frozen=True, slots=True)
class Measured:
    """What a host's agent last measured of its worker's session (``WorkerUsage``), and
    when (our monotonic clock)."""

    usage: WorkerUsage
    at: float


@dataclass
class Link:
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
class Warm:
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


class Links:
    """Every host's connection and the remote actions on it."""

    def __init__(
        self,
        shell: Shell,
        *,
        remote_factory: RemoteFactory,
        after_terminate: AfterTerminate,
        timed: Timed,
    ) -> None:
        self._shell = shell
        self._remote_factory = remote_factory
        self._after_terminate = after_terminate
        self._timed = timed
        self._handshakes = asyncio.Semaphore(shell.config.ssh.max_concurrent_handshakes)
        self._links: dict[str, Link] = {}
        self._warm: dict[str, Warm] = {}
        # Failover: a machine's own settings (hosts and spares), the links of machines that
        # serve no member (spares, and machines that lost their shard), and which member a
        # machine serves where that is not its own name (None: none).
        self._own: dict[str, HostConfig] = {h.name: h for h in shell.config.hosts}
        self._own.update((s.name, config_mod.spare_host(s)) for s in shell.config.spares)
        self._machines: dict[str, Link] = {}
        self._label_of: dict[str, str | None] = {}
        # Every host of every config loaded: a host joins (Connect) with the settings of
        # the config the core admitted it under, even while a newer one is being applied.
        self._host_configs: dict[str, HostConfig] = {h.name: h for h in shell.config.hosts}
        #: Each member's worker's session as its agent last measured it (shown beside the
        #: worker's own figures, never judged).
        self._measured: dict[str, Measured] = {}

    # --- queries -----------------------------------------------------------------------

    def measured(self, name: str) -> Measured | None:
        """What the agent last measured of ``name``'s worker (of whichever pid it was)."""
        return self._measured.get(name)

    def cfg(self, name: str) -> HostConfig:
        """The settings ``name`` runs under: its link's, else the newest config's."""
        link = self._links.get(name)
        return link.cfg if link is not None else self._host_configs[name]

    def linked(self, name: str) -> bool:
        """``name`` has a link (the core connected it)."""
        return name in self._links

    def warm_counts(self) -> dict[str, int]:
        """A standby's warm connections: ``{"hosts", "connected", "probed"}``."""
        warm = self._warm.values()
        return {
            "hosts": len(self._warm),
            "connected": sum(1 for w in warm if w.up),
            "probed": sum(1 for w in warm if w.agent_started),
        }

    # --- configuration -------------------------------------------------------------------

    def remember(self, hosts: tuple[HostConfig, ...]) -> None:
        """A new config was loaded: its hosts' settings, for the hosts it makes join."""
        self._host_configs.update((h.name, h) for h in hosts)

    # --- the fleet's actions -------------------------------------------------------------

    def connect(self, action: fleet.Connect) -> None:
        """A host joins: adopt a standby's warm connection to it, or open one (to the spare
        serving it, when a previous daemon had moved its shard there)."""
        name = action.host
        cfg = self._host_configs[name]
        machine = action.machine or name
        if machine != name:
            cfg = replace(self._own[machine], name=name, shard=action.shard)
            self._label_of[machine] = name
        warm = self._warm.pop(name, None)
        if warm is not None and warm.cfg == cfg and warm.maintain is not None:
            # Taken over with this host's connection warm: adopt it as it is, and tell the
            # core what the standby saw of it (a state is reported only when it changes).
            if warm.warmer is not None:
                warm.warmer.cancel()
            self._links[name] = Link(cfg=cfg, remote=warm.remote, maintain=warm.maintain)
            if warm.up is not None:
                event = health.SshRestored() if warm.up else health.SshLost(reason=warm.reason)
                self._shell.emit(fleet.HostObserved(name, event))
            return
        if warm is not None:  # its settings changed meanwhile: a connection of its own
            warm.cancel_tasks()
            self._shell.spawn(_aclose_quietly(warm.remote, name), f"close:{name}")
        remote = self._new_remote(cfg, machine)
        link = Link(cfg=cfg, remote=remote)
        self._links[name] = link
        link.maintain = self._shell.spawn(self._maintain(name, remote), f"ssh:{name}")
        if action.added:
            log.info("host.added", host=name, shard=action.shard)

    def disconnect(self, action: fleet.Disconnect) -> None:
        """A host left: close its connection."""
        name = action.host
        link = self._links.pop(name)
        self._measured.pop(name, None)
        link.cancel_tasks()
        self._shell.spawn(_aclose_quietly(link.remote, name), f"close:{name}")
        log.info("host.removed", host=name)

    def release(self, action: fleet.Release) -> None:
        """A host served by a spare left: the spare's connection stays, serving none."""
        link = self._links.pop(action.host)
        self._measured.pop(action.host, None)
        for task in link.ops:
            task.cancel()
        machine = action.machine
        self._machines[machine] = replace(link, cfg=self._own[machine], ops=set())
        self._label_of[machine] = None
        log.info("host.removed", host=action.host)

    def reconnect(self, action: fleet.Reconnect) -> None:
        """A host's SSH settings changed: its connection takes them at its next connect."""
        link = self._links[action.host]
        link.cfg = self._shell.config.host(action.host) or link.cfg
        link.remote.update(link.cfg, self._fleet_ssh(), self._shell.config.worker.python)

    def launch(self, action: fleet.Launch) -> None:
        """Start the host's worker; the core hears ``Launched`` or why not."""
        log.info("host.launch_begin", host=action.host)
        self._spawn_op(action.host, self._launch(action.host), "launch")

    def terminate(self, action: fleet.Terminate) -> None:
        """End the host's worker (its evidence first, if asked)."""
        log.info("host.terminate", host=action.host, pid=action.pid, grace_s=action.grace_s)
        self._spawn_op(action.host, self._terminate(action), "terminate")

    def probe(self, action: fleet.Probe) -> None:
        """Ask the host's agent whether the worker runs."""
        self._spawn_op(action.host, self._probe(action), "probe")

    # --- failover's actions ---------------------------------------------------------------

    def keep_spare(self, action: fleet.KeepSpare) -> None:
        """Connect to a spare and keep it connected, serving nothing."""
        name = action.machine
        cfg = self._own[name]
        warm = self._warm.pop(name, None)
        if warm is not None:  # a standby's, to this machine as a host: it serves none now
            warm.cancel_tasks()
            self._shell.spawn(_aclose_quietly(warm.remote, name), f"close:{name}")
        link = Link(cfg=cfg, remote=self._new_remote(cfg, name))
        self._machines[name] = link
        self._label_of[name] = None
        link.maintain = self._shell.spawn(self._maintain(name, link.remote), f"ssh:{name}")

    def move(self, action: fleet.Failover) -> None:
        """``action.label``'s shard is served by ``to_machine`` from now on: the member's
        link takes the spare's connection, and its old machine's connection stays, serving
        nothing, for its leftovers to be killed when it answers."""
        label, old_machine, new_machine = action.label, action.from_machine, action.to_machine
        old = self._links.pop(label)
        for task in old.ops:  # operations on the old machine: their answers are moot now
            task.cancel()
        spare = self._machines.pop(new_machine)
        cfg = replace(self._own[new_machine], name=label, shard=action.shard)
        self._links[label] = Link(cfg=cfg, remote=spare.remote, maintain=spare.maintain)
        own = self._own.get(old_machine, old.cfg)
        self._machines[old_machine] = Link(cfg=own, remote=old.remote, maintain=old.maintain)
        self._label_of[new_machine] = label
        self._label_of[old_machine] = None

    def kill_leftovers(self, action: fleet.KillLeftovers) -> None:
        """Kill the worker a machine that lost its shard may still run."""
        link = self._machines[action.machine]
        task = self._shell.spawn(self._kill_leftovers(action, link), f"leftovers:{action.machine}")
        link.ops.add(task)
        task.add_done_callback(link.ops.discard)

    async def _kill_leftovers(self, action: fleet.KillLeftovers, link: Link) -> None:
        machine = action.machine
        cfg = replace(self._own.get(machine, link.cfg), name=action.label, shard=action.shard)
        spec = replace(layout.launch_spec(self._shell.config, cfg), epoch=self._shell.epoch)
        error: str | None = None
        # Only the pid it ran is looked for, never the pidfile's: that file is the shard's,
        # and names the worker that serves it now (on one box, the agent would find it).
        pid = action.pid
        try:
            reaped = None
            if pid is not None:
                reaped = await link.remote.terminate(spec, pid, grace_s=action.grace_s, kill=True)
        except Fenced as exc:
            log.error("host.fenced", host=machine, op="leftovers", reason=exc.reason)
            self._shell.lead(leadership.Fenced(host=machine, reason=exc.reason))
            return
        except RemoteError as exc:
            error = exc.reason
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("spare.leftovers_failed", machine=machine, label=action.label)
            error = f"internal error: {exc!r}"
        else:
            log.info(
                "spare.leftovers_killed",
                machine=machine,
                label=action.label,
                pid=pid,
                reaped=reaped,
            )
        if error is not None:
            log.warning("spare.leftovers_failed", machine=machine, label=action.label, reason=error)
        self._shell.emit(fleet.LeftoversKilled(machine=machine, error=error))

    # --- leadership's actions --------------------------------------------------------------

    def warm_up(self, cfg: HostConfig) -> None:
        """Connect to ``cfg``'s host and keep its agent started (a standby's wait)."""
        warm = Warm(cfg=cfg, remote=self._new_remote(cfg, cfg.name))
        self._warm[cfg.name] = warm
        warm.maintain = self._shell.spawn(self._maintain(cfg.name, warm.remote), f"ssh:{cfg.name}")
        warm.warmer = self._shell.spawn(self._keep_warm(warm), f"warm:{cfg.name}")

    def abandon_operations(self) -> None:
        """Deposed: every remote operation in flight is abandoned at once."""
        for link in self._links.values():
            for task in link.ops:
                task.cancel()

    # --- the end -----------------------------------------------------------------------

    def cancel_tasks(self) -> None:
        """Stop every task acting for a host (the daemon is stopping)."""
        for link in (*self._links.values(), *self._machines.values()):
            link.cancel_tasks()
        for warm in self._warm.values():
            warm.cancel_tasks()

    async def aclose(self) -> None:
        """Close every connection, each within CLOSE_TIMEOUT_S."""
        async with asyncio.TaskGroup() as tg:
            for name, link in (*self._links.items(), *self._machines.items()):
                tg.create_task(_aclose_quietly(link.remote, name))
            for name, warm in self._warm.items():
                tg.create_task(_aclose_quietly(warm.remote, name))

    # --- inputs ----------------------------------------------------------------------------

    def _on_connection(self, name: str, up: bool, reason: str) -> None:
        log.info("ssh.up" if up else "ssh.down", host=name, reason=reason)
        warm = self._warm.get(name)
        if warm is not None and name not in self._links:
            # A standby's warm connection: remembered, told to the core once it adopts it.
            warm.up, warm.reason = up, reason
            warm.changed.set()
            return
        label = self._label_of.get(name, name)
        if label is None:  # a machine serving no member: a spare, or one that lost its shard
            self._shell.emit(fleet.SpareObserved(machine=name, up=up, reason=reason))
            return
        event = health.SshRestored() if up else health.SshLost(reason=reason)
        self._shell.emit(fleet.HostObserved(label, event))

    def _on_exit_pushed(self, machine: str, news: WorkerExit) -> None:
        """The host's agent saw a worker end: the same fact as its exit record, sooner; the
        core acts on whichever comes first and takes the other as old news."""
        name = self._label_of.get(machine, machine)
        if name is None:  # a leftover of a machine that lost its shard: not a member's
            log.info("spare.exit_reported", machine=machine, pid=news.pid)
            return
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
        self._shell.emit(fleet.HostObserved(name, event))

    def _on_usage_pushed(self, machine: str, news: WorkerUsage) -> None:
        """The host's agent measured its worker's session: kept for ``status`` and metrics,
        under the member the machine serves (a spare's own is nobody's)."""
        name = self._label_of.get(machine, machine)
        if name is not None:
            self._measured[name] = Measured(news, asyncio.get_running_loop().time())

    # --- the work --------------------------------------------------------------------------

    def _spawn_op(self, name: str, coro: Any, what: str) -> None:
        link = self._links[name]
        task = self._shell.spawn(coro, f"{what}:{name}")
        link.ops.add(task)
        task.add_done_callback(link.ops.discard)

    def _new_remote(self, cfg: HostConfig, machine: str) -> RemoteLike:
        # Its news is told by machine: which member that is, if any, is looked up then.
        name = machine
        return self._remote_factory(
            cfg,
            self._fleet_ssh(),
            self._shell.config.worker.python,
            self._handshakes,
            lambda up, reason: self._on_connection(name, up, reason),
            lambda news: self._on_exit_pushed(name, news),
            lambda news: self._on_usage_pushed(name, news),
        )

    def _fleet_ssh(self) -> SshConfig:
        """The SSH settings each connection uses: keepalives spread over the whole fleet."""
        config = self._shell.config
        return config_mod.fleet_ssh(config.ssh, len(config.hosts))

    def _spec(self, link: Link) -> LaunchSpec:
        # Every launch and terminate carries this leadership's epoch: the agent refuses one
        # lower than the run directory's (fencing a deposed leader).
        spec = layout.launch_spec(self._shell.config, link.cfg)
        return replace(spec, epoch=self._shell.epoch)

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

    async def _keep_warm(self, warm: Warm) -> None:
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

    async def _launch(self, name: str) -> None:
        link = self._links[name]
        spec = self._spec(link)
        started = time.monotonic()
        event: health.Event
        try:
            result = await link.remote.launch(spec)
        except Fenced as exc:
            log.error("host.fenced", host=name, op="launch", reason=exc.reason)
            self._shell.lead(leadership.Fenced(host=name, reason=exc.reason))
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
            self._timed("launch", elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info("host.launched", host=name, pid=result.pid, elapsed_ms=elapsed_ms)
            event = health.Launched(pid=result.pid)
        self._shell.emit(fleet.HostObserved(name, event))

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
            self._shell.lead(leadership.Fenced(host=name, reason=exc.reason))
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
            self._timed("terminate", elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info(
                "host.terminated",
                host=name,
                pid=action.pid,
                elapsed_ms=elapsed_ms,
                reaped=reaped,
            )
            # Before the core hears it is dead, so before its successor can start.
            await self._after_terminate(action, link.cfg)
            event = health.TerminateConfirmed(pid=action.pid, evidence=evidence, reaped=reaped)
        self._shell.emit(fleet.HostObserved(name, event))

    async def _evidence(self, action: fleet.Terminate) -> health.Evidence:
        """The worker's stacks and log tail, from its host's agent, within
        ``health.evidence_timeout_s`` (plus a round trip): never raises, never holds the
        terminate back longer; what went wrong is a note."""
        name, pid = action.host, action.pid
        link = self._links[name]
        policy = self._shell.config.health
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
        self._shell.emit(fleet.HostObserved(name, event))


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


async def _aclose_quietly(remote: RemoteLike, name: str) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await remote.aclose()
    except (OSError, RemoteError, TimeoutError) as exc:  # closing is best effort
        log.warning("ssh.close_failed", host=name, reason=repr(exc))
