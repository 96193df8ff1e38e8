"""Rewards that lie inside ``Fleet.step`` (fleet rule 8): a host named as lying is not ready,
its shard moves to a free spare (its worker killed at once, its machine held until
undrain), or it keeps serving, named, where none is free; most of the fleet at once is one
signature that moves and restarts nothing."""

from __future__ import annotations

from dataclasses import replace

from supervisor import fleet as f
from supervisor import health as h
from supervisor import view
from supervisor import vocabulary as v
from supervisor.health import HostState as S
from supervisor.policies import RewardsPolicy
from supervisor.rewards import LOOK_S
from tests.unit.test_fleet_core import HEALTH, Shell, members

POLICY = v.FleetPolicy(startup_timeout_s=30.0, shutdown_timeout_s=60.0)
NAMES = ("a", "b", "c", "d")
#: Tasks each worker finishes between two looks.
TASKS = 150


class Fleet(Shell):
    """A shell whose workers report the AReaL worker's counts in their heartbeats."""

    counts: dict[str, tuple[int, int]]

    def start(self, spares: tuple[str, ...] = ()) -> Fleet:
        """Boot, connect the spares, run a worker on every host (pids 100, 101...)."""
        self.counts = {}
        self.boot()
        for spare in spares:
            self.feed(v.MachineObserved(spare, h.SshRestored()))
        for i, name in enumerate(NAMES):
            self.run_worker(name, 100 + i)
        return self

    def beat(self, name: str, zero_rate: float) -> list[v.Action]:
        """``name``'s worker beats, having scored TASKS more tasks at ``zero_rate``."""
        scored, zero = self.counts.get(name, (0, 0))
        scored, zero = scored + TASKS, zero + round(TASKS * zero_rate)
        self.counts[name] = (scored, zero)
        pid = self.core.hosts[name].pid
        if pid is None:
            return []  # no worker (moved, stopped): nothing beats
        stats = h.WorkerStats(completed=scored, errors=0, semantic_zero=zero)
        # The worker's clock is its own: far from ours, as the core may never mind.
        beat = h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=1e9 + self.now, stats=stats)
        return self.on(name, beat)

    def rollouts(self, seconds: float, rates: dict[str, float]) -> list[v.Action]:
        """``seconds`` of the trainer's calls: every LOOK_S each host beats, then the look."""
        out: list[v.Action] = []
        for _ in range(round(seconds / LOOK_S)):
            self.now += LOOK_S
            for name, rate in rates.items():
                out += self.beat(name, rate)
            out += self.feed(v.DeadlinePassed())
        return out


def fleet(spares: tuple[str, ...] = (), policy: v.FleetPolicy = POLICY) -> Fleet:
    """Four ready hosts a..d (and ``spares``, connected)."""
    s = Fleet(f.Fleet(members(*((n, i) for i, n in enumerate(NAMES))), HEALTH, policy, spares))
    return s.start(spares)


def look_at(s: Shell) -> float | None:
    """When the next look is due."""
    return s.core.rewards_state.look_at


def all_ready(s: Shell) -> bool:
    """The fleet's one "all ready"."""
    return s.core.all_ready


HEALTHY = dict.fromkeys(NAMES, 0.3)
B_LIES = {**HEALTHY, "b": 1.0}


def test_looks_begin_with_the_first_heartbeat_that_reports_counts() -> None:
    """No look is due while no worker reports its counts (figures without them bring
    none); the first heartbeat that does brings one in its own batch, and then one every
    LOOK_S."""
    s = fleet()
    assert look_at(s) is None
    s.now += 1
    pid = s.core.hosts["a"].pid
    assert pid is not None
    partial = h.WorkerStats(completed=10, errors=0)  # no semantic_zero: nothing to judge
    s.on("a", h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=5e8, stats=partial))
    assert look_at(s) is None
    s.beat("a", 0.3)
    assert look_at(s) == s.now + LOOK_S
    assert s.core.deadline_at is not None and s.core.deadline_at <= s.now + LOOK_S


def test_a_lying_host_moves_to_a_free_spare_its_worker_killed_at_once() -> None:
    """Named: the shard moves to the spare (reason "lying"), the old worker is killed at once
    even where restarts drain (its tasks are scored again on the spare), nothing restarts
    it, and the spare launches once it is gone; the machine is held until undrain."""
    s = Fleet(
        f.Fleet(
            members(*((n, i) for i, n in enumerate(NAMES))),
            replace(HEALTH, restart_stop="drain", stop_grace_s=30.0),
            POLICY,
            ("s0",),
        )
    ).start(("s0",))
    s.rollouts(30, HEALTHY)
    out = s.rollouts(60, B_LIES)
    [named] = s.of(out, v.LyingHostNamed)
    assert (named.host, named.machine, named.kinds) == ("b", "b", ("zero",))
    assert s.of(out, v.Failover) == [
        v.Failover(label="b", shard=1, from_machine="b", to_machine="s0", reason="lying")
    ]
    assert s.of(out, v.KillLeftovers) == [
        v.KillLeftovers(machine="b", label="b", shard=1, pid=101, grace_s=0.0)
    ]
    assert s.of(out, v.Terminate) == [] and s.of(out, v.LaunchAsked) == []
    assert s.core.view(s.now).machines["b"] == "s0"
    assert "b" in s.core.rewards_state.held and s.core.rewards_state.named == {}
    out = s.feed(v.LeftoversKilled(machine="b"))
    assert s.of(out, v.Launch) == [v.Launch(host="b", machine="s0", shard=1)]
    roles = {row["name"]: row["role"] for row in s.core.view(s.now).spares}
    assert roles == {"s0": "serving", "b": "drained"}
    assert s.core.seating.counts == {"lying": 1}
    s.feed(v.UndrainRequested(host="b", token=s.token()))
    assert s.core.rewards_state.held == {}


def test_without_a_spare_a_lying_host_keeps_serving_named_and_not_ready() -> None:
    """No spare: the host is named, said once to keep serving, never restarted, and not
    ready: the fleet is not all ready, ``status`` shows it lying with its rates."""
    s = fleet()
    s.rollouts(30, HEALTHY)
    assert all_ready(s)
    out = s.rollouts(60, B_LIES)
    assert [a.host for a in s.of(out, v.LyingHostNamed)] == ["b"]
    [kept] = s.of(out, v.LyingHostKept)
    assert kept.host == "b" and "no spare is configured" in kept.reason
    assert s.of(out, v.Terminate) == [] and s.of(out, v.Failover) == []
    assert s.state("b") is S.READY  # its worker runs: health has nothing against it
    assert not all_ready(s)
    shown = s.core.view(s.now)
    assert set(shown.lying) == {"b"}
    assert view.status_line(shown) == "REWARDS LIE on b; 3/4 ready, 1 lying"
    out = s.rollouts(30, B_LIES)
    assert s.of(out, v.LyingHostKept) == []


def test_a_named_host_moves_once_a_spare_is_free() -> None:
    """The spare is down when the host is named (kept, said once); it moves at the first look
    after the spare connects."""
    s = fleet(("s0",))
    s.feed(v.MachineObserved("s0", h.SshLost(reason="down")))
    s.rollouts(30, HEALTHY)
    out = s.rollouts(60, B_LIES)
    [kept] = s.of(out, v.LyingHostKept)
    assert "no spare is free" in kept.reason
    s.feed(v.MachineObserved("s0", h.SshRestored()))
    out = s.rollouts(LOOK_S, B_LIES)
    assert [m.to_machine for m in s.of(out, v.Failover)] == ["s0"]


def test_a_host_in_another_state_is_shown_in_it_and_a_stopped_one_does_not_hold_all_ready() -> None:
    """Only a ready host is shown lying: one stopped by its operator shows stopped and does
    not keep the fleet from being all ready."""
    s = fleet()
    s.rollouts(30, HEALTHY)
    s.rollouts(60, B_LIES)
    s.feed(v.StopHostRequested(host="b", token=s.token()))
    s.feed(v.StopSentinelWritten(host="b", token=s.tokens))
    s.on("b", h.TerminateConfirmed(pid=101))
    assert s.state("b") is S.STOPPED
    assert "b" in s.core.rewards_state.named
    assert s.core.view(s.now).lying == {}
    assert s.core.all_ready


def test_most_of_the_fleet_at_once_is_one_signature_that_moves_and_restarts_nothing() -> None:
    """Every host scores 0 at once: one signature, nobody named, no move, no restart; the
    fleet stays ready (the trainer can call); an operator's unfreeze ends it."""
    s = fleet(("s0",))
    s.rollouts(120, HEALTHY)
    out = s.rollouts(60, dict.fromkeys(NAMES, 1.0))
    [found] = s.of(out, v.RewardSignatureFound)
    assert found.hosts == NAMES
    assert s.of(out, v.LyingHostNamed) == [] and s.of(out, v.Failover) == []
    assert s.of(out, v.Terminate) == [] and s.of(out, v.LaunchAsked) == []
    assert s.core.all_ready
    assert view.status_line(s.core.view(s.now)).startswith("REWARD SIGNATURE (zero rate): 4 hosts")
    out = s.feed(v.UnfreezeRequested(token=s.token()))
    assert [type(a) for a in out if not isinstance(a, v.Reply)] == [v.RewardSignatureCleared]
    assert s.core.rewards_state.signature is None


def test_moves_off_name_and_keep() -> None:
    """``rewards.move = false``: the host is named and kept, with a spare free."""
    policy = replace(POLICY, rewards=RewardsPolicy(move=False))
    s = fleet(("s0",), policy=policy)
    s.rollouts(30, HEALTHY)
    out = s.rollouts(60, B_LIES)
    assert [a.host for a in s.of(out, v.LyingHostKept)] == ["b"]
    assert s.of(out, v.Failover) == []


def test_no_look_while_the_fleet_stops() -> None:
    """A stop ends the looks: none happens, whatever the workers report."""
    s = fleet()
    s.rollouts(30, HEALTHY)
    look_at = s.core.rewards_state.look_at
    assert look_at is not None
    s.feed(v.ShutdownRequested())
    # (that no past look_at is a deadline then, waking the loop for ever, is a property of
    # test_fleet_properties: every deadline is in the future)
    s.now = look_at + 1
    s.rollouts(LOOK_S, HEALTHY)
    assert s.core.rewards_state.look_at == look_at


def test_a_reload_that_turns_rewards_off_clears_the_names() -> None:
    """``rewards.window_s = 0`` by reload: the named host is cleared at the next batch, and
    no look is due after."""
    s = fleet()
    s.rollouts(30, HEALTHY)
    s.rollouts(60, B_LIES)
    off = replace(POLICY, rewards=RewardsPolicy(window_s=0.0))
    out = s.feed(
        v.Reconfigured(
            members=tuple(s.core.members.values()), health=HEALTH, policy=off, token=s.token()
        )
    )
    assert [a.host for a in s.of(out, v.LyingHostCleared)] == ["b"]
    assert s.core.all_ready
    out = s.rollouts(30, B_LIES)
    assert s.of(out, v.LyingHostNamed) == [] and s.core.rewards_state.look_at is None
