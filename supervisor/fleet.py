"""The fleet: every host's ``health.step`` and the rules that span hosts. Pure, like health.py.

``Fleet`` coordinates sub-cores, each a frozen value with pure transitions that take ``now``
and say what to do: ``failover.py`` (which machine serves each shard), ``signatures.py``
(crash and probe signatures), ``freeze.py`` (the common-mode freeze), ``budget.py`` (the
launch budget), ``pointer.py`` (the pointer file) and ``rewards.py`` (rewards that lie). It
keeps membership, start-up, shutdown and the operators' commands itself, feeds every host's
core, and turns what the sub-cores say into actions (``vocabulary.py``), in order.

Rules (DESIGN §4); the sub-cores state theirs:

1. Membership. A host joins only when no other member holds its name or its shard (one
   worker per shard: a host a reload added waits while a retiring host of that shard is
   still stopping). A joining host's files are read before it is connected, so a stop
   sentinel is known before anything could launch. A removed host is stopped, then dropped.
2. Connections are machines'. What a machine's connection says (up, down, a pushed exit)
   is told to the member it serves; a machine that serves none is failover's. A member
   that joins on a machine whose connection's outcome is known (a spare's, a standby's
   warm one) is told it at once.
3. Launches pass the budget (``budget.py``). A launch that has not begun is given up when
   its host leaves ``starting``; a finished launch gives its slot back before its result
   is applied, so a relaunch asked for at once can have it.
4. Start-up settles when every host has answered (its probe and any launch it led to) or
   could not be reached, or at the start-up deadline, whichever is first.
5. Shutdown completes when every host is stopped, or unreachable with nothing in flight,
   or at the shutdown deadline; the hosts left unstopped are named. "Unreachable" means its
   connection's first outcome came and was a failure: a host still connecting (a daemon
   stopped during its start-up, a standby that just took over) is waited for, so that the
   workers it runs are found and stopped, not left behind. For the same reason hosts whose
   files are being read when a stop begins still join, only to be stopped; a detach lets
   nobody join. A stop asked for before the boot is begun right after it.
6. Operator commands. An unknown or retiring host is refused by name, and every command
   while the daemon starts or stops; a restart of a host held by its stop sentinel is
   refused (start-host is the way); stop-host has the sentinel written before the host is
   stopped and start-host has it removed before the host starts, so the file, which
   outlives the daemon, always agrees with what was done.
7. Leadership is not the fleet's to decide (``leadership.py`` decides it). The fleet boots
   when the shell leads (``Booted``) and halts when told that this daemon does not, or no
   longer, lead (``LeadershipEnded``: deposed, or a standby that stops): at once and in
   every phase, nothing more is done, not even what the same batch asked for before the
   news came: no stop, no launch, no reply, no history write (the new leader owns it).
8. Rewards that lie (``rewards.py``) are looked at every few seconds while a worker reports
   its counts and the fleet runs (booted, not stopping). A host named as lying is
   not ready (``all_ready``, ``view``), and its shard moves to a free spare as a drain
   would move it (``failover.drain``, reason "lying"), tried again at each look while none
   is free; it is never restarted for it.

Theory of operation. ``Fleet`` is a sans-I/O state machine in the manner of h11's
connection: the shell feeds batches of events with ``now`` (a monotonic reading) and
performs the actions returned; the result of every action comes back later as an event.
Hosts are immutable ``health.Host`` values and the sub-cores' states immutable values; the
fleet object holds them and changes only in ``step``. ``deadline_at`` is the one instant at
which time alone could change something; early, late or repeated ``DeadlinePassed`` events
are harmless. Nothing here sleeps, logs or does I/O. The shell reads it through the queries
at the top of the class (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Final, assert_never

from supervisor import budget as budgets
from supervisor import failover, freeze, health, lifecycle, rewards, signatures
from supervisor import pointer as pointers
from supervisor.health import WANT_RUNNING_STATES, Host, HostState
from supervisor.records import record
from supervisor.vocabulary import (
    Action,
    Booted,
    Connect,
    CrashSignature,
    DeadlinePassed,
    DeleteStopSentinel,
    DiagnoseFilesystem,
    Disconnect,
    DrainRequested,
    Event,
    ExitReported,
    FilesScanned,
    FilesystemDiagnosed,
    FleetEvent,
    FleetPolicy,
    FreezeChanged,
    FreezeExplained,
    HistoryChanged,
    HostObserved,
    HostStateChanged,
    Launch,
    LaunchAsked,
    LaunchesWaiting,
    LeadershipEnded,
    LeftoversKilled,
    MachineObserved,
    Member,
    PointerNotWritten,
    PointerWritten,
    Probe,
    ProbeReported,
    Quarantine,
    RecheckStatus,
    Reconfigured,
    Reconnect,
    Refusal,
    Release,
    Reply,
    RestartHostRequested,
    Said,
    SavedSeats,
    ScanFiles,
    SendRewardProbe,
    Settled,
    ShutdownBegan,
    ShutdownDone,
    ShutdownRequested,
    StartHostRequested,
    StopHostRequested,
    StopSentinelDeleted,
    StopSentinelWritten,
    Terminate,
    ToHost,
    UndrainRequested,
    UnfreezeRequested,
    Watch,
    WritePointer,
    WriteStopSentinel,
)

S = HostState

_HISTORY_CHANGED: Final = HistoryChanged()
_RESULTS_OF_LAUNCH: Final = (health.Launched, health.LaunchFailed, health.LaunchRefused)
_SSH_NEWS: Final = (health.SshLost, health.SshRestored)
_SHUTDOWN_STOP: Final = health.StopRequested(
    reason="daemon shutdown", cause=health.StopCause.SHUTDOWN
)


@record
class FleetView:
    """What ``status``, the fleet page and the metrics show of the fleet at one instant:
    one query (``Fleet.view``), so the shell never reads the core's parts."""

    #: Every configured host: a joined one's health; a joining one as the host it is about
    #: to become; one that waits for its shard or name as its ``Member``
    #: (``vocabulary.WAITING``).
    hosts: Mapping[str, Host | Member]
    #: Hosts whose files are being read before they join (shown as they will start).
    joining: frozenset[str]
    #: Hosts a reload removed (or moved to another shard), being stopped before they leave.
    retiring: frozenset[str]
    #: label -> the machine serving its shard.
    machines: Mapping[str, str]
    #: label -> its shard (joined and waiting hosts).
    shards: Mapping[str, int]
    all_ready: bool
    health_policy: health.Policy
    frozen: bool
    frozen_reason: str
    finding: str | None
    #: Each signature holding restarts, with the hosts it holds: of crashes, of probes.
    crash_signatures: tuple[tuple[CrashSignature, tuple[str, ...]], ...]
    probe_signatures: tuple[tuple[CrashSignature, tuple[str, ...]], ...]
    #: Joined hosts with a worker (launched or found).
    workers: int
    spares: list[dict[str, object]]
    free_spares: int
    moves: list[dict[str, object]]
    failover_counts: Mapping[str, int]
    launches_waiting: int
    launches_in_flight: int
    pointer: pointers.Pointer
    #: Ready hosts named as lying (``rewards.py``): shown as ``vocabulary.LYING``, not ready.
    lying: Mapping[str, rewards.Lie]
    #: The rewards' evidence: every host's last look, the fleet's rates, the machines held
    #: for lying, a fleet-wide signature.
    rewards: rewards.Rewards


class Fleet:
    """Every member, its health, and the fleet-wide rules. Change it only through ``step``."""

    def __init__(
        self,
        members: Iterable[Member],
        health_policy: health.Policy,
        policy: FleetPolicy,
        spares: Iterable[str] = (),
    ) -> None:
        self._health = health_policy
        self._policy = policy
        # Membership: configured (in config order), joining (files being read), joined.
        self._configured: dict[str, Member] = {m.name: m for m in members}
        self._joining: dict[str, Member] = {}
        self._members: dict[str, Member] = {}
        self._hosts: dict[str, Host] = {}
        self._retiring: set[str] = set()
        #: The names of joined and joining hosts; a new object whenever they change.
        self.names: frozenset[str] = frozenset()
        #: Histories a previous daemon left for hosts that have not joined, and
        #: ``health.history_of`` of every joined host, replaced only when it changes (the
        #: shell saves the history after every change and re-encodes only new objects).
        self._histories: dict[str, health.History] = {}
        self._joined_histories: dict[str, health.History] = {}
        # The sub-cores' states.
        self._seating = failover.new(spares)
        self._signatures = signatures.NONE
        self._watch = freeze.Watch()
        self._budget = budgets.Budget()
        self._pointer = pointers.Pointer()
        self._pointer_due = False
        self._rewards = rewards.NONE
        #: A host reports its reward counts while no look is due: one is, now.
        self._rewards_wake = False
        self._seats_saved = self._seating.seats
        # Life cycle: boot, start-up, shutdown, halt.
        self._phase = lifecycle.Phase()
        self._at_boot: set[str] = set()
        self._connect_seen: set[str] = set()
        self._unsettled: set[str] = set()
        self._stop_pending: set[str] = set()
        #: Hosts with a stop sentinel written or removed now, and the stop-host/start-host
        #: commands that wait for it, in the order they came: one file operation per host
        #: at a time, so the last command is the one whose effect stays.
        self._sentinel_queues: dict[str, list[StopHostRequested | StartHostRequested]] = {}
        # Per-host deadlines: a heap of (when, host); ``_armed[host]`` is the live entry.
        self._timers: list[tuple[float, str]] = []
        self._armed: dict[str, float] = {}

    # --- queries: what the shell reads ---------------------------------------------------------

    def view(self, now: float) -> FleetView:
        """The fleet as ``status`` shows it at ``now``."""
        shown: dict[str, Host | Member] = dict(self._hosts)
        for name in self._joining:
            shown[name] = health.new_host(name, now, history=self._histories.get(name))
        waiting = self._waiting()
        shown.update(waiting)
        seating, sigs = self._seating, self._signatures
        return FleetView(
            hosts=shown,
            joining=frozenset(self._joining),
            retiring=frozenset(self._retiring),
            machines={name: failover.machine_of(seating, name) for name in shown},
            shards={
                name: m.shard
                for name, m in (*self._members.items(), *self._joining.items(), *waiting.items())
            },
            all_ready=self.all_ready,
            health_policy=self._health,
            frozen=self._watch.freeze.frozen,
            frozen_reason=self._watch.freeze.reason,
            finding=self._watch.finding,
            crash_signatures=tuple(
                (sig, tuple(signatures.held_by(sigs, key)))
                for key, sig in sigs.active.items()
                if sig.kind == "crash"
            ),
            probe_signatures=tuple(
                (sig, tuple(signatures.held_by(sigs, key)))
                for key, sig in sigs.active.items()
                if sig.kind == "probe"
            ),
            workers=sum(1 for h in self._hosts.values() if h.pid is not None),
            spares=failover.spare_rows(seating),
            free_spares=len(failover.free_spares(seating.seats, seating.sightings)),
            moves=failover.moving(seating, self._hosts),
            failover_counts=dict(seating.counts),
            launches_waiting=len(self._budget.waiting),
            launches_in_flight=len(self._budget.in_flight),
            pointer=self._pointer,
            lying=self._lying(),
            rewards=self._rewards,
        )

    def host(self, name: str) -> Host | None:
        """``name``'s health, if it joined."""
        return self._hosts.get(name)

    @property
    def hosts(self) -> Mapping[str, Host]:
        """Every joined host's health, by name."""
        return self._hosts

    @property
    def members(self) -> Mapping[str, Member]:
        """Every joined host's membership, by name."""
        return self._members

    # The sub-cores' states, as values (tests and benchmarks look at them; the shell reads
    # ``view``).

    @property
    def seating(self) -> failover.Seating:
        """Failover's state: seats, sightings, fenced machines."""
        return self._seating

    @property
    def signature_state(self) -> signatures.Signatures:
        """The crash and probe signatures and the hosts they hold."""
        return self._signatures

    @property
    def watch(self) -> freeze.Watch:
        """The freeze and when it is looked at next."""
        return self._watch

    @property
    def budget(self) -> budgets.Budget:
        """The launch budget."""
        return self._budget

    @property
    def pointer(self) -> pointers.Pointer:
        """The pointer file's progress."""
        return self._pointer

    @property
    def rewards_state(self) -> rewards.Rewards:
        """The rewards' evidence and verdicts."""
        return self._rewards

    @property
    def health_policy(self) -> health.Policy:
        """The per-host rules in force."""
        return self._health

    @property
    def all_ready(self) -> bool:
        """The fleet is up: every host not stopped on purpose is ``ready`` (at least one),
        none is named as lying, and none is still joining or waiting for its shard. The one
        meaning of "all ready": ``wait-ready``, the status's ``all_ready`` and the demo use
        it. (The pointer file, the seed's one-time "workers are up" marker, waits for the
        hosts' health alone: ``pointers.pointer_due``.)"""
        return (
            not self._joining
            and not self._waiting()
            and pointers.fleet_all_ready(self._hosts.values())
            and not self._lying()
        )

    def _lying(self) -> dict[str, rewards.Lie]:
        """The ready hosts named as lying (a named host in another state shows that state)."""
        return {
            name: lie
            for name, lie in self._rewards.named.items()
            if name in self._hosts and self._hosts[name].state is S.READY
        }

    @property
    def settled(self) -> bool:
        """Start-up is over (READY=1 went out)."""
        return self._phase.settled

    @property
    def finished(self) -> bool:
        """Shutdown is over: nothing more will happen."""
        return self._phase.finished

    def command_refusal(self) -> Refusal | None:
        """Why an operator command would find nobody to answer it, or None: the fleet has not
        booted (a standby, or a leader still reading its state) or has stopped. (While it
        stops, each command is the core's to refuse or not.)"""
        return lifecycle.command_refusal(self._phase)

    @property
    def history_is_ours(self) -> bool:
        """The restart history is this fleet's to save: it booted (it holds the history a
        previous daemon left) and was not halted (then the new leader owns the file)."""
        return lifecycle.history_is_ours(self._phase)

    def histories(self) -> dict[str, health.History]:
        """What of every host must survive a restart of the daemon; a host's object is the
        same one until its history changes."""
        return {**self._histories, **self._joined_histories}

    def last_states(self) -> dict[str, tuple[str, int | None]]:
        """Every joined host's state and its worker (or the last one it had): what the
        record of a clean stop keeps for offline ``status``."""
        return {
            name: (h.state.value, h.pid if h.pid is not None else h.last_pid)
            for name, h in self._hosts.items()
        }

    def saved_seats(self) -> SavedSeats | None:
        """What the state file keeps of the seats (None without spares: nothing to keep)."""
        return failover.saved(self._seating)

    @property
    def deadline_at(self) -> float | None:
        """The next instant at which time alone could change something."""
        candidates = [
            t
            for t in (
                self._timers[0][0] if self._timers else None,
                self._watch.look_at,
                budgets.next_grant_at(self._budget, self._policy),
                lifecycle.deadline_at(self._phase),
                self._pointer.retry_at,
                failover.deadline_at(self._seating),
                None if self._phase.stopping else self._rewards.look_at,
            )
            if t is not None
        ]
        return min(candidates) if candidates else None

    def _waiting(self) -> dict[str, Member]:
        """Configured hosts that wait for their shard or name to be free."""
        return {
            name: m
            for name, m in self._configured.items()
            if name not in self._joining and (name not in self._members or name in self._retiring)
        }

    # --- step ----------------------------------------------------------------------------------

    def step(self, events: Iterable[Event], now: float) -> list[Action]:
        """Apply a batch of events seen at monotonic ``now``; return what to do, in order."""
        out: list[Action] = []
        for event in events:
            if self._phase.finished:
                break  # nothing happens after shutdown
            if isinstance(event, HostObserved):
                self._observed(event.host, event.event, now, out)
            else:
                self._fleet_event(event, now, out)
        if self._phase.halted:
            return []  # whatever this batch asked for before the news came is not done either
        if self._phase.finished:
            return out
        if self._seating.down:
            self._seating, said = failover.look(
                self._seating,
                self._hosts,
                now=now,
                policy=self._policy,
                shutting_down=self._phase.stopping,
            )
            self._tell(said, now, out)
        if (
            self._phase.booted
            and not self._phase.stopping
            and (self._rewards_wake or rewards.due(self._rewards, now, self._policy.rewards))
        ):
            self._rewards_wake = False
            self._look_at_rewards(now, out)
        if self._seating.seats is not self._seats_saved and self._seating.sparing:
            self._seats_saved = self._seating.seats
            out.append(_HISTORY_CHANGED)
        # A batch matters to the freeze only if the fleet is frozen (heartbeats thaw it) or
        # a host changed state (the count of hosts that should run sets the threshold):
        # heartbeats alone only shorten silences, so they cannot freeze it.
        if self._watch.due or self._watch.freeze.frozen:
            self._look_for_freeze(now, out)
        if self._pointer_due:
            self._write_pointer_if_due(now, out)
        return out

    def _fleet_event(self, event: FleetEvent, now: float, out: list[Action]) -> None:
        match event:
            case Booted():
                self._boot(event, now, out)
            case FilesScanned():
                self._files_scanned(event, now, out)
            case DeadlinePassed():
                self._deadline_passed(now, out)
            case Reconfigured():
                self._reconfigure(event, now, out)
            case RestartHostRequested():
                self._restart_host(event, now, out)
            case StopHostRequested() | StartHostRequested():
                self._sentinel_command(event, out)
            case StopSentinelWritten() | StopSentinelDeleted():
                self._sentinel_done(event, now, out)
            case UnfreezeRequested():
                self._unfreeze(event, now, out)
            case ShutdownRequested() if not self._phase.booted and not self._detaches(event):
                # Before the boot (a signal while the shell read the history): the stop
                # comes once the members are known, so their workers are found and stopped.
                self._phase = replace(self._phase, stop_at_boot=True)
            case ShutdownRequested():
                self._shutdown(self._detaches(event), now, out)
            case PointerWritten():
                self._pointer_written(event, now, out)
            case FilesystemDiagnosed():
                if self._watch.freeze.frozen:  # thawed meanwhile: old news
                    self._watch = replace(self._watch, finding=event.finding)
                    out.append(FreezeExplained(finding=event.finding, free_bytes=event.free_bytes))
            case LeadershipEnded():
                self._phase = replace(self._phase, halted=True, finished=True)
                self._joining.clear()
            case MachineObserved():
                self._machine_observed(event, now, out)
            case LeftoversKilled():
                self._seating, said = failover.leftovers_killed(
                    self._seating, event.machine, event.error, now=now, hosts=self._hosts
                )
                self._tell(said, now, out)
            case DrainRequested():
                self._drain(event, now, out)
            case UndrainRequested():
                self._undrain(event, out)
            case _:
                assert_never(event)

    def _tell(self, said: Iterable[Said], now: float, out: list[Action]) -> None:
        """What a sub-core said, in order: words to a host's core are fed, actions kept."""
        for item in said:
            if isinstance(item, ToHost):
                self._to_host(item.host, item.event, now, out)
            else:
                out.append(item)

    # --- machines and hosts ----------------------------------------------------------------------

    def _machine_observed(self, event: MachineObserved, now: float, out: list[Action]) -> None:
        news = event.event
        if isinstance(news, _SSH_NEWS):
            self._seating, said = failover.connection_changed(
                self._seating,
                event.machine,
                news,
                now=now,
                shutting_down=self._phase.stopping,
                health_policy=self._health,
            )
            self._tell(said, now, out)
            return
        label = failover.label_at(self._seating, event.machine)
        if isinstance(news, health.AgentStarted | health.UsageMeasured):
            if label is not None:
                self._to_host(label, news, now, out)
            return
        out.append(
            ExitReported(
                machine=event.machine,
                host=label,
                pid=news.pid,
                exit_code=news.exit_code,
                signal=news.signal,
                reaped=news.reaped,
            )
        )
        if label is not None:  # else a leftover of a machine that serves no member now
            self._to_host(label, news, now, out)

    def _observed(self, name: str, event: health.Event, now: float, out: list[Action]) -> None:
        """News of a member by name (its files, an action's result); a connection's news is
        its machine's."""
        if isinstance(event, _SSH_NEWS):
            machine = failover.machine_of(self._seating, name)
            self._machine_observed(MachineObserved(machine, event), now, out)
            return
        self._to_host(name, event, now, out)

    def _to_host(self, name: str, event: health.Event, now: float, out: list[Action]) -> None:
        if name not in self._hosts:
            return  # a host that left (or has not joined): its news is moot
        kind = type(event)
        if isinstance(event, health.WorkerExited):
            # Decided before the exit is applied: a held host must not restart at once.
            self._crashed(name, event, now, out)
        elif isinstance(event, health.RewardProbeAnswered):
            report = health.probe_report(self._hosts[name], event, self._health)
            if report is not None:  # said first: what it leads to follows
                out.append(ProbeReported(host=name, report=report))
            self._probe_failed(name, event, now, out)
        elif kind is health.Relocated:
            # Its launch, waiting or in flight, was for the machine it leaves.
            self._budget = budgets.launch_done(self._budget, name)
            self._watch = replace(self._watch, due=True)
            self._pointer_due = True
        if kind in _RESULTS_OF_LAUNCH and name in self._budget.in_flight:
            # The slot goes back before the result is applied: a relaunch the core asks for
            # at once (the first failure after a healthy spell) must find it free.
            self._budget = budgets.launch_done(self._budget, name)
            self._feed(name, event, now, out)
            self._grant(now, out)
            return
        self._feed(name, event, now, out)
        if kind in _SSH_NEWS and name in self._hosts:
            # The first outcome of connecting settles an unreachable host even when it
            # changes nothing else (a host that was never up and still is not).
            self._connect_seen.add(name)
            self._track(name, out)

    def _feed(self, name: str, event: health.Event, now: float, out: list[Action]) -> None:
        """Step one host and act on what it says."""
        before = self._hosts[name]
        host, actions = health.step(before, event, now, self._health)
        self._hosts[name] = host
        if host.state is not before.state:
            self._watch = freeze.counted(self._watch, before.state, host.state)
        alive_at = host.alive_at
        if (
            host.state is S.READY
            and alive_at is not None
            and (before.state is not S.READY or (alive_at != before.alive_at and alive_at != now))
        ):
            # Ready now, or its last heartbeat moved other than to now (a routine beat):
            # its silence may begin sooner than the next crossing the last look found.
            silent_after_s = self._health.heartbeat_stale_s / 2
            self._watch = freeze.silence_moved(self._watch, alive_at, now, silent_after_s)
        for action in actions:
            self._host_action(name, host, action, now, out)
        self._arm(name, host.deadline_at)
        if self._rewards.look_at is None and rewards.reports_counts(host.stats):
            # Looks run only while a worker reports its counts: this one does (rule 8).
            self._rewards_wake = self._policy.rewards.window_s > 0
        if health.history_changed(before, host):
            self._joined_histories[name] = health.history_of(host)
            out.append(_HISTORY_CHANGED)
        if host.state is not before.state or host.ssh_up != before.ssh_up or host.op != before.op:
            self._after_change(name, before, now, out)

    def _host_action(
        self, name: str, host: Host, action: health.Action, now: float, out: list[Action]
    ) -> None:
        if isinstance(action, health.Launch):
            # Every launch waits for the budget (rule 3).
            self._budget = budgets.want_launch(self._budget, name, now)
        out.append(
            fleet_action(
                name,
                failover.machine_of(self._seating, name),
                self._members[name].shard,
                host,
                action,
            )
        )
        if isinstance(action, health.Launch):
            self._grant(now, out)

    def _after_change(self, name: str, before: Host, now: float, out: list[Action]) -> None:
        host = self._hosts[name]
        if host.state is not before.state:
            self._pointer_due = True
            if host.state is S.READY and self._signatures.active:
                self._signatures, said = signatures.ran_again(self._signatures, name)
                self._tell(said, now, out)
        if host.state is not S.STARTING and budgets.is_waiting(self._budget, name):
            # It left ``starting`` (stopped, restarted...) while its launch waited: the
            # launch will never begin, and the core must hear that it did not happen.
            self._budget = budgets.launch_done(self._budget, name)
            self._feed(name, health.LaunchFailed(reason="cancelled before it began"), now, out)
            return
        if name in self._retiring and host.state is S.STOPPED:
            self._drop(name, now, out)
            return
        self._track(name, out)

    def _track(self, name: str, out: list[Action]) -> None:
        """Re-check what start-up and shutdown wait for, for the host that changed."""
        host = self._hosts[name]
        if not self._phase.settled:
            if self._host_settled(name, host):
                self._unsettled.discard(name)
            else:
                self._unsettled.add(name)
            if not self._unsettled and self._phase.booted and not self._joining:
                self._settle((), out)
        if self._phase.stopping:
            if self._stop_done(name, host):
                self._stop_pending.discard(name)
            else:
                self._stop_pending.add(name)
            if not self._stop_pending:
                self._finish(out)

    def _host_settled(self, name: str, host: Host) -> bool:
        """Start-up is done for this host: it answered, or it cannot be reached."""
        if name not in self._connect_seen:
            return False
        if not host.ssh_up:
            return True
        return not host.needs_probe and host.op not in ("probe", "launch")

    # --- membership ----------------------------------------------------------------------------

    def _boot(self, event: Booted, now: float, out: list[Action]) -> None:
        if self._phase.booted:
            return
        self._phase = replace(self._phase, booted=True)
        self._histories = dict(event.histories)
        self._seating, said = failover.restore(self._seating, event.seats, self._configured)
        self._tell(said, now, out)
        self._admit(now, out)
        self._at_boot = set(self._joining)
        if self._phase.stop_at_boot:
            self._shutdown(False, now, out)
            return
        if not self._joining:
            self._settle((), out)

    def _admit(self, now: float, out: list[Action]) -> None:
        """Let configured hosts join whose shard and name no member holds."""
        if self._phase.stopping:
            return
        busy_shards = {m.shard for m in self._members.values()}
        busy_shards.update(m.shard for m in self._joining.values())
        joining: list[str] = []
        for name, member in self._configured.items():
            if name in self._members or name in self._joining or member.shard in busy_shards:
                continue
            self._joining[name] = member
            busy_shards.add(member.shard)
            joining.append(name)
        if joining:
            self._names_changed()
            out.append(ScanFiles(hosts=tuple(joining)))

    def _files_scanned(self, event: FilesScanned, now: float, out: list[Action]) -> None:
        # A stop under way (a detach has finished already): they join only to be stopped,
        # so that a worker already running there is found and stopped, not left behind.
        stopping = self._phase.stopping
        self._phase = lifecycle.first_hosts_read(self._phase, now, self._policy.startup_timeout_s)
        # In the order they joined, which is the config's: hosts connect as listed.
        for name in [n for n in self._joining if n in event.hosts]:
            member = self._joining.pop(name)
            if self._configured.get(name) != member:
                # A reload removed or changed it meanwhile: admitted afresh below (not while
                # stopping: commands are refused then, so it changed before the stop).
                self._stop_pending.discard(name)
                continue
            self._join(name, member, stop_sentinel=name in event.sentinels, now=now, out=out)
            if stopping:
                self._feed(name, _SHUTDOWN_STOP, now, out)
            elif self._watch.freeze.frozen:
                self._feed(name, health.FleetFrozen(reason=self._watch.freeze.reason), now, out)
            self._arm(name, self._hosts[name].deadline_at)
            self._tell_connection(name, now, out)
        self._names_changed()
        if stopping:
            if not self._stop_pending:
                self._finish(out)
            return
        self._admit(now, out)
        if not self._phase.settled and not self._unsettled and not self._joining:
            self._settle((), out)

    def _join(
        self, name: str, member: Member, *, stop_sentinel: bool, now: float, out: list[Action]
    ) -> None:
        """``name`` becomes a member: its health, its seat, its machine's connection."""
        history = self._histories.pop(name, None)
        host = health.new_host(name, now, stop_sentinel=stop_sentinel, history=history)
        self._hosts[name] = host
        self._joined_histories[name] = health.history_of(host)
        self._watch = replace(
            self._watch, expected=self._watch.expected + (host.state in WANT_RUNNING_STATES)
        )
        self._members[name] = member
        if not self._phase.settled:
            self._unsettled.add(name)
        added = name not in self._at_boot
        self._at_boot.discard(name)
        self._seating, machine = failover.seat(self._seating, name, member.shard)
        out.append(Connect(host=name, shard=member.shard, added=added, machine=machine))

    def _tell_connection(self, name: str, now: float, out: list[Action]) -> None:
        """A member joined on a machine whose connection's outcome is known (a spare's, a
        standby's warm one): it is told at once, as the connection will not say it again."""
        sighting = self._seating.sightings[failover.machine_of(self._seating, name)]
        if sighting.connected:
            self._to_host(name, health.SshRestored(), now, out)
        elif sighting.down_since is not None:
            self._to_host(name, health.SshLost(reason=sighting.reason), now, out)

    def _drop(self, name: str, now: float, out: list[Action]) -> None:
        """``name`` is stopped and no longer configured: it leaves, and others may join."""
        self._watch = freeze.counted(self._watch, self._hosts.pop(name).state, S.STOPPED)
        del self._joined_histories[name]
        del self._members[name]
        self._retiring.discard(name)
        self._armed.pop(name, None)
        self._unsettled.discard(name)
        self._stop_pending.discard(name)
        self._connect_seen.discard(name)
        self._signatures = signatures.forget(self._signatures, name)
        self._rewards = rewards.forget(self._rewards, name)
        self._budget = budgets.launch_done(self._budget, name)
        machine = failover.machine_of(self._seating, name)
        self._seating = failover.unseat(self._seating, name)
        self._names_changed()
        if machine == name:
            out.append(Disconnect(host=name, machine=machine))
        else:
            out.append(Release(host=name, machine=machine))
        if not self._phase.stopping:
            self._admit(now, out)
        if self._phase.stopping and not self._stop_pending:
            self._finish(out)

    def _names_changed(self) -> None:
        self.names = frozenset(self._members.keys() | self._joining.keys())

    def _reconfigure(self, event: Reconfigured, now: float, out: list[Action]) -> None:
        old = self._configured
        new = {m.name: m for m in event.members}
        self._configured = new
        probe_changed = (event.health.probe_task, event.health.probe_expect) != (
            self._health.probe_task,
            self._health.probe_expect,
        )
        self._health = event.health
        # Another stale threshold moves every crossing: the next look looks at all.
        self._watch = replace(self._watch, silent_bound=None, due=True)
        if event.policy.pointer_file != self._policy.pointer_file:
            self._pointer = pointers.Pointer()  # another file: it has never been written
            self._pointer_due = True
        self._policy = event.policy
        removed = [n for n in old if n not in new]
        added = [n for n in new if n not in old]
        both = [n for n in new if n in old]
        restarted = [n for n in both if old[n].launch_key != new[n].launch_key]
        # A host moved to another shard leaves and joins again: its new shard may still be
        # held by a host that is stopping, and one worker per shard comes first.
        for name in removed:
            self._retire(name, "removed from config by reload", now, out)
        for name in [n for n in both if old[n].shard != new[n].shard]:
            self._retire(name, f"moved to shard {new[name].shard} by reload", now, out)
        for name in both:
            if name in self._members and name not in self._retiring:
                self._members[name] = new[name]
                if failover.machine_of(self._seating, name) == name:
                    # (a spare serving it keeps its own settings)
                    out.append(Reconnect(host=name, machine=name))
        if restarted:
            self._clear_signatures("a reload changed what the workers run", now, out)
        elif probe_changed:
            self._clear_signatures("a reload changed the reward probe", now, out, kind="probe")
        for name in restarted:
            if name in self._hosts and name not in self._retiring:
                restart = health.RestartRequested(
                    reason="launch parameters changed by reload", planned=health.Planned.RELOAD
                )
                self._feed(name, restart, now, out)
        self._admit(now, out)
        for name in list(self._hosts):  # new timings: recompute every deadline
            self._feed(name, health.DeadlinePassed(), now, out)
        result = {"added": added, "removed": removed, "restarted": restarted, "updated": both}
        out.append(Reply(token=event.token, result=result))

    def _retire(self, name: str, reason: str, now: float, out: list[Action]) -> None:
        if name in self._joining:
            del self._joining[name]  # never connected: nothing to stop
            self._names_changed()
            if self._phase.stopping:  # a stop waited for it to join: no longer
                self._stop_pending.discard(name)
                if not self._stop_pending:
                    self._finish(out)
            return
        if name not in self._hosts or name in self._retiring:
            return
        self._retiring.add(name)
        stop = health.StopRequested(reason=reason, cause=health.StopCause.REMOVED)
        self._feed(name, stop, now, out)
        if name in self._hosts and self._hosts[name].state is S.STOPPED:
            self._drop(name, now, out)

    # --- operator commands ---------------------------------------------------------------------

    def _refuse(self, name: str | None, token: int, out: list[Action]) -> bool:
        """Refuse a command while stopping, or for a host that is not a member (or leaves)."""
        if self._phase.stopping:
            message = "the daemon is stopping"
            out.append(Reply(token=token, refusal=Refusal.SHUTTING_DOWN, message=message))
            return True
        if name is None or (name in self._hosts and name not in self._retiring):
            return False
        known = ", ".join(sorted(n for n in self._hosts if n not in self._retiring)) or "none"
        message = f"unknown host {name!r} (known: {known})"
        out.append(Reply(token=token, refusal=Refusal.UNKNOWN_HOST, message=message))
        return True

    def _restart_host(self, event: RestartHostRequested, now: float, out: list[Action]) -> None:
        if self._refuse(event.host, event.token, out):
            return
        refusal = health.restart_refusal(self._hosts[event.host])
        if refusal is not None:
            message = f"host {event.host!r} is {refusal}"
            out.append(Reply(token=event.token, refusal=Refusal.SENTINEL_HELD, message=message))
            return
        self._feed(event.host, health.RestartRequested(reason="operator restart"), now, out)
        out.append(Reply(token=event.token))

    def _sentinel_command(
        self, event: StopHostRequested | StartHostRequested, out: list[Action]
    ) -> None:
        """stop-host writes the host's stop sentinel, start-host removes it; a command that
        comes while the other's file operation is under way waits for its result. Run at
        once, a remove could finish before an earlier write (two threads): start-host would
        be answered, and the sentinel written after it would keep the host stopped."""
        queue = self._sentinel_queues.get(event.host)
        if queue is not None:
            queue.append(event)
            return
        if self._refuse(event.host, event.token, out):
            return
        self._sentinel_queues[event.host] = []
        if isinstance(event, StopHostRequested):
            out.append(WriteStopSentinel(host=event.host, token=event.token))
        else:
            out.append(DeleteStopSentinel(host=event.host, token=event.token))

    def _sentinel_done(
        self, event: StopSentinelWritten | StopSentinelDeleted, now: float, out: list[Action]
    ) -> None:
        """The sentinel's file operation is done: the command is applied and answered, then
        the next command that waited for it goes."""
        written = isinstance(event, StopSentinelWritten)
        if event.error is not None:
            what = "write" if written else "remove"
            message = f"cannot {what} the stop sentinel of {event.host!r}: {event.error}"
            out.append(Reply(token=event.token, refusal=Refusal.FILE_ERROR, message=message))
        elif not self._refuse(event.host, event.token, out):
            if written:
                self._feed(event.host, health.StopSentinelAppeared(), now, out)
            else:
                self._feed(event.host, health.StopSentinelRemoved(), now, out)
                self._feed(event.host, health.StartRequested(reason="operator start"), now, out)
            out.append(Reply(token=event.token))
        for waiting in self._sentinel_queues.pop(event.host, []):
            if event.host in self._sentinel_queues:
                self._sentinel_queues[event.host].append(waiting)
            else:
                self._sentinel_command(waiting, out)

    def _unfreeze(self, event: UnfreezeRequested, now: float, out: list[Action]) -> None:
        self._clear_signatures("operator unfreeze", now, out)
        self._rewards, said = rewards.accepted(self._rewards)
        self._tell(said, now, out)
        was = self._watch.freeze.frozen
        self._watch, change = freeze.thawed_by_operator(self._watch, now)
        if change is not None:
            self._apply_freeze(change, now, out)
        out.append(Reply(token=event.token, result={"frozen": False, "was_frozen": was}))

    def _drain(self, event: DrainRequested, now: float, out: list[Action]) -> None:
        if self._refuse(None, event.token, out):
            return
        machine = event.host
        if machine not in self._seating.sightings:
            known = ", ".join(sorted(self._seating.sightings)) or "none"
            message = f"unknown host {machine!r} (known: {known})"
            out.append(Reply(token=event.token, refusal=Refusal.UNKNOWN_HOST, message=message))
            return
        result = failover.drain(self._seating, machine, self._hosts, health_policy=self._health)
        if isinstance(result, Refusal):
            out.append(Reply(token=event.token, refusal=result, message=_drain_refused(result)))
            return
        self._seating, move, said = result
        self._tell(said, now, out)
        fields = {"label": move.label, "shard": move.shard, "to": move.to_machine}
        out.append(Reply(token=event.token, result=fields))

    def _undrain(self, event: UndrainRequested, out: list[Action]) -> None:
        result = failover.undrain(self._seating, event.host)
        if isinstance(result, Refusal):
            message = f"{event.host!r} is not drained (or its worker is still being stopped)"
            out.append(Reply(token=event.token, refusal=result, message=message))
            return
        self._seating = result
        self._rewards = rewards.undrained(self._rewards, event.host)
        out.append(Reply(token=event.token, result={"spare": event.host}))

    # --- start-up and shutdown -----------------------------------------------------------------

    def _settle(self, slow: tuple[str, ...], out: list[Action]) -> None:
        self._phase = replace(self._phase, settled=True)
        self._unsettled.clear()
        out.append(Settled(slow=slow))

    def _detaches(self, event: ShutdownRequested) -> bool:
        """Whether this stop leaves the workers running."""
        return self._policy.detach_on_exit if event.detach is None else event.detach

    def _shutdown(self, detach: bool, now: float, out: list[Action]) -> None:
        if self._phase.stopping:
            return
        if not self._phase.settled:
            self._settle(tuple(sorted(self._unsettled | self._joining.keys())), out)
        timeout_s = None if detach else self._policy.shutdown_timeout_s
        self._phase = lifecycle.stopping(self._phase, now, timeout_s)
        out.append(ShutdownBegan(detach=detach))
        if detach:
            self._finish(out, detached=True)  # workers keep running; the next daemon adopts them
            return
        # Hosts whose files are being read join once they are, only to be stopped.
        self._stop_pending = set(self._hosts) | set(self._joining)
        for name in list(self._hosts):
            # Feeding one host can only drop that host (a removed one, now stopped).
            self._feed(name, _SHUTDOWN_STOP, now, out)
            host = self._hosts.get(name)
            if host is not None and self._stop_done(name, host):
                self._stop_pending.discard(name)
        if not self._stop_pending:
            self._finish(out)

    def _stop_done(self, name: str, host: Host) -> bool:
        """Shutdown is done with this host: stopped, or unreachable (its connection's first
        outcome came, a failure) with nothing in flight."""
        if host.state is S.STOPPED:
            return True
        return not host.ssh_up and host.op is None and name in self._connect_seen

    def _finish(self, out: list[Action], *, detached: bool = False) -> None:
        if self._phase.finished:
            return
        self._phase = replace(self._phase, finished=True)
        self._joining.clear()
        if detached:
            out.append(ShutdownDone())
        elif self._stop_pending:
            out.append(ShutdownDone(incomplete=tuple(sorted(self._stop_pending))))
        else:
            # A host we cannot reach cannot be stopped: say so, or a stop would read as a
            # promise kept for workers that may well run on.
            unreachable = tuple(n for n, h in self._hosts.items() if h.state is not S.STOPPED)
            out.append(ShutdownDone(unreachable=unreachable))

    # --- signatures -----------------------------------------------------------------------------

    def _crashed(
        self, name: str, event: health.WorkerExited, now: float, out: list[Action]
    ) -> None:
        """Count a crash of ``name`` by its signature (``signatures.py``)."""
        if self._policy.crash_signature_hosts <= 0 or not health.exit_applies(
            self._hosts[name], event
        ):
            return
        signature = signatures.crash_signature(event)
        if signature is not None:
            self._failed_alike(name, signature, "crash", event.log_tail, now, out)

    def _probe_failed(
        self, name: str, event: health.RewardProbeAnswered, now: float, out: list[Action]
    ) -> None:
        """Count a failed reward probe of ``name`` by its signature, like a crash."""
        if self._policy.crash_signature_hosts <= 0:
            return
        signature = signatures.probe_signature(self._hosts[name], event, self._health)
        if signature is not None:
            self._failed_alike(name, signature, "probe", None, now, out)

    def _failed_alike(
        self,
        name: str,
        signature: str,
        kind: str,
        log_tail: str | None,
        now: float,
        out: list[Action],
    ) -> None:
        self._signatures, said = signatures.failed(
            self._signatures,
            name,
            signature,
            kind=kind,
            log_tail=log_tail,
            hosts=self._hosts,
            now=now,
            policy=self._policy,
        )
        self._tell(said, now, out)

    def _clear_signatures(
        self, reason: str, now: float, out: list[Action], kind: str | None = None
    ) -> None:
        self._signatures, said = signatures.cleared(self._signatures, reason, kind)
        self._tell(said, now, out)

    # --- rewards that lie ----------------------------------------------------------------------

    def _look_at_rewards(self, now: float, out: list[Action]) -> None:
        """Judge every host's rewards (``rewards.py``), then move the shards of the hosts
        named as lying where a spare is free (rule 8)."""
        policy = self._policy.rewards
        machines = {name: failover.machine_of(self._seating, name) for name in self._hosts}
        self._rewards, said = rewards.look(
            self._rewards, self._hosts, machines, now=now, policy=policy
        )
        self._tell(said, now, out)
        for name in rewards.to_move(self._rewards, policy):
            machine = self._rewards.named[name].machine
            result = failover.drain(
                self._seating, machine, self._hosts, health_policy=self._health, reason="lying"
            )
            if isinstance(result, Refusal):
                self._rewards, said = rewards.not_moved(self._rewards, name, _kept(result))
                self._tell(said, now, out)
                continue
            self._seating, _move, said = result
            self._rewards = rewards.moved(self._rewards, name)
            self._tell(said, now, out)

    # --- the pointer file ----------------------------------------------------------------------

    def _write_pointer_if_due(self, now: float, out: list[Action]) -> None:
        self._pointer_due = False
        path = self._policy.pointer_file
        if path is not None and pointers.pointer_due(self._pointer, self._hosts.values(), now):
            self._pointer = pointers.pointer_started(self._pointer)
            out.append(WritePointer(path=path))

    def _pointer_written(self, event: PointerWritten, now: float, out: list[Action]) -> None:
        if event.path != self._policy.pointer_file:
            return  # a reload named another file meanwhile: this one is not wanted
        if event.error is None:
            self._pointer = pointers.pointer_written(self._pointer)
            return
        self._pointer = pointers.pointer_failed(self._pointer, now, event.error)
        retry_at = self._pointer.retry_at if self._pointer.retry_at is not None else now
        out.append(
            PointerNotWritten(
                path=event.path,
                reason=event.error,
                attempt=self._pointer.failures,
                retry_at=retry_at,
            )
        )

    # --- time ----------------------------------------------------------------------------------

    def _arm(self, name: str, deadline_at: float | None) -> None:
        """Keep one timer entry per host that is due no later than its deadline."""
        armed = self._armed.get(name)
        if armed is not None and deadline_at is not None and armed <= deadline_at:
            # Every heartbeat moves a ready host's deadline later; an early wake-up only
            # makes the core say when to come back.
            return
        if deadline_at is None:
            self._armed.pop(name, None)
            return
        # The entry this one supersedes stays in the heap until its time, then is skipped:
        # only a deadline that moves earlier (a state change, never a heartbeat) adds one,
        # so the heap holds the hosts plus the changes of one deadline horizon at most.
        self._armed[name] = deadline_at
        heapq.heappush(self._timers, (deadline_at, name))

    def _deadline_passed(self, now: float, out: list[Action]) -> None:
        look_at = self._watch.look_at
        if look_at is not None and now >= look_at:
            # Before the hosts' own deadlines: a timer that fires late (a stalled loop, a
            # suspended VM) must still freeze the fleet before silence restarts anyone.
            self._look_for_freeze(now, out)
        due: list[str] = []
        while self._timers and self._timers[0][0] <= now:
            when, name = heapq.heappop(self._timers)
            if self._armed.get(name) == when:
                del self._armed[name]
                due.append(name)
        for name in due:  # a host that left was disarmed (_drop): every one is a member
            self._feed(name, health.DeadlinePassed(), now, out)
        grant_at = budgets.next_grant_at(self._budget, self._policy)
        if grant_at is not None and now >= grant_at:
            self._grant(now, out)
        if self._pointer.retry_at is not None and now >= self._pointer.retry_at:
            self._pointer_due = True
        if lifecycle.startup_overdue(self._phase, now):
            self._settle(tuple(sorted(self._unsettled | self._joining.keys())), out)
        if lifecycle.shutdown_overdue(self._phase, now):
            self._finish(out)
        if self._seating.kill_retry_at:
            self._seating, said = failover.retry_kills(
                self._seating,
                now=now,
                shutting_down=self._phase.stopping,
                health_policy=self._health,
            )
            self._tell(said, now, out)

    # --- freeze and budget ----------------------------------------------------------------------

    def _look_for_freeze(self, now: float, out: list[Action]) -> None:
        silent_after_s = self._health.heartbeat_stale_s / 2
        self._watch, change = freeze.look(
            self._watch, self._hosts.values(), now, self._policy, silent_after_s
        )
        if change is not None:
            self._apply_freeze(change, now, out)
            self._watch = freeze.resurveyed(self._watch, self._hosts.values(), now, silent_after_s)

    def _apply_freeze(self, change: freeze.FreezeChange, now: float, out: list[Action]) -> None:
        hosts = tuple(sorted(self._watch.freeze.hosts))
        out.append(FreezeChanged(frozen=change.frozen, reason=change.reason, hosts=hosts))
        if change.frozen:
            out.append(DiagnoseFilesystem())
        event: health.Event = (
            health.FleetFrozen(reason=change.reason) if change.frozen else health.FleetThawed()
        )
        for name in list(self._hosts):
            self._feed(name, event, now, out)

    def _grant(self, now: float, out: list[Action]) -> None:
        """Begin the queued launches the budget allows now (longest waiting first)."""
        self._budget, granted = budgets.grant(self._budget, now, self._policy)
        for name in granted:  # a host that left gave up its place (_drop): every one is a member
            self._feed(name, health.LaunchBegan(), now, out)
            machine = failover.machine_of(self._seating, name)
            out.append(Launch(host=name, machine=machine, shard=self._members[name].shard))
        if self._budget.waiting:
            out.append(LaunchesWaiting(waiting=len(self._budget.waiting)))


def fleet_action(name: str, machine: str, shard: int, host: Host, action: health.Action) -> Action:
    """The fleet's action for what ``name``'s core said: where it is done (the machine
    serving its shard) and what the shell needs to do it."""
    match action:
        case health.StateChanged():
            return HostStateChanged(
                host=name,
                from_=action.from_,
                to=action.to,
                reason=action.reason,
                pid=host.pid if host.pid is not None else host.last_pid,
                cause=host.cause_code if action.to in health.UNHEALTHY_STATES else None,
                evidence=action.evidence,
                fault=action.fault,
            )
        case health.Launch():
            return LaunchAsked(
                host=name,
                reason=action.reason,
                is_restart=action.is_restart,
                cause=action.cause,
                planned=action.planned,
            )
        case health.Terminate():
            return Terminate(
                host=name,
                machine=machine,
                shard=shard,
                pid=action.pid,
                grace_s=action.grace_s,
                kill=action.kill,
                collect_evidence=action.collect_evidence,
            )
        case health.Quarantine():
            return Quarantine(host=name, shard=shard, count=action.count)
        case health.Watch():
            return Watch(
                host=name,
                machine=machine,
                shard=shard,
                pid=action.pid,
                start_time=action.start_time,
            )
        case health.Probe():
            return Probe(host=name, machine=machine, shard=shard, pid=action.pid)
        case health.RecheckStatus():
            older = action.tasks_older_than_s
            return RecheckStatus(host=name, shard=shard, tasks_older_than_s=older)
        case health.SendRewardProbe():
            return SendRewardProbe(
                host=name, shard=shard, pid=action.pid, task=action.task, timeout_s=action.timeout_s
            )
        case _:
            assert_never(action)


def _kept(refusal: Refusal) -> str:
    """Why a lying host's shard stays where it is, in words (its machine serves it: the
    rewards core clears a name whose host runs elsewhere before a move is tried)."""
    if refusal is Refusal.NO_SPARES:
        return "no spare is configured ([[spares]], read at start): it keeps serving, named"
    return "no spare is free now: it keeps serving, named; tried again at each look"


def _drain_refused(refusal: Refusal) -> str:
    """Why a drain was refused, in words that say what to do."""
    if refusal is Refusal.NO_SPARES:
        return (
            "no spare is configured: add a [[spares]] machine to the config and reload, or"
            " use restart-host / stop-host for this host"
        )
    if refusal is Refusal.NO_FREE_SPARE:
        return (
            "every spare is busy, down or still being cleaned (see status's spares);"
            " try again once one is free"
        )
    return "that host serves no shard (a spare, or drained already)"
