"""The common-mode freeze (fleet rules 2 and 3): when enough of the hosts that should run fall
silent together, the cause is shared (the filesystem, the network, this node's mount), not
theirs, and restarts for silence are held until heartbeats return or an operator thaws.

A frozen value and pure functions of it: one look at every host (``survey``) and the verdict
(``assess``). ``Fleet`` decides when to look and feeds the hosts the outcome.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from supervisor.health import WANT_RUNNING_STATES, Host, HostState
from supervisor.records import record
from supervisor.vocabulary import FleetPolicy


@record
class Freeze:
    """The freeze state of the fleet."""

    frozen: bool = False
    reason: str = ""
    since_at: float | None = None
    #: The hosts whose silence froze the fleet.
    hosts: frozenset[str] = frozenset()
    #: Silences that began before this instant do not count (an operator thawed over them).
    ignore_before_at: float = -math.inf


@record(kw_only=False)
class FreezeChange:
    """The fleet froze (``frozen=True``) or thawed."""

    frozen: bool
    reason: str


def threshold(expected: int, policy: FleetPolicy) -> int:
    """How many hosts must fall silent together to freeze a fleet of ``expected``."""
    return max(2, math.ceil(policy.freeze_fraction * expected))


@record(kw_only=False)
class Survey:
    """What one look at every host tells the freeze (``survey``)."""

    #: Hosts that should have a worker running (the freeze's threshold counts them).
    expected: int
    #: Ready hosts silent for ``silent_after_s`` or longer, newest silence first.
    silent: list[Host]
    #: When the next ready host will cross the silence threshold, if nothing else happens.
    next_at: float | None


def survey(freeze: Freeze, hosts: Iterable[Host], now: float, silent_after_s: float) -> Survey:
    """How many hosts should run, which ready hosts are silent, and when the next one will
    be (the freeze's next assessment), in one pass over the fleet: a look costs O(hosts)
    once, not three times (docs/BENCHMARKS.md).
    """
    expected = 0
    silent: list[Host] = []
    next_at: float | None = None
    ignore_before_at = freeze.ignore_before_at
    ready = HostState.READY
    for h in hosts:
        state = h.state
        if state in WANT_RUNNING_STATES:
            expected += 1
        alive_at = h.alive_at
        if state is not ready or alive_at is None or alive_at < ignore_before_at:
            continue
        if now - alive_at >= silent_after_s:
            silent.append(h)
            continue
        crossing = _crossing_at(alive_at, now, silent_after_s)
        if next_at is None or crossing < next_at:
            next_at = crossing
    silent.sort(key=lambda h: h.alive_at or 0.0, reverse=True)
    return Survey(expected=expected, silent=silent, next_at=next_at)


def _crossing_at(alive_at: float, now: float, silent_after_s: float) -> float:
    """When a host not yet silent at ``now`` (heartbeat at ``alive_at``) will be: always
    after ``now``.

    In floating point ``alive_at + silent_after_s`` may round to ``now`` or below while
    ``now - alive_at`` is still short of ``silent_after_s`` (11.899283843798594 + 5 is
    16.899283843798592): such a host would be neither silent nor due, and no look would
    come until something else happened. The next representable time after ``now`` looks
    again.
    """
    crossing = alive_at + silent_after_s
    return crossing if crossing > now else math.nextafter(now, math.inf)


def assess(
    freeze: Freeze,
    hosts: Iterable[Host],
    now: float,
    policy: FleetPolicy,
    silent_after_s: float,
    *,
    surveyed: Survey | None = None,
) -> tuple[Freeze, FreezeChange | None]:
    """Freeze, thaw, or leave the fleet as it is, given every host at ``now`` (and
    ``surveyed``, their ``survey`` at ``now`` with this ``freeze``, if the caller has it).

    A ready host is "silent" once its heartbeat is ``silent_after_s`` old (half the stale
    threshold, so the freeze lands before any host's own restart deadline).
    """
    if surveyed is None:
        hosts = list(hosts)
        surveyed = survey(freeze, hosts, now, silent_after_s)
    expected = surveyed.expected
    needed = threshold(expected, policy)
    silent = surveyed.silent
    if not freeze.frozen:
        together = _largest_group(silent, policy.freeze_window_s)
        if expected < 2 or len(together) < needed:
            return freeze, None
        reason = (
            f"{len(together)}/{expected} hosts fell silent together (no heartbeat for"
            f" {silent_after_s:g}s): suspect the shared filesystem, the network or"
            " this node's mount, not the workers; restarts for silence are frozen"
        )
        names = frozenset(h.name for h in together)
        return replace(freeze, frozen=True, reason=reason, since_at=now, hosts=names), (
            FreezeChange(frozen=True, reason=reason)
        )
    hosts = list(hosts)
    # Hosts that fall silent while frozen are part of the same stall: the thaw waits for them.
    joined = freeze.hosts | {h.name for h in silent}
    if joined != freeze.hosts:
        freeze = replace(freeze, hosts=joined)
    # Only a heartbeat ends a host's part in the stall. A frozen host whose worker really
    # died is replaced, but its new worker writes through the same stalled filesystem:
    # until it beats, the host is as silent as before (counting it as recovered would thaw
    # the fleet, and restart every other stalled host, on the strength of one crash).
    still_silent = [
        h
        for h in hosts
        if h.name in freeze.hosts
        and h.state in WANT_RUNNING_STATES
        and not _beating(h, now, silent_after_s)
    ]
    if len(still_silent) >= needed:
        return freeze, None
    back = sum(1 for h in hosts if h.name in freeze.hosts and _beating(h, now, silent_after_s))
    reason = f"heartbeats returned ({back} of {len(freeze.hosts)} stalled hosts beating again)"
    return _thawed(freeze), FreezeChange(frozen=False, reason=reason)


def _beating(host: Host, now: float, silent_after_s: float) -> bool:
    """The host's current worker has beaten within ``silent_after_s``."""
    return host.alive_at is not None and now - host.alive_at < silent_after_s


def unfreeze(freeze: Freeze, now: float) -> tuple[Freeze, FreezeChange | None]:
    """An operator lifts the freeze; silences older than now stop counting."""
    thawed = replace(_thawed(freeze), ignore_before_at=now)
    if not freeze.frozen:
        return thawed, None
    return thawed, FreezeChange(frozen=False, reason="operator unfreeze")


def _thawed(freeze: Freeze) -> Freeze:
    return replace(freeze, frozen=False, reason="", since_at=None, hosts=frozenset())


def _largest_group(silent: list[Host], window_s: float) -> list[Host]:
    """The largest set of silent hosts whose last heartbeats lie within ``window_s``."""
    stamps = sorted(silent, key=lambda h: h.alive_at or 0.0)
    best: list[Host] = []
    start = 0
    for end, host in enumerate(stamps):
        while (host.alive_at or 0.0) - (stamps[start].alive_at or 0.0) > window_s:
            start += 1
        if end - start + 1 > len(best):
            best = stamps[start : end + 1]
    return best


@record
class Watch:
    """The freeze and when to look at the fleet for it next: ``Fleet``'s freeze state."""

    freeze: Freeze = Freeze()
    #: What the filesystem check said about the current freeze.
    finding: str | None = None
    #: Joined hosts in WANT_RUNNING_STATES, counted as they change (``survey``'s
    #: ``expected`` without the look).
    expected: int = 0
    #: A host changed state since the last look: look at the next batch's end.
    due: bool = False
    #: When the next ready host will cross the silence threshold (look then).
    look_at: float | None = None
    #: No more ready hosts than this are silent before ``look_at``; None: unknown. The look
    #: at every host that a state change calls for is skipped while too few hosts can be
    #: silent to freeze the fleet (``_no_freeze_possible``).
    silent_bound: int | None = None


def look(
    watch: Watch, hosts: Iterable[Host], now: float, policy: FleetPolicy, silent_after_s: float
) -> tuple[Watch, FreezeChange | None]:
    """Freeze, thaw or leave the fleet as it is. A change is the caller's to tell every host,
    then ``resurveyed`` says when to look next."""
    watch = replace(watch, due=False)
    if _no_freeze_possible(watch, now, policy):
        return watch, None
    hosts = list(hosts)
    surveyed = survey(watch.freeze, hosts, now, silent_after_s)
    freeze, change = assess(watch.freeze, hosts, now, policy, silent_after_s, surveyed=surveyed)
    if change is not None:
        return replace(watch, freeze=freeze, finding=None, silent_bound=None), change
    return replace(watch, look_at=surveyed.next_at, silent_bound=len(surveyed.silent)), None


def resurveyed(watch: Watch, hosts: Iterable[Host], now: float, silent_after_s: float) -> Watch:
    """When to look next, once a freeze or a thaw was told to every host (the freeze's
    ``ignore_before_at`` and the hosts may have changed)."""
    surveyed = survey(watch.freeze, hosts, now, silent_after_s)
    return replace(watch, look_at=surveyed.next_at, silent_bound=len(surveyed.silent))


def _no_freeze_possible(watch: Watch, now: float, policy: FleetPolicy) -> bool:
    """Too few hosts can be silent to freeze the fleet, so the look can be skipped.

    A state change (a crash among them) calls for an assessment, and at a thousand hosts
    looking at every one was most of what stood between a pushed exit and its relaunch
    (docs/BENCHMARKS.md). Between looks silence only shrinks (heartbeats, hosts leaving
    ``ready``) until the next crossing, except where ``silence_moved`` says otherwise; the
    threshold follows the hosts that should run.
    """
    return (
        not watch.freeze.frozen
        and watch.silent_bound is not None
        and (watch.look_at is None or now < watch.look_at)
        and watch.silent_bound < threshold(watch.expected, policy)
    )


def silence_moved(watch: Watch, alive_at: float, now: float, silent_after_s: float) -> Watch:
    """Keep the bound and the next crossing true for a host that became ready, or whose last
    heartbeat was moved back to ``alive_at`` (``survey``'s tests, host by host).

    A heartbeat from before an unfreeze, which ``survey`` leaves out, is taken as it comes:
    at worst an early wake-up or a full look, both harmless.
    """
    if now - alive_at >= silent_after_s:
        return replace(watch, silent_bound=None, due=True)  # silent already: look
    crossing = _crossing_at(alive_at, now, silent_after_s)
    if watch.look_at is None or crossing < watch.look_at:
        return replace(watch, look_at=crossing)
    return watch


def thawed_by_operator(watch: Watch, now: float) -> tuple[Watch, FreezeChange | None]:
    """An operator lifted the freeze (``unfreeze``)."""
    freeze, change = unfreeze(watch.freeze, now)
    if change is None:
        return replace(watch, freeze=freeze), None
    return replace(watch, freeze=freeze, finding=None, silent_bound=None), change


def counted(watch: Watch, before: HostState, after: HostState) -> Watch:
    """A host changed state: the count of hosts that should run follows, and a look is due."""
    delta = (after in WANT_RUNNING_STATES) - (before in WANT_RUNNING_STATES)
    return replace(watch, expected=watch.expected + delta, due=True)
