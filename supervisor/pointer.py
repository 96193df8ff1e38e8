"""The pointer file (``run.pointer_file``, the seed's "this run's workers are up" marker):
written once, when the fleet is first all ready; a failed write is retried with a doubling
delay whatever the fleet does meanwhile (fleet rule 7). A frozen value and pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from supervisor.health import Host, HostState
from supervisor.records import record

#: A failed pointer write is retried after this long, doubling up to POINTER_RETRY_MAX_S: a
#: missing directory or a read-only mount is fixed by a person, in minutes, not milliseconds.
POINTER_RETRY_MIN_S = 1.0


POINTER_RETRY_MAX_S = 60.0


@record
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
