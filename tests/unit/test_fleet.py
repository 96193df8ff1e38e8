"""The fleet policy: freeze on common-mode silence, thaw on return, launch in fair waves."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import budget as budgets
from supervisor import freeze as freezes
from supervisor import health as h
from supervisor import vocabulary
from supervisor.health import HostState as S
from tests.examples import examples

POLICY = vocabulary.FleetPolicy(freeze_fraction=0.5, freeze_window_s=30)
#: Half of a 60 s stale threshold: when a ready host counts as silent.
SILENT_S = 30.0


def host(name: str, alive_at: float | None, state: S = S.READY) -> h.Host:
    """A host in ``state`` whose current worker last beat at ``alive_at``."""
    return replace(h.new_host(name, 0.0), state=state, alive_at=alive_at, pid=1)


def test_most_hosts_falling_silent_together_freezes_before_any_stale_deadline() -> None:
    """6 of 10 silent for half the stale threshold: frozen, 30 s before they would restart."""
    hosts = [host(f"w{i}", 100.0 + i * 0.1) for i in range(6)] + [
        host(f"w{i}", 135.0) for i in range(6, 10)
    ]
    freeze, change = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    assert change is not None
    assert change.frozen
    assert freeze.hosts == {f"w{i}" for i in range(6)}
    assert "shared filesystem" in change.reason


def test_a_few_silent_hosts_are_ordinary_failures() -> None:
    """4 of 10 silent is below the fraction: no freeze, each host is handled alone."""
    hosts = [host(f"w{i}", 100.0) for i in range(4)] + [host(f"w{i}", 135.0) for i in range(4, 10)]
    freeze, change = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    assert change is None
    assert not freeze.frozen


def test_silences_spread_wider_than_the_window_are_not_common_mode() -> None:
    """Hosts dying one by one over minutes do not freeze the fleet."""
    hosts = [host(f"w{i}", 100.0 + 40.0 * i) for i in range(6)] + [
        host(f"w{i}", 400.0) for i in range(6, 10)
    ]
    _freeze, change = freezes.assess(freezes.Freeze(), hosts, 400.0, POLICY, SILENT_S)
    assert change is None


def test_a_single_host_fleet_never_freezes() -> None:
    """One silent host of one is a worker problem; freezing needs at least two."""
    _freeze, change = freezes.assess(freezes.Freeze(), [host("w0", 0.0)], 100.0, POLICY, SILENT_S)
    assert change is None


def test_thaws_when_heartbeats_return() -> None:
    """Once enough of the frozen hosts beat again, the fleet thaws."""
    hosts = [host(f"w{i}", 100.0) for i in range(8)] + [host("w8", 135.0), host("w9", 135.0)]
    frozen, change = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    assert change is not None and change.frozen
    # Five of the eight beat again; the two that never stalled keep beating too.
    hosts = [host(f"w{i}", 200.0) for i in range(5)] + hosts[5:8]
    hosts += [host("w8", 200.0), host("w9", 200.0)]
    thawed, change = freezes.assess(frozen, hosts, 201.0, POLICY, SILENT_S)
    assert change is not None and not change.frozen
    assert not thawed.frozen
    assert "heartbeats returned" in change.reason


def test_a_stalled_host_replaced_after_a_crash_stays_silent_until_its_new_worker_beats() -> None:
    """A frozen host whose worker really dies leaves ``ready``, but that is no heartbeat:
    the fleet stays frozen until the replacement beats, and only then thaws."""
    hosts = [host("a", 100.0), host("b", 100.0), host("c", 135.0)]
    frozen, _ = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    assert frozen.hosts == {"a", "b"}
    relaunched = replace(hosts[0], state=S.STARTING, alive_at=None, pid=2)
    hosts = [relaunched, hosts[1], host("c", 140.0)]
    still, change = freezes.assess(frozen, hosts, 141.0, POLICY, SILENT_S)
    assert change is None and still.frozen
    hosts[0] = replace(relaunched, state=S.READY, alive_at=150.0)
    thawed, change = freezes.assess(still, hosts, 150.5, POLICY, SILENT_S)
    assert change is not None and not change.frozen and not thawed.frozen
    assert change.reason == "heartbeats returned (1 of 2 stalled hosts beating again)"


def test_a_stalled_host_an_operator_stops_no_longer_holds_the_freeze() -> None:
    """Hosts that should not run any more (stopped, failed) drop out of the thaw count."""
    hosts = [host("a", 100.0), host("b", 100.0), host("c", 135.0)]
    frozen, _ = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    hosts[0] = replace(hosts[0], state=S.STOPPED)
    _thawed, change = freezes.assess(frozen, hosts, 132.0, POLICY, SILENT_S)
    assert change is not None and not change.frozen


def test_hosts_falling_silent_during_a_freeze_join_it() -> None:
    """A host whose last beat came just after the freeze fired is part of the same stall."""
    hosts = [host("a", 100.0), host("b", 100.0), host("c", 100.06)]
    frozen, _ = freezes.assess(freezes.Freeze(), hosts, 130.01, POLICY, SILENT_S)
    assert frozen.hosts == {"a", "b"}
    later, change = freezes.assess(frozen, hosts, 131.0, POLICY, SILENT_S)
    assert change is None
    assert later.hosts == {"a", "b", "c"}


def test_stays_frozen_while_the_silence_lasts() -> None:
    """A stall that goes on keeps the fleet frozen, however long it lasts."""
    hosts = [host(f"w{i}", 100.0) for i in range(8)]
    frozen, _ = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    later, change = freezes.assess(frozen, hosts, 5000.0, POLICY, SILENT_S)
    assert change is None
    assert later.frozen


def test_operator_unfreeze_sticks_for_old_silences() -> None:
    """After an operator thaw, the same silent hosts do not freeze the fleet again."""
    hosts = [host(f"w{i}", 100.0) for i in range(8)]
    frozen, _ = freezes.assess(freezes.Freeze(), hosts, 131.0, POLICY, SILENT_S)
    thawed, change = freezes.unfreeze(frozen, 140.0)
    assert change is not None and change.reason == "operator unfreeze"
    again, change = freezes.assess(thawed, hosts, 141.0, POLICY, SILENT_S)
    assert change is None
    assert not again.frozen
    assert freezes.unfreeze(again, 150.0)[1] is None


def test_next_assessment_is_when_the_next_host_would_fall_silent() -> None:
    """The timer for the freeze check is the earliest silence crossing, not a poll."""
    hosts = [host("a", 10.0), host("b", 20.0), host("c", None), host("d", 5.0, S.STOPPED)]
    assert freezes.survey(freezes.Freeze(), hosts, 11.0, SILENT_S).next_at == 40.0
    assert freezes.survey(freezes.Freeze(), hosts, 100.0, SILENT_S).next_at is None


def test_a_host_short_of_silence_by_rounding_is_looked_at_again() -> None:
    """11.899283843798594 + 5 rounds to 16.899283843798592, where the host is 1 ulp short
    of silent: it must still have a next look after now, or the freeze never comes."""
    alive_at, now = 11.899283843798594, 16.899283843798592
    assert alive_at + 5.0 <= now and now - alive_at < 5.0  # the rounding the test is about
    hosts = [host("a", alive_at)]
    surveyed = freezes.survey(freezes.Freeze(), hosts, now, 5.0)
    assert surveyed.silent == []
    assert surveyed.next_at is not None and surveyed.next_at > now


@settings(max_examples=examples(300), deadline=None)
@given(
    n=st.integers(2, 40),
    silent=st.data(),
    now=st.floats(100, 10_000),
)
def test_freezing_needs_the_fraction_and_at_least_two(
    n: int, silent: st.DataObject, now: float
) -> None:
    """Frozen exactly when the largest group of recent silences reaches the threshold."""
    flags = silent.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    hosts = [host(f"w{i}", now - (SILENT_S + 1 if quiet else 1)) for i, quiet in enumerate(flags)]
    freeze, change = freezes.assess(freezes.Freeze(), hosts, now, POLICY, SILENT_S)
    assert freeze.frozen == (sum(flags) >= freezes.threshold(n, POLICY))
    assert (change is not None) == freeze.frozen


def test_budget_grants_longest_waiting_first_within_concurrency() -> None:
    """Three slots: the three oldest requests go first; the next goes when one finishes."""
    policy = vocabulary.FleetPolicy(max_concurrent_launches=3, max_launches_per_minute=100)
    budget = budgets.Budget()
    for i, name in enumerate(["d", "a", "c", "b", "e"]):
        budget = budgets.want_launch(budget, name, float(i))
    budget = budgets.want_launch(budget, "a", 9.0)  # asking again keeps its place
    budget, granted = budgets.grant(budget, 10.0, policy)
    assert granted == ["d", "a", "c"]
    budget, granted = budgets.grant(budget, 11.0, policy)
    assert granted == []
    budget = budgets.launch_done(budget, "a")
    budget, granted = budgets.grant(budget, 12.0, policy)
    assert granted == ["b"]


def test_budget_limits_launches_per_minute_and_says_when_to_retry() -> None:
    """Past the per-minute limit, the rest wait for the window; the deadline says when."""
    policy = vocabulary.FleetPolicy(max_concurrent_launches=100, max_launches_per_minute=2)
    budget = budgets.Budget()
    for name in "abcd":
        budget = budgets.want_launch(budget, name, 0.0)
    budget, granted = budgets.grant(budget, 1.0, policy)
    assert granted == ["a", "b"]
    budget = budgets.launch_done(budgets.launch_done(budget, "a"), "b")
    assert budgets.next_grant_at(budget, policy) == 61.0
    budget, granted = budgets.grant(budget, 60.0, policy)
    assert granted == []
    budget, granted = budgets.grant(budget, 61.0, policy)
    assert granted == ["c", "d"]
    assert budgets.next_grant_at(budget, policy) is None


@settings(max_examples=examples(200), deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["want", "done", "grant", "time"]), st.integers(0, 9)),
        max_size=200,
    ),
    concurrent=st.integers(1, 5),
    per_minute=st.integers(1, 8),
)
def test_budget_is_never_exceeded_and_every_waiting_host_is_served(
    ops: list[tuple[str, int]], concurrent: int, per_minute: int
) -> None:
    """Whatever the sequence: in-flight and per-minute limits hold; waiting ends eventually."""
    policy = vocabulary.FleetPolicy(
        max_concurrent_launches=concurrent, max_launches_per_minute=per_minute
    )
    budget, now = budgets.Budget(), 0.0
    starts: list[float] = []
    for op, k in ops:
        name = f"h{k}"
        if op == "want":
            budget = budgets.want_launch(budget, name, now)
        elif op == "done":
            budget = budgets.launch_done(budget, name)
        elif op == "time":
            now += k * 7.0
        else:
            budget, granted = budgets.grant(budget, now, policy)
            starts += [now] * len(granted)
        assert len(budget.in_flight) <= concurrent
        assert sum(1 for t in starts if now < t + budgets.BUDGET_WINDOW_S) <= per_minute
    # Drain: finishing every launch and letting time pass serves everyone still waiting.
    for _ in range(200):
        for name in list(budget.in_flight):
            budget = budgets.launch_done(budget, name)
        if not budget.waiting:
            break
        now = max(now, budgets.next_grant_at(budget, policy) or now)
        budget, _granted = budgets.grant(budget, now, policy)
    assert not budget.waiting


# --------------------------------------------------------------------------------------
# The freeze and the state machine together: a shared-filesystem stall of any length,
# after which the hosts resume one by one, restarts nobody.

CORE = h.Policy(heartbeat_stale_s=10.0, ready_timeout_s=20.0, restart_cooldown_s=1.0)
FLEET = vocabulary.FleetPolicy(freeze_fraction=0.5, freeze_window_s=30.0)
FLEET_SILENT_S = CORE.heartbeat_stale_s / 2
TICK_S = 0.5


def ready_fleet(n: int) -> list[h.Host]:
    """``n`` hosts whose workers (pid = index + 1) are ready at t=1."""
    hosts = []
    for i in range(n):
        host = h.new_host(f"w{i}", 0.0)
        for event, now in (
            (h.StatusMissing(reason="missing"), 0.0),
            (h.SshRestored(), 0.0),
            (h.ProbeResult(pid=None), 0.0),
            (h.Launched(pid=i + 1), 0.0),
            (h.HeartbeatSeen(pid=i + 1, ready=True, remote_heartbeat_at=1.0), 1.0),
        ):
            host, _ = h.step(host, event, now, CORE)
        assert host.state is S.READY
        hosts.append(host)
    return hosts


@settings(max_examples=examples(150), deadline=None)
@given(
    n=st.integers(2, 12),
    stall_s=st.floats(0.0, 120.0),
    resume=st.data(),
)
def test_a_filesystem_stall_of_any_length_restarts_nobody(
    n: int, stall_s: float, resume: st.DataObject
) -> None:
    """Every worker's heartbeats stop at once for ``stall_s`` (the shared filesystem hangs),
    then come back host by host within one stale threshold (of the thaw, or of the stall's
    start when it was too short to freeze the fleet): the fleet freezes before any host is
    judged, thaws when heartbeats return, and no host is ever terminated or relaunched;
    every one ends ready with its original pid."""
    if stall_s >= FLEET_SILENT_S + 1.0:
        latest = CORE.heartbeat_stale_s - 1.0  # frozen: each gets a stale threshold from the thaw
    else:
        # Too short to freeze: a host silent for a stale threshold in all is rightly judged
        # alone (nothing tells it from a hung worker), so they resume before that.
        latest = CORE.heartbeat_stale_s - 1.0 - stall_s
    offsets = resume.draw(st.lists(st.floats(0.0, latest), min_size=n, max_size=n))
    hosts = ready_fleet(n)
    freeze = freezes.Freeze()
    stall_at = 5.0
    end = stall_at + stall_s + CORE.heartbeat_stale_s * 3
    now = 1.0
    while now < end:
        now += TICK_S
        for i, host in enumerate(hosts):
            stalled = stall_at <= now < stall_at + stall_s + offsets[i]
            events: list[h.Event] = []
            if not stalled:
                events.append(h.HeartbeatSeen(pid=i + 1, ready=True, remote_heartbeat_at=now))
            if host.deadline_at is not None and host.deadline_at <= now:
                events.append(h.DeadlinePassed())
            for event in events:
                host, actions = h.step(host, event, now, CORE)
                remote = [a for a in actions if not isinstance(a, h.StateChanged)]
                assert not remote, (now, host.name, remote, freeze)
            hosts[i] = host
        freeze, change = freezes.assess(freeze, hosts, now, FLEET, FLEET_SILENT_S)
        if change is not None:
            event = h.FleetFrozen(reason=change.reason) if change.frozen else h.FleetThawed()
            for i, host in enumerate(hosts):
                hosts[i], actions = h.step(host, event, now, CORE)
                assert not [a for a in actions if not isinstance(a, h.StateChanged)]
    assert not freeze.frozen
    assert [(x.state, x.pid) for x in hosts] == [(S.READY, i + 1) for i in range(n)]


@settings(max_examples=examples(300), deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(list(S)),
            st.one_of(st.none(), st.floats(0.0, 200.0)),
        ),
        max_size=30,
    ),
    now=st.floats(0.0, 250.0),
    ignore_before_at=st.floats(0.0, 100.0) | st.just(float("-inf")),
    silent_after_s=st.floats(0.0, 60.0),
)
def test_one_survey_says_what_three_looks_at_the_fleet_say(
    rows: list[tuple[S, float | None]], now: float, ignore_before_at: float, silent_after_s: float
) -> None:
    """``survey``'s one pass says what three separate looks say: how many hosts should
    run, the silent ready hosts (newest silence first) and the next crossing of the
    silence threshold, boundaries included."""
    hosts = [host(f"w{i}", alive_at, state) for i, (state, alive_at) in enumerate(rows)]
    freeze = replace(freezes.Freeze(), ignore_before_at=ignore_before_at)
    surveyed = freezes.survey(freeze, hosts, now, silent_after_s)
    counted = [x for x in hosts if x.alive_at is not None and x.alive_at >= ignore_before_at]
    ready = [x for x in counted if x.state is S.READY]
    silent = [x for x in ready if now - (x.alive_at or 0.0) >= silent_after_s]
    # A host not silent yet crosses after now, even where its sum rounds to now or below.
    crossings = [
        max(x.alive_at + silent_after_s, math.nextafter(now, math.inf))
        for x in ready
        if x.alive_at is not None and x not in silent
    ]
    assert surveyed.expected == sum(1 for x in hosts if x.state in h.WANT_RUNNING_STATES)
    assert surveyed.silent == sorted(silent, key=lambda x: x.alive_at or 0.0, reverse=True)
    assert surveyed.next_at == (min(crossings) if crossings else None)
