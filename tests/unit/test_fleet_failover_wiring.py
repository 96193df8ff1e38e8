"""The failover rules inside ``Fleet.step`` (issue 32): a lost machine's shard moves to a
spare and starts there, a returning machine is cleaned before it serves again, a drain waits
for the old worker before the spare launches, and an operator hears why not."""

from __future__ import annotations

from supervisor import failover
from supervisor import fleet as f
from supervisor import health as h
from supervisor import vocabulary as v
from supervisor.health import HostState as S
from tests.unit.test_fleet_core import HEALTH, Shell, members

AFTER = 11.0
POLICY = v.FleetPolicy(startup_timeout_s=30.0, shutdown_timeout_s=60.0, failover_after_s=AFTER)


def fleet_with_spares(*spares: str) -> Shell:
    """Hosts a (shard 0) and b (shard 1) ready with pids 100 and 101, spares connected."""
    s = Shell(f.Fleet(members(("a", 0), ("b", 1)), HEALTH, POLICY, spares=spares))
    out = s.boot()
    assert s.of(out, v.KeepSpare) == [v.KeepSpare(machine=m) for m in spares]
    for spare in spares:
        s.feed(v.MachineObserved(spare, h.SshRestored()))
    s.run_worker("a", 100)
    s.run_worker("b", 101)
    return s


def lose(s: Shell, name: str) -> None:
    """``name``'s connection drops at ``s.now``."""
    s.on(name, h.SshLost(reason="keepalive timeout"))


def test_a_machine_down_with_a_stale_heartbeat_moves_its_shard_to_a_spare_which_launches() -> None:
    """Down for after_s with no new heartbeat: its member starts afresh on the spare, probed
    then launched there under the member's name, and the lost machine is fenced."""
    s = fleet_with_spares("s0")
    beat_at = s.core.hosts["a"].beat_changed_at
    assert beat_at is not None
    s.now = beat_at + 1.0
    lose(s, "a")
    assert s.core.deadline_at is not None and s.core.deadline_at <= beat_at + AFTER
    s.now = beat_at + AFTER - 0.1
    assert s.of(s.feed(v.DeadlinePassed()), v.Failover) == []
    s.now = beat_at + AFTER
    out = s.feed(v.DeadlinePassed())
    assert s.of(out, v.Failover) == [
        v.Failover(label="a", shard=0, from_machine="a", to_machine="s0", reason="host_lost")
    ]
    # A free spare runs nothing of ours: launched at once, no probe first.
    assert s.of(out, v.Probe) == []
    assert s.of(out, v.Launch) == [v.Launch(host="a", machine="s0", shard=0)]
    assert s.core.view(0.0).machines.get("a") == "s0"
    assert s.core.hosts["a"].state is S.STARTING
    assert s.core.seating.counts == {"host_lost": 1}
    roles = {row["name"]: row["role"] for row in s.core.view(0.0).spares}
    assert roles == {"s0": "serving", "a": "fenced"}


def test_a_partition_with_the_heartbeat_still_fresh_is_not_a_loss() -> None:
    """The connection is down but the worker still beats on the shared filesystem."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    for _ in range(30):
        s.now += 1.0
        s.on("a", h.HeartbeatSeen(pid=100, ready=True, remote_heartbeat_at=s.now))
        assert s.of(s.feed(v.DeadlinePassed()), v.Failover) == []
    assert s.core.view(0.0).machines.get("a") == "a"


def test_the_lost_machine_returning_is_cleaned_then_becomes_a_spare() -> None:
    """Seen again, it gets KillLeftovers for its old worker first; once they are killed it
    is a free spare, and the member stays on the machine that serves it now."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    s.now += AFTER + 5
    s.feed(v.DeadlinePassed())
    out = s.feed(v.MachineObserved("a", h.SshRestored()))
    assert s.of(out, v.KillLeftovers) == [
        v.KillLeftovers(machine="a", label="a", shard=0, pid=100, grace_s=0.0)
    ]
    assert s.core.view(0.0).free_spares == 0
    s.feed(v.LeftoversKilled(machine="a", error="connection lost"))
    assert s.core.deadline_at is not None  # a retry is due while it stays connected
    s.now += failover.LEFTOVERS_RETRY_S
    assert len(s.of(s.feed(v.DeadlinePassed()), v.KillLeftovers)) == 1
    s.feed(v.LeftoversKilled(machine="a"))
    assert s.core.view(0.0).free_spares == 1
    assert s.core.view(0.0).machines.get("a") == "s0"


def test_with_no_free_spare_the_loss_is_said_once() -> None:
    """Two machines lost and one spare: one shard moves, the other is reported unserved once."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    lose(s, "b")
    s.now += AFTER + 1
    out = s.feed(v.DeadlinePassed())
    assert [a.label for a in s.of(out, v.Failover)] == ["a"]
    assert s.of(out, v.NoFreeSpare) == [v.NoFreeSpare(label="b", shard=1, machine="b")]
    s.now += 1
    assert s.of(s.feed(v.DeadlinePassed()), v.NoFreeSpare) == []


def test_drain_stops_the_old_worker_before_the_spare_launches() -> None:
    """A drain moves the shard, kills the old worker first (as a restart does), and only then
    lets the spare probe and launch; the host is held until undrain."""
    s = fleet_with_spares("s0")
    token = s.token()
    out = s.feed(v.DrainRequested(host="a", token=token))
    assert s.of(out, v.Failover)[0].reason == "drain"
    kill = s.of(out, v.KillLeftovers)
    assert kill == [v.KillLeftovers(machine="a", label="a", shard=0, pid=100, grace_s=0.0)]
    assert s.of(out, v.Launch) == []  # not before the old worker is gone
    assert s.of(out, v.Reply) == [
        v.Reply(token=token, result={"label": "a", "shard": 0, "to": "s0"})
    ]
    out = s.feed(v.LeftoversKilled(machine="a"))
    assert s.of(out, v.Launch) == [v.Launch(host="a", machine="s0", shard=0)]
    assert {r["name"]: r["role"] for r in s.core.view(0.0).spares}["a"] == "drained"
    out = s.feed(v.UndrainRequested(host="a", token=s.token()))
    assert s.of(out, v.Reply)[0].refusal is None
    assert s.core.view(0.0).free_spares == 1


def test_drain_and_undrain_are_refused_with_a_reason() -> None:
    """No free spare, a machine serving nothing, an unknown name, an undrain of a host that
    was not drained: each refused with its code."""
    s = fleet_with_spares()
    out = s.feed(v.DrainRequested(host="a", token=s.token()))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.NO_SPARES
    busy = fleet_with_spares("s0")
    busy.feed(v.MachineObserved("s0", h.SshLost(reason="reset")))
    out = busy.feed(v.DrainRequested(host="a", token=busy.token()))
    assert busy.of(out, v.Reply)[0].refusal is v.Refusal.NO_FREE_SPARE
    out = s.feed(v.DrainRequested(host="zz", token=s.token()))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.UNKNOWN_HOST
    out = s.feed(v.UndrainRequested(host="a", token=s.token()))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.NOT_DRAINED
    t = fleet_with_spares("s0")
    out = t.feed(v.DrainRequested(host="s0", token=t.token()))
    assert t.of(out, v.Reply)[0].refusal is v.Refusal.NOT_SERVING


def test_a_drain_with_restart_stop_drain_gives_the_old_worker_its_grace() -> None:
    """``health.restart_stop = "drain"``: the old worker gets SIGTERM and stop_grace_s."""
    policy = h.Policy(restart_stop="drain", stop_grace_s=7.0)
    s = Shell(f.Fleet(members(("a", 0)), policy, POLICY, spares=("s0",)))
    s.boot()
    s.feed(v.MachineObserved("s0", h.SshRestored()))
    s.run_worker("a", 100)
    out = s.feed(v.DrainRequested(host="a", token=s.token()))
    assert s.of(out, v.KillLeftovers)[0].grace_s == 7.0


def test_a_spare_serving_a_member_speaks_for_it() -> None:
    """News of a spare's connection, once it serves a member, is that member's."""
    s = fleet_with_spares("s0", "s1")
    lose(s, "a")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    s.on("a", h.Launched(pid=200))
    s.on("a", h.HeartbeatSeen(pid=200, ready=True, remote_heartbeat_at=s.now + 1))
    s.feed(v.MachineObserved("s0", h.SshLost(reason="reset")))
    assert not s.core.hosts["a"].ssh_up
    assert (
        s.core.view(0.0).machines.get("a") == "s0"
    )  # its heartbeat is fresh: a partition, not a loss
    assert {r["name"]: r["role"] for r in s.core.view(0.0).spares}["s1"] == "free"
    s.feed(v.MachineObserved("s1", h.SshLost(reason="reset")))
    assert {r["name"]: r["role"] for r in s.core.view(0.0).spares}["s1"] == "down"
    s.feed(v.MachineObserved("zz", h.SshRestored()))  # not one of ours: ignored
    assert "zz" not in {r["name"] for r in s.core.view(0.0).spares}


def test_nothing_moves_while_stopping_and_a_drain_is_refused() -> None:
    """Once a stop began, a lost machine's shard stays where it is; drain is refused."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    s.feed(v.ShutdownRequested(detach=False))
    assert not s.core.finished  # a's worker cannot be reached to be stopped
    s.now += AFTER * 3
    assert s.of(s.feed(v.DeadlinePassed()), v.Failover) == []
    out = s.feed(v.DrainRequested(host="b", token=s.token()))
    assert s.of(out, v.Reply)[0].refusal is v.Refusal.SHUTTING_DOWN


def test_a_second_loss_report_keeps_the_first_instant() -> None:
    """A worker that never beat is timed from its connection's loss: the first report of it,
    not a later one."""
    s = Shell(f.Fleet(members(("a", 0)), HEALTH, POLICY, spares=("s0",)))
    s.boot()
    s.feed(v.MachineObserved("s0", h.SshRestored()))
    s.on("a", h.SshRestored())
    s.on("a", h.ProbeResult(pid=None))
    s.on("a", h.Launched(pid=100))
    assert s.core.hosts["a"].beat_changed_at is None
    s.now = 10.0
    lose(s, "a")
    s.now = 15.0
    lose(s, "a")
    s.now = 10.0 + AFTER
    assert [m.to_machine for m in s.of(s.feed(v.DeadlinePassed()), v.Failover)] == ["s0"]


def test_a_launch_in_flight_to_the_lost_machine_gives_its_slot_back() -> None:
    """The lost machine's launch never answers: moving the shard frees its budget slot, so
    with one launch at a time the spare's launch still begins."""
    one = v.FleetPolicy(
        startup_timeout_s=30.0,
        shutdown_timeout_s=60.0,
        failover_after_s=AFTER,
        max_concurrent_launches=1,
    )
    s = Shell(f.Fleet(members(("a", 0), ("b", 1)), HEALTH, one, spares=("s0",)))
    s.boot()
    s.feed(v.MachineObserved("s0", h.SshRestored()))
    s.run_worker("a", 100)
    s.run_worker("b", 101)
    s.on("a", h.WorkerExited(pid=100, exit_code=1))
    s.now += 60.0
    s.feed(v.DeadlinePassed())
    assert "a" in s.core.budget.in_flight
    lose(s, "a")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    assert s.core.view(0.0).machines.get("a") == "s0"
    # The lost machine's launch gave its slot back; the one in flight is the spare's.
    launches = [a.host for a in s.actions if isinstance(a, v.Launch)]
    assert launches[-2:] == ["a", "a"]
    assert s.core.budget.in_flight == frozenset({"a"})


def test_a_kill_in_flight_is_not_asked_twice_and_one_that_failed_waits_for_the_machine() -> None:
    """A reconnect while leftovers are being killed asks nothing more; a failed kill on a
    machine that went away again is tried when it returns, not on a timer."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    assert len(s.of(s.feed(v.MachineObserved("a", h.SshRestored())), v.KillLeftovers)) == 1
    assert s.of(s.feed(v.MachineObserved("a", h.SshRestored())), v.KillLeftovers) == []
    s.feed(v.MachineObserved("a", h.SshLost(reason="reset")))
    s.feed(v.LeftoversKilled(machine="a", error="connection lost"))
    s.now += 100.0
    assert s.of(s.feed(v.DeadlinePassed()), v.KillLeftovers) == []
    assert len(s.of(s.feed(v.MachineObserved("a", h.SshRestored())), v.KillLeftovers)) == 1


def test_a_retry_due_later_waits_and_one_due_for_a_machine_gone_again_is_dropped() -> None:
    """Retries of a failed kill: not before their time; not while the machine is away."""
    s = fleet_with_spares("s0", "s1")
    lose(s, "a")
    lose(s, "b")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    for machine in ("a", "b"):
        s.feed(v.MachineObserved(machine, h.SshRestored()))
    s.feed(v.LeftoversKilled(machine="a", error="busy"))
    s.now += 1.0
    s.feed(v.LeftoversKilled(machine="b", error="busy"))
    s.feed(v.MachineObserved("a", h.SshLost(reason="reset")))
    s.now += failover.LEFTOVERS_RETRY_S - 0.5  # a's retry is due, b's not yet
    assert s.of(s.feed(v.DeadlinePassed()), v.KillLeftovers) == []
    s.now += 1.0
    assert [k.machine for k in s.of(s.feed(v.DeadlinePassed()), v.KillLeftovers)] == ["b"]


def test_a_member_removed_while_a_spare_serves_it_frees_the_spare() -> None:
    """A reload removes a member that a spare serves: once its worker is stopped it leaves
    and the spare is free again; a member on its own machine leaves with its machine."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    s.on("a", h.Launched(pid=200))
    s.feed(v.Reconfigured(members=(), health=HEALTH, policy=POLICY, token=s.token()))
    for name, pid in (("a", 200), ("b", 101)):
        terminate = s.last(v.Terminate, name)
        assert terminate is not None and terminate.pid == pid
        s.on(name, h.TerminateConfirmed(pid=pid))
    assert set(s.core.hosts) == set()
    assert {r["name"]: r["role"] for r in s.core.view(0.0).spares}["s0"] == "free"
    assert failover.machine_of(s.core.seating, "b") == "b"


def test_a_new_daemon_takes_the_seats_the_last_one_saved() -> None:
    """A daemon restart (or a takeover) mid-failover: the moved member joins on the spare, the
    fenced machine is kept and cleaned when it answers, its leftover named as saved."""
    s = fleet_with_spares("s0", "s1")
    lose(s, "a")
    s.now += AFTER + 1
    out = s.feed(v.DeadlinePassed())
    assert v.HistoryChanged() in out  # the seats are saved with the restart history
    saved = s.core.saved_seats()
    assert saved is not None and saved.serving == {"a": "s0"}
    again = Shell(f.Fleet(members(("a", 0), ("b", 1)), HEALTH, POLICY, spares=("s0", "s1")))
    out = again.core.step([v.Booted(seats=saved)], 0.0)
    assert again.of(out, v.KeepSpare) == [v.KeepSpare(machine="s1"), v.KeepSpare(machine="a")]
    scan = again.of(out, v.ScanFiles)[0]
    connects = again.of(again.scanned(scan), v.Connect)
    assert [(c.host, c.machine) for c in connects] == [("a", "s0"), ("b", "b")]
    assert again.core.view(0.0).machines.get("a") == "s0"
    out = again.feed(v.MachineObserved("a", h.SshRestored()))
    assert again.of(out, v.KillLeftovers) == [
        v.KillLeftovers(machine="a", label="a", shard=0, pid=100, grace_s=0.0)
    ]
    assert {r["name"]: r["role"] for r in again.core.view(0.0).spares} == {
        "s0": "serving",
        "s1": "down",
        "a": "fenced",
    }


def test_saved_seats_that_do_not_fit_the_config_give_way_to_it() -> None:
    """Seats naming a machine or member the config lacks are dropped; seats that would put
    two shards on one machine are ignored whole; a drained machine stays out."""
    unknown = v.SavedSeats(serving={"a": "gone", "zz": "s0"}, fenced=frozenset({"gone"}))
    t = Shell(f.Fleet(members(("a", 0), ("b", 1)), HEALTH, POLICY, spares=("s0",)))
    t.core.step([v.Booted(seats=unknown)], 0.0)
    assert t.core.seating.seats.serving == {} and t.core.seating.seats.fenced == frozenset()
    clash = v.SavedSeats(serving={"a": "b"})
    u = Shell(f.Fleet(members(("a", 0), ("b", 1)), HEALTH, POLICY, spares=("s0",)))
    out = u.core.step([v.Booted(seats=clash)], 0.0)
    assert u.of(out, v.KeepSpare) == [v.KeepSpare(machine="s0")]
    drained = v.SavedSeats(serving={"a": "s0"}, held=frozenset({"a"}))
    w = Shell(f.Fleet(members(("a", 0), ("b", 1)), HEALTH, POLICY, spares=("s0",)))
    w.core.step([v.Booted(seats=drained)], 0.0)
    assert w.core.seating.seats.held == {"a"} and w.core.seating.seats.spares == ()


def test_a_fleet_without_spares_saves_no_seats() -> None:
    """Without [[spares]] nothing about seats is kept or saved."""
    s = Shell(f.Fleet(members(("a", 0)), HEALTH, POLICY))
    s.boot()
    s.run_worker("a", 100)
    assert s.core.saved_seats() is None


def test_failovers_in_progress_are_listed_until_ready_on_the_spare() -> None:
    """``moving``: a member moved and not ready yet, a member lost with no spare free; none
    once the spare's worker is ready."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    lose(s, "b")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    assert s.core.view(0.0).moves == [
        {"host": "a", "shard": 0, "to": "s0", "state": "starting"},
        {"host": "b", "shard": 1, "to": None, "state": "no free spare"},
    ]
    s.on("a", h.Launched(pid=200))
    s.on("a", h.HeartbeatSeen(pid=200, ready=True, remote_heartbeat_at=s.now + 1))
    assert s.core.view(0.0).moves == [
        {"host": "b", "shard": 1, "to": None, "state": "no free spare"}
    ]


def test_a_member_lost_with_no_spare_moves_once_one_is_free() -> None:
    """b lost while a holds the only spare: once a's machine is cleaned and free, b's shard
    moves there at the next look, and not before."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    lose(s, "b")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    s.now += 1
    assert s.of(s.feed(v.DeadlinePassed()), v.Failover) == []
    s.feed(v.MachineObserved("a", h.SshRestored()))
    out = s.feed(v.LeftoversKilled(machine="a"))
    assert s.of(out, v.Failover) == [
        v.Failover(label="b", shard=1, from_machine="b", to_machine="a", reason="host_lost")
    ]
    assert s.core.view(0.0).moves[-1] == {"host": "b", "shard": 1, "to": "a", "state": "starting"}


def test_a_reload_leaves_the_connection_of_a_moved_member_alone() -> None:
    """A reload that keeps both members reconnects the one on its own machine only: the
    spare serving the other keeps its own settings."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    out = s.feed(
        v.Reconfigured(
            members=tuple(members(("a", 0), ("b", 1))),
            health=HEALTH,
            policy=POLICY,
            token=s.token(),
        )
    )
    assert s.of(out, v.Reconnect) == [v.Reconnect(host="b", machine="b")]


def test_the_spare_itself_lost_is_said_once_more_and_the_waiting_member_not_again() -> None:
    """a on the only spare, b lost with none free; then the spare goes too: a is reported
    unserved, b (said already) is not said again."""
    s = fleet_with_spares("s0")
    lose(s, "a")
    lose(s, "b")
    s.now += AFTER + 1
    s.feed(v.DeadlinePassed())
    s.on("a", h.Launched(pid=200))
    s.on("a", h.HeartbeatSeen(pid=200, ready=True, remote_heartbeat_at=s.now + 1))
    s.feed(v.MachineObserved("s0", h.SshLost(reason="gone")))
    s.now += AFTER + 1
    out = s.feed(v.DeadlinePassed())
    assert s.of(out, v.NoFreeSpare) == [v.NoFreeSpare(label="a", shard=0, machine="s0")]
