"""The fleet's phases (fleet rules 4, 5 and 7): booted, settled, stopping, finished, halted.

A frozen value and pure functions of it. ``Fleet`` tells it when start-up settled and a stop
began or ended (it alone knows what every host waits for); this says what each phase allows
and when time alone ends one.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.records import record
from supervisor.vocabulary import Refusal


@record
class Phase:
    """Where the fleet is in its life."""

    #: The daemon leads: members may join (``Booted``).
    booted: bool = False
    #: A stop (not a detach) asked for before the boot: begun right after it.
    stop_at_boot: bool = False
    #: Start-up is over (READY=1 went out), and when it will be at the latest.
    settled: bool = False
    startup_deadline_at: float | None = None
    #: A stop began (workers are stopped or left running), and when it gives up on hosts.
    stopping: bool = False
    shutdown_deadline_at: float | None = None
    #: Nothing more will happen.
    finished: bool = False
    #: Told this daemon does not (or no longer) lead: nothing more is done, not even what
    #: the same batch asked for.
    halted: bool = False


def deadline_at(phase: Phase) -> float | None:
    """When time alone ends a phase: start-up's deadline, or the stop's."""
    times = (
        None if phase.settled else phase.startup_deadline_at,
        None if phase.finished else phase.shutdown_deadline_at,
    )
    return min((t for t in times if t is not None), default=None)


def first_hosts_read(phase: Phase, now: float, startup_timeout_s: float) -> Phase:
    """The first members' files were read: start-up is timed from now."""
    if phase.startup_deadline_at is not None:
        return phase
    return replace(phase, startup_deadline_at=now + startup_timeout_s)


def startup_overdue(phase: Phase, now: float) -> bool:
    """Start-up has not settled by its deadline: it settles without the slow hosts."""
    deadline = phase.startup_deadline_at
    return not phase.settled and deadline is not None and now >= deadline


def shutdown_overdue(phase: Phase, now: float) -> bool:
    """The stop's deadline passed: it ends, naming the hosts still stopping."""
    deadline = phase.shutdown_deadline_at
    return not phase.finished and deadline is not None and now >= deadline


def stopping(phase: Phase, now: float, shutdown_timeout_s: float | None) -> Phase:
    """A stop began (``None``: a detach, which waits for nothing)."""
    deadline = None if shutdown_timeout_s is None else now + shutdown_timeout_s
    return replace(phase, stopping=True, shutdown_deadline_at=deadline)


def command_refusal(phase: Phase) -> Refusal | None:
    """Why an operator command would find nobody to answer it, or None: not booted (a
    standby, or a leader still reading its state), or stopped. (While the fleet stops, each
    command is the core's to refuse or not.)"""
    if phase.finished:
        return Refusal.SHUTTING_DOWN
    if not phase.booted:
        return Refusal.UNAVAILABLE
    return None


def history_is_ours(phase: Phase) -> bool:
    """The restart history is this fleet's to save: it booted (it holds what a previous
    daemon left) and was not halted (then the new leader owns the file)."""
    return phase.booted and not phase.halted
