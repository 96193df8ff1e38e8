"""The rewards sub-core (rewards.py): the statistics, the hysteresis, one host against the
fleet, most of the fleet against its own past, and no false trip in long healthy runs where
hosts differ by +-30 % in zero rate.

``World`` plays the fleet: each host's worker counts its results as the AReaL worker does
(``completed``, ``errors``, ``semantic_zero``, cumulative per pid), and every LOOK_S the core
looks at them. Random worlds are seeded: a failure replays exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import config, health, rewards
from supervisor.policies import RewardsPolicy
from supervisor.rewards import LOOK_S, Counts
from supervisor.vocabulary import (
    LyingHostCleared,
    LyingHostKept,
    LyingHostNamed,
    RewardSignatureCleared,
    RewardSignatureFound,
    Said,
)

POLICY = RewardsPolicy()


@dataclass
class Worker:
    """One host's worker as its heartbeat reports it: cumulative counts, a pid, a machine."""

    pid: int = 100
    machine: str = ""
    scored: int = 0
    errors: int = 0
    zero: int = 0


@dataclass(frozen=True, slots=True)
class Seen:
    """What a look reads of a host (``rewards.Worked``: a ``health.Host`` has more)."""

    pid: int | None
    stats: health.WorkerStats | None


@dataclass
class World:
    """A fleet of hosts whose workers finish tasks; the core looks every LOOK_S."""

    names: list[str]
    policy: RewardsPolicy = POLICY
    seed: int = 0
    now: float = 0.0
    state: rewards.Rewards = rewards.NONE
    said: list[tuple[float, Said]] = field(default_factory=list)
    workers: dict[str, Worker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        for name in self.names:
            self.workers.setdefault(name, Worker(machine=name))

    def finish(self, name: str, tasks: int, zero_rate: float, error_rate: float = 0.0) -> None:
        """``name``'s worker finishes ``tasks`` tasks at these rates (exactly, rounded)."""
        w = self.workers[name]
        errors = round(tasks * error_rate)
        scored = tasks - errors
        w.errors += errors
        w.scored += scored
        w.zero += round(scored * zero_rate)

    def draw(
        self, name: str, tasks_per_s: float, zero_rate: float, error_rate: float = 0.0
    ) -> None:
        """``name``'s worker finishes a look's worth of tasks drawn at random (binomial counts,
        by the normal approximation: fast enough for hours of a fleet)."""
        w = self.workers[name]
        mean = tasks_per_s * LOOK_S
        tasks = max(0, round(self.rng.gauss(mean, math.sqrt(mean))))
        errors = _binomial(self.rng, tasks, error_rate)
        scored = tasks - errors
        w.errors += errors
        w.scored += scored
        w.zero += _binomial(self.rng, scored, zero_rate)

    def hosts(self) -> dict[str, Seen]:
        """Each host as the core reads it: its pid and its worker's counts."""
        return {
            name: Seen(
                pid=w.pid,
                stats=health.WorkerStats(completed=w.scored, errors=w.errors, semantic_zero=w.zero),
            )
            for name, w in self.workers.items()
        }

    def look(self) -> list[Said]:
        """LOOK_S passes and the core looks."""
        self.now += LOOK_S
        machines = {name: w.machine for name, w in self.workers.items()}
        self.state, out = rewards.look(
            self.state, self.hosts(), machines, now=self.now, policy=self.policy
        )
        self.said += [(self.now, item) for item in out]
        return out

    def run(self, seconds: float, rates: dict[str, float], tasks_per_s: float = 30.0) -> None:
        """``seconds`` of random tasks at each host's zero rate."""
        for _ in range(round(seconds / LOOK_S)):
            for name, rate in rates.items():
                self.draw(name, tasks_per_s, rate)
            self.look()

    def steady(self, seconds: float, rates: dict[str, float], tasks: int = 150) -> None:
        """``seconds`` of exactly ``tasks`` tasks a look at each host's zero rate."""
        for _ in range(round(seconds / LOOK_S)):
            for name, rate in rates.items():
                self.finish(name, tasks, rate)
            self.look()

    def of(self, kind: type[Said]) -> list[tuple[float, Said]]:
        """What the core said of ``kind``, with when."""
        return [(t, s) for t, s in self.said if isinstance(s, kind)]


def _binomial(rng: random.Random, n: int, p: float) -> int:
    """A binomial draw (the normal approximation, clipped; exact at p of 0 or 1)."""
    if n <= 0 or p <= 0:
        return 0
    if p >= 1:
        return n
    value = round(rng.gauss(n * p, math.sqrt(n * p * (1 - p))))
    return min(n, max(0, value))


def world(*names: str, **kw: object) -> World:
    """A world of ``names`` (``h0``.. when none)."""
    return World(list(names) or [f"h{i}" for i in range(4)], **kw)  # type: ignore[arg-type]


# --- the statistics ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fleet", "limit"),
    [(0.0, 0.05), (0.1, 0.25), (0.3, 0.65), (0.5, 0.875), (0.6, 0.9), (1.0, 1.0)],
)
def test_the_tolerance_is_twice_the_fleet_plus_5_points_or_three_quarters_to_100(
    fleet: float, limit: float
) -> None:
    """The highest rate in line: ``tolerance`` times the fleet's plus 5 points, never more
    than three quarters of the way from the fleet's to 100 %."""
    assert rewards.threshold(fleet, 2.0) == pytest.approx(limit)


@pytest.mark.parametrize(
    ("count", "total", "limit", "out"),
    [
        (3, 10, 0.05, False),  # 3 of 10 at a 5 % limit happens by chance 1 time in 100
        (10, 10, 0.05, True),
        (100, 100, 0.65, True),
        (70, 100, 0.65, False),  # above the limit, but by chance as likely as not
        (300, 400, 0.65, True),
        (0, 0, 0.05, False),
        (500, 500, 1.0, False),  # nothing is out of line with a fleet at 100 %
    ],
)
def test_a_rate_is_out_of_line_only_4_standard_errors_above_the_limit(
    count: int, total: int, limit: float, out: bool
) -> None:
    """Out of line means above the limit by Z_MIN standard errors, not merely above it."""
    assert rewards.above(count, total, limit) is out


def test_the_limit_in_config_matches_the_look_interval() -> None:
    """``rewards.window_s`` may not be below one look (config keeps its own copy)."""
    assert config.REWARDS_LOOK_S == rewards.LOOK_S


# --- one host against the fleet ---------------------------------------------------------------


def test_a_host_scoring_everything_0_is_named_after_sustain_s_with_both_rates() -> None:
    """One host scoring 0 while the others score 30 % zeros: out of line at the first look
    with enough tasks, named sustain_s later, once, its reason giving its zero rate beside
    the fleet's."""
    w = world()
    w.steady(30, {"h0": 0.3, "h1": 0.3, "h2": 0.3, "h3": 0.3})
    w.steady(10, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    assert w.state.hosts["h1"].out_since is not None
    out_since = w.state.hosts["h1"].out_since
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    [(at, named)] = w.of(LyingHostNamed)
    assert at == out_since + POLICY.sustain_s
    assert isinstance(named, LyingHostNamed)
    assert (named.host, named.machine, named.kinds) == ("h1", "h1", ("zero",))
    assert "zero rate 100%" in named.reason and "the fleet's 30%" in named.reason
    assert set(w.state.named) == {"h1"}


def test_a_burst_shorter_than_sustain_s_names_no_one() -> None:
    """Out of line for a moment (shorter than sustain_s) is not a lie."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(10, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    w.steady(120, dict.fromkeys(w.names, 0.3))
    assert w.of(LyingHostNamed) == []
    assert w.state.hosts["h1"].out_since is None


def test_a_named_host_back_in_line_for_clear_s_is_cleared() -> None:
    """A named host whose rates come back is cleared once in line for clear_s, not before."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    assert set(w.state.named) == {"h1"}
    w.steady(30, dict.fromkeys(w.names, 0.3))
    assert set(w.state.named) == {"h1"}
    w.steady(60, dict.fromkeys(w.names, 0.3))
    [(_, cleared)] = w.of(LyingHostCleared)
    assert isinstance(cleared, LyingHostCleared)
    assert cleared.host == "h1" and "in line with the fleet" in cleared.reason
    assert w.state.named == {}


def test_a_look_with_too_few_tasks_is_evidence_neither_way() -> None:
    """While the trainer is idle nothing is judged: a named host stays named, and a host out
    of line before the lull is not named for the lull's time alone."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    w.steady(300, dict.fromkeys(w.names, 0.3), tasks=0)
    assert set(w.state.named) == {"h1"}
    assert w.of(LyingHostCleared) == []


def test_error_results_out_of_line_are_a_lie_of_their_own_kind() -> None:
    """A host whose results are errors a fifth of the time while the fleet's are not is
    named for its error rate."""
    w = world()
    for _ in range(20):
        for name in w.names:
            w.finish(name, 150, 0.3, error_rate=0.2 if name == "h2" else 0.0)
        w.look()
    [(_, named)] = w.of(LyingHostNamed)
    assert isinstance(named, LyingHostNamed)
    assert named.host == "h2" and named.kinds == ("error",)
    assert "error rate 20%" in named.reason and "the fleet's 0%" in named.reason


def test_two_hosts_compare_with_each_other_and_one_host_with_nobody() -> None:
    """In a fleet of two the other host is the fleet; a fleet of one has nobody to compare
    with, so no host is ever named for being unlike the rest."""
    pair = world("a", "b")
    pair.steady(90, {"a": 0.3, "b": 1.0})
    assert set(pair.state.named) == {"b"}
    alone = world("a")
    alone.steady(90, {"a": 1.0})
    assert alone.of(LyingHostNamed) == []
    look = alone.state.hosts["a"].last
    assert look is not None and not look.judged and look.fleet_zero is None


def test_a_named_host_is_left_out_of_the_fleet_s_rate() -> None:
    """The fleet's rate is the median of the hosts not named: a liar does not move it."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    assert w.state.fleet_zero == pytest.approx(0.3, abs=0.01)
    look = w.state.hosts["h1"].last
    assert look is not None and look.fleet_zero == pytest.approx(0.3, abs=0.01)


def test_a_new_worker_or_counts_that_go_back_start_the_window_afresh() -> None:
    """Another pid counts from 0: its first look has no window, and nothing of the old
    worker's tasks is held against it."""
    w = world()
    w.steady(30, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    w.workers["h1"] = Worker(pid=200, machine="h1")
    w.steady(5, dict.fromkeys(w.names, 0.3))
    look = w.state.hosts["h1"].last
    assert look is not None and look.recent == Counts() and look.span_s == 0.0
    assert samples(w, "h1") == 1
    w.steady(5, dict.fromkeys(w.names, 0.3))
    assert samples(w, "h1") == 2
    w.workers["h1"].scored = 10  # counts that go back (a worker that restarted its count)
    w.look()
    assert samples(w, "h1") == 1


def samples(w: World, name: str) -> int:
    """How many samples of ``name`` the core keeps."""
    return len(w.state.hosts[name].samples)


def test_a_slow_host_s_window_stretches_back_until_it_holds_min_tasks() -> None:
    """At a few tasks a look, the window reaches back further than window_s."""
    w = world("a", "b")
    w.steady(120, {"a": 0.3, "b": 0.3}, tasks=20)
    look = w.state.hosts["a"].last
    assert look is not None
    assert look.recent.results >= POLICY.min_tasks and look.span_s > POLICY.window_s


def test_a_host_without_counts_is_never_looked_at_and_no_look_is_due() -> None:
    """A worker that reports no counts (not the AReaL worker) gives no evidence: nothing is
    looked at, and no look is due until one does."""
    hosts: dict[str, rewards.Worked] = {
        "a": health.new_host("a", 0.0),
        "b": Seen(pid=7, stats=health.WorkerStats()),
    }
    state, out = rewards.look(rewards.NONE, hosts, {"a": "a", "b": "b"}, now=1.0, policy=POLICY)
    assert out == [] and state.look_at is None
    assert not rewards.due(state, 100.0, POLICY)


def test_an_early_look_changes_nothing() -> None:
    """A look before look_at (an early wake-up) is harmless."""
    w = world()
    w.steady(10, dict.fromkeys(w.names, 0.3))
    before = w.state
    assert before.look_at == w.now + LOOK_S
    state, out = rewards.look(
        before, w.hosts(), {n: n for n in w.names}, now=w.now + 1, policy=POLICY
    )
    assert (state, out) == (before, [])


# --- most of the fleet at once ------------------------------------------------------------------


def test_most_of_the_fleet_out_of_line_with_its_past_is_one_signature_and_no_name() -> None:
    """Three of four hosts go to 100 % zeros at once after a healthy spell: one fleet-wide
    signature, and no host named (no single host is to blame)."""
    w = world()
    w.steady(120, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 1.0, "h1": 1.0, "h2": 1.0, "h3": 0.3})
    [(_, found)] = w.of(RewardSignatureFound)
    assert isinstance(found, RewardSignatureFound)
    assert found.kinds == ("zero",) and found.hosts == ("h0", "h1", "h2")
    assert "3 of 4 hosts" in found.reason
    assert w.of(LyingHostNamed) == []
    assert rewards.to_move(w.state, POLICY) == []


def test_a_fleet_that_scores_nothing_from_the_start_is_a_signature_too() -> None:
    """With no past to compare with, a fleet in which nothing scores (every result 0 or an
    error) is still one signature."""
    w = world()
    w.steady(60, dict.fromkeys(w.names, 1.0))
    [(_, found)] = w.of(RewardSignatureFound)
    assert isinstance(found, RewardSignatureFound) and len(found.hosts) == 4


def test_the_signature_clears_once_the_rates_are_back_for_clear_s() -> None:
    """The signature ends when most hosts are back in line with their past for clear_s; the
    baselines did not learn the lie meanwhile."""
    w = world()
    w.steady(120, dict.fromkeys(w.names, 0.3))
    w.steady(30, dict.fromkeys(w.names, 1.0))
    assert w.state.signature is not None
    learnt = w.state.hosts["h0"].baseline
    assert learnt.zero_rate == pytest.approx(0.3)
    w.steady(30, dict.fromkeys(w.names, 1.0))
    assert w.state.hosts["h0"].baseline == learnt
    w.steady(50, dict.fromkeys(w.names, 0.3))
    assert signed(w)
    w.steady(30, dict.fromkeys(w.names, 0.3))
    assert not signed(w)
    [(_, cleared)] = w.of(RewardSignatureCleared)
    assert isinstance(cleared, RewardSignatureCleared)


def signed(w: World) -> bool:
    """A fleet-wide signature stands."""
    return w.state.signature is not None


def test_an_operator_takes_the_rates_now_as_normal() -> None:
    """``accepted`` (unfreeze) ends the signature and starts every host's past afresh, so the
    same rates do not trip it again."""
    w = world()
    w.steady(120, dict.fromkeys(w.names, 0.3))
    w.steady(60, dict.fromkeys(w.names, 0.9))
    assert w.state.signature is not None
    w.state, out = rewards.accepted(w.state)
    assert [type(o) for o in out] == [RewardSignatureCleared]
    assert all(h.baseline == Counts() for h in w.state.hosts.values())
    w.steady(300, dict.fromkeys(w.names, 0.9))
    assert w.state.signature is None and len(w.of(RewardSignatureFound)) == 1
    assert rewards.accepted(w.state)[1] == []


# --- what Fleet tells it --------------------------------------------------------------------


def test_a_host_moved_off_its_machine_leaves_the_machine_held() -> None:
    """``moved``: the machine is held for the lie (until undrained), the host starts afresh,
    keeping its own past."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    baseline = w.state.hosts["h1"].baseline
    state = rewards.moved(w.state, "h1")
    assert state.named == {} and set(state.held) == {"h1"}
    assert state.hosts["h1"].samples == () and state.hosts["h1"].baseline == baseline
    assert rewards.undrained(state, "h1").held == {}
    assert rewards.undrained(state, "other") is state


def test_a_named_host_that_runs_elsewhere_now_is_cleared() -> None:
    """A named host whose shard another machine serves (a failover) is no longer named: the
    lie was its machine's."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    w.workers["h1"] = Worker(pid=300, machine="spare")
    w.steady(5, dict.fromkeys(w.names, 0.3))
    [(_, cleared)] = w.of(LyingHostCleared)
    assert isinstance(cleared, LyingHostCleared) and "now served by spare" in cleared.reason


def test_not_moved_is_said_once() -> None:
    """A named host whose shard cannot be moved is said to stay, once."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    state, out = rewards.not_moved(w.state, "h1", "no spare")
    assert [type(o) for o in out] == [LyingHostKept]
    assert rewards.not_moved(state, "h1", "no spare") == (state, [])


def test_with_moves_off_a_named_host_is_kept_at_once() -> None:
    """``move = false``: named and said to keep serving in the same look; none to move."""
    w = world(policy=RewardsPolicy(move=False))
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    [(named_at, _)] = w.of(LyingHostNamed)
    [(kept_at, kept)] = w.of(LyingHostKept)
    assert (
        kept_at == named_at and isinstance(kept, LyingHostKept) and "moves are off" in kept.reason
    )
    assert rewards.to_move(w.state, w.policy) == []


def test_a_host_that_leaves_is_forgotten() -> None:
    """A host that left the fleet takes its evidence and its name with it."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    state = rewards.forget(w.state, "h1")
    assert "h1" not in state.hosts and state.named == {}
    assert rewards.forget(state, "h1") is state


def test_rewards_not_judged_clears_every_verdict() -> None:
    """``window_s = 0`` (a reload): the names and the signature end, said; the held machines
    stay held (an operator undrains them)."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    state = rewards.moved(w.state, "h1")
    w.state = replace(state, named=w.state.named)
    off = RewardsPolicy(window_s=0.0)
    assert rewards.due(w.state, w.now, off)
    w.policy = off
    out = w.look()
    assert [type(o) for o in out] == [LyingHostCleared]
    assert w.state.named == {} and w.state.hosts == {} and set(w.state.held) == {"h1"}
    assert not rewards.due(w.state, w.now, off)


# --- no false trip ---------------------------------------------------------------------------

#: Fleet zero rates the tolerance separates a liar from +-30 % at: above about 65 %, a host
#: at +30 % is too near 100 % to tell from one that scores nothing (docs/BEHAVIOUR.md).
FLEET_RATES = (0.0, 0.05, 0.3, 0.5, 0.65)


def spread(rate: float, n: int, worst: bool) -> dict[str, float]:
    """``n`` hosts within +-30 % of ``rate``: evenly spread, or the worst case (one at +30 %,
    every other one at -30 %, so the fleet's median is as far from it as it can be)."""
    if worst:
        return {f"h{i}": rate * (1.3 if i == 0 else 0.7) for i in range(n)}
    return {f"h{i}": rate * (0.7 + 0.6 * i / (n - 1)) for i in range(n)}


@pytest.mark.parametrize("rate", FLEET_RATES)
@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("worst", [False, True], ids=["even", "worst"])
def test_no_false_trip_in_a_30_minute_healthy_run_with_hosts_30_percent_apart(
    rate: float, n: int, worst: bool
) -> None:
    """30 minutes of random tasks, hosts +-30 % apart in zero rate (evenly, or one at +30 %
    against all others at -30 %): nobody named, no signature."""
    rates = spread(rate, n, worst)
    w = World(list(rates), seed=hash((rate, n, worst)) % 2**32)
    w.run(30 * 60, rates)
    assert w.said == []


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rate=st.floats(0.0, 0.6),
    offsets=st.lists(st.floats(-0.3, 0.3), min_size=2, max_size=8),
    tasks_per_s=st.sampled_from([2.0, 10.0, 40.0]),
)
def test_no_false_trip_for_any_healthy_fleet_within_30_percent(
    seed: int, rate: float, offsets: list[float], tasks_per_s: float
) -> None:
    """Any fleet whose hosts sit within +-30 % of a zero rate up to 60 %, at any traffic:
    nobody named and no signature in 10 minutes."""
    rates = {f"h{i}": rate * (1 + off) for i, off in enumerate(offsets)}
    w = World(list(rates), seed=seed)
    w.run(10 * 60, rates, tasks_per_s=tasks_per_s)
    assert w.said == []


@pytest.mark.parametrize(
    ("start", "end"), [(0.6, 0.2), (0.3, 0.45)], ids=["learning", "harder_data"]
)
def test_a_fleet_whose_rate_drifts_together_slowly_trips_nothing(start: float, end: float) -> None:
    """A run's zero rate falls as the model learns, or rises slowly as its data gets
    harder, on every host alike: over 30 minutes neither names a host nor makes a
    signature (each host's past follows it)."""
    w = world(seed=7)
    looks = round(30 * 60 / LOOK_S)
    for i in range(looks):
        rate = start + (end - start) * i / looks
        for name in w.names:
            w.draw(name, 30.0, rate)
        w.look()
    assert w.said == []


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.6])
@pytest.mark.parametrize("tasks_per_s", [10.0, 30.0])
def test_a_zero_scoring_host_is_named_within_60_s(rate: float, tasks_per_s: float) -> None:
    """After a healthy spell, one host of four starts scoring everything 0: named within
    60 s of its first zero, whatever the fleet's zero rate up to 60 %."""
    w = world(seed=3)
    healthy = dict.fromkeys(w.names, rate)
    w.run(120, healthy, tasks_per_s)
    began = w.now
    w.run(60, {**healthy, "h1": 1.0}, tasks_per_s)
    [(at, named)] = w.of(LyingHostNamed)
    assert isinstance(named, LyingHostNamed) and named.host == "h1"
    assert at - began <= 60


def names_of(items: Iterable[tuple[float, Said]]) -> list[str]:
    """The hosts named, in order."""
    return [s.host for _, s in items if isinstance(s, LyingHostNamed)]


def test_two_liars_among_ten_are_both_named() -> None:
    """Two hosts of ten scoring 0 at once: not most of the fleet, so each is named (the
    median of the others is not moved by the other liar)."""
    w = world(*(f"h{i}" for i in range(10)), seed=5)
    healthy = dict.fromkeys(w.names, 0.3)
    w.run(120, healthy)
    w.run(60, {**healthy, "h3": 1.0, "h7": 1.0})
    assert sorted(names_of(w.said)) == ["h3", "h7"]
    assert w.of(RewardSignatureFound) == []


def test_during_a_signature_no_host_is_named_even_out_of_line_with_the_fleet() -> None:
    """Three hosts move from 10 % to 50 % zeros together (a signature) while the fourth
    scores nothing: out of line with the fleet too, but a shared cause holds, so no one host
    is named while it lasts."""
    w = world()
    w.steady(120, dict.fromkeys(w.names, 0.1))
    w.steady(90, {"h0": 0.5, "h1": 0.5, "h2": 0.5, "h3": 1.0})
    assert w.state.signature is not None and w.of(LyingHostNamed) == []
    look = w.state.hosts["h3"].last
    assert look is not None and look.out == ("zero",)
    assert w.state.hosts["h3"].out_since is None


def test_a_fleet_whose_results_all_fail_at_once_is_an_error_signature() -> None:
    """Every host's results turn to errors at once (a reward module gone from the deploy):
    one signature of the error kind."""
    w = world()
    w.steady(120, dict.fromkeys(w.names, 0.3))
    for _ in range(12):
        for name in w.names:
            w.finish(name, 150, 0.3, error_rate=1.0)
        w.look()
    [(_, found)] = w.of(RewardSignatureFound)
    assert isinstance(found, RewardSignatureFound) and found.kinds == ("error",)
    assert "error rate 100%" in found.reason


def test_rewards_turned_off_during_a_signature_end_it() -> None:
    """``window_s = 0`` while a signature stands: it is said to end."""
    w = world()
    w.steady(60, dict.fromkeys(w.names, 1.0))
    assert w.state.signature is not None
    w.policy = RewardsPolicy(window_s=0.0)
    assert [type(o) for o in w.look()] == [RewardSignatureCleared]
    assert w.state.signature is None


def test_a_named_host_missing_from_a_look_is_cleared() -> None:
    """A look that no longer has a named host (it left) clears its name."""
    w = world()
    w.steady(30, dict.fromkeys(w.names, 0.3))
    w.steady(60, {"h0": 0.3, "h1": 1.0, "h2": 0.3, "h3": 0.3})
    del w.workers["h1"]
    w.steady(5, {"h0": 0.3, "h2": 0.3, "h3": 0.3})
    [(_, cleared)] = w.of(LyingHostCleared)
    assert isinstance(cleared, LyingHostCleared) and cleared.reason == "left the fleet"
