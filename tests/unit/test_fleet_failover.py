"""The failover sub-core (failover.py): lost machines, spares, fencing, drain, undrain."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import failover, fleet, health, runfiles, vocabulary
from supervisor.failover import Seating, Sighting
from supervisor.vocabulary import Failover, KillLeftovers, NoFreeSpare, Refusal, ToHost
from tests.examples import examples

AFTER = 10.0
POLICY = vocabulary.FleetPolicy(failover_after_s=AFTER)
HEALTH = health.Policy()
UP = Sighting(connected=True, beat_at=100.0)


def seated(spares: tuple[str, ...] = ("s0",)) -> Seating:
    """Two labels on their own machines and the given spares, every machine connected."""
    seating = failover.new(spares)
    for label, shard in (("h0", 0), ("h1", 1)):
        seating, _ = failover.seat(seating, label, shard)
    for machine in ("h0", "h1", *spares):
        seating = up(seating, machine)
    return seating


def up(seating: Seating, machine: str, now: float = 0.0) -> Seating:
    """``machine``'s connection came up."""
    seating, _ = failover.connection_changed(
        seating,
        machine,
        health.SshRestored(),
        now=now,
        shutting_down=False,
        health_policy=HEALTH,
    )
    return seating


def down(seating: Seating, machine: str, now: float) -> Seating:
    """``machine``'s connection went down at ``now``."""
    seating, _ = failover.connection_changed(
        seating,
        machine,
        health.SshLost(reason="reset"),
        now=now,
        shutting_down=False,
        health_policy=HEALTH,
    )
    return seating


def hosts(
    beats: dict[str, float | None], pids: dict[str, int] | None = None
) -> dict[str, health.Host]:
    """Each label's health as failover reads it: its last heartbeat and its worker."""
    pids = pids or {}
    return {
        label: replace(health.new_host(label, 0.0), beat_changed_at=beat, pid=pids.get(label))
        for label, beat in beats.items()
    }


def look(
    seating: Seating, beats: dict[str, float | None], now: float
) -> tuple[Seating, list[vocabulary.Said]]:
    """One look for lost machines at ``now``."""
    return failover.look(seating, hosts(beats), now=now, policy=POLICY, shutting_down=False)


def sighting(since: float, beat: float | None) -> Sighting:
    """A machine whose connection went down at ``since``, last heartbeat at ``beat``."""
    return Sighting(connected=False, down_since=since, beat_at=beat)


@pytest.mark.parametrize(
    ("seen", "lost"),
    [
        (UP, False),
        (Sighting(connected=False), False),
        (sighting(99.0, 90.0), True),
        (sighting(90.0, 95.0), False),
        (sighting(90.0, 90.0), True),
        (sighting(90.0, None), True),
    ],
)
def test_lost_needs_connection_seen_down_and_heartbeat_after_s_old(
    seen: Sighting, lost: bool
) -> None:
    """Only a connection seen down and a heartbeat after_s old make a machine lost."""
    assert failover.is_lost(seen, 100.0, AFTER) is lost


def test_lost_host_shard_goes_to_first_free_spare_under_its_label() -> None:
    """A lost host's label is served by the first free spare, the host is fenced, and the
    label starts afresh there (connected: a free spare is)."""
    seating = down(seated(("s0", "s1")), "h0", 80.0)
    seating, out = look(seating, {"h0": 80.0, "h1": 99.0}, 100.0)
    move = Failover(label="h0", shard=0, from_machine="h0", to_machine="s0", reason="host_lost")
    assert out == [
        move,
        ToHost(host="h0", event=health.Relocated(reason="moving to s0: h0 host lost", ssh_up=True)),
    ]
    assert seating.seats.serving == {"h0": "s0", "h1": "h1"}
    assert seating.seats.spares == ("s1",)
    assert seating.seats.fenced == {"h0"}
    assert failover.label_at(seating, "s0") == "h0" and failover.label_at(seating, "h0") is None
    assert seating.counts == {"host_lost": 1}


def test_a_partition_with_a_fresh_heartbeat_is_not_a_loss() -> None:
    """Down but still beating: the worker writes through the shared filesystem, so the machine
    is not lost; the next look is due when its heartbeat would be after_s old."""
    seating = down(seated(), "h0", 95.0)
    seating, out = look(seating, {"h0": 99.0, "h1": 99.0}, 100.0)
    assert out == [] and seating.lost_next_at == 99.0 + AFTER
    assert failover.deadline_at(seating) == 99.0 + AFTER


def test_two_lost_at_once_with_one_spare_serves_one_and_says_the_other_waits_once() -> None:
    """Two hosts lost with one spare: one label moves, the other is reported unserved, once."""
    seating = down(down(seated(), "h0", 80.0), "h1", 80.0)
    seating, out = look(seating, {"h0": 80.0, "h1": 80.0}, 100.0)
    assert [a for a in out if not isinstance(a, ToHost)] == [
        Failover(label="h0", shard=0, from_machine="h0", to_machine="s0", reason="host_lost"),
        NoFreeSpare(label="h1", shard=1, machine="h1"),
    ]
    assert seating.seats.serving["h1"] == "h1"
    _, again = look(seating, {"h0": 80.0, "h1": 80.0}, 101.0)
    assert again == []
    assert failover.moving(seating, hosts({"h0": 80.0, "h1": 80.0}))[-1] == {
        "host": "h1",
        "shard": 1,
        "to": None,
        "state": "no free spare",
    }


def test_unreachable_spare_is_not_free() -> None:
    """A spare that is not connected is given nothing."""
    seating = down(down(seated(), "s0", 99.0), "h0", 80.0)
    _, out = look(seating, {"h0": 80.0, "h1": 99.0}, 100.0)
    assert out == [NoFreeSpare(label="h0", shard=0, machine="h0")]


def test_machine_never_seen_down_is_not_lost() -> None:
    """A machine the daemon has not seen go down (just restarted) is never declared lost."""
    seating = failover.new(("s0",))
    seating, _ = failover.seat(seating, "h0", 0)
    seating, out = look(seating, {"h0": None}, 100.0)
    assert out == [] and seating.down == {}


def test_without_spares_nothing_is_watched() -> None:
    """Without a spare nothing can move: a member's machine going down is not watched."""
    seating = down(seated(()), "h0", 80.0)
    assert seating.down == {} and not seating.sparing
    assert failover.saved(seating) is None


def test_returning_lost_host_is_cleaned_then_becomes_a_spare_not_its_old_label() -> None:
    """A lost host that comes back has its leftovers killed, then is a spare: no flap back."""
    seating = down(seated(), "h0", 80.0)
    seating, _ = failover.look(
        seating,
        hosts({"h0": 80.0, "h1": 99.0}, {"h0": 7}),
        now=100.0,
        policy=POLICY,
        shutting_down=False,
    )
    seating, out = failover.connection_changed(
        seating, "h0", health.SshRestored(), now=101.0, shutting_down=False, health_policy=HEALTH
    )
    assert out == [KillLeftovers(machine="h0", label="h0", shard=0, pid=7, grace_s=0.0)]
    assert failover.free_spares(seating.seats, seating.sightings) == ()
    seating, out = failover.connection_changed(
        seating, "h0", health.SshRestored(), now=101.5, shutting_down=False, health_policy=HEALTH
    )
    assert out == []  # a kill in flight is not asked twice
    seating, out = failover.leftovers_killed(seating, "h0", None, now=102.0, hosts={})
    assert out == []
    assert seating.seats.serving == {"h0": "s0", "h1": "h1"}
    assert seating.seats.spares == ("h0",)
    again, _ = failover.leftovers_killed(seating, "h0", None, now=103.0, hosts={})
    assert again.seats == seating.seats


def test_a_failed_kill_is_tried_again_while_connected_only() -> None:
    """A kill that failed waits LEFTOVERS_RETRY_S while the machine stays connected."""
    seating = down(seated(), "h0", 80.0)
    seating, _ = look(seating, {"h0": 80.0, "h1": 99.0}, 100.0)
    seating = up(seating, "h0", 101.0)
    seating, _ = failover.leftovers_killed(seating, "h0", "agent died", now=102.0, hosts={})
    assert failover.deadline_at(seating) == 102.0 + failover.LEFTOVERS_RETRY_S

    def retried(seating: Seating, now: float) -> list[vocabulary.Said]:
        return failover.retry_kills(seating, now=now, shutting_down=False, health_policy=HEALTH)[1]

    assert retried(seating, 103.0) == []
    assert [type(a) for a in retried(seating, 102.0 + failover.LEFTOVERS_RETRY_S)] == [
        KillLeftovers
    ]
    assert retried(down(seating, "h0", 103.0), 200.0) == []


def test_drain_moves_label_then_holds_host_until_undrain() -> None:
    """Drain moves the label to a spare, waits for the old worker before the label's launch,
    holds the host after cleaning until undrain."""
    seating = seated()
    result = failover.drain(
        seating, "h0", hosts({"h0": 99.0, "h1": 99.0}, {"h0": 5}), health_policy=HEALTH
    )
    assert not isinstance(result, Refusal)
    seating, move, out = result
    assert move == Failover(label="h0", shard=0, from_machine="h0", to_machine="s0", reason="drain")
    assert out == [
        move,
        ToHost(host="h0", event=health.Relocated(reason="moving to s0: h0 drained", ssh_up=False)),
        KillLeftovers(machine="h0", label="h0", shard=0, pid=5, grace_s=0.0),
    ]
    assert failover.undrain(seating, "h0") is Refusal.NOT_DRAINED
    seating, out = failover.leftovers_killed(
        seating, "h0", None, now=1.0, hosts=hosts({"h0": 99.0})
    )
    assert out == [ToHost(host="h0", event=health.SshRestored())]  # now it may launch
    assert seating.seats.held == {"h0"} and seating.seats.spares == ()
    back = failover.undrain(seating, "h0")
    assert not isinstance(back, Refusal)
    assert back.seats.spares == ("h0",) and back.seats.held == frozenset()


def test_a_drain_with_restart_stop_drain_gives_the_old_worker_its_grace() -> None:
    """``restart_stop = "drain"``: the old worker gets SIGTERM and stop_grace_s."""
    graceful = health.Policy(restart_stop="drain", stop_grace_s=7.0)
    result = failover.drain(seated(), "h0", hosts({"h0": 1.0, "h1": 1.0}), health_policy=graceful)
    assert not isinstance(result, Refusal)
    assert [a.grace_s for a in result[2] if isinstance(a, KillLeftovers)] == [7.0]


def test_drain_refused_with_a_code_for_each_reason() -> None:
    """Drain is refused with a reason: no spare configured, none free, or a machine that
    serves no shard."""
    beats = hosts({"h0": 1.0, "h1": 1.0})
    assert failover.drain(seated(()), "h0", beats, health_policy=HEALTH) is Refusal.NO_SPARES
    busy = down(seated(), "s0", 1.0)
    assert failover.drain(busy, "h0", beats, health_policy=HEALTH) is Refusal.NO_FREE_SPARE
    assert failover.drain(seated(), "s0", beats, health_policy=HEALTH) is Refusal.NOT_SERVING


# ---------------------------------------------------------------------------------------
# Property: a model world (machines, partitions, worker processes, the shard lock) driven by
# random sequences, the sub-core deciding. Throughout: a launch never lands on a machine with
# leftovers, and outside fenced machines each shard has at most one worker process.

HOSTS = ("h0", "h1", "h2")
SPARES = ("s0", "s1")
MACHINES = HOSTS + SPARES


@dataclass
class World:
    """The machines as they are, and the daemon's view of them."""

    seating: Seating
    now: float = 0.0
    cut: set[str] = field(default_factory=set)  # partitioned: unreachable, processes alive
    hung: set[str] = field(default_factory=set)  # its workers stop beating
    procs: dict[str, set[str]] = field(default_factory=lambda: {m: set() for m in MACHINES})
    lock: dict[str, str] = field(default_factory=dict)
    beats: dict[str, float] = field(default_factory=dict)  # label -> last heartbeat
    reported: dict[str, bool] = field(default_factory=dict)  # machine -> last connection news

    def grab_locks(self) -> None:
        """Every worker waiting on a free shard lock takes it."""
        for m in MACHINES:
            for label in sorted(self.procs[m]):
                self.lock.setdefault(label, m)

    def hosts(self) -> dict[str, health.Host]:
        """Each label's health as the daemon saw it: its status file's last heartbeat."""
        return {
            label: replace(health.new_host(label, 0.0), beat_changed_at=self.beats.get(label))
            for label in HOSTS
        }

    def said(self, out: list[vocabulary.Said]) -> None:
        """Perform what the sub-core said: kills answered (an unreachable machine's fail)."""
        for action in out:
            if isinstance(action, KillLeftovers):
                error = "unreachable" if action.machine in self.cut else None
                if error is None:
                    self.kill(action.machine)
                self.seating, more = failover.leftovers_killed(
                    self.seating, action.machine, error, now=self.now, hosts=self.hosts()
                )
                self.said(more)
            elif isinstance(action, Failover):
                assert not self.procs[action.to_machine], "launch on a machine with leftovers"
                self.procs[action.to_machine].add(action.label)

    def tick(self) -> None:
        """Beats, connection news, then the sub-core's look, as the daemon does each turn."""
        self.grab_locks()
        for label, holder in self.lock.items():
            if holder not in self.hung:
                self.beats[label] = self.now
        for m in MACHINES:
            connected = m not in self.cut
            if self.reported.get(m) == connected:
                continue
            self.reported[m] = connected
            news = health.SshRestored() if connected else health.SshLost(reason="cut")
            self.seating, out = failover.connection_changed(
                self.seating, m, news, now=self.now, shutting_down=False, health_policy=HEALTH
            )
            self.said(out)
        self.seating, out = failover.retry_kills(
            self.seating, now=self.now, shutting_down=False, health_policy=HEALTH
        )
        self.said(out)
        if self.seating.down:
            self.seating, out = failover.look(
                self.seating, self.hosts(), now=self.now, policy=POLICY, shutting_down=False
            )
            self.said(out)
        self.grab_locks()

    def kill(self, m: str) -> None:
        """Every process of ours on ``m`` is gone, its locks released."""
        self.procs[m] = set()
        self.lock = {lb: h for lb, h in self.lock.items() if h != m}
        self.hung.discard(m)

    def check(self) -> None:
        """At most one worker per shard outside fenced machines; one label per machine."""
        seats = self.seating.seats
        served = list(seats.serving.values())
        assert len(served) == len(set(served))
        for label in HOSTS:
            live = [m for m in MACHINES if label in self.procs[m] and m not in seats.fenced]
            assert len(live) <= 1, (label, live)
        for m in MACHINES:
            if m not in seats.fenced:
                assert self.procs[m] <= {lb for lb, s in seats.serving.items() if s == m}


def restarted(seating: Seating) -> Seating:
    """``seating`` as a new daemon has it: saved in the state file's form, read back, and
    taken by a new ``Fleet`` whose members then join; the same seats, spares in some order,
    and no connection news yet."""
    saved = failover.saved(seating)
    assert saved is not None
    read = runfiles.seats_from_json({"seats": runfiles.seats_record(saved)})
    assert read == saved
    core = fleet.Fleet(
        [vocabulary.Member(name=h, shard=i) for i, h in enumerate(HOSTS)],
        health.Policy(),
        vocabulary.FleetPolicy(),
        spares=SPARES,
    )
    core.step([vocabulary.Booted(seats=read)], 0.0)
    core.step([vocabulary.FilesScanned(hosts=frozenset(HOSTS), sentinels=frozenset())], 0.0)
    old, new = seating.seats, core.seating.seats
    assert (new.serving, new.fenced, new.drained, new.held) == (
        old.serving,
        old.fenced,
        old.drained,
        old.held,
    )
    assert sorted(new.spares) == sorted(old.spares)
    return core.seating


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
    seating = failover.new(SPARES)
    for i, h in enumerate(HOSTS):
        seating, _ = failover.seat(seating, h, i)
    w = World(seating=seating)
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
            w.seating = restarted(w.seating)
            w.reported = {}
        elif op == "drain":
            result = failover.drain(w.seating, m, w.hosts(), health_policy=HEALTH)
            if not isinstance(result, Refusal):
                w.seating, _move, out = result
                w.said(out)
        else:
            undone = failover.undrain(w.seating, m)
            if not isinstance(undone, Refusal):
                w.seating = undone
        w.now += dt
        w.tick()
        w.check()
    # Every machine back: each fenced one is cleaned and none stays out of the pool for ever.
    w.cut.clear()
    w.now += failover.LEFTOVERS_RETRY_S + 1.0
    w.tick()
    w.now += failover.LEFTOVERS_RETRY_S + 1.0
    w.tick()
    w.check()
    assert w.seating.seats.fenced == frozenset()
    idle = set(MACHINES) - set(w.seating.seats.serving.values())
    assert all(not w.procs[m] for m in idle)
