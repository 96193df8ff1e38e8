"""Fleet-wide decisions, pure like health.py: the common-mode freeze and the launch budget.

Rules (DESIGN §4, "common-mode failures are not worker failures"):

1. When at least ``freeze_fraction`` of the hosts that should be running (and at least 2)
   fall silent together, the likely cause is the shared filesystem, the network or this
   node's mount, not the workers. The fleet freezes: health.py then holds every restart
   that silence alone would cause, while exits are still acted on.
2. Silence is judged at half the stale threshold, so the freeze lands before any host
   reaches its own restart deadline: nothing is restarted on the way into a freeze.
   "Together" means their last heartbeats fall within ``freeze_window_s`` of each other.
3. The fleet thaws when heartbeats return (fewer than the threshold still without a fresh
   heartbeat among the hosts that froze it or fell silent while it was frozen; a host
   whose worker died and was replaced counts as silent until the new worker beats), or
   when an operator says so; after an operator's thaw, silences that began before it no
   longer count (else it would freeze again at once). health.py then gives every host
   still silent a full stale threshold from the thaw before judging it.
4. Launches pass a budget: at most ``max_concurrent_launches`` in flight and
   ``max_launches_per_minute`` started, granted longest-waiting first, so a mass failure
   restarts in waves instead of stampeding the shared filesystem with model loads.

Time is an argument (monotonic seconds); nothing here sleeps, logs or does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from supervisor.health import WANT_RUNNING_STATES, Host, HostState

#: The budget counts launches over this sliding window (the per-minute limit).
BUDGET_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetPolicy:
    """``[fleet]`` settings plus the heartbeat threshold they are judged against."""

    freeze_fraction: float = 0.5
    freeze_window_s: float = 30.0
    heartbeat_stale_s: float = 60.0
    max_concurrent_launches: int = 16
    max_launches_per_minute: int = 120

    @property
    def silent_after_s(self) -> float:
        """A ready host is 'silent' once its heartbeat is this old: half the stale limit."""
        return self.heartbeat_stale_s / 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Freeze:
    """The freeze state of the fleet."""

    frozen: bool = False
    reason: str = ""
    since_at: float | None = None
    #: The hosts whose silence froze the fleet.
    hosts: frozenset[str] = frozenset()
    #: Silences that began before this instant do not count (an operator thawed over them).
    ignore_before_at: float = -math.inf


@dataclass(frozen=True, slots=True)
class FreezeChanged:
    """The fleet froze (``frozen=True``) or thawed; tell every host and the operator."""

    frozen: bool
    reason: str


def threshold(expected: int, policy: FleetPolicy) -> int:
    """How many hosts must fall silent together to freeze a fleet of ``expected``."""
    return max(2, math.ceil(policy.freeze_fraction * expected))


def silent_hosts(
    hosts: Iterable[Host], now: float, policy: FleetPolicy, freeze: Freeze
) -> list[Host]:
    """Ready hosts whose heartbeat is older than ``silent_after_s``, newest silence first."""
    silent = [
        h
        for h in hosts
        if h.state is HostState.READY
        and h.alive_at is not None
        and h.alive_at >= freeze.ignore_before_at
        and now - h.alive_at >= policy.silent_after_s
    ]
    return sorted(silent, key=lambda h: h.alive_at or 0.0, reverse=True)


def assess(
    freeze: Freeze, hosts: Iterable[Host], now: float, policy: FleetPolicy
) -> tuple[Freeze, FreezeChanged | None]:
    """Freeze, thaw, or leave the fleet as it is, given every host at ``now``."""
    hosts = list(hosts)
    expected = sum(1 for h in hosts if h.state in WANT_RUNNING_STATES)
    needed = threshold(expected, policy)
    silent = silent_hosts(hosts, now, policy, freeze)
    if not freeze.frozen:
        together = _largest_group(silent, policy.freeze_window_s)
        if expected < 2 or len(together) < needed:
            return freeze, None
        reason = (
            f"{len(together)}/{expected} hosts fell silent together (no heartbeat for"
            f" {policy.silent_after_s:g}s): suspect the shared filesystem, the network or"
            " this node's mount, not the workers; restarts for silence are frozen"
        )
        names = frozenset(h.name for h in together)
        return replace(freeze, frozen=True, reason=reason, since_at=now, hosts=names), (
            FreezeChanged(frozen=True, reason=reason)
        )
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
        and not _beating(h, now, policy)
    ]
    if len(still_silent) >= needed:
        return freeze, None
    back = sum(1 for h in hosts if h.name in freeze.hosts and _beating(h, now, policy))
    reason = f"heartbeats returned ({back} of {len(freeze.hosts)} stalled hosts beating again)"
    return _thawed(freeze), FreezeChanged(frozen=False, reason=reason)


def _beating(host: Host, now: float, policy: FleetPolicy) -> bool:
    """The host's current worker has beaten within ``silent_after_s``."""
    return host.alive_at is not None and now - host.alive_at < policy.silent_after_s


def unfreeze(freeze: Freeze, now: float) -> tuple[Freeze, FreezeChanged | None]:
    """An operator lifts the freeze; silences older than now stop counting."""
    thawed = replace(_thawed(freeze), ignore_before_at=now)
    if not freeze.frozen:
        return thawed, None
    return thawed, FreezeChanged(frozen=False, reason="operator unfreeze")


def next_assessment_at(
    freeze: Freeze, hosts: Iterable[Host], now: float, policy: FleetPolicy
) -> float | None:
    """When a ready host will cross the silence threshold, if nothing else happens first."""
    crossings = [
        h.alive_at + policy.silent_after_s
        for h in hosts
        if h.state is HostState.READY
        and h.alive_at is not None
        and h.alive_at >= freeze.ignore_before_at
        and h.alive_at + policy.silent_after_s > now
    ]
    return min(crossings) if crossings else None


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


# --------------------------------------------------------------------------------------
# Launch budget


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Launches waiting for a slot, launches in flight, and recent launch starts."""

    #: (host, since_at), oldest first.
    waiting: tuple[tuple[str, float], ...] = ()
    in_flight: frozenset[str] = frozenset()
    started_at: tuple[float, ...] = ()


def want_launch(budget: Budget, name: str, now: float) -> Budget:
    """``name`` asks to launch (idempotent: asking twice keeps its place)."""
    if name in budget.in_flight or any(n == name for n, _ in budget.waiting):
        return budget
    return replace(budget, waiting=(*budget.waiting, (name, now)))


def grant(budget: Budget, now: float, policy: FleetPolicy) -> tuple[Budget, list[str]]:
    """Start as many waiting launches as the budget allows, longest-waiting first."""
    recent = tuple(t for t in budget.started_at if now - t < BUDGET_WINDOW_S)
    waiting = list(budget.waiting)
    in_flight = set(budget.in_flight)
    granted: list[str] = []
    while (
        waiting
        and len(in_flight) < policy.max_concurrent_launches
        and len(recent) < policy.max_launches_per_minute
    ):
        name, _since = waiting.pop(0)
        granted.append(name)
        in_flight.add(name)
        recent = (*recent, now)
    new = Budget(waiting=tuple(waiting), in_flight=frozenset(in_flight), started_at=recent)
    return new, granted


def launch_done(budget: Budget, name: str) -> Budget:
    """``name``'s launch finished (either way), or it is no longer wanted."""
    return replace(
        budget,
        in_flight=budget.in_flight - {name},
        waiting=tuple((n, t) for n, t in budget.waiting if n != name),
    )


def next_grant_at(budget: Budget, policy: FleetPolicy) -> float | None:
    """When the per-minute window frees a slot for a launch that is waiting on it."""
    if not budget.waiting or len(budget.in_flight) >= policy.max_concurrent_launches:
        return None
    if len(budget.started_at) < policy.max_launches_per_minute:
        return None
    return min(budget.started_at) + BUDGET_WINDOW_S


# --------------------------------------------------------------------------------------
# The pointer file (``run.pointer_file``): the seed's "this run's workers are up" marker

#: A failed pointer write is retried after this long, doubling up to POINTER_RETRY_MAX_S: a
#: missing directory or a read-only mount is fixed by a person, in minutes, not milliseconds.
POINTER_RETRY_MIN_S = 1.0
POINTER_RETRY_MAX_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Pointer:
    """The pointer file's progress: written once, when the fleet is first all ready.

    The seed wrote it at the end of a successful ``start`` (every worker ready), so a reader
    of the file may take it to mean the run's reward workers are up. Once the fleet has been
    all ready, a failed write is retried with backoff until it succeeds, whatever the fleet
    does meanwhile: the moment it stands for has happened.
    """

    written: bool = False
    #: A write is in flight (the shell performs it off the event loop).
    writing: bool = False
    #: Failed writes so far; more than 0 also means the fleet has been all ready.
    failures: int = 0
    retry_at: float | None = None
    last_error: str | None = None


def fleet_all_ready(hosts: Iterable[Host]) -> bool:
    """Every host not stopped on purpose is ``ready``, and there is at least one.

    A host an operator stopped (``stop-host``, a ``.stop`` sentinel) is not expected to run;
    a ``failed`` one is, so it holds the pointer back like any host not yet ready.
    """
    ready = False
    for h in hosts:
        if h.state is HostState.READY:
            ready = True
        elif h.state not in (HostState.STOPPING, HostState.STOPPED):
            return False
    return ready


def pointer_due(pointer: Pointer, hosts: Iterable[Host], now: float) -> bool:
    """Write the pointer now: never written, no write in flight or waiting out its retry
    delay, and the fleet is all ready (or was, when an earlier write failed)."""
    if pointer.written or pointer.writing:
        return False
    if pointer.retry_at is not None and now < pointer.retry_at:
        return False
    return pointer.failures > 0 or fleet_all_ready(hosts)


def pointer_started(pointer: Pointer) -> Pointer:
    """A write has begun."""
    return replace(pointer, writing=True)


def pointer_written(pointer: Pointer) -> Pointer:
    """The write succeeded: the pointer is never written again (until the path changes)."""
    return replace(pointer, written=True, writing=False, retry_at=None, last_error=None)


def pointer_failed(pointer: Pointer, now: float, error: str) -> Pointer:
    """The write failed with ``error``: retry after a delay that doubles with each failure."""
    failures = pointer.failures + 1
    # The exponent is capped so that days of failures cannot overflow a float.
    delay = min(POINTER_RETRY_MAX_S, POINTER_RETRY_MIN_S * 2 ** min(failures - 1, 32))
    return replace(
        pointer, writing=False, failures=failures, retry_at=now + delay, last_error=error
    )
