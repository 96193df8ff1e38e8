"""The pointer file's decision: written once, when the fleet is first all ready; retried."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import health as h
from supervisor import pointer as pointers
from supervisor.health import HostState as S


def host(name: str, state: S) -> h.Host:
    """A host in ``state``."""
    return replace(h.new_host(name, 0.0), state=state)


@pytest.mark.parametrize(
    ("states", "all_ready"),
    [
        ([S.READY, S.READY], True),
        ([S.READY, S.STARTING], False),
        ([S.READY, S.COOLING_DOWN], False),
        ([S.READY, S.STALE], False),
        # Gave up, but still meant to run: the fleet is not up.
        ([S.READY, S.FAILED], False),
        # Stopped on purpose (stop-host, a sentinel): not expected to run.
        ([S.READY, S.STOPPED], True),
        ([S.READY, S.STOPPING], True),
        ([S.STOPPED, S.STOPPED], False),
        ([], False),
    ],
)
def test_all_ready_counts_every_host_not_stopped_on_purpose(
    states: list[S], all_ready: bool
) -> None:
    """Every host that should run is ready, and at least one is."""
    hosts = [host(f"w{i}", s) for i, s in enumerate(states)]
    assert pointers.fleet_all_ready(hosts) is all_ready


def test_pointer_is_due_only_once_the_fleet_is_all_ready() -> None:
    """Nothing while a host starts; due the moment the last one is ready."""
    pointer = pointers.Pointer()
    assert not pointers.pointer_due(pointer, [host("a", S.READY), host("b", S.STARTING)], 5.0)
    assert pointers.pointer_due(pointer, [host("a", S.READY), host("b", S.READY)], 6.0)


def test_pointer_is_written_once_and_never_again() -> None:
    """After a successful write the fleet being all ready again changes nothing."""
    ready = [host("a", S.READY)]
    pointer = pointers.pointer_started(pointers.Pointer())
    assert not pointers.pointer_due(pointer, ready, 1.0)  # in flight
    pointer = pointers.pointer_written(pointer)
    assert pointer.written and not pointer.writing
    assert not pointers.pointer_due(pointer, ready, 1e9)


def test_a_failed_write_is_retried_with_doubling_delays_even_if_the_fleet_changed() -> None:
    """1 s, 2 s, 4 s ... capped at the maximum; the retry does not wait for readiness again."""
    not_ready = [host("a", S.COOLING_DOWN)]
    pointer = pointers.pointer_started(pointers.Pointer())
    now = 100.0
    delays = []
    for _ in range(10):
        pointer = pointers.pointer_failed(pointer, now, "read-only file system")
        assert pointer.retry_at is not None
        delays.append(pointer.retry_at - now)
        assert not pointers.pointer_due(pointer, not_ready, pointer.retry_at - 0.001)
        assert pointers.pointer_due(pointer, not_ready, pointer.retry_at)
        now = pointer.retry_at
        pointer = pointers.pointer_started(pointer)
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert max(delays) == pointers.POINTER_RETRY_MAX_S
    assert pointer.last_error == "read-only file system"
    pointer = pointers.pointer_written(pointer)
    assert pointer.last_error is None and pointer.retry_at is None


@given(failures=st.integers(min_value=1, max_value=100_000))
def test_retry_delay_stays_within_bounds_after_any_number_of_failures(failures: int) -> None:
    """Days of failures neither overflow nor exceed the cap; the delay is never below the
    minimum."""
    pointer = replace(pointers.Pointer(), failures=failures - 1)
    failed = pointers.pointer_failed(pointer, 0.0, "x")
    assert failed.retry_at is not None
    assert pointers.POINTER_RETRY_MIN_S <= failed.retry_at <= pointers.POINTER_RETRY_MAX_S
