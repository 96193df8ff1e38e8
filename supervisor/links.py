"""The SSH links adapter: one connection and one agent per host, and the remote actions the
cores ask for (connect, disconnect, launch, terminate, evidence, probe), each answered with
an event. A standby's warm connections live here too, adopted as they are at a takeover.

It decides nothing: what to do, and when, comes from the cores' actions; what happened goes
back as events through the ``Shell`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final, Protocol

import structlog

from supervisor import config as config_mod
from supervisor import health, layout, leadership, vocabulary
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

    async def watch(self, spec: LaunchSpec, pid: int, start_time: int | None) -> None: ...

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
        Callable[[], None],
        Callable[[WorkerUsage], None],
    ],
    RemoteLike,
]
#: Told how long a launch or a terminate took (``"launch"``/``"terminate"``, seconds).
Timed = Callable[[str, float], None]


def default_remote_factory(
    host: HostConfig,
    ssh: SshConfig,
    python: str,
    handshakes: asyncio.Semaphore,
    on_connection: Callable[[bool, str], None],
    on_exit: Callable[[WorkerExit], None],
    on_agent: Callable[[], None],
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
        on_agent=on_agent,
        on_usage=on_usage,
    )


@dataclass
class Link:
    """One machine's connection and the tasks acting on it. A machine is a member's own
    host, a spare, or (a standby's) a host kept warm for a takeover; which member it
    serves, if any, is the fleet core's to know: every action says it."""

    #: The machine's own settings (address, port, user: its connection's).
    cfg: HostConfig
    remote: RemoteLike
    maintain: asyncio.Task[None] | None = None
    #: A standby's: keeps the agent started on every connection, for a takeover.
    warmer: asyncio.Task[None] | None = None
    #: Set at each news of the connection (the warmer waits on it).
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Its agent has started (and said hello) on some connection (a standby's count).
    agent_started: bool = False
    ops: set[asyncio.Task[None]] = field(default_factory=set)

    def cancel_tasks(self) -> None:
        """Stop everything that acts on this machine."""
        for task in (self.maintain, self.warmer, *self.ops):
            if task is not None:
                task.cancel()

    def cancel_ops(self) -> None:
        """Abandon the remote operations in flight (their answers are moot)."""
        for task in self.ops:
            task.cancel()


class Links:
    """Every machine's connection and the remote actions on it."""

    def __init__(
        self,
        shell: Shell,
        *,
        remote_factory: RemoteFactory,
        timed: Timed,
    ) -> None:
        self._shell = shell
        self._remote_factory = remote_factory
        self._timed = timed
        self._handshakes = asyncio.Semaphore(shell.config.ssh.max_concurrent_handshakes)
        self._machines: dict[str, Link] = {}
        # Every machine's own settings, from every config loaded: a host joins (Connect)
        # with the settings of the config the core admitted it under, even while a newer
        # one is being applied; a spare's are its newest.
        self._host_configs: dict[str, HostConfig] = {h.name: h for h in shell.config.hosts}
        self._spares: dict[str, HostConfig] = {
            s.name: config_mod.spare_host(s) for s in shell.config.spares
        }

    # --- queries -----------------------------------------------------------------------

    def machine_cfg(self, machine: str) -> HostConfig:
        """The settings ``machine``'s connection runs under (a host's or a spare's)."""
        link = self._machines.get(machine)
        return link.cfg if link is not None else self._own_cfg(machine)

    def _own_cfg(self, machine: str) -> HostConfig:
        """``machine``'s own settings: a host's (of the config it was admitted under), or a
        spare's."""
        return self._host_configs.get(machine) or self._spares[machine]

    def warm_counts(self) -> dict[str, int]:
        """A standby's warm connections: ``{"hosts", "connected", "probed"}``."""
        warm = [link for link in self._machines.values() if link.warmer is not None]
        return {
            "hosts": len(warm),
            "connected": sum(1 for link in warm if link.remote.connected),
            "probed": sum(1 for link in warm if link.agent_started),
        }

    # --- configuration -------------------------------------------------------------------

    def remember(self, hosts: tuple[HostConfig, ...]) -> None:
        """A new config was loaded: its hosts' settings, for the hosts it makes join."""
        self._host_configs.update((h.name, h) for h in hosts)

    # --- the fleet's actions -------------------------------------------------------------

    def connect(self, action: vocabulary.Connect) -> None:
        """A host joins on its machine: that machine's connection, kept (a spare's or a
        standby's, open already, as it is: the core knows what it said) or opened."""
        self._keep(action.machine, self._own_cfg(action.machine))
        if action.added:
            log.info("host.added", host=action.host, shard=action.shard)

    def keep_spare(self, action: vocabulary.KeepSpare) -> None:
        """Connect to a spare and keep it connected, serving nothing."""
        self._keep(action.machine, self._own_cfg(action.machine))

    def disconnect(self, action: vocabulary.Disconnect) -> None:
        """A host left: close its machine's connection."""
        link = self._machines.pop(action.machine)
        link.cancel_tasks()
        self._shell.spawn(_aclose_quietly(link.remote, action.machine), f"close:{action.machine}")
        log.info("host.removed", host=action.host)

    def release(self, action: vocabulary.Release) -> None:
        """A host served by a spare left: the spare's connection stays, serving none."""
        self._machines[action.machine].cancel_ops()
        log.info("host.removed", host=action.host)

    def reconnect(self, action: vocabulary.Reconnect) -> None:
        """A host's SSH settings changed: its connection takes them at its next connect."""
        link = self._machines[action.machine]
        link.cfg = self._shell.config.host(action.machine) or link.cfg
        link.remote.update(link.cfg, self._fleet_ssh(), self._shell.config.worker.python)

    def launch(self, action: vocabulary.Launch) -> None:
        """Start the host's worker; the core hears ``Launched`` or why not."""
        log.info("host.launch_begin", host=action.host)
        self._spawn_op(action.machine, self._launch(action), f"launch:{action.host}")

    def terminate(self, action: vocabulary.Terminate) -> None:
        """End the host's worker (its evidence first, if asked)."""
        log.info("host.terminate", host=action.host, pid=action.pid, grace_s=action.grace_s)
        self._spawn_op(action.machine, self._terminate(action), f"terminate:{action.host}")

    def probe(self, action: vocabulary.Probe) -> None:
        """Ask the host's agent whether the worker runs."""
        self._spawn_op(action.machine, self._probe(action), f"probe:{action.host}")

    def watch(self, action: vocabulary.Watch) -> None:
        """Have the machine's agent watch the host's worker (best effort)."""
        spec = self._spec(action.machine, action.host, action.shard)
        remote = self._machines[action.machine].remote
        self._spawn_op(
            action.machine,
            remote.watch(spec, action.pid, action.start_time),
            f"watch:{action.host}",
        )

    def move(self, action: vocabulary.Failover) -> None:
        """``action.label``'s shard is served by ``to_machine`` from now on: what was asked
        of its old machine is abandoned (its answers are moot); that machine's connection
        stays, serving nothing, for its leftovers to be killed when it answers."""
        self._machines[action.from_machine].cancel_ops()

    def kill_leftovers(self, action: vocabulary.KillLeftovers) -> None:
        """Kill the worker a machine that lost its shard may still run."""
        self._spawn_op(action.machine, self._kill_leftovers(action), f"leftovers:{action.machine}")

    async def _kill_leftovers(self, action: vocabulary.KillLeftovers) -> None:
        machine = action.machine
        spec = self._spec(machine, action.label, action.shard)
        error: str | None = None
        # Only the pid it ran is looked for, never the pidfile's: that file is the shard's,
        # and names the worker that serves it now (on one box, the agent would find it).
        pid = action.pid
        try:
            reaped = None
            if pid is not None:
                link = self._machines[machine]
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
        self._shell.emit(vocabulary.LeftoversKilled(machine=machine, error=error))

    # --- leadership's actions --------------------------------------------------------------

    def warm_up(self, cfg: HostConfig) -> None:
        """Connect to ``cfg``'s host and keep its agent started (a standby's wait)."""
        link = self._keep(cfg.name, cfg)
        link.warmer = self._shell.spawn(self._keep_warm(link), f"warm:{cfg.name}")

    def abandon_operations(self) -> None:
        """Deposed: every remote operation in flight is abandoned at once."""
        for link in self._machines.values():
            link.cancel_ops()

    # --- the end -----------------------------------------------------------------------

    def cancel_tasks(self) -> None:
        """Stop every task acting on a machine (the daemon is stopping)."""
        for link in self._machines.values():
            link.cancel_tasks()

    async def aclose(self) -> None:
        """Close every connection, each within CLOSE_TIMEOUT_S."""
        async with asyncio.TaskGroup() as tg:
            for name, link in self._machines.items():
                tg.create_task(_aclose_quietly(link.remote, name))

    # --- inputs ----------------------------------------------------------------------------

    def _on_connection(self, machine: str, link: Link, up: bool, reason: str) -> None:
        if self._machines.get(machine) is not link:
            return  # a connection closed since: not this machine's news any more
        log.info("ssh.up" if up else "ssh.down", host=machine, reason=reason)
        link.changed.set()
        event = health.SshRestored() if up else health.SshLost(reason=reason)
        self._shell.emit(vocabulary.MachineObserved(machine, event))

    def _on_exit_pushed(self, machine: str, link: Link, news: WorkerExit) -> None:
        """The machine's agent saw a worker end: the same fact as its exit record, sooner;
        the core acts on whichever comes first and takes the other as old news."""
        if self._machines.get(machine) is not link:
            return
        event = health.WorkerExited(
            pid=news.pid,
            exit_code=news.exit_code,
            signal=news.signal,
            log_tail=news.log_tail,
            reaped=news.reaped,
        )
        self._shell.emit(vocabulary.MachineObserved(machine, event))

    def _on_agent(self, machine: str, link: Link) -> None:
        """A new agent started on the machine's connection: it watches nothing yet."""
        if self._machines.get(machine) is link:
            self._shell.emit(vocabulary.MachineObserved(machine, health.AgentStarted()))

    def _on_usage(self, machine: str, link: Link, news: WorkerUsage) -> None:
        """The machine's agent measured its worker's session: told to the core, which keeps
        it for ``status`` and metrics under the member the machine serves."""
        if self._machines.get(machine) is link:
            usage = health.UsageMeasured(
                pid=news.pid, rss_bytes=news.rss_bytes, processes=news.processes, via=news.via
            )
            self._shell.emit(vocabulary.MachineObserved(machine, usage))

    # --- the work --------------------------------------------------------------------------

    def _keep(self, machine: str, cfg: HostConfig) -> Link:
        """``machine``'s link: the one it has (taking ``cfg`` if it changed, and no longer a
        standby's warm-up), or a new connection."""
        link = self._machines.get(machine)
        if link is None:
            # Its news names the link it came from: a connection closed since is not heard.
            made: list[Link] = []
            remote = self._remote_factory(
                cfg,
                self._fleet_ssh(),
                self._shell.config.worker.python,
                self._handshakes,
                lambda up, reason: self._on_connection(machine, made[0], up, reason),
                lambda news: self._on_exit_pushed(machine, made[0], news),
                lambda: self._on_agent(machine, made[0]),
                lambda news: self._on_usage(machine, made[0], news),
            )
            link = Link(cfg=cfg, remote=remote)
            made.append(link)
            self._machines[machine] = link
            link.maintain = self._shell.spawn(self._maintain(machine, remote), f"ssh:{machine}")
            return link
        if link.warmer is not None:
            link.warmer.cancel()  # a takeover adopts it as it is
            link.warmer = None
        if link.cfg != cfg:
            link.cfg = cfg
            link.remote.update(cfg, self._fleet_ssh(), self._shell.config.worker.python)
        return link

    def _spawn_op(self, machine: str, coro: Any, name: str) -> None:
        link = self._machines[machine]
        task = self._shell.spawn(coro, name)
        link.ops.add(task)
        task.add_done_callback(link.ops.discard)

    def _fleet_ssh(self) -> SshConfig:
        """The SSH settings each connection uses: keepalives spread over the whole fleet."""
        config = self._shell.config
        return config_mod.fleet_ssh(config.ssh, len(config.hosts))

    def _spec(self, machine: str, host: str, shard: int) -> LaunchSpec:
        """What ``host``'s worker for ``shard`` is on ``machine`` (``--host host --shard
        shard``, the machine's own settings otherwise)."""
        cfg = replace(self.machine_cfg(machine), name=host, shard=shard)
        # Every launch and terminate carries this leadership's epoch: the agent refuses one
        # lower than the run directory's (fencing a deposed leader).
        return replace(layout.launch_spec(self._shell.config, cfg), epoch=self._shell.epoch)

    async def _maintain(self, name: str, remote: RemoteLike) -> None:
        """The machine's connection for as long as it is kept; its faults stay its own."""
        while True:
            try:
                await remote.maintain()
            except Exception:  # task root: a fault of one host's link must not end the daemon
                log.exception("ssh.maintain_failed", host=name, retry_in_s=MAINTAIN_RETRY_S)
                await asyncio.sleep(MAINTAIN_RETRY_S)
            else:
                return

    async def _keep_warm(self, link: Link) -> None:
        """Have the agent started once per connection: the connection starts it too, but
        says nothing of a failure, and a takeover's first request must find it running."""
        name = link.cfg.name
        started_up = False
        while True:
            await link.changed.wait()
            link.changed.clear()
            if not link.remote.connected:
                started_up = False
                continue
            if started_up:
                continue
            try:
                await link.remote.start_agent()
            except Exception as exc:  # task root: a standby's warm-up is only a warm-up
                if isinstance(exc, RemoteError):
                    log.info("ha.warm_probe_failed", host=name, reason=exc.reason)
                else:
                    log.exception("ha.warm_probe_failed", host=name)
                await asyncio.sleep(WARM_RETRY_S)
                link.changed.set()  # try again while the connection is up
                continue
            link.agent_started = started_up = True
            log.debug("ha.warm", host=name)

    async def _launch(self, action: vocabulary.Launch) -> None:
        name = action.host
        link = self._machines[action.machine]
        spec = self._spec(action.machine, name, action.shard)
        loop = asyncio.get_running_loop()
        started = loop.time()
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
            elapsed = loop.time() - started
            self._timed("launch", elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info("host.launched", host=name, pid=result.pid, elapsed_ms=elapsed_ms)
            event = health.Launched(pid=result.pid, start_time=result.start_time)
        self._shell.emit(vocabulary.HostObserved(name, event))

    async def _terminate(self, action: vocabulary.Terminate) -> None:
        name = action.host
        link = self._machines[action.machine]
        evidence = await self._evidence(action) if action.collect_evidence else None
        loop = asyncio.get_running_loop()
        started = loop.time()
        event: health.Event
        try:
            reaped = await link.remote.terminate(
                self._spec(action.machine, name, action.shard),
                action.pid,
                grace_s=action.grace_s,
                kill=action.kill,
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
            elapsed = loop.time() - started
            self._timed("terminate", elapsed)
            elapsed_ms = round(elapsed * 1000, 1)
            log.info(
                "host.terminated",
                host=name,
                pid=action.pid,
                elapsed_ms=elapsed_ms,
                reaped=reaped,
            )
            event = health.TerminateConfirmed(pid=action.pid, evidence=evidence, reaped=reaped)
        self._shell.emit(vocabulary.HostObserved(name, event))

    async def _evidence(self, action: vocabulary.Terminate) -> health.Evidence:
        """The worker's stacks and log tail, from its host's agent, within
        ``health.evidence_timeout_s`` (plus a round trip): never raises, never holds the
        terminate back longer; what went wrong is a note."""
        name, pid = action.host, action.pid
        link = self._machines[action.machine]
        policy = self._shell.config.health
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(policy.evidence_timeout_s + EVIDENCE_SLACK_S):
                evidence = await link.remote.evidence(
                    self._spec(action.machine, name, action.shard),
                    pid,
                    timeout_s=policy.evidence_timeout_s,
                    stacks=policy.evidence_stacks,
                )
        except (RemoteError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, RemoteError) else "no answer in time"
            log.warning("host.evidence_failed", host=name, pid=pid, reason=reason)
            notes: tuple[str, ...] = (f"not collected: {reason}",)
            return health.Evidence(pid=pid, notes=notes, elapsed_s=_since(loop, started))
        except Exception as exc:  # task root of the capture: the terminate must go on
            log.exception("host.evidence_failed", host=name, pid=pid)
            notes = (f"not collected: internal error: {exc!r}",)
            return health.Evidence(pid=pid, notes=notes, elapsed_s=_since(loop, started))
        log.info(
            "host.evidence",
            host=name,
            pid=pid,
            via=evidence.stacks_via,
            stacks_chars=len(evidence.stacks or ""),
            notes=list(evidence.notes),
            elapsed_ms=round(1000 * _since(loop, started), 1),
        )
        return evidence

    async def _probe(self, action: vocabulary.Probe) -> None:
        name = action.host
        link = self._machines[action.machine]
        event: health.Event
        try:
            pid = await link.remote.probe(
                self._spec(action.machine, name, action.shard), action.pid
            )
        except RemoteError as exc:
            log.warning("host.probe_failed", host=name, reason=exc.reason)
            event = health.ProbeFailed(reason=exc.reason)
        except Exception as exc:  # task root: the core must hear an answer
            log.exception("host.probe_failed", host=name)
            event = health.ProbeFailed(reason=f"internal error: {exc!r}")
        else:
            log.info("host.probe", host=name, found_pid=pid)
            event = health.ProbeResult(pid=pid)
        self._shell.emit(vocabulary.HostObserved(name, event))


def _since(loop: asyncio.AbstractEventLoop, started: float) -> float:
    """Seconds since ``started`` on the loop's clock, the clock the cores run on."""
    return round(loop.time() - started, 3)


async def _aclose_quietly(remote: RemoteLike, name: str) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await remote.aclose()
    except (OSError, RemoteError, TimeoutError) as exc:  # closing is best effort
        log.warning("ssh.close_failed", host=name, reason=repr(exc))
