"""Every (role, event type) pair of the leadership core, with the role and actions expected.

Each role is reached through ``step`` from ``new()`` (so only reachable states are tested),
with the I/O that role performs in flight where it has one (a standby's try, a leader's
check, a hold-off's look), so that answers count. The expectations were worked out from the
rules at the top of leadership.py, not recorded from the code.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from supervisor import leadership as ld
from supervisor.leadership import Role as R

POLICY = ld.Policy(
    standby=True,
    poll_interval_s=0.5,
    check_interval_s=5.0,
    confirm_timeout_s=30.0,
    handover_hold_s=5.0,
)
EPOCH = 7
ME = "node-b pid 2"
OTHER = "node-a pid 1"


@dataclass(frozen=True)
class Scenario:
    """A leadership state and the monotonic time it was reached at."""

    state: ld.Leadership
    now: float


def drive(steps: list[tuple[ld.Event, float]], state: ld.Leadership | None = None) -> Scenario:
    """Feed ``steps`` (event, time) to ``state`` (or a new one); the scenario reached."""
    state = state or ld.new()
    now = 0.0
    for event, now in steps:
        state, _ = ld.step(state, event, now, POLICY)
    return Scenario(state, now)


def scenarios() -> dict[R, Scenario]:
    """One scenario per role, each reached through ``step``."""
    trying = drive(
        [
            (ld.LockBusy(holder=OTHER), 0.0),
            (ld.Serving(), 0.0),
            (ld.ViewRead(epoch_on_disk=EPOCH), 0.1),
            (ld.DeadlinePassed(), 0.6),  # the first try
        ]
    )
    checking = drive(
        [
            (ld.LockTaken(epoch=EPOCH, leader=ME, locked_at=0.0), 0.0),
            (ld.Serving(), 0.0),
            (ld.DeadlinePassed(), 5.0),  # the first check
        ]
    )
    handing_over = drive([(ld.HandoverAsked(token=9), 5.0)], checking.state)
    looking = drive([(ld.ServingEnded(), 5.5), (ld.LockReleased(), 6.0)], handing_over.state)
    deposed = drive([(ld.Fenced(host="w-0", reason="epoch 8 > 7"), 5.0)], checking.state)
    stopped = drive([(ld.StopAsked(), 0.6)], trying.state)
    found = {
        R.STARTING: Scenario(ld.new(), 0.0),
        R.STANDBY: trying,
        R.LEADER: checking,
        R.HANDING_OVER: handing_over,
        R.HOLDING_OFF: looking,
        R.DEPOSED: deposed,
        R.STOPPED: stopped,
    }
    for role, scenario in found.items():
        assert scenario.state.role is role, (role, scenario.state)
    assert trying.state.op == "try" and checking.state.op == "check"
    assert handing_over.state.op == "check" and looking.state.op == "look"
    return found


SCENARIOS = scenarios()

EVENTS: dict[type[ld.Event], ld.Event] = {
    ld.LockTaken: ld.LockTaken(epoch=EPOCH + 1, leader=ME, locked_at=0.5),
    ld.LockBusy: ld.LockBusy(holder=OTHER),
    ld.LockFailed: ld.LockFailed(reason="EIO"),
    ld.LockChecked: ld.LockChecked(held=True, epoch_on_disk=EPOCH),
    ld.ViewRead: ld.ViewRead(epoch_on_disk=EPOCH),
    ld.LockLooked: ld.LockLooked(holder=OTHER),
    ld.Fenced: ld.Fenced(host="w-0", reason="epoch 8 > 7"),
    ld.CheckAsked: ld.CheckAsked(),
    ld.Serving: ld.Serving(),
    ld.ServingEnded: ld.ServingEnded(),
    ld.LockReleased: ld.LockReleased(),
    ld.StatusAsked: ld.StatusAsked(),
    ld.HandoverAsked: ld.HandoverAsked(token=1),
    ld.StopAsked: ld.StopAsked(),
    ld.FleetSettled: ld.FleetSettled(),
    ld.WatchdogDue: ld.WatchdogDue(watcher_healthy=True),
    ld.DeadlinePassed: ld.DeadlinePassed(),
}

A = ld
_ = ()
REFUSED = (A.Reply,)
PING = (A.PingWatchdog,)

#: (role, event type) -> (role after, action types in order). Every pair is listed.
TABLE: dict[tuple[R, type[ld.Event]], tuple[R, tuple[type[ld.Action], ...]]] = {
    # Starting: only the first try's answer matters (and a handover is refused).
    (R.STARTING, ld.LockTaken): (R.LEADER, (A.Leading, A.RoleChanged)),
    (R.STARTING, ld.LockBusy): (R.STANDBY, (A.RoleChanged,)),
    (R.STARTING, ld.LockFailed): (R.STOPPED, (A.CannotStart, A.RoleChanged)),
    (R.STARTING, ld.LockChecked): (R.STARTING, _),
    (R.STARTING, ld.ViewRead): (R.STARTING, _),
    (R.STARTING, ld.LockLooked): (R.STARTING, _),
    (R.STARTING, ld.Fenced): (R.STARTING, _),
    (R.STARTING, ld.CheckAsked): (R.STARTING, _),
    (R.STARTING, ld.Serving): (R.STARTING, _),
    (R.STARTING, ld.ServingEnded): (R.STARTING, _),
    (R.STARTING, ld.LockReleased): (R.STOPPED, (A.RoleChanged,)),
    (R.STARTING, ld.StatusAsked): (R.STARTING, _),
    (R.STARTING, ld.HandoverAsked): (R.STARTING, REFUSED),
    (R.STARTING, ld.StopAsked): (R.STARTING, _),
    (R.STARTING, ld.FleetSettled): (R.STARTING, _),
    (R.STARTING, ld.WatchdogDue): (R.STARTING, PING),
    (R.STARTING, ld.DeadlinePassed): (R.STARTING, _),
    # Standby, its try in flight: the answer decides; nothing of a leader's applies.
    (R.STANDBY, ld.LockTaken): (R.LEADER, (A.Leading, A.Announce, A.Lead, A.RoleChanged)),
    (R.STANDBY, ld.LockBusy): (R.STANDBY, _),  # same holder, view fresh: wait
    (R.STANDBY, ld.LockFailed): (R.STANDBY, (A.TakeoverFailed,)),
    (R.STANDBY, ld.LockChecked): (R.STANDBY, _),
    (R.STANDBY, ld.ViewRead): (R.STANDBY, _),  # no read in flight: old news
    (R.STANDBY, ld.LockLooked): (R.STANDBY, _),
    (R.STANDBY, ld.Fenced): (R.STANDBY, _),
    (R.STANDBY, ld.CheckAsked): (R.STANDBY, _),
    (R.STANDBY, ld.Serving): (R.STANDBY, _),
    (R.STANDBY, ld.ServingEnded): (R.STANDBY, _),
    (R.STANDBY, ld.LockReleased): (R.STOPPED, (A.RoleChanged,)),
    (R.STANDBY, ld.StatusAsked): (R.STANDBY, _),
    (R.STANDBY, ld.HandoverAsked): (R.STANDBY, REFUSED),
    (R.STANDBY, ld.StopAsked): (R.STOPPED, (A.StandDown, A.RoleChanged)),
    (R.STANDBY, ld.FleetSettled): (R.STANDBY, _),
    (R.STANDBY, ld.WatchdogDue): (R.STANDBY, PING),
    (R.STANDBY, ld.DeadlinePassed): (R.STANDBY, _),
    # Leader, its check in flight.
    (R.LEADER, ld.LockTaken): (R.LEADER, _),
    (R.LEADER, ld.LockBusy): (R.LEADER, _),
    (R.LEADER, ld.LockFailed): (R.LEADER, _),
    (R.LEADER, ld.LockChecked): (R.LEADER, _),
    (R.LEADER, ld.ViewRead): (R.LEADER, _),
    (R.LEADER, ld.LockLooked): (R.LEADER, _),
    (R.LEADER, ld.Fenced): (R.DEPOSED, (A.Deposed, A.RoleChanged)),
    (R.LEADER, ld.CheckAsked): (R.LEADER, _),  # one check in flight is enough for now
    (R.LEADER, ld.Serving): (R.LEADER, _),
    (R.LEADER, ld.ServingEnded): (R.LEADER, _),
    (R.LEADER, ld.LockReleased): (R.STOPPED, (A.RoleChanged,)),
    (R.LEADER, ld.StatusAsked): (R.LEADER, _),
    (R.LEADER, ld.HandoverAsked): (R.HANDING_OVER, (A.HandOver, A.Reply, A.RoleChanged)),
    (R.LEADER, ld.StopAsked): (R.LEADER, _),
    (R.LEADER, ld.FleetSettled): (R.LEADER, _),  # led from the start: nothing to say
    (R.LEADER, ld.WatchdogDue): (R.LEADER, PING),
    (R.LEADER, ld.DeadlinePassed): (R.LEADER, _),  # the check is not late yet
    # Handing over: still checked (and deposable) until the lock goes; then it holds off.
    (R.HANDING_OVER, ld.LockTaken): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.LockBusy): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.LockFailed): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.LockChecked): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.ViewRead): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.LockLooked): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.Fenced): (R.DEPOSED, (A.Deposed, A.RoleChanged)),
    (R.HANDING_OVER, ld.CheckAsked): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.Serving): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.ServingEnded): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.LockReleased): (R.HOLDING_OFF, (A.RoleChanged, A.LookAtLock)),
    (R.HANDING_OVER, ld.StatusAsked): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.HandoverAsked): (R.HANDING_OVER, REFUSED),
    (R.HANDING_OVER, ld.StopAsked): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.FleetSettled): (R.HANDING_OVER, _),
    (R.HANDING_OVER, ld.WatchdogDue): (R.HANDING_OVER, PING),
    (R.HANDING_OVER, ld.DeadlinePassed): (R.HANDING_OVER, _),
    # Holding off, a look in flight: only its answer and the end of the hold matter.
    (R.HOLDING_OFF, ld.LockTaken): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.LockBusy): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.LockFailed): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.LockChecked): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.ViewRead): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.LockLooked): (R.STOPPED, (A.HandedOver, A.RoleChanged)),
    (R.HOLDING_OFF, ld.Fenced): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.CheckAsked): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.Serving): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.ServingEnded): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.LockReleased): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.StatusAsked): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.HandoverAsked): (R.HOLDING_OFF, REFUSED),
    (R.HOLDING_OFF, ld.StopAsked): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.FleetSettled): (R.HOLDING_OFF, _),
    (R.HOLDING_OFF, ld.WatchdogDue): (R.HOLDING_OFF, PING),
    (R.HOLDING_OFF, ld.DeadlinePassed): (R.HOLDING_OFF, _),  # the hold is not over
    # Deposed: nothing is tried, checked or led again; it only exits.
    (R.DEPOSED, ld.LockTaken): (R.DEPOSED, _),
    (R.DEPOSED, ld.LockBusy): (R.DEPOSED, _),
    (R.DEPOSED, ld.LockFailed): (R.DEPOSED, _),
    (R.DEPOSED, ld.LockChecked): (R.DEPOSED, _),
    (R.DEPOSED, ld.ViewRead): (R.DEPOSED, _),
    (R.DEPOSED, ld.LockLooked): (R.DEPOSED, _),
    (R.DEPOSED, ld.Fenced): (R.DEPOSED, _),
    (R.DEPOSED, ld.CheckAsked): (R.DEPOSED, _),
    (R.DEPOSED, ld.Serving): (R.DEPOSED, _),
    (R.DEPOSED, ld.ServingEnded): (R.DEPOSED, _),
    (R.DEPOSED, ld.LockReleased): (R.STOPPED, (A.RoleChanged,)),
    (R.DEPOSED, ld.StatusAsked): (R.DEPOSED, _),
    (R.DEPOSED, ld.HandoverAsked): (R.DEPOSED, REFUSED),
    (R.DEPOSED, ld.StopAsked): (R.DEPOSED, _),
    (R.DEPOSED, ld.FleetSettled): (R.DEPOSED, _),
    (R.DEPOSED, ld.WatchdogDue): (R.DEPOSED, PING),
    (R.DEPOSED, ld.DeadlinePassed): (R.DEPOSED, _),
    # Stopped (a standby that stopped): over; a try that took the lock late is only said.
    (R.STOPPED, ld.LockTaken): (R.STOPPED, (A.Leading,)),
    (R.STOPPED, ld.LockBusy): (R.STOPPED, _),
    (R.STOPPED, ld.LockFailed): (R.STOPPED, _),
    (R.STOPPED, ld.LockChecked): (R.STOPPED, _),
    (R.STOPPED, ld.ViewRead): (R.STOPPED, _),
    (R.STOPPED, ld.LockLooked): (R.STOPPED, _),
    (R.STOPPED, ld.Fenced): (R.STOPPED, _),
    (R.STOPPED, ld.CheckAsked): (R.STOPPED, _),
    (R.STOPPED, ld.Serving): (R.STOPPED, _),
    (R.STOPPED, ld.ServingEnded): (R.STOPPED, _),
    (R.STOPPED, ld.LockReleased): (R.STOPPED, _),
    (R.STOPPED, ld.StatusAsked): (R.STOPPED, _),
    (R.STOPPED, ld.HandoverAsked): (R.STOPPED, REFUSED),
    (R.STOPPED, ld.StopAsked): (R.STOPPED, _),
    (R.STOPPED, ld.FleetSettled): (R.STOPPED, _),
    (R.STOPPED, ld.WatchdogDue): (R.STOPPED, PING),
    (R.STOPPED, ld.DeadlinePassed): (R.STOPPED, _),
}


def test_the_table_lists_every_role_and_event_type() -> None:
    """No pair is left out: a new role or event needs its row."""
    assert set(TABLE) == {(role, event) for role in R for event in EVENTS}


@pytest.mark.parametrize(("role", "event_type"), sorted(TABLE, key=str))
def test_transition(role: R, event_type: type[ld.Event]) -> None:
    """Each role answers each event with the role and the actions the rules call for."""
    scenario = SCENARIOS[role]
    state, actions = ld.step(scenario.state, EVENTS[event_type], scenario.now, POLICY)
    expected_role, expected_actions = TABLE[(role, event_type)]
    assert state.role is expected_role
    assert tuple(type(a) for a in actions) == expected_actions
    changes = [a for a in actions if isinstance(a, ld.RoleChanged)]
    if state.role is role:
        assert changes == []
    else:
        assert [(c.from_, c.to) for c in changes] == [(role, state.role)]
