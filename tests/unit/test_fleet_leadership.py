"""The fleet core's side of leadership (fleet.py rule 10): told that this daemon does not or
no longer lead (``LeadershipEnded``), the fleet halts at once, whatever it was doing.

Who leads is decided by leadership.py (tests/unit/test_leadership_*.py); here, what the
fleet does with the news, in each phase, and a property over random event sequences: once
halted, the core never asks for anything again (no launch, terminate, reply, history write).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import health as h
from supervisor import vocabulary as v
from tests.examples import examples
from tests.unit.test_fleet_core import Shell, shell


def booted(*specs: tuple[str, int]) -> Shell:
    """A booted fleet, every host's files read."""
    s = shell(*specs)
    out = s.feed(v.Booted())
    for scan in s.of(out, v.ScanFiles):
        s.scanned(scan)
    return s


def test_a_running_fleet_halts_at_once_and_owns_no_history() -> None:
    """Told it does not lead, a fleet with a running worker asks for nothing (no stop, no
    terminate), is finished, and its history is no longer its own to save."""
    s = booted(("a", 0), ("b", 1))
    s.run_worker("a", 100)
    assert s.core.history_is_ours
    assert s.feed(v.LeadershipEnded()) == []
    assert s.core.finished
    assert not s.core.history_is_ours


def test_actions_earlier_in_the_batch_are_dropped() -> None:
    """A worker exit and the news in one batch: the relaunch the exit would cause is not
    asked for (the new leader decides)."""
    s = booted(("a", 0))
    s.run_worker("a", 100)
    out = s.feed(
        v.HostObserved("a", h.WorkerExited(pid=100, exit_code=1)),
        v.LeadershipEnded(),
    )
    assert out == []


def test_events_after_the_news_in_the_batch_are_not_applied() -> None:
    """An operator's restart queued behind the news is neither done nor answered."""
    s = booted(("a", 0))
    s.run_worker("a", 100)
    out = s.feed(v.LeadershipEnded(), v.RestartHostRequested(host="a", token=1))
    assert out == []


def test_halted_during_shutdown_stops_stopping() -> None:
    """A leader stopping its workers (on_exit=stop) that is deposed terminates nothing more
    and never reports the shutdown done."""
    s = booted(("a", 0), ("b", 1))
    s.run_worker("a", 100)
    s.run_worker("b", 101)
    out = s.feed(v.ShutdownRequested(detach=False))
    assert s.of(out, v.Terminate)
    assert s.feed(v.LeadershipEnded()) == []
    assert s.feed(v.HostObserved("a", h.TerminateConfirmed(pid=100))) == []
    assert s.feed(v.DeadlinePassed()) == []


def test_halted_before_boot_never_boots() -> None:
    """A standby that stops: its fleet, told before it booted, is finished and never boots,
    even with a stop asked for before (which would stop workers at boot)."""
    s = shell(("a", 0))
    assert s.feed(v.ShutdownRequested(detach=False), v.LeadershipEnded()) == []
    assert s.core.finished
    assert s.feed(v.Booted()) == []
    assert not s.core.history_is_ours
    assert s.core.hosts == {}


def test_a_fleet_that_never_booted_owns_no_history() -> None:
    """Before the boot the history on disk is not this fleet's to overwrite."""
    s = shell(("a", 0))
    assert not s.core.history_is_ours


# --- property ----------------------------------------------------------------------------

NAMES = ("a", "b", "c")

host_events = st.sampled_from(
    [
        h.SshRestored(),
        h.SshLost(reason="x"),
        h.ProbeResult(pid=None),
        h.ProbeResult(pid=100),
        h.Launched(pid=100),
        h.LaunchFailed(reason="x"),
        h.HeartbeatSeen(pid=100, ready=True, remote_heartbeat_at=1.0),
        h.WorkerExited(pid=100, exit_code=1),
        h.TerminateConfirmed(pid=100),
        h.StatusMissing(reason="x"),
    ]
)
fleet_events = st.one_of(
    st.builds(v.HostObserved, st.sampled_from(NAMES), host_events),
    st.just(v.DeadlinePassed()),
    st.builds(v.RestartHostRequested, host=st.sampled_from(NAMES), token=st.just(1)),
    st.builds(v.ShutdownRequested, detach=st.booleans()),
    st.just(v.LeadershipEnded()),
)


@settings(max_examples=examples(300), deadline=None)
@given(
    batches=st.lists(st.lists(fleet_events, min_size=1, max_size=4), max_size=30),
    steps=st.lists(st.floats(0.0, 20.0), min_size=30, max_size=30),
)
@pytest.mark.parametrize("boot", [True, False])
def test_once_halted_nothing_is_ever_asked_for_again(
    boot: bool, batches: list[list[v.Event]], steps: list[float]
) -> None:
    """Random batches, the news among them: a batch that carries it asks for nothing, and
    from then on nothing is ever asked for; the history is ours exactly while booted and
    not halted."""
    s = shell(*((n, i) for i, n in enumerate(NAMES)))
    if boot:
        out = s.feed(v.Booted())
        for scan in s.of(out, v.ScanFiles):
            s.scanned(scan)
    halted = False
    for batch, dt in zip(batches, steps, strict=False):
        s.now += dt
        was_finished = s.core.finished
        out = s.feed(*batch)
        if was_finished:
            assert out == []  # halted or shut down: nothing, ever
            continue
        if any(isinstance(e, v.LeadershipEnded) for e in batch):
            # Only a shutdown that ended earlier in the batch can have hidden the news.
            assert out == [] or s.core.finished
            halted = halted or out == []
        assert s.core.history_is_ours is (boot and not halted)
