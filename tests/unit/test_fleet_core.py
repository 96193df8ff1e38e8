"""The fleet core as a specification: membership, start-up, the launch budget, operator
commands, shutdown and the freeze, each rule shown on a small fleet driven by hand.

``Shell`` below plays the daemon: it feeds events, keeps the actions, and answers the
remote operations the way a test says. Nothing here sleeps or does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from supervisor import budget as budgets
from supervisor import fleet as f
from supervisor import health as h
from supervisor import signatures
from supervisor import vocabulary as v
from supervisor.health import HostState as S
from tests.unit.freshread import fresh_read

A = TypeVar("A", bound=v.Action)

HEALTH = h.Policy(heartbeat_stale_s=10.0, ready_timeout_s=20.0, restart_cooldown_s=1.0)
POLICY = v.FleetPolicy(max_concurrent_launches=16, startup_timeout_s=30.0, shutdown_timeout_s=60.0)


def members(*specs: tuple[str, int]) -> list[v.Member]:
    """Members from (name, shard) pairs."""
    return [v.Member(name=name, shard=shard) for name, shard in specs]


@dataclass
class Shell:
    """Drives a ``Fleet`` by hand and remembers everything it was told to do."""

    core: f.Fleet
    now: float = 0.0
    actions: list[v.Action] = field(default_factory=list)
    tokens: int = 0

    def feed(self, *events: v.Event) -> list[v.Action]:
        """Step the core with ``events`` as one batch; return (and keep) its actions. A
        fresh read asked for (``RecheckStatus``) is answered at once, finding each file as
        its host last saw it."""
        out = self.core.step(events, self.now)
        rechecks = [a.host for a in out if isinstance(a, v.RecheckStatus)]
        if rechecks:
            out += self.core.step(
                [v.HostObserved(n, fresh_read(self.core.hosts[n])) for n in rechecks], self.now
            )
        self.actions += out
        return out

    def on(self, name: str, *events: h.Event) -> list[v.Action]:
        """Feed events about one host."""
        return self.feed(*(v.HostObserved(name, e) for e in events))

    def core_policy(self) -> v.FleetPolicy:
        """The fleet rules in force (what a reload that changes nothing else would send)."""
        return self.core._policy

    def state(self, name: str) -> S:
        """``name``'s state now."""
        return self.core.hosts[name].state

    def finished(self) -> bool:
        """Shutdown is over."""
        return self.core.finished

    def token(self) -> int:
        """A fresh command token."""
        self.tokens += 1
        return self.tokens

    def boot(self, sentinels: Iterable[str] = ()) -> list[v.Action]:
        """Booted, then the scan of every joining host."""
        out = self.feed(v.Booted())
        scans = [a for a in out if isinstance(a, v.ScanFiles)]
        for scan in scans:
            out += self.scanned(scan, sentinels)
        return out

    def scanned(self, scan: v.ScanFiles, sentinels: Iterable[str] = ()) -> list[v.Action]:
        """Answer a ScanFiles: the hosts' files read, every status file missing."""
        events: list[v.Event] = [
            v.FilesScanned(hosts=frozenset(scan.hosts), sentinels=frozenset(sentinels))
        ]
        events += [v.HostObserved(n, h.StatusMissing(reason="missing")) for n in scan.hosts]
        return self.feed(*events)

    def run_worker(self, name: str, pid: int) -> None:
        """Connect ``name``, probe nothing, launch ``pid`` and see it ready."""
        self.on(name, h.SshRestored())
        self.on(name, h.ProbeResult(pid=None))
        assert self.last(v.Launch, name) is not None
        self.on(name, h.Launched(pid=pid))
        self.on(name, h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=self.now + 1))
        assert self.core.hosts[name].state is S.READY

    def last(self, kind: type[A], host: str | None = None) -> A | None:
        """The most recent action of ``kind`` (for ``host``), if any."""
        for action in reversed(self.actions):
            if isinstance(action, kind) and (host is None or getattr(action, "host", None) == host):
                return action
        return None

    def of(self, out: list[v.Action], kind: type[A]) -> list[A]:
        """The actions of ``kind`` in ``out``."""
        return [a for a in out if isinstance(a, kind)]


def shell(*specs: tuple[str, int], policy: v.FleetPolicy = POLICY) -> Shell:
    """A fleet of ``specs`` not yet booted."""
    return Shell(f.Fleet(members(*specs), HEALTH, policy))


# --- membership ---------------------------------------------------------------------------


def test_boot_reads_every_host_s_files_before_connecting_in_config_order() -> None:
    """Booted asks for one scan of every host; the scan's answer connects them as listed."""
    s = shell(("b", 1), ("a", 0), ("c", 2))
    out = s.feed(v.Booted())
    assert out == [v.ScanFiles(hosts=("b", "a", "c"))]
    assert s.core.names == {"a", "b", "c"}
    out = s.scanned(v.ScanFiles(hosts=("b", "a", "c")))
    assert [a.host for a in s.of(out, v.Connect)] == ["b", "a", "c"]
    assert not any(a.added for a in s.of(out, v.Connect))


def test_a_host_with_a_stop_sentinel_joins_stopping_and_never_launches() -> None:
    """The sentinel read before connecting keeps the host from launching at all."""
    s = shell(("a", 0))
    s.boot(sentinels=["a"])
    s.on("a", h.SshRestored())
    s.on("a", h.ProbeResult(pid=None))
    assert s.state("a") is S.STOPPED
    assert s.last(v.Launch) is None


def test_history_of_a_previous_daemon_carries_over() -> None:
    """A host that was ``failed`` when the last daemon stopped joins ``failed``."""
    s = shell(("a", 0))
    s.feed(v.Booted(histories={"a": h.History(failures=3, failed="gave up")}))
    s.scanned(v.ScanFiles(hosts=("a",)))
    assert s.state("a") is S.FAILED
    assert s.core.histories()["a"].failures == 3


def test_a_host_added_on_a_busy_shard_waits_for_the_retiring_host_to_stop() -> None:
    """One worker per shard: the newcomer joins only after the removed host is stopped."""
    s = shell(("old", 0), ("other", 1))
    s.boot()
    s.run_worker("old", 100)
    token = s.token()
    out = s.feed(
        v.Reconfigured(
            members=(v.Member(name="new", shard=0), v.Member(name="other", shard=1)),
            health=HEALTH,
            policy=POLICY,
            token=token,
        )
    )
    assert s.of(out, v.Terminate) == [
        v.Terminate(
            host="old", machine="old", shard=0, pid=100, grace_s=HEALTH.stop_grace_s, kill=False
        )
    ]
    assert not s.of(out, v.ScanFiles)
    assert "new" in {n for n, x in s.core.view(0.0).hosts.items() if isinstance(x, v.Member)}
    reply = s.of(out, v.Reply)[0]
    assert reply.result == {
        "added": ["new"],
        "removed": ["old"],
        "restarted": [],
        "updated": ["other"],
    }
    out = s.on("old", h.TerminateConfirmed(pid=100))
    assert s.of(out, v.Disconnect) == [v.Disconnect(host="old", machine="old")]
    assert s.of(out, v.ScanFiles) == [v.ScanFiles(hosts=("new",))]
    out = s.scanned(v.ScanFiles(hosts=("new",)))
    assert s.of(out, v.Connect) == [v.Connect(host="new", shard=0, added=True, machine="new")]
    assert "old" not in s.core.hosts


def test_a_host_removed_and_added_back_waits_for_its_old_self() -> None:
    """A name re-added while its predecessor is stopping joins once that one is gone."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    s.feed(v.Reconfigured(members=(), health=HEALTH, policy=POLICY, token=s.token()))
    assert "a" in s.core.view(0.0).retiring
    out = s.feed(
        v.Reconfigured(members=tuple(members(("a", 0))), health=HEALTH, policy=POLICY, token=2)
    )
    assert not s.of(out, v.ScanFiles)
    assert {n for n, x in s.core.view(0.0).hosts.items() if isinstance(x, v.Member)} == {"a"}
    out = s.on("a", h.TerminateConfirmed(pid=100))
    assert s.of(out, v.Disconnect) == [v.Disconnect(host="a", machine="a")]
    assert s.of(out, v.ScanFiles) == [v.ScanFiles(hosts=("a",))]


def test_a_reload_that_changes_launch_parameters_restarts_only_that_host() -> None:
    """A changed launch key means a fresh worker; an unchanged one is left alone."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    new = (v.Member(name="a", shard=0, launch_key=("v2",)), v.Member(name="b", shard=1))
    out = s.feed(v.Reconfigured(members=new, health=HEALTH, policy=POLICY, token=s.token()))
    assert [a.host for a in s.of(out, v.Terminate)] == ["a"]
    assert {a.host for a in s.of(out, v.Reconnect)} == {"a", "b"}
    assert (s.of(out, v.Reply)[0].result or {})["restarted"] == ["a"]


# --- start-up -----------------------------------------------------------------------------


def test_start_up_settles_once_every_host_answered_or_is_unreachable() -> None:
    """READY waits for probes and the launches they lead to; an unreachable host counts."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.on("b", h.SshLost(reason="connection refused"))
    assert not s.core.settled
    s.on("a", h.SshRestored())
    s.on("a", h.ProbeResult(pid=None))
    assert not s.core.settled  # its launch is in flight
    out = s.on("a", h.Launched(pid=100))
    assert s.of(out, v.Settled) == [v.Settled(slow=())]


def test_start_up_settles_at_its_deadline_naming_the_slow_hosts() -> None:
    """A host that never answers holds READY back only until the start-up deadline."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.on("a", h.SshLost(reason="refused"))
    assert s.core.deadline_at == POLICY.startup_timeout_s
    s.now = POLICY.startup_timeout_s
    out = s.feed(v.DeadlinePassed())
    assert s.of(out, v.Settled) == [v.Settled(slow=("b",))]


def test_a_stop_before_start_up_settles_ends_start_up_first() -> None:
    """Stopping during start-up settles it (READY), then shutdown begins (STOPPING)."""
    s = shell(("a", 0))
    s.boot()
    out = s.feed(v.ShutdownRequested(detach=True))
    assert out == [v.Settled(slow=("a",)), v.ShutdownBegan(detach=True), v.ShutdownDone()]


# --- launch budget ------------------------------------------------------------------------


def test_launches_wait_for_the_budget_and_begin_in_turn() -> None:
    """With one launch at a time, the second host's launch begins when the first answers."""
    s = shell(("a", 0), ("b", 1), policy=v.FleetPolicy(max_concurrent_launches=1))
    s.boot()
    for name in ("a", "b"):
        s.on(name, h.SshRestored())
        s.on(name, h.ProbeResult(pid=None))
    assert [a.host for a in s.actions if isinstance(a, v.Launch)] == ["a"]
    assert s.last(v.LaunchesWaiting) == v.LaunchesWaiting(waiting=1)
    s.now = 5.0
    out = s.on("a", h.Launched(pid=100))
    assert s.of(out, v.Launch) == [v.Launch(host="b", machine="b", shard=1)]
    assert s.core.hosts["b"].launched_at == 5.0  # readiness is timed from the grant


def test_a_queued_launch_is_given_up_when_its_host_stops() -> None:
    """A host stopped while its launch waits never launches, and the core hears why."""
    s = shell(("a", 0), ("b", 1), policy=v.FleetPolicy(max_concurrent_launches=1))
    s.boot()
    for name in ("a", "b"):
        s.on(name, h.SshRestored())
        s.on(name, h.ProbeResult(pid=None))
    token = s.token()
    s.feed(v.StopHostRequested(host="b", token=token))
    s.feed(v.StopSentinelWritten(host="b", token=token))
    assert s.state("b") is S.STOPPED
    assert not budgets.is_waiting(s.core.budget, "b")
    s.on("a", h.Launched(pid=100))
    assert [a.host for a in s.actions if isinstance(a, v.Launch)] == ["a"]


def test_a_failed_launch_gives_its_slot_back_before_the_relaunch_asks_for_it() -> None:
    """The first failure after a healthy spell relaunches at once, through the same slot."""
    s = shell(("a", 0), policy=v.FleetPolicy(max_concurrent_launches=1))
    s.boot()
    s.run_worker("a", 100)
    s.now = 1000.0  # long healthy: the next failure restarts at once
    s.on("a", h.WorkerExited(pid=100, exit_code=1))
    assert s.last(v.Launch) == v.Launch(host="a", machine="a", shard=0)
    out = s.on("a", h.LaunchFailed(reason="exec failed"))
    assert s.core.hosts["a"].state in (S.STARTING, S.COOLING_DOWN)
    if s.state("a") is S.STARTING:
        assert s.of(out, v.Launch) == [v.Launch(host="a", machine="a", shard=0)]
    assert len(s.core.budget.in_flight) <= 1


# --- operator commands --------------------------------------------------------------------


def test_commands_for_unknown_hosts_are_refused_by_name() -> None:
    """restart-host, stop-host and start-host of a non-member answer UNKNOWN_HOST."""
    s = shell(("a", 0))
    s.boot()
    for event in (
        v.RestartHostRequested(host="zz", token=1),
        v.StopHostRequested(host="zz", token=2),
        v.StartHostRequested(host="zz", token=3),
    ):
        (reply,) = s.feed(event)
        assert isinstance(reply, v.Reply)
        assert reply.refusal is v.Refusal.UNKNOWN_HOST
        assert "'zz'" in reply.message and "known: a" in reply.message


def test_restart_of_a_sentinel_held_host_is_refused() -> None:
    """A host kept stopped by its sentinel is started with start-host, not restart-host."""
    s = shell(("a", 0))
    s.boot(sentinels=["a"])
    (reply,) = s.feed(v.RestartHostRequested(host="a", token=1))
    assert isinstance(reply, v.Reply) and reply.refusal is v.Refusal.SENTINEL_HELD


def test_stop_host_writes_the_sentinel_before_stopping_and_start_host_removes_it_first() -> None:
    """The file that outlives the daemon is written (removed) before the host stops (starts);
    a failed write leaves the host as it was."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    assert s.feed(v.StopHostRequested(host="a", token=1)) == [
        v.WriteStopSentinel(host="a", token=1)
    ]
    assert s.state("a") is S.READY
    out = s.feed(v.StopSentinelWritten(host="a", token=1, error="read-only file system"))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.FILE_ERROR
    assert s.state("a") is S.READY
    s.feed(v.StopSentinelWritten(host="a", token=1))
    assert s.state("a") is S.STOPPING
    s.on("a", h.TerminateConfirmed(pid=100))
    assert s.state("a") is S.STOPPED
    assert s.feed(v.StartHostRequested(host="a", token=2)) == [
        v.DeleteStopSentinel(host="a", token=2)
    ]
    out = s.feed(v.StopSentinelDeleted(host="a", token=2))
    assert s.state("a") is S.STARTING
    assert s.of(out, v.Reply) == [v.Reply(token=2)]


def test_a_start_host_during_a_stop_host_s_write_waits_for_it_and_has_the_last_word() -> None:
    """stop-host then start-host before the sentinel's write is done: the removal is issued
    only once the write is over (two file operations at once could end in either order, and
    a write landing after the removal would keep the host stopped after start-host was
    answered); the host ends starting, each command answered in its turn."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    assert s.feed(v.StopHostRequested(host="a", token=1)) == [
        v.WriteStopSentinel(host="a", token=1)
    ]
    assert s.feed(v.StartHostRequested(host="a", token=2)) == []
    assert s.feed(v.StopHostRequested(host="a", token=3)) == []
    assert s.feed(v.StartHostRequested(host="a", token=4)) == []
    out = s.feed(v.StopSentinelWritten(host="a", token=1))
    assert s.of(out, v.Reply) == [v.Reply(token=1)]
    assert s.of(out, v.DeleteStopSentinel) == [v.DeleteStopSentinel(host="a", token=2)]
    out = s.feed(v.StopSentinelDeleted(host="a", token=2))
    assert s.of(out, v.Reply) == [v.Reply(token=2)]
    assert s.of(out, v.WriteStopSentinel) == [v.WriteStopSentinel(host="a", token=3)]
    out = s.feed(v.StopSentinelWritten(host="a", token=3))
    assert s.of(out, v.DeleteStopSentinel) == [v.DeleteStopSentinel(host="a", token=4)]
    s.on("a", h.TerminateConfirmed(pid=100))
    out = s.feed(v.StopSentinelDeleted(host="a", token=4))
    assert s.of(out, v.Reply) == [v.Reply(token=4)]
    assert s.state("a") is S.STARTING and not s.core.hosts["a"].stop_sentinel
    assert s.feed(v.StopHostRequested(host="a", token=5)) == [
        v.WriteStopSentinel(host="a", token=5)
    ]


def test_a_command_waiting_for_a_sentinel_operation_is_refused_if_its_host_left() -> None:
    """A start-host queued behind a stop-host's write is refused with a code when its turn
    comes and the host is no longer a member."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.feed(v.StopHostRequested(host="a", token=1))
    s.feed(v.StartHostRequested(host="a", token=2))
    s.feed(v.Reconfigured(members=tuple(members(("b", 1))), health=HEALTH, policy=POLICY, token=3))
    out = s.feed(v.StopSentinelWritten(host="a", token=1))
    assert [r.refusal for r in s.of(out, v.Reply)] == [v.Refusal.UNKNOWN_HOST] * 2
    assert s.of(out, v.DeleteStopSentinel) == []


# --- shutdown -----------------------------------------------------------------------------


def test_shutdown_ends_when_every_host_is_stopped() -> None:
    """Every worker is terminated; shutdown is done with the last confirmation."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    out = s.feed(v.ShutdownRequested(detach=False))
    assert {a.host for a in s.of(out, v.Terminate)} == {"a", "b"}
    s.on("a", h.TerminateConfirmed(pid=100))
    assert not s.finished()
    out = s.on("b", h.TerminateConfirmed(pid=200))
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone()]
    assert s.finished()
    assert s.feed(v.RestartHostRequested(host="a", token=9)) == []  # nothing after the end


def test_shutdown_names_the_hosts_it_could_not_reach() -> None:
    """An unreachable host with nothing in flight ends shutdown, named as unreachable."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    s.on("b", h.SshLost(reason="network down"))
    s.feed(v.ShutdownRequested(detach=False))
    out = s.on("a", h.TerminateConfirmed(pid=100))
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone(unreachable=("b",))]


def test_shutdown_gives_up_at_its_deadline() -> None:
    """A terminate that never answers ends shutdown at the deadline, incomplete."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    s.feed(v.ShutdownRequested(detach=False))
    s.now = POLICY.shutdown_timeout_s
    out = s.feed(v.DeadlinePassed())
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone(incomplete=("a",))]


def test_detach_leaves_every_worker_running() -> None:
    """``on_exit = "detach"``: no terminate, shutdown is done at once."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    out = s.feed(v.ShutdownRequested(detach=True))
    assert out == [v.ShutdownBegan(detach=True), v.ShutdownDone()]


def test_commands_during_shutdown_are_refused() -> None:
    """Nothing may restart a worker while the daemon stops them all."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    s.feed(v.ShutdownRequested(detach=False))
    (reply,) = s.feed(v.RestartHostRequested(host="a", token=5))
    assert isinstance(reply, v.Reply) and reply.refusal is v.Refusal.SHUTTING_DOWN


# --- the freeze ---------------------------------------------------------------------------


def silent_fleet(n: int) -> Shell:
    """``n`` ready hosts, then time passes beyond the silence threshold with no beats."""
    s = shell(*((f"w{i}", i) for i in range(n)))
    s.boot()
    for i in range(n):
        s.run_worker(f"w{i}", 100 + i)
    s.now = HEALTH.heartbeat_stale_s / 2 + 0.1
    return s


def test_most_hosts_falling_silent_freeze_the_fleet_and_ask_for_a_diagnosis() -> None:
    """The freeze is told to every host and the operator, with a filesystem check."""
    s = silent_fleet(4)
    out = s.feed(v.DeadlinePassed())
    assert [type(a) for a in out if isinstance(a, v.FreezeChanged | v.DiagnoseFilesystem)] == [
        v.FreezeChanged,
        v.DiagnoseFilesystem,
    ]
    assert s.core.watch.freeze.frozen
    assert all(host.frozen for host in s.core.hosts.values())
    out = s.feed(v.FilesystemDiagnosed(finding="run root hung", free_bytes=None))
    assert out == [v.FreezeExplained(finding="run root hung", free_bytes=None)]
    assert s.core.watch.finding == "run root hung"


def test_a_diagnosis_arriving_after_the_thaw_is_old_news() -> None:
    """An operator's unfreeze answers with what was; a late finding is dropped."""
    s = silent_fleet(4)
    s.feed(v.DeadlinePassed())
    out = s.feed(v.UnfreezeRequested(token=3))
    assert v.Reply(token=3, result={"frozen": False, "was_frozen": True}) in out
    assert s.feed(v.FilesystemDiagnosed(finding="late")) == []
    assert s.core.watch.finding is None


SILENT_AFTER_S = HEALTH.heartbeat_stale_s / 2


def frozen(s: Shell) -> bool:
    """The fleet is frozen now (a call, so that a checker reads it afresh each time)."""
    return s.core.watch.freeze.frozen


def test_a_freeze_made_due_by_fewer_hosts_to_run_is_not_skipped() -> None:
    """Four of ten hosts silent together are too few to freeze (five are needed); once an
    operator stops two others, four of eight are enough: the stop, a state change, looks
    at the fleet again rather than trusting the count of the last look."""
    s = shell(*((f"w{i}", i) for i in range(10)))
    s.boot()
    for i in range(10):
        s.run_worker(f"w{i}", 100 + i)
    s.now = SILENT_AFTER_S + 0.1
    s.feed(
        *(
            v.HostObserved(
                f"w{i}", h.HeartbeatSeen(pid=100 + i, ready=True, remote_heartbeat_at=9.0)
            )
            for i in range(4, 10)
        ),
        v.DeadlinePassed(),
    )
    assert not frozen(s)
    stop = h.StopRequested(reason="operator", cause=h.StopCause.OPERATOR)
    s.on("w9", stop)
    assert not frozen(s)  # four of nine: five still needed
    s.on("w8", stop)
    assert frozen(s)
    assert s.core.watch.freeze.hosts == {"w0", "w1", "w2", "w3"}


def test_a_host_that_turns_ready_already_silent_counts_at_once() -> None:
    """A worker whose first heartbeat came well before its launch's answer is ready, and
    silent, from the moment the answer lands: with another silent host that makes two of
    three, and the fleet freezes then, not at some later look."""
    s = shell(("w0", 0), ("w1", 1), ("w2", 2))
    s.boot()
    s.run_worker("w0", 100)
    s.run_worker("w1", 101)
    s.on("w2", h.SshRestored())
    s.on("w2", h.ProbeResult(pid=None))
    assert s.last(v.Launch, "w2") is not None
    s.now = 1.0
    s.on("w2", h.HeartbeatSeen(pid=102, ready=True, remote_heartbeat_at=1.0))
    s.now = SILENT_AFTER_S + 0.5  # w0 is silent now, alone: no freeze
    s.on("w1", h.HeartbeatSeen(pid=101, ready=True, remote_heartbeat_at=5.0))
    s.feed(v.DeadlinePassed())
    assert not frozen(s)
    s.now = 1.0 + SILENT_AFTER_S + 0.5
    s.on("w1", h.HeartbeatSeen(pid=101, ready=True, remote_heartbeat_at=6.0))
    s.on("w2", h.Launched(pid=102))
    assert s.state("w2") is S.READY
    assert frozen(s)
    assert s.core.watch.freeze.hosts == {"w0", "w2"}


# --- time -----------------------------------------------------------------------------------


def test_one_deadline_for_the_fleet_and_early_wake_ups_are_harmless() -> None:
    """``deadline_at`` is the earliest host deadline; DeadlinePassed before it does nothing."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    s.feed(v.DeadlinePassed())  # settle start-up bookkeeping; nothing is due
    stale_at = s.core.deadline_at
    assert stale_at is not None and stale_at > s.now
    s.now = stale_at - 1.0
    out = s.feed(v.DeadlinePassed())
    assert not [a for a in out if not isinstance(a, v.HistoryChanged)]
    assert all(host.state is S.READY for host in s.core.hosts.values())


def test_history_changes_are_announced() -> None:
    """A restart changes history: the shell is told to persist it."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    s.now = 1000.0
    out = s.on("a", h.WorkerExited(pid=100, exit_code=1))
    assert v.HistoryChanged() in out
    assert s.core.histories()["a"].restarts == 1


@pytest.mark.parametrize("event", [h.SshRestored(), h.DeadlinePassed()])
def test_news_of_a_host_that_is_not_a_member_is_ignored(event: h.Event) -> None:
    """Late news of a departed (or never joined) host changes nothing."""
    s = shell(("a", 0))
    s.boot()
    assert s.on("ghost", event) == []


# --- edges of membership, start-up and shutdown ------------------------------------------


def test_a_joining_host_is_visible_with_the_history_it_will_join_with() -> None:
    """While its files are read, a host is listed as joining with its saved history."""
    s = shell(("a", 0))
    s.feed(v.Booted(histories={"a": h.History(restarts=4)}))
    assert s.core.view(0.0).joining == {"a"}
    joining = s.core.view(0.0).hosts["a"]
    assert isinstance(joining, h.Host) and joining.restarts == 4
    assert s.core.health_policy is HEALTH
    s.scanned(v.ScanFiles(hosts=("a",)))
    assert not s.core.view(0.0).joining
    assert s.core.hosts["a"].restarts == 4


def test_booting_twice_changes_nothing() -> None:
    """A second Booted is ignored: hosts join once."""
    s = shell(("a", 0))
    s.feed(v.Booted())
    assert s.feed(v.Booted()) == []


def test_an_empty_fleet_settles_at_once() -> None:
    """With no host to wait for, start-up is over as soon as it begins."""
    s = shell()
    assert s.feed(v.Booted()) == [v.Settled(slow=())]


def test_hosts_whose_files_arrive_during_a_stop_join_only_to_be_stopped() -> None:
    """A stop that begins while hosts' files are read (a daemon stopped during its start-up,
    a standby that just took over) waits for them: they join, connect, and the worker found
    there is stopped, not left running. A detach lets nobody join."""
    s = shell(("a", 0))
    s.feed(v.Booted())
    scan = s.last(v.ScanFiles)
    assert scan is not None
    s.feed(v.ShutdownRequested(detach=False))
    assert not s.core.finished  # "a" may run a worker: it must be found first
    out = s.scanned(scan)
    assert s.of(out, v.Connect) == [v.Connect(host="a", shard=0, added=False, machine="a")]
    s.on("a", h.SshRestored())
    probe = s.last(v.Probe, "a")
    assert probe is not None
    s.on("a", h.ProbeResult(pid=100))
    assert s.last(v.Terminate, "a") == v.Terminate(
        host="a",
        machine="a",
        shard=0,
        pid=100,
        grace_s=HEALTH.stop_grace_s,
        kill=HEALTH.kill_after_grace,
    )
    assert not s.core.finished
    out = s.on("a", h.TerminateConfirmed(pid=100))
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone()]

    d = shell(("a", 0))
    d.feed(v.Booted())
    scan = d.last(v.ScanFiles)
    assert scan is not None
    d.feed(v.ShutdownRequested(detach=True))
    assert d.core.finished
    assert d.scanned(scan) == []

    s2 = shell(("a", 0), ("b", 1))
    s2.boot()
    s2.run_worker("a", 100)
    s2.feed(
        v.Reconfigured(
            members=tuple(members(("a", 0), ("b", 1), ("c", 2))),
            health=HEALTH,
            policy=POLICY,
            token=1,
        )
    )
    scan = s2.last(v.ScanFiles)
    assert scan == v.ScanFiles(hosts=("c",))
    s2.feed(v.ShutdownRequested(detach=False))
    assert s2.of(s2.scanned(scan), v.Connect) == [
        v.Connect(host="c", shard=2, added=True, machine="c")
    ]
    assert "c" in s2.core.hosts


def test_a_stop_before_the_boot_stops_the_workers_found_after_it() -> None:
    """A SIGTERM while the shell still reads the history (before ``Booted``): the fleet
    boots, its hosts join only to be stopped, and the worker found is stopped; a detach
    before the boot just ends it."""
    s = shell(("a", 0))
    assert s.feed(v.ShutdownRequested(detach=False)) == []
    out = s.feed(v.Booted())
    assert s.of(out, v.ShutdownBegan) == [v.ShutdownBegan(detach=False)]
    scan = s.last(v.ScanFiles)
    assert scan == v.ScanFiles(hosts=("a",))
    s.scanned(scan)
    s.on("a", h.SshRestored())
    s.on("a", h.ProbeResult(pid=100))
    assert s.last(v.Terminate, "a") is not None
    assert s.last(v.Launch, "a") is None
    out = s.on("a", h.TerminateConfirmed(pid=100))
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone()]

    d = shell(("a", 0))
    out = d.feed(v.ShutdownRequested(detach=True))
    assert d.of(out, v.ShutdownDone) == [v.ShutdownDone()]
    assert d.feed(v.Booted()) == []


def test_a_stop_waits_for_a_host_s_first_connection_outcome() -> None:
    """A host whose connection has not come up yet is not "unreachable": the stop waits for
    it (up: probe and stop; down: unreachable, named), or for its deadline."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.feed(v.ShutdownRequested(detach=False))
    assert not s.finished()
    s.on("a", h.SshLost(reason="refused"))
    assert not s.finished()
    s.on("b", h.SshRestored())
    s.on("b", h.ProbeResult(pid=None))
    assert s.finished()
    done = s.last(v.ShutdownDone)
    assert done == v.ShutdownDone(unreachable=("a",))


def test_a_host_changed_by_a_reload_while_read_then_a_stop_is_not_waited_for() -> None:
    """A reload changes a joining host; a stop comes before its files are read: the stale
    scan admits nothing and the stop does not wait for it."""
    s = shell(("a", 0))
    s.feed(v.Booted())
    scan = s.last(v.ScanFiles)
    assert scan is not None
    s.feed(
        v.Reconfigured(
            members=(v.Member(name="a", shard=0, launch_key=("new",)),),
            health=HEALTH,
            policy=POLICY,
            token=1,
        )
    )
    s.feed(v.ShutdownRequested(detach=False))
    out = s.scanned(scan)
    assert s.of(out, v.Connect) == []
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone()]


def test_a_host_changed_while_its_files_are_read_joins_with_its_new_settings() -> None:
    """A reload that changes a joining host makes it join afresh, as the new config says."""
    s = shell(("a", 0))
    s.feed(v.Booted())
    changed = (v.Member(name="a", shard=0, launch_key=("v2",)),)
    s.feed(v.Reconfigured(members=changed, health=HEALTH, policy=POLICY, token=1))
    out = s.scanned(v.ScanFiles(hosts=("a",)))
    assert not s.of(out, v.Connect)
    assert s.of(out, v.ScanFiles) == [v.ScanFiles(hosts=("a",))]
    out = s.scanned(v.ScanFiles(hosts=("a",)))
    assert s.of(out, v.Connect) == [
        v.Connect(host="a", shard=0, added=False, machine="a")
    ]  # a boot member
    assert s.core.members["a"].launch_key == ("v2",)


def test_start_up_settles_when_every_joining_host_was_removed() -> None:
    """A reload that removes every host still being read ends start-up with nobody slow."""
    s = shell(("a", 0))
    s.feed(v.Booted())
    s.feed(v.Reconfigured(members=(), health=HEALTH, policy=POLICY, token=1))
    out = s.scanned(v.ScanFiles(hosts=("a",)))
    assert out == [v.Settled(slow=())]


def test_a_host_that_joins_a_frozen_fleet_is_frozen_too() -> None:
    """A host added during a freeze holds its silence-driven restarts like the others."""
    s = silent_fleet(4)
    s.feed(v.DeadlinePassed())
    assert s.core.watch.freeze.frozen
    new = (*members(*((f"w{i}", i) for i in range(4))), v.Member(name="w9", shard=9))
    s.feed(v.Reconfigured(members=new, health=HEALTH, policy=POLICY, token=1))
    s.scanned(v.ScanFiles(hosts=("w9",)))
    assert s.core.hosts["w9"].frozen


def test_unfreeze_of_a_fleet_that_is_not_frozen_only_answers() -> None:
    """Nothing is thawed that was not frozen; the reply says so."""
    s = shell(("a", 0))
    s.boot()
    assert s.feed(v.UnfreezeRequested(token=1)) == [
        v.Reply(token=1, result={"frozen": False, "was_frozen": False})
    ]


def test_a_sentinel_removed_for_a_host_that_left_meanwhile_is_refused() -> None:
    """A start-host whose host was removed by a reload before the file went is refused."""
    s = shell(("a", 0))
    s.boot()
    s.feed(v.StartHostRequested(host="a", token=1))
    s.feed(v.Reconfigured(members=(), health=HEALTH, policy=POLICY, token=2))
    out = s.feed(v.StopSentinelDeleted(host="a", token=1))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.UNKNOWN_HOST


def test_a_second_shutdown_request_changes_nothing() -> None:
    """SIGTERM twice is one shutdown."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    s.feed(v.ShutdownRequested(detach=False))
    assert s.feed(v.ShutdownRequested(detach=True)) == []


def test_a_fleet_that_is_all_unreachable_stops_at_once_naming_every_host() -> None:
    """No host can be reached: shutdown is over at once, and says every worker may run on."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    s.on("a", h.SshLost(reason="down"))
    s.on("b", h.SshLost(reason="down"))
    out = s.feed(v.ShutdownRequested(detach=False))
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone(unreachable=("a", "b"))]


def test_a_removed_host_that_stops_during_shutdown_leaves_and_ends_it() -> None:
    """A retiring host's confirmed stop drops it; if it was the last, shutdown is done."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    s.on("b", h.SshLost(reason="down"))
    s.feed(v.Reconfigured(members=tuple(members(("b", 1))), health=HEALTH, policy=POLICY, token=1))
    s.feed(v.ShutdownRequested(detach=False))
    out = s.on("a", h.TerminateConfirmed(pid=100))
    assert s.of(out, v.Disconnect) == [v.Disconnect(host="a", machine="a")]
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone(unreachable=("b",))]


def test_a_host_already_stopped_leaves_as_soon_as_it_is_removed() -> None:
    """Removing a host held stopped by its sentinel disconnects it at once."""
    s = shell(("a", 0), ("b", 1))
    s.boot(sentinels=["a"])
    s.on("a", h.SshRestored())
    s.on("a", h.ProbeResult(pid=None))
    assert s.state("a") is S.STOPPED
    out = s.feed(
        v.Reconfigured(members=tuple(members(("b", 1))), health=HEALTH, policy=POLICY, token=1)
    )
    assert s.of(out, v.Disconnect) == [v.Disconnect(host="a", machine="a")]


def test_launches_past_the_per_minute_budget_begin_when_the_window_moves() -> None:
    """The fleet's deadline includes the budget window: its timer begins the next launch."""
    policy = v.FleetPolicy(max_launches_per_minute=1, startup_timeout_s=1000.0)
    patient = h.Policy(heartbeat_stale_s=100.0, ready_timeout_s=100.0)
    s = Shell(f.Fleet(members(("a", 0), ("b", 1)), patient, policy))
    s.boot()
    for name in ("a", "b"):
        s.on(name, h.SshRestored())
        s.on(name, h.ProbeResult(pid=None))
    s.on("a", h.Launched(pid=100))
    assert [a.host for a in s.actions if isinstance(a, v.Launch)] == ["a"]
    assert s.core.deadline_at == pytest.approx(budgets.BUDGET_WINDOW_S)
    s.now = budgets.BUDGET_WINDOW_S
    out = s.feed(v.DeadlinePassed())
    assert s.of(out, v.Launch) == [v.Launch(host="b", machine="b", shard=1)]


def test_sentinel_news_for_a_host_that_left_or_a_failed_removal_are_refused() -> None:
    """A stop-host whose host left before the file was written, and a start-host whose file
    could not be removed, are answered with why; the host stays as it was."""
    s = shell(("a", 0), ("b", 1))
    s.boot(sentinels=["b"])
    s.feed(v.StopHostRequested(host="a", token=1))
    s.feed(v.Reconfigured(members=tuple(members(("b", 1))), health=HEALTH, policy=POLICY, token=2))
    out = s.feed(v.StopSentinelWritten(host="a", token=1))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.UNKNOWN_HOST
    s.feed(v.StartHostRequested(host="b", token=3))
    out = s.feed(v.StopSentinelDeleted(host="b", token=3, error="permission denied"))
    (reply,) = s.of(out, v.Reply)
    assert reply.refusal is v.Refusal.FILE_ERROR and "permission denied" in reply.message
    assert s.core.hosts["b"].stop_sentinel


# --- the pointer file ------------------------------------------------------------------------


def test_the_pointer_is_written_once_when_the_fleet_is_first_all_ready() -> None:
    """Not before every host is ready; once; never again, whatever the fleet does after."""
    policy = v.FleetPolicy(pointer_file="/shared/ptr.json")
    s = shell(("a", 0), ("b", 1), policy=policy)
    s.boot()
    s.run_worker("a", 100)
    assert s.last(v.WritePointer) is None
    s.run_worker("b", 200)
    assert s.last(v.WritePointer) == v.WritePointer(path="/shared/ptr.json")
    s.feed(v.PointerWritten(path="/shared/ptr.json"))
    assert s.core.pointer.written
    s.now = 1000.0
    s.on("a", h.WorkerExited(pid=100, exit_code=1))
    s.on("a", h.Launched(pid=101))
    s.on("a", h.HeartbeatSeen(pid=101, ready=True, remote_heartbeat_at=5.0))
    assert [a for a in s.actions if isinstance(a, v.WritePointer)] == [
        v.WritePointer(path="/shared/ptr.json")
    ]


def test_a_failed_pointer_write_is_retried_with_a_doubling_delay_and_stops_nothing() -> None:
    """The failure is reported with its next try; the fleet's timer brings the retry."""
    policy = v.FleetPolicy(pointer_file="/ro/ptr.json", startup_timeout_s=1000.0)
    s = shell(("a", 0), policy=policy)
    s.boot()
    s.run_worker("a", 100)
    out = s.feed(v.PointerWritten(path="/ro/ptr.json", error="read-only file system"))
    assert out == [
        v.PointerNotWritten(
            path="/ro/ptr.json", reason="read-only file system", attempt=1, retry_at=1.0
        )
    ]
    assert s.core.deadline_at == 1.0
    s.now = 1.0
    assert s.of(s.feed(v.DeadlinePassed()), v.WritePointer) == [v.WritePointer(path="/ro/ptr.json")]
    out = s.feed(v.PointerWritten(path="/ro/ptr.json", error="read-only file system"))
    assert s.of(out, v.PointerNotWritten)[0].retry_at == 3.0  # 1 s, then 2 s
    assert s.state("a") is S.READY


def test_a_reload_that_names_another_pointer_file_writes_that_one_and_ignores_the_old() -> None:
    """A new path has never been written; a late answer about the old path changes nothing."""
    s = shell(("a", 0), policy=v.FleetPolicy(pointer_file="/p/one.json"))
    s.boot()
    s.run_worker("a", 100)
    new = v.FleetPolicy(pointer_file="/p/two.json")
    out = s.feed(
        v.Reconfigured(members=tuple(members(("a", 0))), health=HEALTH, policy=new, token=1)
    )
    assert s.of(out, v.WritePointer) == [v.WritePointer(path="/p/two.json")]
    assert s.feed(v.PointerWritten(path="/p/one.json")) == []
    assert not s.core.pointer.written


# --- crash signatures ------------------------------------------------------------------------

IMPORT_ERROR = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'rw'\n"


def crash(s: Shell, name: str, pid: int, tail: str | None = IMPORT_ERROR, code: int = 2) -> None:
    """``name``'s worker ``pid`` exits with ``code`` and ``tail`` in its log."""
    s.on(name, h.WorkerExited(pid=pid, exit_code=code, log_tail=tail))


def bad_deploy(n: int, policy: v.FleetPolicy | None = None) -> Shell:
    """``n`` hosts whose workers start, are ready, and then all crash at start-up, again and
    again, the same way, as long as the test answers their launches."""
    policy = policy or v.FleetPolicy(crash_signature_hosts=3, startup_timeout_s=1e6)
    s = shell(*((f"w{i}", i) for i in range(n)), policy=policy)
    s.boot()
    for i in range(n):
        s.run_worker(f"w{i}", 100 + i)
    s.now = 1000.0  # long healthy: the first crash restarts at once
    s.feed(
        *(
            v.HostObserved(f"w{i}", h.HeartbeatSeen(pid=100 + i, ready=True, remote_heartbeat_at=2))
            for i in range(n)
        )
    )
    return s


def answer_launches(s: Shell, pids: list[int]) -> list[str]:
    """Answer every launch in flight with a worker that crashes at once; the hosts launched."""
    launched = sorted(s.core.budget.in_flight)
    for name in launched:
        pid = pids.pop()
        s.on(name, h.Launched(pid=pid))
        crash(s, name, pid)
    return launched


def test_hosts_crashing_the_same_way_hold_their_restarts_but_for_one_canary() -> None:
    """20 hosts exit 2 with the same import error: after the third, one event, every other
    host waits in cooling_down, and only the canary keeps restarting, on its own backoff."""
    s = bad_deploy(20)
    for i in range(20):
        crash(s, f"w{i}", 100 + i)
    found = [a for a in s.actions if isinstance(a, v.CrashSignatureFound)]
    assert len(found) == 1
    assert found[0].signature == "exit 2: ModuleNotFoundError: No module named 'rw'"
    assert found[0].canary == "w2" and found[0].hosts == ("w0", "w1", "w2")
    pids = list(range(5000, 6000))
    launched: list[str] = []
    for _ in range(30):  # five minutes of relaunches, answered as fast as they come
        launched += answer_launches(s, pids)
        s.now += 10.0
        s.feed(v.DeadlinePassed())
    # Before the third crash the first two restarted once each; after it, only the canary,
    # under its doubling backoff (1, 2, 4 ... 256 s): at most nine times in five minutes.
    assert sorted(n for n in launched if n != "w2") == ["w0", "w1"]
    assert launched.count("w2") <= 9
    held = {n for n, host in s.core.hosts.items() if host.held is not None}
    assert held == {f"w{i}" for i in range(20)} - {"w2"}
    assert all(s.state(n) is S.COOLING_DOWN for n in held)
    assert len([a for a in s.actions if isinstance(a, v.CrashSignatureFound)]) == 1


def test_a_canary_that_runs_again_releases_every_held_host() -> None:
    """Once the canary is ready, the cause is gone: the held hosts restart."""
    s = bad_deploy(5)
    for i in range(5):
        crash(s, f"w{i}", 100 + i)
    canary = s.core.signature_state.active[
        "exit 2: ModuleNotFoundError: No module named 'rw'"
    ].canary
    s.on(canary, h.Launched(pid=7000))
    s.on(canary, h.HeartbeatSeen(pid=7000, ready=True, remote_heartbeat_at=1.0))
    cleared = s.last(v.CrashSignatureCleared)
    assert cleared is not None and cleared.reason == f"the canary {canary} is ready"
    assert not s.core.signature_state.active and not s.core.signature_state.held
    assert all(host.held is None for host in s.core.hosts.values())


def test_a_reload_that_changes_the_workers_or_an_unfreeze_releases_the_hold() -> None:
    """A fix deployed by reload (or an operator's unfreeze) ends the hold at once."""
    for release in ("reload", "unfreeze"):
        s = bad_deploy(4)
        for i in range(4):
            crash(s, f"w{i}", 100 + i)
        assert s.core.signature_state.held
        if release == "reload":
            fixed = tuple(v.Member(name=f"w{i}", shard=i, launch_key=("fixed",)) for i in range(4))
            s.feed(v.Reconfigured(members=fixed, health=HEALTH, policy=POLICY, token=1))
        else:
            s.feed(v.UnfreezeRequested(token=1))
        assert not s.core.signature_state.active and not s.core.signature_state.held, release


def test_random_kills_and_different_crashes_keep_their_normal_restarts() -> None:
    """kill -9 on every host, or exits that differ, form no signature: all restart at once."""
    s = bad_deploy(6)
    for i in range(3):
        s.on(f"w{i}", h.WorkerExited(pid=100 + i, signal=9, log_tail=IMPORT_ERROR))
    for i in range(3, 6):
        errors = ("ValueError: bad task", "KeyError: 'k'", "OSError: disk full")
        crash(s, f"w{i}", 100 + i, tail=errors[i - 3])
    assert not s.core.signature_state.active
    assert all(s.state(f"w{i}") is S.STARTING for i in range(6))


def test_signatures_blur_numbers_and_ignore_signals_someone_sent() -> None:
    """Pids, addresses and counts do not split a signature; SIGKILL and SIGTERM make none."""
    one = h.WorkerExited(pid=1, exit_code=1, log_tail="RuntimeError: worker 17 at 0xdeadbeef\n")
    two = h.WorkerExited(pid=2, exit_code=1, log_tail="RuntimeError:  worker 942 at 0x1234 \n")
    assert (
        signatures.crash_signature(one)
        == signatures.crash_signature(two)
        == ("exit 1: RuntimeError: worker N at 0x?")
    )
    assert signatures.crash_signature(h.WorkerExited(pid=1, signal=11)) == "signal 11"
    assert signatures.crash_signature(h.WorkerExited(pid=1, signal=9)) is None
    assert signatures.crash_signature(h.WorkerExited(pid=1, signal=15)) is None
    assert signatures.crash_signature(h.WorkerExited(pid=1)) is None


def test_the_hold_spares_hosts_running_again_and_a_departed_canary_is_replaced() -> None:
    """A host that crashed but runs again by the time the signature forms is not held; if
    the canary leaves, the next host to crash that way becomes the canary; a held host an
    operator restarts runs again without ending the hold of the others."""
    s = bad_deploy(5)
    crash(s, "w0", 100)
    s.on("w0", h.Launched(pid=200))
    s.on("w0", h.HeartbeatSeen(pid=200, ready=True, remote_heartbeat_at=9.0))
    crash(s, "w1", 101)
    s.on("w1", h.Launched(pid=201))
    crash(s, "w1", 201)  # its second crash waits out a backoff
    crash(s, "w2", 102)
    assert s.core.signature_state.held.keys() == {"w1"} and s.state("w0") is S.READY
    assert s.state("w1") is S.COOLING_DOWN and s.core.hosts["w1"].held is not None
    kept = tuple(v.Member(name=f"w{i}", shard=i) for i in (0, 1, 3, 4))
    s.feed(v.Reconfigured(members=kept, health=HEALTH, policy=s.core_policy(), token=1))
    s.on("w2", h.LaunchFailed(reason="connection closed"))  # the canary's relaunch ends
    assert "w2" not in s.core.hosts
    crash(s, "w3", 103)
    (signature,) = s.core.signature_state.active.values()
    assert signature.canary == "w3"
    token = s.token()
    s.feed(v.RestartHostRequested(host="w1", token=token))
    s.on("w1", h.Launched(pid=300))
    s.on("w1", h.HeartbeatSeen(pid=300, ready=True, remote_heartbeat_at=9.0))
    assert "w1" not in s.core.signature_state.held and s.core.signature_state.active


def test_a_reload_during_shutdown_lets_nobody_join() -> None:
    """A host added while the daemon stops every worker is not even read: it never joins."""
    s = shell(("a", 0))
    s.boot()
    s.run_worker("a", 100)
    s.feed(v.ShutdownRequested(detach=False))
    out = s.feed(
        v.Reconfigured(
            members=tuple(members(("a", 0), ("b", 1))), health=HEALTH, policy=POLICY, token=1
        )
    )
    assert not s.of(out, v.ScanFiles) and "b" not in s.core.view(0.0).joining


def test_a_joining_host_removed_by_a_reload_during_a_stop_is_not_waited_for() -> None:
    """A stop waits for the hosts being read; a reload that removes the only one of them
    ends the wait: the shutdown is done (one of two: the other is still waited for)."""
    s = shell(("a", 0))
    s.feed(v.Booted())
    s.feed(v.ShutdownRequested(detach=False))
    assert not s.finished()
    out = s.feed(v.Reconfigured(members=(), health=HEALTH, policy=POLICY, token=1))
    assert s.of(out, v.ShutdownDone) == [v.ShutdownDone()]
    assert s.finished()
    t = shell(("a", 0), ("b", 1))
    t.feed(v.Booted())
    t.feed(v.ShutdownRequested(detach=False))
    only_b = (v.Member(name="b", shard=1),)
    out = t.feed(v.Reconfigured(members=only_b, health=HEALTH, policy=POLICY, token=1))
    assert not t.of(out, v.ShutdownDone) and not t.finished()  # "b" is still waited for


def test_a_silent_worker_s_terminate_asks_for_evidence_and_the_restart_carries_it() -> None:
    """A stale worker is terminated with its evidence asked for, and the host.state change
    that announces its replacement carries what was captured."""
    s = shell(("w0", 0), ("w1", 1), ("w2", 2))
    s.boot()
    for i in range(3):
        s.run_worker(f"w{i}", 100 + i)
    for t in (5.0, 10.0, 15.0):
        s.now = t
        for i in (1, 2):
            s.on(f"w{i}", h.HeartbeatSeen(pid=101 + i - 1, ready=True, remote_heartbeat_at=t))
    s.now = 15.0
    s.feed(v.DeadlinePassed())
    terminate = s.last(v.Terminate, "w0")
    assert terminate is not None and terminate.pid == 100 and terminate.collect_evidence
    evidence = h.Evidence(pid=100, stacks="Thread 1\n", stacks_via="py-spy", log_tail="x\n")
    out = s.on("w0", h.TerminateConfirmed(pid=100, evidence=evidence))
    changes = s.of(out, v.HostStateChanged)
    assert [(c.to, c.evidence) for c in changes] == [(S.STARTING, evidence)]
    assert s.core.hosts["w0"].evidence == evidence


def test_a_host_removed_again_while_still_stopping_is_retired_once() -> None:
    """Removed, added back (it waits for its old self) and removed again before its old
    worker is gone: one terminate, one retirement, and it never joins."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.run_worker("b", 200)
    only_a = (v.Member(name="a", shard=0),)
    both = (v.Member(name="a", shard=0), v.Member(name="b", shard=1))
    out = s.feed(v.Reconfigured(members=only_a, health=HEALTH, policy=POLICY, token=s.token()))
    assert [a.host for a in s.of(out, v.Terminate)] == ["b"]
    out = s.feed(v.Reconfigured(members=both, health=HEALTH, policy=POLICY, token=s.token()))
    out += s.feed(v.Reconfigured(members=only_a, health=HEALTH, policy=POLICY, token=s.token()))
    assert not s.of(out, v.Terminate) and s.state("b") is S.STOPPING
    out = s.on("b", h.TerminateConfirmed(pid=200))
    assert "b" not in s.core.hosts and not s.of(out, v.ScanFiles)


def test_the_last_states_name_each_host_s_state_and_its_last_worker() -> None:
    """What a clean stop records: each joined host's state and its worker, or the one it
    had last once that one is gone."""
    s = shell(("a", 0), ("b", 1))
    s.boot()
    s.run_worker("a", 100)
    s.on("b", h.SshRestored())
    assert s.core.last_states() == {"a": ("ready", 100), "b": ("starting", None)}
    s.feed(v.ShutdownRequested(detach=False))
    s.on("a", h.TerminateConfirmed(pid=100))
    assert s.core.last_states()["a"] == ("stopped", 100)
