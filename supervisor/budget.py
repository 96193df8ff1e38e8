"""The launch budget: launches wait for a slot, at most ``max_concurrent_launches`` in flight
and ``max_launches_per_minute`` begun, longest-waiting first (fleet rule 4), so a mass
failure restarts in waves instead of stampeding the shared filesystem with model loads.

A frozen value and pure functions of it; ``Fleet`` holds the value and feeds the hosts the
budget lets begin.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from supervisor.records import record
from supervisor.vocabulary import FleetPolicy

#: The budget counts launches over this sliding window (the per-minute limit).
BUDGET_WINDOW_S: Final = 60.0


@record
class Budget:
    """Launches waiting for a slot, launches in flight, and recent launch starts."""

    #: (host, since_at), oldest first.
    waiting: tuple[tuple[str, float], ...] = ()
    in_flight: frozenset[str] = frozenset()
    started_at: tuple[float, ...] = ()


def is_waiting(budget: Budget, name: str) -> bool:
    """``name``'s launch waits for a slot."""
    return any(n == name for n, _ in budget.waiting)


def want_launch(budget: Budget, name: str, now: float) -> Budget:
    """``name`` asks to launch (idempotent: asking twice keeps its place)."""
    if name in budget.in_flight or is_waiting(budget, name):
        return budget
    return replace(budget, waiting=(*budget.waiting, (name, now)))


def grant(budget: Budget, now: float, policy: FleetPolicy) -> tuple[Budget, list[str]]:
    """Begin as many waiting launches as the budget allows, longest-waiting first."""
    if not budget.waiting:
        return budget, []
    # ``now < t + window``, the very sum ``next_grant_at`` wakes the fleet at: written as
    # ``now - t < window`` it can hold at that instant by a rounding error, and the timer
    # would fire with nothing granted.
    recent = tuple(t for t in budget.started_at if now < t + BUDGET_WINDOW_S)
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
    if name not in budget.in_flight and not is_waiting(budget, name):
        return budget
    return replace(
        budget,
        in_flight=budget.in_flight - {name},
        waiting=tuple(w for w in budget.waiting if w[0] != name),
    )


def next_grant_at(budget: Budget, policy: FleetPolicy) -> float | None:
    """When the per-minute window frees a slot for a launch that is waiting on it."""
    if not budget.waiting or len(budget.in_flight) >= policy.max_concurrent_launches:
        return None
    if len(budget.started_at) < policy.max_launches_per_minute:
        return None
    return min(budget.started_at) + BUDGET_WINDOW_S
