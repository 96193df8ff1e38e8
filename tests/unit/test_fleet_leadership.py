"""The fleet core's leadership rules (fleet.py rule 10): a deposed fleet stops acting at once.

A table of what each leadership check or fence does, in each phase of the fleet, and a
property over random event sequences: once ``Deposed`` is out, the core never asks for
anything again (no launch, terminate, reply, history write), whatever comes next.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import fleet as f
from supervisor import health as h
from tests.unit.test_fleet_core import Shell, shell

EPOCH = 7


def booted(*specs: tuple[str, int], epoch: int = EPOCH) -> Shell:
    """A fleet booted under ``epoch``, every host's files read."""
    s = shell(*specs)
    out = s.feed(f.Booted(epoch=epoch))
    for scan in s.of(out, f.ScanFiles):
        s.scanned(scan)
    return s


@pytest.mark.parametrize(
    ("event", "deposed"),
    [
        (f.LeadershipChecked(held=True, epoch_on_disk=EPOCH), False),
        (f.LeadershipChecked(held=True, epoch_on_disk=None), False),
        (f.LeadershipChecked(held=True, epoch_on_disk=EPOCH + 1), True),
        (f.LeadershipChecked(held=True, epoch_on_disk=EPOCH - 1), True),
        (f.LeadershipChecked(held=False, epoch_on_disk=EPOCH), True),
        (f.LeadershipChecked(held=False, epoch_on_disk=None), True),
        (f.Fenced(host="a", reason="epoch 8 > 7"), True),
    ],
)
def test_what_a_leadership_check_decides(event: f.Event, deposed: bool) -> None:
    """Held lock and our epoch (or an unreadable epoch file): lead on. A lost lock, another
    epoch on disk, or a fenced request: deposed, and ``Deposed`` is the only action."""
    s = booted(("a", 0), ("b", 1))
    s.run_worker("a", 100)
    out = s.feed(event)
    assert s.core.deposed is deposed
    assert s.core.finished is deposed
    if deposed:
        assert len(out) == 1 and isinstance(out[0], f.Deposed)
        assert out[0].epoch == EPOCH
    else:
        assert not s.of(out, f.Deposed)


def test_the_epoch_comes_from_boot_and_is_reported_when_deposed() -> None:
    """``Deposed`` names both epochs and why, for the ``ha.deposed`` log line."""
    s = booted(("a", 0), epoch=3)
    assert s.core.epoch == 3
    out = s.feed(f.LeadershipChecked(held=True, epoch_on_disk=4))
    assert out == [
        f.Deposed(epoch=3, epoch_on_disk=4, reason="the run directory's epoch is 4, ours 3")
    ]


def test_a_lost_lock_says_why() -> None:
    """The shell's reason is kept; without one the core says the lock is lost."""
    s = booted(("a", 0))
    out = s.feed(f.LeadershipChecked(held=False, epoch_on_disk=None, reason="lock file replaced"))
    assert out == [f.Deposed(epoch=EPOCH, epoch_on_disk=None, reason="lock file replaced")]
    t = booted(("a", 0))
    out = t.feed(f.LeadershipChecked(held=False, epoch_on_disk=8))
    assert out == [f.Deposed(epoch=EPOCH, epoch_on_disk=8, reason="the run lock is lost")]


def test_actions_earlier_in_the_batch_are_dropped() -> None:
    """A worker exit and the news of deposition in one batch: the relaunch the exit would
    cause is not asked for (the new leader decides)."""
    s = booted(("a", 0))
    s.run_worker("a", 100)
    out = s.feed(
        f.HostObserved("a", h.WorkerExited(pid=100, exit_code=1)),
        f.LeadershipChecked(held=False, epoch_on_disk=EPOCH + 1),
    )
    assert [type(a) for a in out] == [f.Deposed]


def test_deposed_during_shutdown_stops_stopping() -> None:
    """A leader stopping its workers (on_exit=stop) that is deposed terminates nothing more
    and never reports the shutdown done."""
    s = booted(("a", 0), ("b", 1))
    s.run_worker("a", 100)
    s.run_worker("b", 101)
    out = s.feed(f.ShutdownRequested(detach=False))
    assert s.of(out, f.Terminate)
    out = s.feed(f.Fenced(host="a", reason="epoch"))
    assert [type(a) for a in out] == [f.Deposed]
    assert s.feed(f.HostObserved("a", h.TerminateConfirmed(pid=100))) == []
    assert s.feed(f.DeadlinePassed()) == []


def test_deposed_before_boot() -> None:
    """A check that comes before the fleet booted deposes it as well: it never boots."""
    s = shell(("a", 0))
    out = s.feed(f.LeadershipChecked(held=False, epoch_on_disk=1))
    assert [type(a) for a in out] == [f.Deposed]
    assert s.feed(f.Booted(epoch=1)) == []
    assert s.core.epoch == 0


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
    st.builds(f.HostObserved, st.sampled_from(NAMES), host_events),
    st.just(f.DeadlinePassed()),
    st.builds(f.RestartHostRequested, host=st.sampled_from(NAMES), token=st.just(1)),
    st.builds(f.ShutdownRequested, detach=st.booleans()),
    st.builds(
        f.LeadershipChecked,
        held=st.booleans(),
        epoch_on_disk=st.one_of(st.none(), st.integers(0, 10)),
    ),
    st.builds(f.Fenced, host=st.sampled_from(NAMES), reason=st.just("fenced")),
)


@settings(max_examples=300, deadline=None)
@given(
    epoch=st.integers(0, 10),
    batches=st.lists(st.lists(fleet_events, min_size=1, max_size=4), max_size=30),
    steps=st.lists(st.floats(0.0, 20.0), min_size=30, max_size=30),
)
def test_once_deposed_nothing_is_ever_asked_for_again(
    epoch: int, batches: list[list[f.Event]], steps: list[float]
) -> None:
    """Random batches, leadership checks among them: ``Deposed`` comes out at most once,
    alone in its batch, exactly when a check or fence says so, and then nothing ever."""
    s = shell(*((n, i) for i, n in enumerate(NAMES)))
    out = s.feed(f.Booted(epoch=epoch))
    for scan in s.of(out, f.ScanFiles):
        s.scanned(scan)
    deposed = False
    for batch, dt in zip(batches, steps, strict=False):
        s.now += dt
        was_finished = s.core.finished
        out = s.feed(*batch)
        if was_finished:
            assert out == []  # deposed or shut down: nothing, ever
            continue
        if s.of(out, f.Deposed):
            assert [type(a) for a in out] == [f.Deposed]
            assert any(_deposes(e, epoch) for e in batch)
            deposed = True
        else:
            # Only a shutdown that ended before the news can have hidden it.
            assert not _deposes(batch[0], epoch)
            assert not any(_deposes(e, epoch) for e in batch) or s.core.finished
    assert s.core.deposed is deposed


def _deposes(event: f.Event, epoch: int) -> bool:
    """Whether ``event`` alone deposes a leader of ``epoch``."""
    if isinstance(event, f.Fenced):
        return True
    if isinstance(event, f.LeadershipChecked):
        return not event.held or (event.epoch_on_disk not in (None, epoch))
    return False
