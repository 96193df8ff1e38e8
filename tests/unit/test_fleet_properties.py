"""Properties of the fleet core over random event sequences on several hosts (hypothesis).

A truthful world: workers that start, crash, hang and beat on the shard of the host that
launched them, counting the tasks they score (a host's machine may start to score them all
0); SSH that comes and goes; operations answered truthfully, failed, or with
their answer lost; operators, reloads that add, remove and move hosts between shards, and a
shutdown. The world does not enforce the shard lock: the core alone must keep one worker
per shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor import budget as budgets
from supervisor import fleet as f
from supervisor import freeze as freezes
from supervisor import health as h
from supervisor import vocabulary as v
from supervisor.health import HostState as S
from supervisor.policies import RewardsPolicy
from tests.examples import examples

HEALTH = h.Policy(
    heartbeat_stale_s=10.0,
    ready_timeout_s=20.0,
    restart_cooldown_s=1.0,
    backoff_max_s=30.0,
    stop_grace_s=5.0,
)
POLICY = v.FleetPolicy(
    freeze_fraction=0.5,
    freeze_window_s=30.0,
    max_concurrent_launches=2,
    max_launches_per_minute=4,
    startup_timeout_s=30.0,
    shutdown_timeout_s=60.0,
    # Quick to name and to clear, so that sixty random steps see both.
    rewards=RewardsPolicy(window_s=5.0, min_tasks=100, sustain_s=5.0, clear_s=10.0),
)
NAMES = ("a", "b", "c", "d")


@dataclass(frozen=True)
class Worker:
    """A live worker process: which host launched it, for which shard."""

    host: str
    shard: int


def members_of(config: dict[str, int]) -> tuple[v.Member, ...]:
    """Members from a name -> shard map."""
    return tuple(v.Member(name=n, shard=s) for n, s in config.items())


class FleetWorld(RuleBasedStateMachine):
    """Several hosts, one core, a truthful world around it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.config = {"a": 0, "b": 1, "c": 2}
        self.core = f.Fleet(members_of(self.config), HEALTH, POLICY)
        self.workers: dict[int, Worker] = {}
        self.hung: set[int] = set()
        self.exits: list[tuple[str, int]] = []
        self.ops: dict[str, v.Action] = {}
        self.scans: list[v.ScanFiles] = []
        self.sentinel_ops: list[v.WriteStopSentinel | v.DeleteStopSentinel] = []
        self.sentinels: set[str] = set()
        self.launch_starts: list[float] = []
        self.next_pid = 1000
        self.stamp = 0.0
        self.settled = 0
        self.stopping = False
        self.done: v.ShutdownDone | None = None
        self.tokens = 0
        self.connecting: list[str] = []
        #: Each worker's (scored, zero) counts, and the hosts whose machines score 0.
        self.counts: dict[int, tuple[int, int]] = {}
        self.liars: set[str] = set()
        self.feed(v.Booted())

    # --- the shell ---------------------------------------------------------------------------

    def feed(self, *events: v.Event) -> None:
        """Step the core with one batch and perform (record) each action, checking it."""
        if self.core.finished:
            return  # the daemon has exited: nothing is fed any more
        for action in self.core.step(events, self.now):
            self.perform(action)
        self.check_shutdown_is_exact()
        while self.connecting and not self.core.finished:
            name = self.connecting.pop(0)
            for action in self.core.step([v.HostObserved(name, h.SshRestored())], self.now):
                self.perform(action)
            self.check_shutdown_is_exact()

    def perform(self, action: v.Action) -> None:
        """What the daemon would do; the checks are the fleet's promises."""
        match action:
            case v.Launch(host=host):
                assert host not in self.ops, "two operations in flight for one host"
                shard = self.core.view(0.0).shards[host]
                launching = [
                    self.core.view(0.0).shards[n]
                    for n, op in self.ops.items()
                    if isinstance(op, v.Launch)
                ]
                assert shard not in launching, "two launches for one shard in flight"
                self.ops[host] = action
                self.launch_starts.append(self.now)
                in_flight = sum(1 for op in self.ops.values() if isinstance(op, v.Launch))
                assert in_flight <= POLICY.max_concurrent_launches
                recent = [t for t in self.launch_starts if self.now < t + budgets.BUDGET_WINDOW_S]
                assert len(recent) <= POLICY.max_launches_per_minute
            case v.Terminate(host=host):
                assert host not in self.ops, "two operations in flight for one host"
                target = self.core.hosts[host]
                if self.core.watch.freeze.frozen:
                    # Frozen: only a stop or an operator terminates, never silence.
                    assert target.state is S.STOPPING or not target.restart_is_automatic
                self.ops[host] = action
            case v.Probe(host=host):
                assert host not in self.ops, "two operations in flight for one host"
                self.ops[host] = action
            case v.ScanFiles():
                self.scans.append(action)
            case v.Connect(host=host):
                self.connecting.append(host)  # its connection comes up next
            case v.Disconnect(host=host):
                self.ops.pop(host, None)  # the shell cancels the leaving host's operations
            case v.WriteStopSentinel() | v.DeleteStopSentinel():
                self.sentinel_ops.append(action)
            case v.Settled():
                self.settled += 1
                assert self.settled == 1, "start-up settled twice"
            case v.ShutdownDone():
                assert self.done is None
                self.done = action
            case _:
                pass

    def check_shutdown_is_exact(self) -> None:
        """Shutdown ends exactly when every host is stopped or unreachable (or at its
        deadline), and names the unreachable ones."""
        if not self.stopping or self.detached:
            return
        hosts = self.core.hosts
        # A host still joining, or whose connection has had no outcome yet, may run a worker
        # that must be found and stopped: shutdown waits for it.
        all_done = not self.core.view(0.0).joining and all(
            x.state is S.STOPPED or (not x.ssh_up and x.op is None and n not in self.connecting)
            for n, x in hosts.items()
        )
        if self.done is None:
            assert not all_done or self.now >= self.stop_deadline, "shutdown should be over"
            return
        if not self.done.incomplete:
            assert all_done
            assert set(self.done.unreachable) == {
                n for n, x in hosts.items() if x.state is not S.STOPPED
            }

    # --- the world ----------------------------------------------------------------------------

    @rule(dt=st.floats(0, 40))
    def time_passes(self, dt: float) -> None:
        """Time moves forward; the fleet's timer fires."""
        self.now += dt
        self.feed(v.DeadlinePassed())
        # Whatever was due is acted on: no deadline is left behind in the past.
        deadline = self.core.deadline_at
        assert self.core.finished or deadline is None or deadline > self.now

    @rule(data=st.data())
    def files_are_read(self, data: st.DataObject) -> None:
        """A scan of joining hosts answers, some with a stop sentinel on disk."""
        if not self.scans:
            return
        scan = self.scans.pop(0)
        sentinels = {n for n in scan.hosts if n in self.sentinels}
        if data.draw(st.booleans()):
            sentinels |= set(scan.hosts[:1])
            self.sentinels |= sentinels
        self.feed(v.FilesScanned(hosts=frozenset(scan.hosts), sentinels=frozenset(sentinels)))

    @rule()
    def live_workers_beat(self) -> None:
        """Every live, unhung worker rewrites its host's status file, with the counts of
        the tasks it scored since (a third scored 0; every one on a lying host's)."""
        self.stamp += 1.0
        events: list[v.Event] = []
        for pid, w in sorted(self.workers.items()):
            if pid in self.hung:
                continue
            scored, zero = self.counts.get(pid, (0, 0))
            scored, zero = scored + 150, zero + (150 if w.host in self.liars else 50)
            self.counts[pid] = (scored, zero)
            stats = h.WorkerStats(completed=scored, errors=0, semantic_zero=zero)
            beat = h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=self.stamp, stats=stats)
            events.append(v.HostObserved(w.host, beat))
        self.feed(*events)

    @rule(seconds=st.integers(5, 30))
    def rollouts_flow(self, seconds: int) -> None:
        """The trainer's calls for a while: every second, each live worker beats with its
        counts, and the fleet's timer fires."""
        for _ in range(seconds):
            self.now += 1.0
            self.live_workers_beat()
            self.feed(v.DeadlinePassed())

    @rule(name=st.sampled_from(NAMES), lies=st.booleans())
    def a_machine_starts_or_stops_lying(self, name: str, lies: bool) -> None:
        """A host's machine loses (or gets back) its verifier: its tasks all score 0."""
        if lies:
            self.liars.add(name)
        else:
            self.liars.discard(name)

    @rule(data=st.data())
    def worker_crashes(self, data: st.DataObject) -> None:
        """A live worker dies; its exit record is read later (or never)."""
        if self.workers:
            pid = data.draw(st.sampled_from(sorted(self.workers)))
            worker = self.workers.pop(pid)
            self.hung.discard(pid)
            self.exits.append((worker.host, pid))

    @rule()
    def exit_record_arrives(self) -> None:
        """The oldest exit record is read."""
        if self.exits:
            host, pid = self.exits.pop(0)
            self.feed(v.HostObserved(host, h.WorkerExited(pid=pid, exit_code=1)))

    @rule()
    def workers_hang(self) -> None:
        """Every live worker stops heartbeating but stays alive."""
        self.hung |= set(self.workers)

    @rule(name=st.sampled_from(NAMES), up=st.booleans())
    def ssh_flaps(self, name: str, up: bool) -> None:
        """One host's SSH connection drops or comes back."""
        event = h.SshRestored() if up else h.SshLost(reason="eof")
        self.feed(v.HostObserved(name, event))

    @rule(seconds=st.integers(1, 6))
    def all_goes_well(self, seconds: int) -> None:
        """For a few seconds every operation succeeds, files are read and workers beat."""
        for _ in range(seconds):
            while self.scans:
                scan = self.scans.pop(0)
                sentinels = frozenset(n for n in scan.hosts if n in self.sentinels)
                self.feed(v.FilesScanned(hosts=frozenset(scan.hosts), sentinels=sentinels))
            for name in sorted(self.ops):
                self.answer(name, "ok")
            self.live_workers_beat()
            self.time_passes(1.0)

    @rule(data=st.data(), outcome=st.sampled_from(["ok", "fail", "lost-started", "lost"]))
    def an_operation_answers(self, data: st.DataObject, outcome: str) -> None:
        """One host's operation completes truthfully, fails, or loses its answer."""
        if self.ops:
            self.answer(data.draw(st.sampled_from(sorted(self.ops))), outcome)

    def answer(self, name: str, outcome: str) -> None:
        """Answer ``name``'s operation with ``outcome``, as the remote side would."""
        action = self.ops.pop(name, None)
        event: h.Event
        match action:
            case v.Launch(shard=shard):
                # The worker runs the shard its launch named (a reload may have moved the
                # host since: the launch still started a worker of the old one).
                pid = self.next_pid
                if outcome in ("ok", "lost-started"):
                    self.next_pid += 1
                    self.workers[pid] = Worker(host=name, shard=shard)
                if outcome == "ok":
                    event = h.Launched(pid=pid)
                elif outcome == "fail":
                    event = h.LaunchFailed(reason="exec failed")
                else:
                    event = h.LaunchFailed(reason="connection lost", uncertain=True)
            case v.Terminate(pid=pid):
                if outcome == "ok" or pid not in self.workers:
                    if self.workers.pop(pid, None) is not None:
                        self.exits.append((name, pid))
                    self.hung.discard(pid)
                    event = h.TerminateConfirmed(pid=pid)
                else:
                    event = h.TerminateFailed(pid=pid, reason="still alive")
            case v.Probe():
                mine = sorted(p for p, w in self.workers.items() if w.host == name)
                if outcome == "fail":
                    event = h.ProbeFailed(reason="agent died")
                else:
                    event = h.ProbeResult(pid=mine[0] if mine else None)
            case _:
                return
        self.feed(v.HostObserved(name, event))

    @rule(name=st.sampled_from(NAMES), command=st.sampled_from(["restart", "stop", "start"]))
    def operator_acts(self, name: str, command: str) -> None:
        """An operator restarts, stops or starts a host (by name, maybe unknown)."""
        self.tokens += 1
        events: dict[str, v.Event] = {
            "restart": v.RestartHostRequested(host=name, token=self.tokens),
            "stop": v.StopHostRequested(host=name, token=self.tokens),
            "start": v.StartHostRequested(host=name, token=self.tokens),
        }
        self.feed(events[command])

    @rule(ok=st.booleans())
    def a_sentinel_file_is_written_or_removed(self, ok: bool) -> None:
        """The shell answers the oldest stop-host / start-host file operation."""
        if not self.sentinel_ops:
            return
        op = self.sentinel_ops.pop(0)
        error = None if ok else "read-only file system"
        if isinstance(op, v.WriteStopSentinel):
            if ok:
                self.sentinels.add(op.host)
            self.feed(v.StopSentinelWritten(host=op.host, token=op.token, error=error))
        else:
            if ok:
                self.sentinels.discard(op.host)
            self.feed(v.StopSentinelDeleted(host=op.host, token=op.token, error=error))

    @rule(data=st.data())
    def config_is_reloaded(self, data: st.DataObject) -> None:
        """A reload keeps, removes, adds and moves hosts between shards (distinct shards,
        as config validation requires)."""
        names = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        shards = data.draw(st.permutations(range(4)))
        self.config = {n: shards[i] for i, n in enumerate(names)}
        self.tokens += 1
        self.feed(
            v.Reconfigured(
                members=members_of(self.config), health=HEALTH, policy=POLICY, token=self.tokens
            )
        )

    @precondition(lambda self: not self.stopping)
    @rule(detach=st.booleans())
    def shutdown_is_requested(self, detach: bool) -> None:
        """SIGTERM: stop every worker, or leave them running."""
        self.stopping = True
        self.detached = detach
        self.stop_deadline = self.now + POLICY.shutdown_timeout_s
        before = dict(self.ops)
        self.feed(v.ShutdownRequested(detach=detach))
        if detach:
            assert self.done == v.ShutdownDone()
            assert self.ops == before  # no worker is touched

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def at_most_one_live_worker_per_shard(self) -> None:
        """The world never has two live workers on one shard."""
        shards = [w.shard for w in self.workers.values()]
        assert len(shards) == len(set(shards)), self.workers

    @invariant()
    def members_hold_distinct_shards(self) -> None:
        """Joined hosts (leaving ones included) never share a shard."""
        shards = [m.shard for m in self.core.members.values()]
        assert len(shards) == len(set(shards))

    @invariant()
    def each_host_s_operation_matches_the_core(self) -> None:
        """The core's op for a host and the operation awaiting an answer agree."""
        if self.core.finished:
            return
        kinds = {v.Launch: "launch", v.Terminate: "terminate", v.Probe: "probe"}
        for name, host in self.core.hosts.items():
            pending = self.ops.get(name)
            expected = None if pending is None else kinds[type(pending)]
            if host.op == "launch" and expected is None:
                assert budgets.is_waiting(self.core.budget, name)  # queued, not begun
            else:
                assert host.op == expected, (name, host.op, pending)

    @invariant()
    def the_freeze_is_what_a_full_look_says(self) -> None:
        """Frozen or not, the core agrees with ``assess`` over every host at the time of
        its last step: it may skip looks, never a freeze or a thaw that is due."""
        if self.core.finished:
            return
        _, change = freezes.assess(
            self.core.watch.freeze,
            list(self.core.hosts.values()),
            self.now,
            POLICY,
            HEALTH.heartbeat_stale_s / 2,
        )
        assert change is None, change

    @invariant()
    def hosts_that_should_run_are_counted_as_they_change(self) -> None:
        """The count the freeze's threshold uses between looks is the count of a look."""
        expected = sum(host.state in h.WANT_RUNNING_STATES for host in self.core.hosts.values())
        assert self.core.watch.expected == expected

    @invariant()
    def a_host_named_as_lying_is_a_member_and_never_all_ready(self) -> None:
        """Only members are named, and a ready host named as lying keeps the fleet from
        being all ready."""
        named = self.core.rewards_state.named
        assert set(named) <= set(self.core.hosts)
        if any(self.core.hosts[n].state is S.READY for n in named):
            assert not self.core.all_ready

    @invariant()
    def saved_histories_are_every_host_s_current_one(self) -> None:
        """``histories()`` keeps a host's object until its history changes: it must still be
        what the host's health says, or the saved file would miss a restart."""
        histories = self.core.histories()
        for name, host in self.core.hosts.items():
            assert histories[name] == h.history_of(host), name


FleetWorld.detached = False
FleetWorld.stop_deadline = 0.0
TestFleetWorld = FleetWorld.TestCase
TestFleetWorld.settings = settings(
    max_examples=examples(100), stateful_step_count=60, deadline=None
)
