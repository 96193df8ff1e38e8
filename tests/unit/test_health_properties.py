"""Properties of the state machine over random event sequences and time jumps (hypothesis).

The stateful test plays a truthful world — real processes that start, crash, hang and beat;
SSH that comes and goes; remote operations that succeed, fail or lose their answer — and
checks the core's decisions against what is really running.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor import health as h
from supervisor.health import HostState as S
from tests.examples import examples
from tests.unit.freshread import fresh_read

#: Causes that leave the worker alive: only its terminate captures evidence.
LIVE_BUT_UNHEALTHY = frozenset(
    {
        h.Cause.STUCK,
        h.Cause.HEARTBEAT_STALE,
        h.Cause.NOT_READY,
        h.Cause.NOT_TAKING,
        h.Cause.PROBE_TIMEOUT,
    }
)

policies = st.builds(
    h.Policy,
    heartbeat_stale_s=st.floats(3, 120),
    ready_timeout_s=st.floats(2, 120),
    restart_cooldown_s=st.floats(0.5, 60),
    backoff_max_s=st.floats(60, 600),
    backoff_reset_s=st.floats(1, 1200),
    max_restarts=st.integers(0, 5),
    restart_window_s=st.floats(1, 3600),
    stop_grace_s=st.floats(0.1, 60),
    kill_after_grace=st.booleans(),
    progress_stale_s=st.sampled_from([0.0, 5.0, 30.0, 300.0]),
    permanent_exit_codes=st.sampled_from([frozenset(), frozenset({1})]),
)


@dataclass
class World:
    """What really runs on the host, which the core only learns through events."""

    alive: set[int] = field(default_factory=set)
    hung: set[int] = field(default_factory=set)
    exits: list[int] = field(default_factory=list)
    #: Dead workers whose agent has pushed the exit (their record may still come).
    pushed: set[int] = field(default_factory=set)
    next_pid: int = 1000
    stamp: float = 0.0
    ssh_up: bool = False
    #: Tasks the live worker has finished (its status file's ``processed``).
    done: int = 0
    #: What the status file says now: the last heartbeat written, if any.
    file: h.HeartbeatSeen | None = None


class FleetOfOne(RuleBasedStateMachine):
    """One host driven by a random but truthful world."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = h.Policy()
        self.now = 0.0
        self.world = World()
        self.host = h.new_host("w", self.now)
        self.pending: h.Action | None = None
        self.restart_times: list[float] = []
        self.stamp_offset = 0.0
        self.frozen = False
        #: The reward probe awaiting its answer, if any.
        self.probe: h.SendRewardProbe | None = None

    @rule(
        policy=policies,
        offset=st.floats(-1e6, 1e6),
        probe_interval_s=st.sampled_from([0.0, 5.0, 30.0]),
        probe_expect=st.sampled_from([None, 1.0]),
    )
    @precondition(lambda self: self.now == 0.0 and self.pending is None and self.probe is None)
    def choose_policy(
        self, policy: h.Policy, offset: float, probe_interval_s: float, probe_expect: float | None
    ) -> None:
        """Before anything happens, pick timing rules, probes and the worker clock's offset."""
        assume(policy.backoff_max_s >= policy.restart_cooldown_s)
        self.policy = replace(policy, probe_interval_s=probe_interval_s, probe_expect=probe_expect)
        self.stamp_offset = offset

    # --- feeding the core ----------------------------------------------------------------

    def feed(self, event: h.Event) -> None:
        """Step the core and check every action against the world."""
        permanent = (
            isinstance(event, h.WorkerExited)
            and event.pid == self.host.pid
            and event.signal is None
            and event.exit_code in self.policy.permanent_exit_codes
        )
        host, actions = h.step(self.host, event, self.now, self.policy)
        # The routine-heartbeat shortcut decides exactly what the full path decides.
        assert (host, actions) == h._step_in_full(self.host, event, self.now, self.policy)
        # The shell's cheap check agrees with comparing the full histories.
        full = h.history_of(host) != h.history_of(self.host)
        assert h.history_changed(self.host, host) == full
        for action in actions:
            match action:
                case h.Launch():
                    # Rule 1: never a launch while an earlier worker may be alive.
                    assert not self.world.alive, (self.world.alive, host)
                    if action.is_restart:
                        self.restart_times.append(self.now)
                        if self.policy.max_restarts > 0:
                            recent = [
                                t
                                for t in self.restart_times
                                if self.now - t < self.policy.restart_window_s
                            ]
                            assert len(recent) <= self.policy.max_restarts
                    self._take(action)
                case h.Terminate():
                    # While frozen, only a stop or an operator may terminate: never silence.
                    automatic = host.state is S.STALE and host.restart_is_automatic
                    assert not (host.frozen and automatic), "terminated for silence while frozen"
                    # Evidence only of a worker replaced for being alive but unhealthy.
                    assert not action.collect_evidence or (
                        automatic and host.cause_code in LIVE_BUT_UNHEALTHY
                    ), (action, host.state, host.cause_code)
                    self._take(action)
                case h.Probe():
                    self._take(action)
                case h.Quarantine():
                    # Only once the stuck worker it follows is gone, before any launch.
                    assert host.pid is None and action.count > 0
                    self._take(action)
                case h.Watch():
                    # Only of the worker the core knows, with nothing in flight.
                    assert action.pid == host.pid and host.op is None
                case h.SendRewardProbe():
                    # One probe at a time per host, only with probes on, only to its worker.
                    assert self.probe is None and self.policy.probe_interval_s > 0
                    assert action.pid == host.pid
                    self.probe = action
                case h.RecheckStatus():
                    # Rule 10: a verdict from silence asks for a fresh read, only in ready.
                    assert host.state is S.READY and host.recheck_at == self.now
                case h.StateChanged(to=S.FAILED) if permanent:
                    pass  # an exit no restart can mend fails the host at once
                case h.StateChanged(to=S.FAILED):
                    assert self.policy.max_restarts > 0, "failed although max_restarts is 0"
                    recent = [
                        t for t in self.restart_times if self.now - t < self.policy.restart_window_s
                    ]
                    assert len(recent) >= self.policy.max_restarts
                case h.StateChanged():
                    pass
            # Evidence rides only the change a terminate's result causes.
            if isinstance(action, h.StateChanged) and action.evidence is not None:
                if isinstance(event, h.Quarantined):  # the replacement after a quarantine
                    assert action.evidence == host.evidence
                else:
                    assert isinstance(event, h.TerminateConfirmed | h.TerminateFailed)
                    assert action.evidence == event.evidence
        self.host = host

    def _take(self, action: h.Action) -> None:
        """Hold a remote action until the world answers it."""
        assert self.pending is None, "a second remote operation while one is in flight"
        self.pending = action

    # --- the world -------------------------------------------------------------------------

    @rule(dt=st.floats(0, 700))
    def time_passes(self, dt: float) -> None:
        """Time only moves forward, in jumps of any size; the timer fires when due."""
        self.now += dt
        self.feed(h.DeadlinePassed())

    @rule(
        ready=st.booleans(),
        backwards=st.booleans(),
        progress=st.sampled_from(["none", "advancing", "stalled", "idle"]),
    )
    def live_worker_beats(self, ready: bool, backwards: bool, progress: str) -> None:
        """Each live, unhung worker rewrites the status file (its clock may jump back), with
        or without progress fields, finishing tasks or not."""
        for pid in sorted(self.world.alive - self.world.hung):
            self.world.stamp += -5.0 if backwards else 1.0
            stamp = self.world.stamp + self.stamp_offset
            self.world.done += progress == "advancing"
            processed, in_flight = {
                "none": (None, None),
                "advancing": (self.world.done, 4),
                "stalled": (self.world.done, 4),
                "idle": (self.world.done, 0),
            }[progress]
            beat = h.HeartbeatSeen(
                pid=pid,
                ready=ready,
                remote_heartbeat_at=stamp,
                processed=processed,
                in_flight=in_flight,
            )
            self.world.file = beat
            self.feed(beat)

    @rule(readable=st.booleans())
    def status_file_reread(self, readable: bool) -> None:
        """The fresh read a verdict waits for finds the file as the world last wrote it (or
        cannot be made)."""
        if self.host.recheck_at is not None:
            beat = self.world.file if self.world.file is not None else None
            self.feed(h.StatusRechecked(beat=beat if readable else None))

    @rule()
    def status_file_unreadable(self) -> None:
        """The status file is missing or garbage for a moment."""
        self.feed(h.StatusMissing(reason="not JSON"))

    @rule(data=st.data())
    def worker_crashes(self, data: st.DataObject) -> None:
        """A live worker dies; its exit record is delivered later (or never)."""
        if self.world.alive:
            pid = data.draw(st.sampled_from(sorted(self.world.alive)))
            self.world.alive.discard(pid)
            self.world.hung.discard(pid)
            self.world.exits.append(pid)

    @rule()
    def exit_record_arrives(self) -> None:
        """The shepherd's exit record for the oldest dead worker is read."""
        if self.world.exits:
            self.feed(h.WorkerExited(pid=self.world.exits.pop(0), exit_code=1))

    @rule(data=st.data())
    def agent_pushes_an_exit(self, data: st.DataObject) -> None:
        """The host's agent tells of a dead worker before (or after) its record, once, not
        always knowing how it ended."""
        fresh = [pid for pid in self.world.exits if pid not in self.world.pushed]
        if fresh:
            pid = data.draw(st.sampled_from(fresh))
            self.world.pushed.add(pid)
            code = data.draw(st.sampled_from([None, 1]))
            self.feed(h.WorkerExited(pid=pid, exit_code=code))

    @rule()
    def worker_hangs(self) -> None:
        """Every live worker stops heartbeating but stays alive."""
        self.world.hung |= self.world.alive

    @rule(up=st.booleans())
    def ssh_flaps(self, up: bool) -> None:
        """The SSH connection drops or comes back."""
        self.world.ssh_up = up
        self.feed(h.SshRestored() if up else h.SshLost(reason="eof"))

    @rule()
    def a_new_agent_starts(self) -> None:
        """The connection's agent is (re)started: it watches nothing until told."""
        self.feed(h.AgentStarted())

    @rule(outcome=st.sampled_from(["ok", "fail", "lost-started", "lost-nothing"]))
    def answer_remote_operation(self, outcome: str) -> None:
        """The operation in flight completes truthfully, fails, or loses its answer."""
        action, self.pending = self.pending, None
        match action:
            case None:
                return
            case h.Launch():
                self._answer_launch(outcome)
            case h.Terminate(pid=pid, collect_evidence=wanted):
                evidence = h.Evidence(pid=pid, stacks="Thread 1\n") if wanted else None
                if outcome == "ok" or pid not in self.world.alive:
                    killed = pid in self.world.alive
                    self.world.alive.discard(pid)
                    self.world.hung.discard(pid)
                    if killed:
                        self.world.exits.append(pid)
                    self.feed(h.TerminateConfirmed(pid=pid, evidence=evidence))
                    if wanted:  # kept for status HOST
                        assert self.host.evidence is evidence
                else:
                    self.feed(h.TerminateFailed(pid=pid, reason="still alive", evidence=evidence))
            case h.Probe():
                if outcome == "fail":
                    self.feed(h.ProbeFailed(reason="agent died"))
                else:
                    alive = sorted(self.world.alive)
                    self.feed(h.ProbeResult(pid=alive[0] if alive else None))
            case h.Quarantine(count=count):
                self.feed(h.Quarantined(count=0 if outcome == "fail" else count))
            case _:
                raise AssertionError(action)

    def _answer_launch(self, outcome: str) -> None:
        """Answer a launch as the remote side would, refusing while the shard is held."""
        if self.world.alive:
            # The shard lock is held: the remote side refuses, naming the holder.
            self.feed(h.LaunchRefused(holder_pid=min(self.world.alive)))
            return
        if outcome in ("ok", "lost-started"):
            pid = self.world.next_pid
            self.world.next_pid += 1
            self.world.alive.add(pid)
        if outcome == "ok":
            self.feed(h.Launched(pid=pid))
        elif outcome == "fail":
            self.feed(h.LaunchFailed(reason="exec failed"))
        else:
            self.feed(h.LaunchFailed(reason="connection lost", uncertain=True))

    @rule(outcome=st.sampled_from(["scored", "error", "wrong", "unanswered"]))
    @precondition(lambda self: self.probe is not None)
    def reward_probe_answered(self, outcome: str) -> None:
        """The probe comes back; a dead or hung worker's is never answered."""
        assert self.probe is not None
        pid, self.probe = self.probe.pid, None
        if pid not in self.world.alive or pid in self.world.hung:
            outcome = "unanswered"
        answer = {
            "scored": h.RewardProbeAnswered(pid=pid, status="ok", score=1.0, round_trip_s=0.1),
            "error": h.RewardProbeAnswered(pid=pid, status="error", error="KeyError: 'x'"),
            "wrong": h.RewardProbeAnswered(pid=pid, status="ok", score=0.0),
            "unanswered": h.RewardProbeAnswered(pid=pid, status=None, error="no result"),
        }[outcome]
        self.feed(answer)

    @rule(frozen=st.booleans())
    def fleet_freezes_or_thaws(self, frozen: bool) -> None:
        """The fleet policy freezes or thaws restarts for silence."""
        self.feed(h.FleetFrozen(reason="most hosts silent") if frozen else h.FleetThawed())
        self.frozen = frozen

    @rule(request=st.sampled_from(["start", "stop", "restart", "sentinel+", "sentinel-"]))
    def operator_acts(self, request: str) -> None:
        """An operator (or the stop sentinel) asks for something."""
        events: dict[str, h.Event] = {
            "start": h.StartRequested(),
            "stop": h.StopRequested(reason="operator stop"),
            "restart": h.RestartRequested(),
            "sentinel+": h.StopSentinelAppeared(),
            "sentinel-": h.StopSentinelRemoved(),
        }
        self.feed(events[request])

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def at_most_one_live_worker(self) -> None:
        """The world never has two live workers for the shard."""
        assert len(self.world.alive) <= 1

    @invariant()
    def ready_only_once_a_probe_scored(self) -> None:
        """With probes on, a ready host's current worker has scored its last probe."""
        if self.policy.probe_interval_s > 0 and self.host.state is S.READY:
            assert self.host.probe_scored_pid == self.host.pid

    @invariant()
    def probe_in_flight_matches_pending(self) -> None:
        """The core's probe in flight and the probe awaiting an answer agree."""
        assert (self.host.probe_at is not None) == (self.probe is not None)

    @invariant()
    def op_in_flight_matches_pending(self) -> None:
        """The core's op and the action awaiting an answer agree."""
        kinds = {
            h.Launch: "launch",
            h.Terminate: "terminate",
            h.Probe: "probe",
            h.Quarantine: "quarantine",
        }
        expected = None if self.pending is None else kinds[type(self.pending)]
        assert self.host.op == expected

    @invariant()
    def deadline_is_never_in_the_past_after_a_timer(self) -> None:
        """A deadline is either in the future or already acted upon (no lost wake-ups)."""
        if self.host.deadline_at is not None and self.host.deadline_at <= self.now:
            again, _ = h.step(self.host, h.DeadlinePassed(), self.now, self.policy)
            assert again.deadline_at is None or again.deadline_at > self.now or again.op


TestFleetOfOne = FleetOfOne.TestCase
TestFleetOfOne.settings = settings(
    max_examples=examples(200), stateful_step_count=50, deadline=None
)


# --- focused properties ----------------------------------------------------------------------


@given(
    policy=policies,
    order=st.permutations(["push", "record", "answer"]),
    gaps=st.lists(st.floats(0.0, 5.0), min_size=3, max_size=3),
    pushed_code=st.sampled_from([None, 1]),
)
def test_an_exit_told_by_push_and_by_record_launches_once(
    policy: h.Policy, order: list[str], gaps: list[float], pushed_code: int | None
) -> None:
    """One exit, reported by the agent and by the exit record in either order, around the
    answer of the launch it caused: one Launch at most, and one unless the first report
    made the host ``failed``."""
    host, now = _ready_host(policy, pid=7)
    launches = 0
    first: h.WorkerExited | None = None
    for what, gap in zip(order, gaps, strict=True):
        now += gap
        event: h.Event
        if what == "push":
            event = h.WorkerExited(pid=7, exit_code=pushed_code)
        elif what == "record":
            event = h.WorkerExited(pid=7, exit_code=1)
        elif host.op == "launch":
            event = h.Launched(pid=8)
        else:
            continue  # no launch asked yet: nothing to answer
        if first is None and isinstance(event, h.WorkerExited):
            first = event
        host, actions = h.step(host, event, now, policy)
        launches += sum(isinstance(a, h.Launch) for a in actions)
    host, actions = h.step(host, h.DeadlinePassed(), now + 1.0, policy)
    launches += sum(isinstance(a, h.Launch) for a in actions)
    assert first is not None
    gave_up = not policy.auto_restart or first.exit_code in policy.permanent_exit_codes
    assert launches == (0 if gave_up else 1)


@given(
    policy=policies,
    reports=st.lists(
        st.tuples(st.sampled_from(["exit", "terminate"]), st.none() | st.integers(0, 100)),
        min_size=1,
        max_size=5,
    ),
)
def test_the_last_exit_keeps_the_largest_count_of_processes_reaped(
    policy: h.Policy, reports: list[tuple[str, int | None]]
) -> None:
    """One exit told by the agent, the shepherd and a terminate, in any order, each with
    what its own sweep killed (or nothing): the host keeps the largest count, and the first
    report alone decided the exit."""
    host, now = _ready_host(policy, pid=7)
    for what, reaped in reports:
        now += 0.1
        event: h.Event = (
            h.WorkerExited(pid=7, signal=9, reaped=reaped)
            if what == "exit"
            else h.TerminateConfirmed(pid=7, reaped=reaped)
        )
        host, _ = h.step(host, event, now, policy)
    counts = [reaped for _, reaped in reports if reaped is not None]
    assert host.last_exit_pid == 7
    assert host.last_exit_reaped == (max(counts) if counts else None)
    first = "killed by signal 9 (SIGKILL)" if reports[0][0] == "exit" else "confirmed dead"
    assert host.last_exit == first


def test_a_later_report_of_an_older_exit_changes_nothing() -> None:
    """A count for a pid that is not the last exit's (an older worker's record) is old
    news: the last exit's count stays."""
    host, now = _ready_host(h.Policy(), pid=7)
    host, _ = h.step(host, h.WorkerExited(pid=7, signal=9, reaped=2), now + 0.1, h.Policy())
    again, _ = h.step(host, h.WorkerExited(pid=6, signal=9, reaped=40), now + 0.2, h.Policy())
    assert again == host


def _ready_host(policy: h.Policy, pid: int = 7) -> tuple[h.Host, float]:
    """A host whose worker ``pid`` is ready at t=0."""
    host = h.new_host("w", 0.0)
    for event in (
        h.StatusMissing(reason="missing"),
        h.SshRestored(),
        h.ProbeResult(pid=None),
        h.Launched(pid=pid),
        h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=1.0),
    ):
        host, _ = h.step(host, event, 0.0, policy)
    assert host.state is S.READY
    return host, 0.0


@given(
    policy=policies,
    beats=st.lists(
        st.tuples(st.floats(0.0, 0.49), st.booleans(), st.floats(-1e5, 1e5)), max_size=80
    ),
)
def test_a_worker_whose_heartbeat_keeps_changing_is_never_restarted(
    policy: h.Policy, beats: list[tuple[float, bool, float]]
) -> None:
    """Whatever SSH does, a heartbeat that keeps changing keeps the host ready, untouched."""
    host, now = _ready_host(policy)
    for fraction, ssh_up, stamp in beats:
        now += fraction * policy.heartbeat_stale_s
        for event in (
            h.DeadlinePassed(),
            h.SshRestored() if ssh_up else h.SshLost(reason="flap"),
            h.HeartbeatSeen(pid=7, ready=True, remote_heartbeat_at=stamp + now),
        ):
            host, actions = h.step(host, event, now, policy)
            assert not [a for a in actions if isinstance(a, h.Launch | h.Terminate)]
            assert host.state is S.READY


@given(policy=policies, crashes=st.integers(1, 12))
def test_restart_delays_double_from_the_cooldown_up_to_the_cap(
    policy: h.Policy, crashes: int
) -> None:
    """Consecutive crashes wait 0, c, 2c, 4c ... capped at backoff_max_s, never shrinking."""
    assume(policy.backoff_max_s >= policy.restart_cooldown_s)
    policy = h.Policy(
        heartbeat_stale_s=policy.heartbeat_stale_s,
        ready_timeout_s=policy.ready_timeout_s,
        restart_cooldown_s=policy.restart_cooldown_s,
        backoff_max_s=policy.backoff_max_s,
        backoff_reset_s=policy.backoff_reset_s,
        max_restarts=0,
    )
    host, now = _ready_host(policy, pid=100)
    delays: list[float] = []
    for k in range(crashes):
        crashed_at = now
        host, actions = h.step(host, h.WorkerExited(pid=100 + k, exit_code=1), now, policy)
        if host.state is S.COOLING_DOWN:
            assert host.next_restart_at is not None
            now = host.next_restart_at
            host, actions = h.step(host, h.DeadlinePassed(), now, policy)
        assert [type(a) for a in actions if not isinstance(a, h.StateChanged)] == [h.Launch]
        delays.append(now - crashed_at)
        host, _ = h.step(host, h.Launched(pid=101 + k), now, policy)
    expected = [0.0] + [
        min(policy.restart_cooldown_s * 2**i, policy.backoff_max_s) for i in range(crashes - 1)
    ]
    assert delays == [pytest_approx(d) for d in expected]
    assert all(b >= a - 1e-6 for a, b in itertools.pairwise(delays[1:]))


def pytest_approx(value: float) -> object:
    """Float comparison that tolerates the rounding of adding delays to the clock."""
    import pytest

    return pytest.approx(value, rel=1e-9, abs=1e-6)


@given(policy=policies)
def test_backoff_resets_after_a_healthy_spell(policy: h.Policy) -> None:
    """After backoff_reset_s of healthy running, the next crash restarts at once."""
    policy = h.Policy(
        heartbeat_stale_s=1e9,
        restart_cooldown_s=policy.restart_cooldown_s,
        backoff_max_s=max(policy.backoff_max_s, policy.restart_cooldown_s),
        backoff_reset_s=policy.backoff_reset_s,
    )
    host, now = _ready_host(policy, pid=1)
    host, _ = h.step(host, h.WorkerExited(pid=1, exit_code=1), now, policy)  # failure 1
    host, _ = h.step(host, h.Launched(pid=2), now, policy)
    host, _ = h.step(host, h.HeartbeatSeen(pid=2, ready=True, remote_heartbeat_at=9.0), now, policy)
    assert host.state is S.READY and host.failures == 1
    now += policy.backoff_reset_s
    host, actions = h.step(host, h.WorkerExited(pid=2, exit_code=1), now, policy)
    assert host.state is S.STARTING and any(isinstance(a, h.Launch) for a in actions)


@given(
    offset=st.floats(-1e7, 1e7).filter(lambda x: x != 0),
    script=st.lists(
        st.tuples(
            st.sampled_from(["beat", "beat-not-ready", "tick", "exit", "launched", "confirm"]),
            st.floats(0, 90),
        ),
        max_size=60,
    ),
)
def test_adding_a_constant_to_every_heartbeat_at_changes_no_decision(
    offset: float, script: list[tuple[str, float]]
) -> None:
    """Hours of clock skew on the worker change nothing: decisions depend on changes only."""

    def run(shift: float) -> list[tuple[str, tuple[str, ...]]]:
        policy = h.Policy(heartbeat_stale_s=30, ready_timeout_s=30, restart_cooldown_s=5)
        host, now = _ready_host(policy, pid=1)
        host, _ = h.step(
            host, h.HeartbeatSeen(pid=1, ready=True, remote_heartbeat_at=5.0 + shift), 0, policy
        )
        stamp, pid = 5.0, 1
        trace: list[tuple[str, tuple[str, ...]]] = []
        for kind, dt in script:
            now += dt
            event: h.Event
            if kind.startswith("beat"):
                stamp += 1
                ready = kind == "beat"
                event = h.HeartbeatSeen(pid=pid, ready=ready, remote_heartbeat_at=stamp + shift)
            elif kind == "tick":
                event = h.DeadlinePassed()
            elif kind == "exit":
                event = h.WorkerExited(pid=pid, exit_code=1)
            elif kind == "launched":
                pid += 1
                event = h.Launched(pid=pid)
            else:
                event = h.TerminateConfirmed(pid=pid)
            host, actions = h.step(host, event, now, policy)
            trace.append((host.state.value, tuple(sorted(repr(a) for a in actions))))
        return trace

    assert run(0.0) == run(offset)


def test_a_heartbeat_at_that_goes_backwards_still_counts() -> None:
    """A worker clock stepped back (NTP) still proves life: only change matters."""
    policy = h.Policy(heartbeat_stale_s=10)
    host, now = _ready_host(policy, pid=3)
    for i in range(1, 20):
        now = i * 6.0
        stamp = 1.0 - i  # strictly decreasing
        host, actions = h.step(
            host, h.HeartbeatSeen(pid=3, ready=True, remote_heartbeat_at=stamp), now, policy
        )
        host, actions = h.step(host, h.DeadlinePassed(), now, policy)
        assert host.state is S.READY and not actions


def test_an_unchanged_heartbeat_does_not_count() -> None:
    """Re-reading the same stamp is not a heartbeat: a frozen file goes stale."""
    policy = h.Policy(heartbeat_stale_s=10)
    host, _ = _ready_host(policy, pid=3)
    for i in range(1, 4):
        host, _ = h.step(
            host, h.HeartbeatSeen(pid=3, ready=True, remote_heartbeat_at=1.0), i * 4.0, policy
        )
    host, actions = h.step(host, h.DeadlinePassed(), 12.0, policy)
    assert host.state is S.READY and [type(a) for a in actions] == [h.RecheckStatus]
    host, actions = h.step(host, fresh_read(host), 12.0, policy)
    assert host.state is S.STALE
    assert [type(a) for a in actions if not isinstance(a, h.StateChanged)] == [h.Terminate]


@given(
    other_pids=st.lists(st.integers(1, 10_000).filter(lambda p: p != 42), min_size=1, max_size=30)
)
def test_in_starting_a_status_of_another_pid_never_makes_the_host_ready(
    other_pids: list[int],
) -> None:
    """The previous worker's file (or anyone else's) cannot make the new worker look ready."""
    policy = h.Policy(ready_timeout_s=1e9)
    host = h.new_host("w", 0.0)
    for event in (h.SshRestored(), h.ProbeResult(pid=None), h.Launched(pid=42)):
        host, _ = h.step(host, event, 0.0, policy)
    for i, pid in enumerate(other_pids):
        beat = h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=float(i))
        host, _ = h.step(host, beat, float(i), policy)
        assert host.state is S.STARTING
    host, _ = h.step(
        host, h.HeartbeatSeen(pid=42, ready=True, remote_heartbeat_at=-1.0), 99.0, policy
    )
    assert host.state is S.READY


def test_the_first_status_file_read_is_only_a_baseline() -> None:
    """A file left by a long-dead worker does not make a probed-absent host look alive."""
    policy = h.Policy()
    host = h.new_host("w", 0.0)
    host, _ = h.step(host, h.HeartbeatSeen(pid=5, ready=True, remote_heartbeat_at=1.0), 0, policy)
    assert host.state is S.STARTING and host.pid is None and host.alive_at is None


def test_a_heartbeat_that_overtakes_the_launch_answer_still_counts() -> None:
    """The new worker's first heartbeat may be read before Launched arrives: ready at once."""
    policy = h.Policy()
    host = h.new_host("w", 0.0)
    for event in (h.StatusMissing(reason="missing"), h.SshRestored(), h.ProbeResult(pid=None)):
        host, _ = h.step(host, event, 0.0, policy)
    host, _ = h.step(host, h.HeartbeatSeen(pid=9, ready=True, remote_heartbeat_at=3.0), 0.2, policy)
    assert host.state is S.STARTING
    host, _ = h.step(host, h.Launched(pid=9), 0.3, policy)
    assert host.state is S.READY


def test_failed_needs_more_than_max_restarts_within_the_window() -> None:
    """With max_restarts=2, two restarts happen and the third failure gives up."""
    policy = h.Policy(restart_cooldown_s=1, backoff_max_s=1, max_restarts=2, restart_window_s=100)
    host, now = _ready_host(policy, pid=1)
    restarts = 0
    for pid in (1, 2, 3):
        host, actions = h.step(host, h.WorkerExited(pid=pid, exit_code=1), now, policy)
        if host.state is S.COOLING_DOWN:
            now += 1
            host, actions = h.step(host, h.DeadlinePassed(), now, policy)
        restarts += sum(1 for a in actions if isinstance(a, h.Launch) and a.is_restart)
        if host.state is S.FAILED:
            break
        host, _ = h.step(host, h.Launched(pid=pid + 1), now, policy)
    assert restarts == 2 and host.state is S.FAILED


def test_restarts_older_than_the_window_do_not_count() -> None:
    """Crashes spread wider than restart_window_s never reach failed."""
    policy = h.Policy(
        restart_cooldown_s=1,
        backoff_max_s=1,
        backoff_reset_s=5,
        max_restarts=1,
        restart_window_s=10,
    )
    host, now = _ready_host(policy, pid=1)
    for pid in range(1, 8):
        now += 11
        host, _ = h.step(
            host, h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=now), now, policy
        )
        host, _ = h.step(host, h.WorkerExited(pid=pid, exit_code=1), now, policy)
        assert host.state is not S.FAILED
        if host.state is S.COOLING_DOWN:
            now += 1
            host, _ = h.step(host, h.DeadlinePassed(), now, policy)
        host, _ = h.step(host, h.Launched(pid=pid + 1), now, policy)


def test_backoff_delay_is_capped_even_for_huge_failure_counts() -> None:
    """The doubling never overflows: the cap holds at any count."""
    policy = h.Policy(restart_cooldown_s=30, backoff_max_s=300)
    assert [h.backoff_delay_s(n, policy) for n in (0, 1, 2, 3, 4, 5, 6)] == [
        0,
        0,
        30,
        60,
        120,
        240,
        300,
    ]
    assert h.backoff_delay_s(10_000, policy) == 300


# --- the routine-heartbeat shortcut ----------------------------------------------------------

_maybe_time = st.none() | st.floats(-50.0, 50.0)
_mostly_none = st.sampled_from([None, None, None, None, None, 10.0, -5.0])
#: Hosts in every state, the fields the shortcut tests drawn near its boundaries and often
#: at the values that let it through, so both of its outcomes are common.
hosts = st.builds(
    h.Host,
    name=st.just("w"),
    state=st.sampled_from([S.READY] * 6 + list(S)),
    reason=st.just("r"),
    since_at=st.floats(-50.0, 50.0),
    pid=st.sampled_from([1, 1, 1, None, 2]),
    needs_probe=st.sampled_from([False, False, False, True]),
    op=st.sampled_from([None, "launch", "probe", "terminate"]),
    op_retry_at=_mostly_none,
    ssh_up=st.booleans(),
    beat_pid=st.sampled_from([None, 1, 2]),
    beat_ready=st.booleans(),
    remote_heartbeat_at=st.sampled_from([None, 1.0, 2.0]),
    remote_seq=st.sampled_from([None, 1, 2]),
    beat_changed_at=_maybe_time,
    status_seen=st.sampled_from([True, True, True, False]),
    status_problem=st.sampled_from([None, "missing"]),
    alive_at=_maybe_time,
    not_ready_since_at=_mostly_none,
    launched_at=_maybe_time,
    failures=st.sampled_from([0, 0, 0, 1, 2]),
    healthy_since_at=_maybe_time,
    frozen=st.booleans(),
    thawed_at=_maybe_time,
)


def _eligible(host: h.Host) -> h.Host:
    """``host`` ready with worker 1 and its status seen; the shortcut's other conditions
    are left as drawn (mostly met), so each is also tested where it alone fails."""
    return replace(host, state=S.READY, pid=1, status_seen=True)


#: Half of them eligible for the shortcut (the rest almost never are).
hosts_near_routine = hosts | hosts.map(_eligible)
beats = st.builds(
    h.HeartbeatSeen,
    pid=st.sampled_from([1, 1, 1, 2]),
    ready=st.sampled_from([True, True, True, False]),
    remote_heartbeat_at=st.sampled_from([None, 1.0, 3.0]),
    remote_seq=st.sampled_from([None, 1, 3]),
)


@settings(max_examples=examples(1000))
@given(
    host=hosts_near_routine,
    event=beats | st.just(h.DeadlinePassed()),
    now=st.floats(0.0, 100.0),
    policy=policies,
)
def test_the_shortcuts_agree_with_the_full_step(
    host: h.Host, event: h.Event, now: float, policy: h.Policy
) -> None:
    """Whenever ``step`` takes a shortcut (a routine heartbeat, an early timer), the full
    path gives the same host and actions."""
    assert h.step(host, event, now, policy) == h._step_in_full(host, event, now, policy)


def test_a_ready_workers_next_heartbeat_takes_the_shortcut() -> None:
    """The steady-state heartbeat is the case the shortcut exists for (else it is dead code)."""
    policy = h.Policy()
    host, now = _ready_host(policy)
    beat = h.HeartbeatSeen(pid=7, ready=True, remote_heartbeat_at=2.0)
    routine = h._routine_beat(host, beat, now + 1.0, policy)
    assert routine is not None
    assert routine.alive_at == now + 1.0
    assert routine.deadline_at == now + 1.0 + policy.heartbeat_stale_s
    assert (routine, []) == h._step_in_full(host, beat, now + 1.0, policy)
    # Not for a different pid, a not-ready report, or a stamp already seen.
    for other in (
        h.HeartbeatSeen(pid=8, ready=True, remote_heartbeat_at=2.0),
        h.HeartbeatSeen(pid=7, ready=False, remote_heartbeat_at=2.0),
        h.HeartbeatSeen(pid=7, ready=True, remote_heartbeat_at=1.0),
    ):
        assert h._routine_beat(host, other, now + 1.0, policy) is None


def test_a_timer_that_fires_before_the_moved_deadline_takes_the_shortcut() -> None:
    """The timer armed at the first heartbeat fires while later ones moved the deadline."""
    policy = h.Policy()
    host, now = _ready_host(policy)
    beat = h.HeartbeatSeen(pid=7, ready=True, remote_heartbeat_at=2.0)
    host, _ = h.step(host, beat, now + 10.0, policy)
    early = h._early_deadline(host, now + policy.heartbeat_stale_s, policy)
    assert early is host
    assert h._step_in_full(host, h.DeadlinePassed(), now + policy.heartbeat_stale_s, policy) == (
        host,
        [],
    )
    # Past the moved deadline it is due, and the full step makes the host stale.
    assert h._early_deadline(host, now + 10.0 + policy.heartbeat_stale_s, policy) is None


@given(host=hosts, data=st.data())
def test_evolve_builds_what_dataclasses_replace_builds(host: h.Host, data: st.DataObject) -> None:
    """The hot path's copy equals ``replace`` for any subset of changed fields."""
    names = data.draw(st.sets(st.sampled_from([f.name for f in fields(h.Host)])))
    changes: dict[str, Any] = {name: data.draw(st.none() | st.integers(0, 3)) for name in names}
    assert h._evolve(host, **changes) == replace(host, **changes)
    assert h._evolve(host) == host and h._evolve(host) is not host
