"""Rewards that lie: a host whose worker "succeeds" with a score of 0, or fails its tasks, far
more often than the rest of the fleet (a verifier dependency gone from that machine: sandbox
clients score a connection error as 0), and most of the fleet doing so at once (a deploy, a
shared dependency). A frozen value and pure functions of it, like ``signatures.py``.

Rules:

1. The evidence is the workers' own counts. Every heartbeat of the AReaL worker carries its
   cumulative ``completed`` (scored results), ``errors`` (error results) and ``semantic_zero``
   (scored exactly 0). Every LOOK_S each host's counts are sampled; its recent tasks are the
   difference between the newest sample and the last one at least ``window_s`` older (older
   still while that holds fewer than ``min_tasks`` results, up to MAX_WINDOW_S). Another
   pid (a new worker counts from 0), another machine, or counts that go back start afresh.
2. One host out of line with the fleet. Its zero rate (zero / scored) and its error rate
   (errors / results) are each compared with the median of the other judged hosts' (hosts
   named as lying left out): out of line when above ``tolerance`` times the fleet's rate plus
   ABS_MARGIN (but never above SCORE_LOSS of the way from it to 100 %) by at least Z_MIN
   standard errors. The shards hash task ids, so every shard's mix is alike: a healthy host
   differs from the fleet by chance and by a few tens of percent (a host 30 % above a fleet
   whose others are all 30 % below is at 1.86 times their rate, under the default 2); a host
   with fewer than ``min_tasks`` results (scored ones, for its zero rate) is not judged.
3. Hysteresis. Out of line at every judged look for ``sustain_s``: the host is named, once.
   A named host back in line at every judged look for ``clear_s`` is cleared. A look with
   too few tasks is evidence neither way.
4. Most of the fleet at once is one cause, not many liars. Each host's rates are also
   compared (the same test) with its own past: a baseline of its earlier in-line tasks,
   decaying by half every BASELINE_HALF_LIFE_S; and a window in which nothing scored (at
   least ``min_tasks`` results, none above 0) is out of line whatever the past. When
   more than half of the hosts judged so are out of line for ``sustain_s``, that is one
   fleet-wide signature: said once, no host named while it lasts, nothing moved or
   restarted. It clears once that is no longer so for ``clear_s``, or when an operator
   takes the rates now as the new normal (``unfreeze``). The baselines stand still while a
   signature or a name says the rates are wrong, so a lie never becomes a host's normal.
5. A named host is not ready (``Fleet.all_ready``, the status, the page), and is never
   restarted for it: a restart brings no missing dependency back. ``Fleet`` moves its shard
   where it can (a free spare: ``moved``), and the machine is held until an operator
   ``undrain``s it; where it cannot, the host stays named and serving (``not_moved`` says so
   once). A host named on a machine it no longer runs on is cleared.

Nothing here reads a clock: ``now`` is passed in; ``look_at`` is when the next look is due.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from typing import Final, Protocol

from supervisor.health import WorkerStats
from supervisor.policies import RewardsPolicy
from supervisor.records import record
from supervisor.vocabulary import (
    LyingHostCleared,
    LyingHostKept,
    LyingHostNamed,
    RewardSignatureCleared,
    RewardSignatureFound,
    Said,
)

#: How often the counts are sampled and judged: a heartbeat a second would cost a look at a
#: thousand hosts a second, and a verdict needs seconds of tasks anyway.
LOOK_S: Final = 5.0
#: A window is stretched back at most this far for a slow host to reach ``min_tasks`` (at a
#: task a second, 200 s); older samples are dropped.
MAX_WINDOW_S: Final = 600.0
#: Standard errors above the tolerance before a rate is out of line: a thousand hosts looked
#: at every 5 s for a month is ~5e8 tests, and 4 sigma one-sided is 3e-5 each: with the
#: tolerance's own margin (a healthy host sits well below it) no chance trip is expected.
Z_MIN: Final = 4.0
#: A rate up to this many points above ``tolerance`` times the fleet's is in line: at a fleet
#: rate near 0 (errors, an easy task), a handful of zeros must not be twice "nothing".
ABS_MARGIN: Final = 0.05
#: ...and a rate is out of line once it is this far from the fleet's towards 100 %, whatever
#: ``tolerance`` says: a host that lost three quarters of the non-zero scores its shard's mix
#: should give is lying, at any fleet rate.
SCORE_LOSS: Final = 0.75
#: A host's own past fades by half in this long: a run's rates drift as the model learns.
BASELINE_HALF_LIFE_S: Final = 1800.0
#: More than this share of the hosts judged against their past, out of line together, is
#: one fleet-wide cause.
MOST: Final = 0.5
#: Kinds of lie: too many zero scores, too many error results.
ZERO: Final = "zero"
ERROR: Final = "error"


@record(kw_only=False)
class Sample:
    """A worker's cumulative counts as its heartbeat said them at a look."""

    at: float
    pid: int
    machine: str
    scored: int
    errors: int
    zero: int


@record(kw_only=False)
class Counts:
    """Results over some span: scored ones, those that scored 0 among them, error results
    (floats: a baseline decays)."""

    scored: float = 0.0
    zero: float = 0.0
    errors: float = 0.0

    @property
    def results(self) -> float:
        """Every result, scored or an error."""
        return self.scored + self.errors

    @property
    def zero_rate(self) -> float | None:
        """The share of scored results that scored 0 (None: none scored)."""
        return self.zero / self.scored if self.scored > 0 else None

    @property
    def error_rate(self) -> float | None:
        """The share of results that were errors (None: no result)."""
        return self.errors / self.results if self.results > 0 else None

    def plus(self, other: Counts, keep: float = 1.0) -> Counts:
        """``keep`` of these and all of ``other``."""
        return Counts(
            scored=self.scored * keep + other.scored,
            zero=self.zero * keep + other.zero,
            errors=self.errors * keep + other.errors,
        )


@record
class Look:
    """What one look found of one host (at ``HostRewards.looked_at``)."""

    #: Its recent tasks and the span they came in.
    recent: Counts
    span_s: float
    #: The fleet's rates it was compared with (None: no other host judged).
    fleet_zero: float | None = None
    fleet_error: float | None = None
    #: Kinds out of line with the fleet, and with its own past; judged at all (enough tasks
    #: and a fleet to compare with; a past to compare with).
    out: tuple[str, ...] = ()
    past_out: tuple[str, ...] = ()
    judged: bool = False
    past_judged: bool = False


@record
class HostRewards:
    """One host's samples, its own past and its verdict's clock."""

    samples: tuple[Sample, ...] = ()
    baseline: Counts = Counts()
    baseline_at: float | None = None
    #: Out of line at every judged look since (None: in line at the last one).
    out_since: float | None = None
    #: In line at every judged look since (None: out of line at the last one).
    in_since: float | None = None
    #: The last look that found tasks, and when.
    last: Look | None = None
    looked_at: float | None = None


@record
class Lie:
    """A host named as lying: on which machine, how, and the look that named it."""

    host: str
    machine: str
    kinds: tuple[str, ...]
    reason: str
    since_at: float


@record
class Signature:
    """Most of the fleet out of line with its own past at once."""

    kinds: tuple[str, ...]
    hosts: frozenset[str]
    reason: str
    since_at: float


@record
class Rewards:
    """Every host's evidence, the hosts named, the machines held for lying, the fleet-wide
    signature, and when to look next."""

    hosts: Mapping[str, HostRewards] = field(default_factory=dict)
    named: Mapping[str, Lie] = field(default_factory=dict)
    #: Named hosts whose shard could not be moved (said once, tried again at each look).
    kept: frozenset[str] = frozenset()
    #: Machine -> the lie it was moved away for (held until ``undrain``).
    held: Mapping[str, Lie] = field(default_factory=dict)
    signature: Signature | None = None
    #: Most hosts out of line with their past since (None: not at the last look).
    together_since: float | None = None
    #: The signature's hosts no longer out of line together since.
    apart_since: float | None = None
    #: The fleet's rates at the last look: the median of the judged hosts not named.
    fleet_zero: float | None = None
    fleet_error: float | None = None
    look_at: float | None = None


NONE: Final = Rewards()
_NEW_HOST: Final = HostRewards()


class Worked(Protocol):
    """What a look reads of a host (a ``health.Host``): its worker and the counts its last
    heartbeat reported."""

    @property
    def pid(self) -> int | None:
        """The host's current worker."""

    @property
    def stats(self) -> WorkerStats | None:
        """What that worker's last heartbeat said of its work."""


# --- queries ---------------------------------------------------------------------------------


def due(rewards: Rewards, now: float, policy: RewardsPolicy) -> bool:
    """A look is due at ``now``: its time came, or rewards are no longer judged and a verdict
    stands. (With no look due, none is until a worker reports its counts: ``Fleet`` asks.)"""
    if policy.window_s <= 0:
        return bool(rewards.named or rewards.signature or rewards.hosts)
    return rewards.look_at is not None and now >= rewards.look_at


def counts_in(stats: WorkerStats | None) -> tuple[int, int, int] | None:
    """The counts a look judges, as a heartbeat's figures carry them (the AReaL worker's
    ``completed``, ``errors``, ``semantic_zero``); None where one is missing."""
    if stats is None:
        return None
    scored, errors, zero = stats.completed, stats.errors, stats.semantic_zero
    if scored is None or errors is None or zero is None:
        return None
    return scored, errors, zero


def reports_counts(stats: WorkerStats | None) -> bool:
    """A heartbeat's figures carry the counts a look judges."""
    return counts_in(stats) is not None


def to_move(rewards: Rewards, policy: RewardsPolicy) -> list[str]:
    """Named hosts whose shard ``Fleet`` should try to move now (none while a fleet-wide
    signature says the cause is shared, or when moves are off)."""
    if not policy.move or rewards.signature is not None:
        return []
    return sorted(rewards.named)


def threshold(fleet_rate: float, tolerance: float) -> float:
    """The highest rate in line with ``fleet_rate`` (rule 2)."""
    return min(fleet_rate * tolerance + ABS_MARGIN, fleet_rate + SCORE_LOSS * (1 - fleet_rate))


def above(count: float, total: float, limit: float) -> bool:
    """``count`` of ``total`` is above the rate ``limit`` by at least Z_MIN standard errors
    (a binomial's, under the limit): a limit of 1 or more is never passed."""
    if total <= 0 or limit >= 1.0:
        return False
    excess = count - total * limit
    return excess > 0 and excess >= Z_MIN * math.sqrt(total * limit * (1.0 - limit))


def describe(kind: str, recent: Counts, fleet_rate: float | None, span_s: float) -> str:
    """``zero rate 100% (412 of 412 scored) vs the fleet's 31% over 30s``."""
    if kind == ZERO:
        rate, count, total, of = recent.zero_rate, recent.zero, recent.scored, "scored"
    else:
        rate, count, total, of = recent.error_rate, recent.errors, recent.results, "results"
    against = "no other host" if fleet_rate is None else f"the fleet's {_percent(fleet_rate)}"
    return (
        f"{kind} rate {_percent(rate)} ({count:.0f} of {total:.0f} {of}) vs {against}"
        f" over {span_s:.0f}s"
    )


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.0f}%"


# --- the look ----------------------------------------------------------------------------------


def look(
    rewards: Rewards,
    hosts: Mapping[str, Worked],
    machines: Mapping[str, str],
    *,
    now: float,
    policy: RewardsPolicy,
) -> tuple[Rewards, list[Said]]:
    """Sample every host's counts, judge each against the fleet and against its own past,
    and say who is named, who is cleared, and whether most of the fleet moved together."""
    if policy.window_s <= 0:
        return _off(rewards)
    if rewards.look_at is not None and now < rewards.look_at:
        return rewards, []  # an early wake-up
    # Every host's samples first: the fleet's rates need every window before any verdict.
    samples = {
        name: _sampled(
            rewards.hosts.get(name, _NEW_HOST).samples, host, machines[name], now, policy
        )
        for name, host in hosts.items()
    }
    windows = {name: _window(kept, now, policy) for name, kept in samples.items()}
    zero_rates = _rates(windows, rewards.named, policy, ZERO)
    error_rates = _rates(windows, rewards.named, policy, ERROR)
    # Then each host's look, its verdict's clock and its past, in one new value each (a
    # thousand hosts every LOOK_S).
    states: dict[str, HostRewards] = {}
    looks: dict[str, Look] = {}
    for name, kept in samples.items():
        before = rewards.hosts.get(name, _NEW_HOST)
        window = windows[name]
        if window is None:
            states[name] = before if kept is before.samples else replace(before, samples=kept)
            continue
        found = looks[name] = _judge(
            name, *window, before.baseline, zero_rates, error_rates, policy
        )
        states[name] = _next(rewards, name, before, kept, found, now)
    rewards = replace(
        rewards,
        hosts=states,
        fleet_zero=_median(zero_rates[0]),
        fleet_error=_median(error_rates[0]),
        # No worker reports its counts: nothing to look at until one does.
        look_at=now + LOOK_S if looks else None,
    )
    out: list[Said] = []
    rewards = _together(rewards, looks, now, policy, out)
    rewards = _names(rewards, looks, machines, now, policy, out)
    return rewards, out


def _off(rewards: Rewards) -> tuple[Rewards, list[Said]]:
    """``window_s`` is 0: no verdict stands, nothing is kept."""
    out: list[Said] = []
    why = "rewards are not judged (rewards.window_s = 0)"
    for name, lie in sorted(rewards.named.items()):
        out.append(LyingHostCleared(host=name, machine=lie.machine, reason=why))
    if rewards.signature is not None:
        out.append(RewardSignatureCleared(reason=why))
    return replace(NONE, held=rewards.held), out


def _sampled(
    samples: tuple[Sample, ...], host: Worked, machine: str, now: float, policy: RewardsPolicy
) -> tuple[Sample, ...]:
    """``samples`` and one of ``host``'s counts now (none: its worker reports none, or it has
    none); a new worker, another machine, or counts that went back start afresh."""
    counts = counts_in(host.stats)
    if host.pid is None or counts is None:
        return samples
    sample = Sample(now, host.pid, machine, *counts)
    if not samples or not _continues(samples[-1], sample):
        return (sample,)
    oldest, first = now - max(MAX_WINDOW_S, policy.window_s), 0
    while samples[first].at < oldest:
        first += 1  # (the newest is from the previous look: never dropped)
    return (*samples[first:], sample)


def _continues(before: Sample, after: Sample) -> bool:
    """``after`` counts on from ``before``: the same worker on the same machine, no count
    going back."""
    return (
        before.pid == after.pid
        and before.machine == after.machine
        and after.scored >= before.scored
        and after.errors >= before.errors
        and after.zero >= before.zero
    )


def _window(
    samples: tuple[Sample, ...], now: float, policy: RewardsPolicy
) -> tuple[Counts, float] | None:
    """The host's recent tasks and their span (rule 1); None when it was not sampled now."""
    if not samples or samples[-1].at != now:
        return None
    newest = start = samples[-1]
    for sample in reversed(samples[:-1]):
        start = sample
        results = newest.scored + newest.errors - sample.scored - sample.errors
        if now - sample.at >= policy.window_s and results >= policy.min_tasks:
            break
    recent = Counts(
        scored=newest.scored - start.scored,
        zero=newest.zero - start.zero,
        errors=newest.errors - start.errors,
    )
    return recent, now - start.at


#: The judged hosts' rates of one kind, sorted, and where each host's is among them.
_Rates = tuple[list[float], dict[str, int]]


def _rates(
    windows: Mapping[str, tuple[Counts, float] | None],
    named: Mapping[str, Lie],
    policy: RewardsPolicy,
    kind: str,
) -> _Rates:
    """The rates of ``kind`` of every host judged on it and not named, sorted."""
    pairs: list[tuple[float, str]] = []
    for name, window in windows.items():
        if window is None or name in named:
            continue
        count, total = _of(kind, window[0])
        if total >= policy.min_tasks:
            pairs.append((count / total, name))
    pairs.sort()
    return [rate for rate, _ in pairs], {name: i for i, (_, name) in enumerate(pairs)}


def _of(kind: str, counts: Counts) -> tuple[float, float]:
    """The count and the total a rate of ``kind`` is taken over."""
    if kind == ZERO:
        return counts.zero, counts.scored
    return counts.errors, counts.results


def _median(values: Sequence[float], without: int | None = None) -> float | None:
    """The median of sorted ``values``, the one at index ``without`` left out (None: none)."""
    n = len(values) - (without is not None)
    if n <= 0:
        return None

    def at(k: int) -> float:
        return values[k + 1] if without is not None and k >= without else values[k]

    middle = n // 2
    return at(middle) if n % 2 else (at(middle - 1) + at(middle)) / 2


def _judge(
    name: str,
    recent: Counts,
    span: float,
    baseline: Counts,
    zero_rates: _Rates,
    error_rates: _Rates,
    policy: RewardsPolicy,
) -> Look:
    """One host's look: against the fleet (rule 2), against its own past (rule 4). (Written
    out per kind: it runs for every host at every look.)"""
    least, tolerance = policy.min_tasks, policy.tolerance
    fleet_zero = _median(zero_rates[0], zero_rates[1].get(name))
    fleet_error = _median(error_rates[0], error_rates[1].get(name))
    out: list[str] = []
    past_out: list[str] = []
    judged = past_judged = False
    if recent.scored >= least:
        if fleet_zero is not None:
            judged = True
            if above(recent.zero, recent.scored, threshold(fleet_zero, tolerance)):
                out.append(ZERO)
        if baseline.scored >= least:
            past_judged = True
            past = threshold(baseline.zero / baseline.scored, tolerance)
            if above(recent.zero, recent.scored, past):
                past_out.append(ZERO)
    results = recent.results
    if results >= least:
        if fleet_error is not None:
            judged = True
            if above(recent.errors, results, threshold(fleet_error, tolerance)):
                out.append(ERROR)
        if baseline.results >= least:
            past_judged = True
            past = threshold(baseline.errors / baseline.results, tolerance)
            if above(recent.errors, results, past):
                past_out.append(ERROR)
        if recent.scored == recent.zero:
            past_judged = True  # nothing scored: out of line whatever the past (rule 4)
            kind = ZERO if recent.scored > 0 else ERROR
            if kind not in past_out:
                past_out.append(kind)
    return Look(
        recent=recent,
        span_s=span,
        fleet_zero=fleet_zero,
        fleet_error=fleet_error,
        out=tuple(out),
        past_out=tuple(sorted(past_out)),
        judged=judged,
        past_judged=past_judged,
    )


def _next(
    rewards: Rewards,
    name: str,
    before: HostRewards,
    samples: tuple[Sample, ...],
    found: Look,
    now: float,
) -> HostRewards:
    """The host after a look: since when it has been out of line (or in line) at every
    judged look (rule 3), and its own past (rule 4): each in-line look adds the tasks of the
    step before the newest, one look late, so that the first tasks of a change (which the
    look that sees them may still find in line) are judged once more before they are
    learnt; nothing is learnt while a signature or a name says the rates are wrong."""
    out_since, in_since = before.out_since, before.in_since
    if found.judged and found.out:
        out_since, in_since = (now if out_since is None else out_since), None
    elif found.judged:
        out_since, in_since = None, (now if in_since is None else in_since)
    baseline, baseline_at = before.baseline, before.baseline_at
    if (
        rewards.signature is None
        and name not in rewards.named
        and not found.out
        and not found.past_out
        and len(samples) >= 3
    ):
        older, old = samples[-3], samples[-2]
        step = Counts(
            scored=old.scored - older.scored,
            zero=old.zero - older.zero,
            errors=old.errors - older.errors,
        )
        keep = 1.0 if baseline_at is None else 0.5 ** ((now - baseline_at) / BASELINE_HALF_LIFE_S)
        baseline, baseline_at = baseline.plus(step, keep), now
    return HostRewards(
        samples=samples,
        baseline=baseline,
        baseline_at=baseline_at,
        out_since=out_since,
        in_since=in_since,
        last=found,
        looked_at=now,
    )


def _together(
    rewards: Rewards, looks: Mapping[str, Look], now: float, policy: RewardsPolicy, out: list[Said]
) -> Rewards:
    """Most hosts out of line with their own past at once: one signature (rule 4)."""
    judged = [name for name, look in looks.items() if look.past_judged]
    moved = sorted(name for name in judged if looks[name].past_out)
    if not judged:
        return rewards  # no evidence either way: the trainer is idle
    signature = rewards.signature
    if len(moved) > MOST * len(judged):
        since = rewards.together_since if rewards.together_since is not None else now
        rewards = replace(rewards, together_since=since, apart_since=None)
        kinds = tuple(sorted({k for name in moved for k in looks[name].past_out}))
        if signature is not None:
            return replace(
                rewards, signature=replace(signature, hosts=signature.hosts | set(moved))
            )
        if now - since < policy.sustain_s:
            return rewards
        reason = (
            f"{len(moved)} of {len(judged)} hosts out of line with their own past at once"
            f" ({', '.join(kinds)} rate): "
            + "; ".join(f"{name} {_past(looks[name])}" for name in moved[:3])
            + ("; ..." if len(moved) > 3 else "")
        )
        signature = Signature(kinds=kinds, hosts=frozenset(moved), reason=reason, since_at=now)
        out.append(RewardSignatureFound(kinds=kinds, hosts=tuple(moved), reason=reason))
        return replace(rewards, signature=signature)
    rewards = replace(rewards, together_since=None)
    if signature is None:
        return rewards
    apart = rewards.apart_since if rewards.apart_since is not None else now
    if now - apart < policy.clear_s:
        return replace(rewards, apart_since=apart)
    out.append(
        RewardSignatureCleared(
            reason=f"{len(moved)} of {len(judged)} hosts out of line with their own past"
            f" for {policy.clear_s:g}s"
        )
    )
    return replace(rewards, signature=None, apart_since=None)


def _past(look: Look) -> str:
    """What a host's look says of its recent rates, for a signature's reason."""
    parts = []
    if ZERO in look.past_out:
        parts.append(f"zero rate {_percent(look.recent.zero_rate)}")
    if ERROR in look.past_out:
        parts.append(f"error rate {_percent(look.recent.error_rate)}")
    return ", ".join(parts)


def _names(
    rewards: Rewards,
    looks: Mapping[str, Look],
    machines: Mapping[str, str],
    now: float,
    policy: RewardsPolicy,
    out: list[Said],
) -> Rewards:
    """Name the hosts out of line for ``sustain_s``, clear those in line for ``clear_s``, and
    those that moved to another machine (rules 3 and 5)."""
    named = dict(rewards.named)
    hosts = dict(rewards.hosts)
    kept = set(rewards.kept)
    for name, lie in sorted(rewards.named.items()):
        state = hosts.get(name)
        why = None
        if name not in machines:
            why = "left the fleet"
        elif machines[name] != lie.machine:
            why = f"now served by {machines[name]}"
        elif (back := _back_in_line(state, now, policy)) is not None:
            why = f"in line with the fleet for {policy.clear_s:g}s: {_rates_text(back)}"
        if why is not None:
            del named[name]
            out.append(LyingHostCleared(host=name, machine=lie.machine, reason=why))
    for name, state in sorted(hosts.items()):
        look = looks.get(name)
        if name in named or look is None or not look.out or state.out_since is None:
            continue
        if rewards.signature is not None:
            # A shared cause: no one host is to blame, and its evidence starts again after.
            hosts[name] = replace(state, out_since=None)
            continue
        if now - state.out_since < policy.sustain_s:
            continue
        reason = "; ".join(
            describe(
                kind,
                look.recent,
                look.fleet_zero if kind == ZERO else look.fleet_error,
                look.span_s,
            )
            for kind in look.out
        )
        lie = Lie(host=name, machine=machines[name], kinds=look.out, reason=reason, since_at=now)
        named[name] = lie
        out.append(LyingHostNamed(host=name, machine=lie.machine, kinds=lie.kinds, reason=reason))
        if not policy.move:
            kept.add(name)
            why = "moves are off (rewards.move = false): it keeps serving, named"
            out.append(LyingHostKept(host=name, machine=lie.machine, reason=why))
    return replace(rewards, named=named, hosts=hosts, kept=frozenset(kept & named.keys()))


def _back_in_line(state: HostRewards | None, now: float, policy: RewardsPolicy) -> Look | None:
    """The last look of a named host in line at every judged look for ``clear_s`` (rule 3);
    None if it is not."""
    if state is None or state.last is None or not state.last.judged or state.in_since is None:
        return None
    return state.last if now - state.in_since >= policy.clear_s else None


def _rates_text(look: Look) -> str:
    """``zero rate 31% (fleet 30%), error rate 0% (fleet 0%)``."""
    return (
        f"zero rate {_percent(look.recent.zero_rate)} (fleet {_percent(look.fleet_zero)}),"
        f" error rate {_percent(look.recent.error_rate)} (fleet {_percent(look.fleet_error)})"
    )


# --- what Fleet tells it ---------------------------------------------------------------------


def moved(rewards: Rewards, name: str) -> Rewards:
    """``name``'s shard was moved off the machine it was named on: the machine is held for
    it (until ``undrain``), and the host starts afresh where it runs now."""
    lie = rewards.named[name]
    named = {n: v for n, v in rewards.named.items() if n != name}
    # (a named host was looked at: it has evidence)
    hosts = {**rewards.hosts, name: replace(_NEW_HOST, baseline=rewards.hosts[name].baseline)}
    return replace(
        rewards,
        named=named,
        hosts=hosts,
        kept=rewards.kept - {name},
        held={**rewards.held, lie.machine: lie},
    )


def not_moved(rewards: Rewards, name: str, why: str) -> tuple[Rewards, list[Said]]:
    """``name``'s shard cannot be moved now: it stays named and serving; said once."""
    if name in rewards.kept:
        return rewards, []
    lie = rewards.named[name]
    said: list[Said] = [LyingHostKept(host=name, machine=lie.machine, reason=why)]
    return replace(rewards, kept=rewards.kept | {name}), said


def undrained(rewards: Rewards, machine: str) -> Rewards:
    """An operator put ``machine`` back in the pool: it is held for lying no more."""
    if machine not in rewards.held:
        return rewards
    return replace(rewards, held={m: v for m, v in rewards.held.items() if m != machine})


def forget(rewards: Rewards, name: str) -> Rewards:
    """``name`` left the fleet."""
    if name not in rewards.hosts and name not in rewards.named:
        return rewards
    return replace(
        rewards,
        hosts={n: v for n, v in rewards.hosts.items() if n != name},
        named={n: v for n, v in rewards.named.items() if n != name},
        kept=rewards.kept - {name},
    )


def accepted(rewards: Rewards) -> tuple[Rewards, list[Said]]:
    """An operator takes the rates now as the new normal (``unfreeze``): the fleet-wide
    signature ends and every host's past starts again from here."""
    hosts = {
        name: replace(state, baseline=Counts(), baseline_at=None)
        for name, state in rewards.hosts.items()
    }
    out: list[Said] = []
    if rewards.signature is not None:
        out.append(RewardSignatureCleared(reason="operator unfreeze: the rates now are normal"))
    return replace(rewards, hosts=hosts, signature=None, together_since=None), out
