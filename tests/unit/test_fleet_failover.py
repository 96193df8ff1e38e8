"""The failover core (fleet.py, issue 32): lost machines, spares, fencing, drain, undrain."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import fleet, health, runfiles
from supervisor.fleet import Failover, KillLeftovers, NoFreeSpare, Refusal, Sighting
from tests.examples import examples

AFTER = 10.0
UP = Sighting(connected=True, beat_at=100.0)


def seats(spares: tuple[str, ...] = ("s0",)) -> fleet.Seats:
    """Two labels on their own hosts and the given spares."""
    return fleet.new_seats([("h0", 0), ("h1", 1)], spares)


def down(since: float, beat: float | None) -> Sighting:
    """A machine whose connection went down at ``since``, last heartbeat at ``beat``."""
    return Sighting(connected=False, down_since=since, beat_at=beat)


@pytest.mark.parametrize(
    ("sighting", "lost"),
    [
        (UP, False),
        (Sighting(connected=False), False),
        (down(99.0, 90.0), True),
        (down(90.0, 95.0), False),
        (down(90.0, 90.0), True),
        (down(90.0, None), True),
    ],
)
def test_lost_needs_connection_seen_down_and_heartbeat_after_s_old(
    sighting: Sighting, lost: bool
) -> None:
    """Only a connection seen down and a heartbeat after_s old make a machine lost."""
    assert fleet.is_lost(sighting, 100.0, AFTER) is lost


def test_lost_host_shard_goes_to_first_free_spare_under_its_label() -> None:
    """A lost host's label is served by the first free spare and the host is fenced."""
    sights = {"h0": down(80.0, 80.0), "h1": UP, "s0": UP, "s1": UP}
    new, out = fleet.fail_over(seats(("s0", "s1")), sights, 100.0, AFTER)
    assert out == [
        Failover(label="h0", shard=0, from_machine="h0", to_machine="s0", reason="host_lost")
    ]
    assert new.serving == {"h0": "s0", "h1": "h1"}
    assert new.spares == ("s1",)
    assert new.fenced == {"h0"}


def test_two_lost_at_once_with_one_spare_serves_one_and_says_the_other_waits() -> None:
    """Two hosts lost with one spare: one label moves, the other is reported unserved."""
    sights = {"h0": down(80.0, 80.0), "h1": down(80.0, 80.0), "s0": UP}
    new, out = fleet.fail_over(seats(), sights, 100.0, AFTER)
    assert out == [
        Failover(label="h0", shard=0, from_machine="h0", to_machine="s0", reason="host_lost"),
        NoFreeSpare(label="h1", shard=1, machine="h1"),
    ]
    assert new.serving["h1"] == "h1"


def test_unreachable_or_unseen_spare_is_not_free() -> None:
    """A spare that is not connected, or never seen, is given nothing."""
    sights = {"h0": down(80.0, 80.0), "h1": UP, "s0": down(99.0, None)}
    _, out = fleet.fail_over(seats(("s0", "s9")), sights, 100.0, AFTER)
    assert out == [NoFreeSpare(label="h0", shard=0, machine="h0")]


def test_machine_without_sighting_is_not_lost() -> None:
    """A machine the daemon has no sighting of (just restarted) is never declared lost."""
    new, out = fleet.fail_over(seats(), {"s0": UP}, 100.0, AFTER)
    assert (new, out) == (seats(), [])


def test_returning_lost_host_is_cleaned_then_becomes_a_spare_not_its_old_label() -> None:
    """A lost host that comes back has its leftovers killed, then is a spare: no flap back."""
    sights = {"h0": down(80.0, 80.0), "h1": UP, "s0": UP}
    new, _ = fleet.fail_over(seats(), sights, 100.0, AFTER)
    assert fleet.seen_again(new, "h0") == [KillLeftovers(machine="h0")]
    assert fleet.seen_again(new, "h1") == []
    assert fleet.free_spares(new, {**sights, "h0": UP}) == ()
    clean = fleet.leftovers_killed(new, "h0")
    assert clean.serving == {"h0": "s0", "h1": "h1"}
    assert clean.spares == ("h0",)
    assert fleet.leftovers_killed(clean, "h0") == clean


def test_drain_moves_label_then_holds_host_until_undrain() -> None:
    """Drain moves the label to a spare; the host is held after cleaning until undrain."""
    sights = {"h0": UP, "h1": UP, "s0": UP}
    result = fleet.drain(seats(), "h0", sights)
    assert not isinstance(result, Refusal)
    new, move = result
    assert move == Failover(label="h0", shard=0, from_machine="h0", to_machine="s0", reason="drain")
    assert fleet.undrain(new, "h0") is Refusal.NOT_DRAINED
    clean = fleet.leftovers_killed(new, "h0")
    assert clean.held == {"h0"} and clean.spares == ()
    back = fleet.undrain(clean, "h0")
    assert not isinstance(back, Refusal)
    assert back.spares == ("h0",) and back.held == frozenset()


def test_drain_refused_without_free_spare_or_for_a_machine_serving_nothing() -> None:
    """Drain is refused with a reason: no free spare, or a host that serves no shard."""
    sights = {"h0": UP, "h1": UP, "s0": UP}
    assert fleet.drain(seats(()), "h0", sights) is Refusal.NO_FREE_SPARE
    assert fleet.drain(seats(), "s0", sights) is Refusal.NOT_SERVING


# ---------------------------------------------------------------------------------------
# Property: a model world (machines, partitions, worker processes, the shard lock) driven by
# random sequences, the core deciding. Throughout: a launch never lands on a machine with
# leftovers, and outside fenced machines each shard has at most one worker process.

HOSTS = ("h0", "h1", "h2")
SPARES = ("s0", "s1")
MACHINES = HOSTS + SPARES


@dataclass
class World:
    """The machines as they are, and the daemon's view of them."""

    seats: fleet.Seats
    now: float = 0.0
    cut: set[str] = field(default_factory=set)  # partitioned: unreachable, processes alive
    hung: set[str] = field(default_factory=set)  # its workers stop beating
    procs: dict[str, set[str]] = field(default_factory=lambda: {m: set() for m in MACHINES})
    lock: dict[str, str] = field(default_factory=dict)
    sights: dict[str, Sighting] = field(default_factory=dict)
    beats: dict[str, float] = field(default_factory=dict)

    def grab_locks(self) -> None:
        """Every worker waiting on a free shard lock takes it."""
        for m in MACHINES:
            for label in sorted(self.procs[m]):
                self.lock.setdefault(label, m)

    def tick(self) -> None:
        """Beats, connections, then the core's decision, as the daemon does each turn."""
        self.grab_locks()
        for m in MACHINES:
            if m not in self.hung and any(self.lock.get(lb) == m for lb in self.procs[m]):
                self.beats[m] = self.now
        for m in MACHINES:
            old = self.sights.get(m, Sighting(connected=False))
            beat = self.beats.get(m)
            if m in self.cut:
                since = self.now if old.connected or old.down_since is None else old.down_since
                self.sights[m] = Sighting(connected=False, down_since=since, beat_at=beat)
            else:
                self.sights[m] = Sighting(connected=True, beat_at=beat)
                if not old.connected:
                    for action in fleet.seen_again(self.seats, m):
                        assert isinstance(action, KillLeftovers)
                        self.kill(m)
                        self.seats = fleet.leftovers_killed(self.seats, m)
        self.seats, out = fleet.fail_over(self.seats, self.sights, self.now, AFTER)
        for action in out:
            if isinstance(action, Failover):
                assert not self.procs[action.to_machine], "launch on a machine with leftovers"
                self.procs[action.to_machine].add(action.label)
        self.grab_locks()

    def kill(self, m: str) -> None:
        """Every process of ours on ``m`` is gone, its locks released."""
        self.procs[m] = set()
        self.lock = {lb: h for lb, h in self.lock.items() if h != m}
        self.hung.discard(m)

    def check(self) -> None:
        """At most one worker per shard outside fenced machines; one label per machine."""
        served = list(self.seats.serving.values())
        assert len(served) == len(set(served))
        for label in HOSTS:
            live = [m for m in MACHINES if label in self.procs[m] and m not in self.seats.fenced]
            assert len(live) <= 1, (label, live)
        for m in MACHINES:
            if m not in self.seats.fenced:
                assert self.procs[m] <= {lb for lb, s in self.seats.serving.items() if s == m}


def restarted(seats: fleet.Seats) -> fleet.Seats:
    """``seats`` as a new daemon has them: saved in the state file's form, read back, and
    taken by a new ``Fleet`` whose members then join; the same seats, spares in some order."""
    saved = fleet.SavedSeats(
        serving={lb: m for lb, m in seats.serving.items() if m != lb},
        fenced=seats.fenced,
        drained=seats.drained,
        held=seats.held,
    )
    read = runfiles.seats_from_json({"seats": runfiles.seats_record(saved)})
    assert read == saved
    core = fleet.Fleet(
        [fleet.Member(name=h, shard=i) for i, h in enumerate(HOSTS)],
        health.Policy(),
        fleet.FleetPolicy(),
        spares=SPARES,
    )
    core.step([fleet.Booted(seats=read)], 0.0)
    core.step([fleet.FilesScanned(hosts=frozenset(HOSTS), sentinels=frozenset())], 0.0)
    new = core.seats
    assert (new.serving, new.fenced, new.drained, new.held) == (
        seats.serving,
        seats.fenced,
        seats.drained,
        seats.held,
    )
    assert sorted(new.spares) == sorted(seats.spares)
    return new


ops = st.lists(
    st.tuples(
        st.sampled_from(["cut", "heal", "die", "hang", "wait", "restart", "drain", "undrain"]),
        st.sampled_from(MACHINES),
        st.floats(min_value=0.5, max_value=15.0),
    ),
    max_size=40,
)


@settings(max_examples=examples(300), deadline=None)
@given(ops)
def test_random_partitions_returns_restarts_never_two_workers_on_a_shard(
    steps: list[tuple[str, str, float]],
) -> None:
    """Partitions, deaths, returns, restarts and takeovers never leave two workers per shard."""
    w = World(seats=fleet.new_seats([(h, i) for i, h in enumerate(HOSTS)], SPARES))
    for h in HOSTS:
        w.procs[h].add(h)
    w.tick()
    for op, m, dt in steps:
        if op == "cut":
            w.cut.add(m)
        elif op == "heal":
            w.cut.discard(m)
        elif op == "die":  # its sshd and processes gone: unreachable until it heals
            w.kill(m)
            w.cut.add(m)
        elif op == "hang":
            w.hung.add(m)
        elif op == "restart":  # daemon restart or standby takeover: seats persisted, views not
            w.seats = restarted(w.seats)
            w.sights = {}
        elif op == "drain":
            result = fleet.drain(w.seats, m, w.sights)
            if not isinstance(result, Refusal):
                w.seats, move = result
                assert not w.procs[move.to_machine]
                w.procs[move.to_machine].add(move.label)
                if m not in w.cut:
                    w.kill(m)
                    w.seats = fleet.leftovers_killed(w.seats, m)
        else:
            undone = fleet.undrain(w.seats, m)
            if not isinstance(undone, Refusal):
                w.seats = undone
        w.now += dt
        w.tick()
        w.check()
    # Every machine back: each fenced one is cleaned and none stays out of the pool for ever.
    w.cut.clear()
    w.now += 1.0
    w.tick()
    w.check()
    assert w.seats.fenced == frozenset()
    idle = set(MACHINES) - set(w.seats.serving.values())
    assert all(not w.procs[m] for m in idle)
