"""The leadership core's rules, one scenario each: the election by the run lock, a standby's
wait, the checks that depose a leader, the handover and its hold-off, the watchdog, exit
codes. No lock, no clock: every answer is fed by hand, every instant passed in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from supervisor import leadership as ld
from supervisor.leadership import Role as R

POLICY = ld.Policy(standby=True, poll_interval_s=0.5, check_interval_s=5.0, handover_hold_s=5.0)
ME = "node-b pid 2"
_A = TypeVar("_A")
OTHER = "node-a pid 1"


@dataclass
class Daemon:
    """One daemon's leadership core, fed by hand: what it did last, and all it did."""

    policy: ld.Policy = POLICY
    state: ld.Leadership = field(default_factory=ld.new)
    now: float = 0.0
    done: list[ld.Action] = field(default_factory=list)

    def feed(self, event: ld.Event, at: float | None = None) -> list[ld.Action]:
        """Apply ``event`` at ``at`` (default: now); the actions."""
        if at is not None:
            self.now = at
        self.state, actions = ld.step(self.state, event, self.now, self.policy)
        self.done += actions
        return actions

    def wake(self) -> list[ld.Action]:
        """Move to the core's deadline and feed DeadlinePassed there."""
        assert self.state.deadline_at is not None
        return self.feed(ld.DeadlinePassed(), self.state.deadline_at)


def kinds(actions: Sequence[ld.Action]) -> list[type[ld.Action]]:
    """The types of ``actions``, in order."""
    return [type(a) for a in actions]


def of(actions: Sequence[ld.Action], kind: type[_A]) -> list[_A]:
    """The actions of one type."""
    return [a for a in actions if isinstance(a, kind)]


def leader(epoch: int = 7) -> Daemon:
    """A daemon that took the lock at start and serves."""
    d = Daemon()
    d.feed(ld.LockTaken(epoch=epoch, leader=ME, locked_at=0.0))
    assert kinds(d.feed(ld.Serving())) == [ld.Lead]
    return d


def standby() -> Daemon:
    """A daemon waiting for the lock, its first view of the run directory read."""
    d = Daemon()
    d.feed(ld.LockBusy(holder=OTHER))
    d.feed(ld.Serving())
    d.feed(ld.ViewRead(epoch_on_disk=7), 0.1)
    return d


# --- the election ------------------------------------------------------------------------


def test_a_daemon_that_takes_the_lock_leads_under_the_epoch_it_wrote() -> None:
    """The first try takes the lock: ``ha.leading``, then (once serving) the fleet boots
    under that epoch; the daemon is shown as the leader from then on."""
    d = Daemon()
    out = d.feed(ld.LockTaken(epoch=4, leader=ME, locked_at=0.0))
    assert of(out, ld.Leading) == [ld.Leading(epoch=4, leader=ME, took_over=False)]
    assert d.state.role is R.LEADER and d.state.epoch == 4 and d.state.shown_role == "leader"
    assert d.feed(ld.Serving(), 0.2) == [ld.Lead(epoch=4)]
    assert d.feed(ld.Serving(), 0.3) == []  # once


def test_without_standby_a_held_lock_means_exit_1_naming_the_holder() -> None:
    """No ``[ha] standby``: the lock held by another daemon ends this one at once, exit 1,
    with a reason that names the holder, the lock file and how to wait instead."""
    d = Daemon(policy=ld.Policy(standby=False))
    out = d.feed(ld.LockBusy(holder=OTHER, lock_file="/run/x/ctl/supervisor.lock"))
    [cannot] = of(out, ld.CannotStart)
    assert OTHER in cannot.reason and "/run/x/ctl/supervisor.lock" in cannot.reason
    assert "--standby" in cannot.reason
    assert d.state.finished and d.state.exit_code == ld.EXIT_CANNOT_START


def test_an_unnamed_holder_is_called_unknown() -> None:
    """A lock file whose holder cannot be read still makes a sentence."""
    d = Daemon(policy=ld.Policy(standby=False))
    [cannot] = of(d.feed(ld.LockBusy(holder="")), ld.CannotStart)
    assert "the run lock is locked by unknown" in cannot.reason


def test_a_first_try_that_fails_is_a_failed_start() -> None:
    """The run root's I/O error on the first try: exit 1, the error as the reason."""
    d = Daemon()
    assert d.feed(ld.LockFailed(reason="EROFS")) == [
        ld.CannotStart(reason="EROFS"),
        ld.RoleChanged(from_=R.STARTING, to=R.STOPPED, reason="EROFS"),
    ]
    assert d.state.exit_code == ld.EXIT_CANNOT_START


def test_a_stop_before_the_first_answer_means_no_standing_by() -> None:
    """A stop asked before the lock was found held: the daemon stops, exit 0."""
    d = Daemon()
    d.feed(ld.StopAsked())
    out = d.feed(ld.LockBusy(holder=OTHER))
    assert kinds(out) == [ld.StandDown, ld.RoleChanged]
    assert d.state.finished and d.state.exit_code == 0


# --- the standby's wait ------------------------------------------------------------------


def test_a_standby_stands_by_reads_the_run_directory_then_tries_every_poll_interval() -> None:
    """Serving: warm up and READY (with the leader named), read the view; then one try
    every ``poll_interval_s`` after the last answer, never two at once."""
    d = Daemon()
    d.feed(ld.LockBusy(holder=OTHER))
    out = d.feed(ld.Serving())
    assert out == [
        ld.StandBy(leader=OTHER, poll_interval_s=0.5, summary=f"standby, leader: {OTHER}"),
        ld.ReadView(),
    ]
    assert d.state.deadline_at is None  # the read is in flight
    d.feed(ld.ViewRead(epoch_on_disk=7), 0.1)
    assert d.state.epoch_on_disk == 7 and d.state.deadline_at == pytest.approx(0.6)
    assert d.feed(ld.DeadlinePassed(), 0.3) == []  # early: nothing
    assert d.wake() == [ld.TryLock()]
    assert d.state.deadline_at is None
    assert d.feed(ld.DeadlinePassed(), 5.0) == []  # no second try while one is in flight
    d.feed(ld.LockBusy(holder=OTHER), 5.1)
    assert d.state.deadline_at == pytest.approx(5.6)


def test_a_new_leader_is_said_and_the_view_read_again() -> None:
    """Another holder than the one known: ``ha.leader_changed``, the status line, and the
    run directory read again at once (its epoch is news)."""
    d = standby()
    d.wake()
    out = d.feed(ld.LockBusy(holder="node-c pid 3"))
    assert out == [
        ld.LeaderChanged(leader="node-c pid 3"),
        ld.Announce(text="standby, leader: node-c pid 3"),
        ld.ReadView(),
    ]
    assert d.state.leader == "node-c pid 3"


def test_the_view_is_read_again_only_while_someone_asks() -> None:
    """Nobody asked: never re-read. Asked: re-read once STANDBY_VIEW_INTERVAL_S passed,
    for STANDBY_VIEW_ASKED_S after the last ask."""
    d = standby()
    for _ in range(10):
        d.wake()
        assert d.feed(ld.LockBusy(holder=OTHER)) == []
    d.feed(ld.StatusAsked())
    asked_at = d.now
    d.wake()
    assert d.feed(ld.LockBusy(holder=OTHER)) == [ld.ReadView()]
    d.feed(ld.ViewRead(epoch_on_disk=7))
    d.wake()
    assert d.feed(ld.LockBusy(holder=OTHER)) == []  # read within the interval
    d.now = asked_at + ld.STANDBY_VIEW_ASKED_S + 1
    d.wake()
    assert d.feed(ld.LockBusy(holder=OTHER)) == []  # asked too long ago


def test_a_failed_try_is_said_and_tried_again_after_a_poll_interval() -> None:
    """The run root's error on a try: ``ha.takeover_failed`` and the next try as usual."""
    d = standby()
    d.wake()
    out = d.feed(ld.LockFailed(reason="EIO"), 1.0)
    assert out == [ld.TakeoverFailed(reason="EIO", retry_in_s=0.5)]
    assert d.state.deadline_at == pytest.approx(1.5)


def test_answers_to_nothing_in_flight_are_old_news() -> None:
    """A try's or a read's answer when none is in flight changes nothing."""
    d = standby()
    before = d.state
    for event in (
        ld.LockTaken(epoch=8, leader=ME, locked_at=0.2),
        ld.LockBusy(holder="x"),
        ld.LockFailed(reason="x"),
        ld.ViewRead(epoch_on_disk=1),
    ):
        assert d.feed(event, 0.2) == []
    assert d.state == before


def test_a_takeover_leads_boots_the_fleet_and_is_in_charge_once_settled() -> None:
    """The lock taken on a try: ``ha.leading`` with the takeover flag, the status line, the
    fleet booted; once the fleet settles, ``ha.in_charge`` with the times since the lock
    was taken and since the try that found it free, said once."""
    d = standby()
    d.wake()  # the try that finds it free, at 0.6
    out = d.feed(ld.LockTaken(epoch=8, leader=ME, locked_at=0.65), 0.7)
    assert out == [
        ld.Leading(epoch=8, leader=ME, took_over=True),
        ld.Announce(text="taking over (epoch 8)"),
        ld.Lead(epoch=8),
        ld.RoleChanged(from_=R.STANDBY, to=R.LEADER, reason="took the run lock (epoch 8)"),
    ]
    assert d.state.shown_role == "leader" and d.state.deadline_at == pytest.approx(5.7)
    out = d.feed(ld.FleetSettled(), 1.25)
    assert out == [ld.InCharge(epoch=8, since_lock_s=0.6, since_lock_free_s=0.65)]
    assert d.feed(ld.FleetSettled(), 2.0) == []


def test_a_standby_stops_at_once_and_a_late_lock_leads_nothing() -> None:
    """Stop as a standby: stand down (exit 0). The try in flight that then takes the lock is
    said (the epoch moved) but leads nothing: no fleet, no check."""
    d = standby()
    d.wake()
    assert kinds(d.feed(ld.StopAsked())) == [ld.StandDown, ld.RoleChanged]
    assert d.state.finished and d.state.exit_code == 0
    out = d.feed(ld.LockTaken(epoch=8, leader=ME, locked_at=1.0), 1.0)
    assert out == [ld.Leading(epoch=8, leader=ME, took_over=True)]
    assert d.state.shown_role == "leader" and d.state.deadline_at is None
    assert d.feed(ld.LockTaken(epoch=9, leader=ME, locked_at=1.1), 1.1) == []


def test_a_standby_whose_serving_ended_tries_no_more() -> None:
    """The shell stopped serving (an unexpected end): no more tries, and a try in flight
    that took the lock leads nothing."""
    d = standby()
    d.wake()
    d.feed(ld.ServingEnded())
    assert d.state.deadline_at is None
    assert d.feed(ld.LockTaken(epoch=8, leader=ME, locked_at=1.0), 1.0) == []
    assert d.state.role is R.STANDBY and d.feed(ld.DeadlinePassed(), 9.0) == []


# --- a leader's checks -------------------------------------------------------------------


def test_a_leader_checks_every_check_interval_after_the_last_answer() -> None:
    """The first check ``check_interval_s`` after serving, the next that long after its
    answer; a held lock and our epoch (or an unreadable epoch file) change nothing."""
    d = leader()
    assert d.state.deadline_at == pytest.approx(5.0)
    assert d.wake() == [ld.CheckLock()]
    assert d.feed(ld.LockChecked(held=True, epoch_on_disk=7), 5.2) == []
    assert d.state.deadline_at == pytest.approx(10.2)
    d.wake()
    assert d.feed(ld.LockChecked(held=True, epoch_on_disk=None), 10.3) == []
    assert d.state.role is R.LEADER


def test_a_sign_of_trouble_checks_at_once_or_right_after_the_check_in_flight() -> None:
    """``CheckAsked`` (an I/O error on the run root) checks now; during a check, once more
    right after it."""
    d = leader()
    assert d.feed(ld.CheckAsked(), 1.0) == [ld.CheckLock()]
    assert d.feed(ld.CheckAsked(), 1.1) == []
    assert d.feed(ld.LockChecked(held=True, epoch_on_disk=7), 1.2) == [ld.CheckLock()]
    assert d.feed(ld.LockChecked(held=True, epoch_on_disk=7), 1.3) == []
    assert d.state.deadline_at == pytest.approx(6.3)


@pytest.mark.parametrize(
    ("event", "epoch_on_disk", "reason"),
    [
        (ld.LockChecked(held=False, epoch_on_disk=7, reason="lock file replaced"), 7,
         "lock file replaced"),
        (ld.LockChecked(held=False, epoch_on_disk=None), None, "the run lock is lost"),
        (ld.LockChecked(held=True, epoch_on_disk=8), 8, "the run directory's epoch is 8, ours 7"),
        (ld.LockChecked(held=True, epoch_on_disk=6), 6, "the run directory's epoch is 6, ours 7"),
    ],
)  # fmt: skip
def test_a_lost_lock_or_another_epoch_deposes(
    event: ld.LockChecked, epoch_on_disk: int | None, reason: str
) -> None:
    """A check that finds the lock lost (the shell's reason kept) or another epoch on disk:
    ``Deposed`` with both epochs and why, exit 3, and no check ever again."""
    d = leader()
    d.wake()
    out = d.feed(event, 5.1)
    assert of(out, ld.Deposed) == [ld.Deposed(epoch=7, epoch_on_disk=epoch_on_disk, reason=reason)]
    assert d.state.role is R.DEPOSED and d.state.exit_code == ld.EXIT_DEPOSED
    assert d.state.deadline_at is None
    assert d.feed(ld.CheckAsked(), 6.0) == []


def test_a_fenced_request_deposes_at_once() -> None:
    """An agent refused a request by the epoch: deposed, naming the host."""
    d = leader()
    out = d.feed(ld.Fenced(host="w-3", reason="epoch 8 > 7"), 1.0)
    assert of(out, ld.Deposed) == [
        ld.Deposed(epoch=7, epoch_on_disk=None, reason="w-3: fenced: epoch 8 > 7")
    ]


def test_a_check_that_hangs_deposes_after_the_check_timeout() -> None:
    """No answer within CHECK_TIMEOUT_S (the run root hangs): deposed; the late answer is
    old news."""
    d = leader()
    d.wake()
    assert d.state.deadline_at == pytest.approx(5.0 + ld.CHECK_TIMEOUT_S)
    assert d.feed(ld.DeadlinePassed(), 20.0) == []
    [deposed] = of(d.wake(), ld.Deposed)
    assert deposed.reason == (
        f"the run lock could not be checked within {ld.CHECK_TIMEOUT_S:g}s (the run root hangs)"
    )
    assert d.feed(ld.LockChecked(held=True, epoch_on_disk=7), 40.0) == []
    assert d.state.role is R.DEPOSED


def test_no_check_once_serving_ended_and_a_stop_exits_0() -> None:
    """The fleet over, the files being saved: no more checks (an answer in flight is old
    news); the lock released: stopped, exit 0."""
    d = leader()
    d.feed(ld.StopAsked(), 1.0)
    d.wake()
    d.feed(ld.ServingEnded(), 5.5)
    assert d.state.deadline_at is None
    assert d.feed(ld.LockChecked(held=False, epoch_on_disk=None), 5.6) == []
    assert d.feed(ld.CheckAsked(), 5.7) == []
    d.feed(ld.LockReleased(), 6.0)
    assert d.state.finished and d.state.exit_code == 0


# --- handover ----------------------------------------------------------------------------


def test_a_handover_detaches_releases_then_watches_for_the_next_leader() -> None:
    """Asked to hand over: ``HandOver`` (detach, hold ``handover_hold_s``) and the reply
    naming us and the epoch; exit 3 from now. Once the lock is released it looks at it at
    once and every HANDOVER_LOOK_S until a daemon other than us holds it."""
    d = leader()
    out = d.feed(ld.HandoverAsked(token=5), 1.0)
    assert out[:2] == [
        ld.HandOver(epoch=7, hold_s=5.0),
        ld.Reply(token=5, result={"handing_over": True, "leader": ME, "epoch": 7}),
    ]
    assert d.state.exit_code == ld.EXIT_DEPOSED
    d.feed(ld.StopAsked(), 1.0)
    d.feed(ld.ServingEnded(), 1.5)
    assert of(d.feed(ld.LockReleased(), 2.0), ld.LookAtLock) == [ld.LookAtLock()]
    assert d.feed(ld.LockLooked(holder=""), 2.01) == []
    assert d.state.deadline_at == pytest.approx(2.06)
    assert d.wake() == [ld.LookAtLock()]
    assert d.feed(ld.LockLooked(holder=ME), 2.07) == []  # our name, left in the file
    d.wake()
    out = d.feed(ld.LockLooked(holder=OTHER), 2.2)
    assert out[0] == ld.HandedOver(leader=OTHER)
    assert d.state.finished and d.state.exit_code == ld.EXIT_DEPOSED


def test_a_handover_nobody_takes_is_said_after_the_hold() -> None:
    """Nobody took the lock within ``handover_hold_s``: ``ha.handover_unclaimed``, exit 3."""
    d = leader()
    d.feed(ld.HandoverAsked(token=1), 1.0)
    looks = of(d.feed(ld.LockReleased(), 2.0), ld.LookAtLock)
    while looks:
        d.feed(ld.LockLooked(holder=""))
        looks = of(d.wake(), ld.LookAtLock)
    assert d.state.finished
    assert of(d.done, ld.HandoverUnclaimed) == [ld.HandoverUnclaimed(waited_s=5.0)]
    assert d.now == pytest.approx(7.0) and d.state.exit_code == ld.EXIT_DEPOSED


def test_a_look_that_hangs_ends_the_hold_off_silently() -> None:
    """The run root hangs during the hold-off: at its end, stop without a verdict."""
    d = leader()
    d.feed(ld.HandoverAsked(token=1), 1.0)
    d.feed(ld.LockReleased(), 2.0)  # a look in flight, never answered
    out = d.wake()
    assert kinds(out) == [ld.RoleChanged]
    assert d.state.finished and d.now == pytest.approx(7.0)


@pytest.mark.parametrize(
    ("prepare", "code"),
    [
        ("standby", ld.Refusal.NOT_LEADER),
        ("stopping", ld.Refusal.SHUTTING_DOWN),
        ("deposed", ld.Refusal.NOT_LEADER),
    ],
)
def test_a_handover_is_refused_when_there_is_nothing_to_hand_over(
    prepare: str, code: ld.Refusal
) -> None:
    """A standby, a stopping leader and a deposed one refuse a handover by a code, with a
    message saying why."""
    d = standby() if prepare == "standby" else leader()
    if prepare == "stopping":
        d.feed(ld.StopAsked())
    if prepare == "deposed":
        d.feed(ld.Fenced(host="w", reason="x"))
    role = d.state.role
    (reply,) = d.feed(ld.HandoverAsked(token=3))
    assert isinstance(reply, ld.Reply)
    assert (reply.token, reply.refusal, reply.result) == (3, code, None) and reply.message
    assert d.state.role is role


def test_deposed_during_a_handover_still_holds_off() -> None:
    """A handover asked, then deposed before the lock went: it still holds off (the next
    leader is then named), and exits 3."""
    d = leader()
    d.feed(ld.HandoverAsked(token=1), 1.0)
    d.feed(ld.Fenced(host="w", reason="x"), 1.1)
    assert of(d.feed(ld.LockReleased(), 2.0), ld.LookAtLock) == [ld.LookAtLock()]
    d.feed(ld.LockLooked(holder=OTHER), 2.1)
    assert of(d.done, ld.HandedOver) == [ld.HandedOver(leader=OTHER)]
    assert d.state.exit_code == ld.EXIT_DEPOSED


def test_the_cli_waits_for_a_handover_by_the_same_rule() -> None:
    """``watch_handover``: a look at once; a holder other than the old leader ends it; the
    wait ends after ``wait_s`` without one."""
    state, out = ld.watch_handover(OTHER, 10.0, 3.0)
    assert out == [ld.LookAtLock()] and state.deadline_at == pytest.approx(13.0)
    state, out = ld.step(state, ld.LockLooked(holder=OTHER), 10.1, POLICY)
    assert out == [] and not state.finished
    state, out = ld.step(state, ld.LockLooked(holder=ME), 10.12, POLICY)  # none in flight
    assert out == [] and not state.finished
    state, out = ld.step(state, ld.DeadlinePassed(), 10.15, POLICY)
    assert out == [ld.LookAtLock()]
    state, out = ld.step(state, ld.LockLooked(holder=ME), 10.3, POLICY)
    assert out[0] == ld.HandedOver(leader=ME) and state.finished


# --- health, exit codes, the rules the shell asks about -------------------------------------


def test_a_standby_is_healthy_while_its_wait_turns() -> None:
    """The watchdog is pinged while a try was issued within STANDBY_HEALTH_MIN_S (or four
    poll intervals); a try that hangs longer withholds it. The file watcher is no measure
    of a standby."""
    d = standby()
    d.wake()
    tried_at = d.now
    assert d.feed(ld.WatchdogDue(watcher_healthy=False), tried_at + 9.0) == [ld.PingWatchdog()]
    [withheld] = d.feed(ld.WatchdogDue(watcher_healthy=True), tried_at + 10.5)
    assert isinstance(withheld, ld.WithholdWatchdog) and "10s" in withheld.reason
    slow = Daemon(policy=ld.Policy(standby=True, poll_interval_s=4.0))
    slow.feed(ld.LockBusy(holder=OTHER))
    slow.feed(ld.Serving())
    assert slow.feed(ld.WatchdogDue(watcher_healthy=False), 15.0) == [ld.PingWatchdog()]


def test_a_leader_is_as_healthy_as_its_file_watcher() -> None:
    """A leader pings the watchdog iff its file watcher is healthy."""
    d = leader()
    assert d.feed(ld.WatchdogDue(watcher_healthy=True)) == [ld.PingWatchdog()]
    assert d.feed(ld.WatchdogDue(watcher_healthy=False)) == [
        ld.WithholdWatchdog(reason="file watcher not healthy")
    ]


@pytest.mark.parametrize(
    ("epoch", "on_disk", "why"),
    [
        (7, 7, None),
        (7, None, None),
        (7, 8, "the run directory's epoch is 8, ours 7"),
        (7, 0, "the run directory's epoch is 0, ours 7"),
        (0, 3, "the run directory's epoch is 3, ours 0"),
    ],
)
def test_the_run_files_are_ours_only_under_our_epoch(
    epoch: int, on_disk: int | None, why: str | None
) -> None:
    """``not_ours``: another epoch on disk forbids a write; an unreadable one does not."""
    assert ld.not_ours(epoch, on_disk) == why


def test_a_standby_refuses_a_leaders_commands_and_a_leader_serves_them() -> None:
    """``refusal``: a standby refuses a command or a reload as ``not_leader``, the command's
    message naming the leader; a leader, even one that stopped, refuses nothing on these
    grounds."""
    s = standby()
    assert s.state.standing_by and s.state.shown_role == "standby"
    command, reload = ld.refusal(s.state, "command"), ld.refusal(s.state, "reload")
    assert command is not None and reload is not None
    assert command[0] is reload[0] is ld.Refusal.NOT_LEADER
    assert OTHER in command[1]
    assert (ld.refusal(ld.new(), "command") or (None, ""))[0] is ld.Refusal.NOT_LEADER
    assert ld.refusal(leader().state, "command") is None
