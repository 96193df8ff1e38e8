"""Who leads a run: the run lock, the epoch, a standby's wait, the handover. Pure, like health.py.

Rules (docs/OPERATIONS.md §9); everything that decides who leads lives in this file:

1. The lock is the election. A daemon leads only after it took ``ctl/supervisor.lock``; the
   shell writes the next epoch under it before it says so (``LockTaken``), so the lock
   orders the bumps and every leadership has an epoch of its own. ``epoch`` comes from no
   other event: a daemon leads with the epoch it wrote, or not at all.
2. Without ``[ha] standby`` a daemon that finds the lock held does not start
   (EXIT_CANNOT_START). A standby tries the lock every ``poll_interval_s``, one try at a
   time, with its hosts' connections warm, and leads at the first success. Until then it
   writes nothing under the run root: it only tries the lock and reads the run directory
   (for its ``status``, while someone asks, and when the leader changes).
3. The epoch is the fence. A leader checks every ``check_interval_s`` (and at once when the
   shell saw the run root fail) that it still holds the lock and that the epoch on disk is
   its own (``not_ours``). A lost lock, another epoch on disk, a request an agent fenced, or
   a check that does not answer within CHECK_TIMEOUT_S (the run root hangs) deposes it: it
   acts no more, at once (the shell tells the fleet), and exits EXIT_DEPOSED. An epoch file
   that cannot be read deposes no one: the lock is the election, the epoch only the fence.
4. Deposed is for good. A deposed daemon never tries, checks or leads again; it only exits
   (after a hold-off, if a handover had been asked).
5. Handover. A leader asked to hand over has its fleet detach (every worker left running),
   and once the shell released the lock, looks at it until a daemon other than itself holds
   it or ``handover_hold_s`` passed: systemd's restart of this one then finds the lock taken.
   It exits EXIT_DEPOSED either way. ``reward-supervisor handover`` waits by the same rule.
6. Health. A standby is healthy (the watchdog is pinged) while its wait turns: a try of the
   lock issued within STANDBY_HEALTH_MIN_S, or four poll intervals if longer. Any other
   daemon is as healthy as its file watcher.
7. Exit codes: 0 after a stop; EXIT_DEPOSED exactly when deposed or handed over;
   EXIT_CANNOT_START when the lock was held (or could not be tried) and we may not wait.

Theory of operation. ``step(state, event, now, policy)`` returns the new frozen
``Leadership`` and the actions to perform; every I/O action (``TryLock``, ``CheckLock``,
``ReadView``, ``LookAtLock``) is answered by exactly one event, and at most one is in flight.
``deadline_at`` is the next instant at which time alone could change something (the next
try, check or look, a check that takes too long, the end of the hold-off); the shell feeds
``DeadlinePassed`` then, and early, late or repeated wake-ups are harmless. Nothing here
sleeps, logs or does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from enum import StrEnum
from typing import Any, Final, Literal, assert_never

from supervisor.policies import HaPolicy
from supervisor.records import record
from supervisor.refusals import Refusal as Refusal

#: The exit code of a daemon that was deposed or handed over: non-zero, so that systemd
#: (Restart=on-failure) starts it again, as a standby.
EXIT_DEPOSED: Final = 3
#: The exit code of a daemon that may not wait for a held lock (no ``[ha] standby``).
EXIT_CANNOT_START: Final = 1
#: A leader that cannot tell for this long whether it still holds the lock (the run root
#: hangs) steps down: well within the NFS lease (90 s) after which a standby may take over.
CHECK_TIMEOUT_S: Final = 30.0
#: A standby is healthy (the watchdog is pinged) while its wait for the lock turned within
#: this long, or four poll intervals if longer.
STANDBY_HEALTH_MIN_S: Final = 10.0
#: A standby re-reads the run directory for its ``status`` at most this often, and only
#: while its status was asked for within STANDBY_VIEW_ASKED_S: a thousand hosts' files
#: every two seconds would load the shared filesystem for nobody.
STANDBY_VIEW_INTERVAL_S: Final = 2.0
STANDBY_VIEW_ASKED_S: Final = 60.0
#: A handover's wait looks at the lock this often (or every poll interval if shorter): a
#: look is two opens of a small file, and the new leader is named within a blink.
HANDOVER_LOOK_S: Final = 0.05


class Role(StrEnum):
    """What this daemon is to the run."""

    #: The lock not tried yet.
    STARTING = "starting"
    #: Another daemon holds the lock; ours is tried every ``poll_interval_s``.
    STANDBY = "standby"
    #: We hold the lock under ``epoch``, checked every ``check_interval_s``.
    LEADER = "leader"
    #: A handover was asked: the fleet detaches; the lock goes once the files are saved.
    HANDING_OVER = "handing_over"
    #: The lock released after a handover: watching for another daemon to take it.
    HOLDING_OFF = "holding_off"
    #: Another daemon leads (or we cannot tell): nothing more is done; exits EXIT_DEPOSED.
    DEPOSED = "deposed"
    #: Over: ``exit_code`` says how.
    STOPPED = "stopped"


#: Roles in which this daemon's fleet acts under ``epoch`` (it is checked meanwhile).
ACTING_ROLES: Final = frozenset({Role.LEADER, Role.HANDING_OVER})

#: The one I/O operation in flight, if any.
Op = Literal["try", "check", "view", "look"]

#: ``[ha]``; ``config.py`` builds it. Defined apart (``policies.py``) so that reading a
#: config imports no core.
Policy = HaPolicy


@record
class Leadership:
    """One daemon's leadership; change it only through ``step``."""

    role: Role = Role.STARTING
    #: This leadership's epoch (``ctl/supervisor.epoch`` as we wrote it); 0 until we lead.
    epoch: int = 0
    #: Who holds the lock, as the holder wrote it (ours once we lead; "" unknown).
    leader: str = ""
    #: The epoch on disk as last read (None: not read, or unreadable).
    epoch_on_disk: int | None = None
    #: We took the lock at some point (we are shown as the leader from then on).
    led: bool = False
    #: We led after standing by (``InCharge`` is said once the fleet settles).
    took_over: bool = False
    #: The shell is ready to act on our behalf (between ``Serving`` and ``ServingEnded``).
    serving: bool = False
    #: A stop was asked; a handover was asked (it holds off even if deposed meanwhile).
    stopping: bool = False
    handover_asked: bool = False
    #: The I/O operation in flight and when it was issued.
    op: Op | None = None
    op_at: float | None = None
    #: When the next try, check or look is due (None: none is).
    next_at: float | None = None
    #: The shell saw a sign that we may no longer lead: check as soon as possible.
    check_asked: bool = False
    #: When the standby's wait last turned (a try issued), for its health.
    tick_at: float | None = None
    #: When the standby last read the run directory, and when its status was last asked.
    view_at: float | None = None
    view_asked_at: float | None = None
    #: The takeover's timeline: the try that found the lock free, the lock taken.
    free_seen_at: float | None = None
    locked_at: float | None = None
    #: The hold-off: since when, until when.
    hold_from: float | None = None
    hold_until: float | None = None
    exit_code: int = 0
    deadline_at: float | None = None

    @property
    def finished(self) -> bool:
        """Nothing more will happen: the daemon may exit with ``exit_code``."""
        return self.role is Role.STOPPED

    @property
    def standing_by(self) -> bool:
        """We have not led: the run directory is all we can show, a leader's commands are
        refused (``refusal``)."""
        return not self.led

    @property
    def shown_role(self) -> str:
        """The role in ``status`` and logs (contract): "leader" once we took the lock."""
        return "standby" if self.standing_by else "leader"


def new() -> Leadership:
    """A daemon about to try the lock."""
    return Leadership()


def watch_handover(old: str, now: float, wait_s: float) -> tuple[Leadership, list[Action]]:
    """A handover seen from outside the daemons (``reward-supervisor handover``): look at
    the lock until a daemon other than ``old`` holds it, or for ``wait_s``; the same rule
    as the old leader's hold-off."""
    state = Leadership(
        role=Role.HOLDING_OFF, leader=old, hold_from=now, hold_until=now + wait_s, next_at=now
    )
    return _reconcile(state, [], now, Policy())


def not_ours(epoch: int, on_disk: int | None) -> str | None:
    """Why the run's files are not ours to write (another leadership's epoch is on disk), or
    None: they are, or the epoch file cannot be read (it fences nothing)."""
    if on_disk is None or on_disk == epoch:
        return None
    return f"the run directory's epoch is {on_disk}, ours {epoch}"


def asked_to_stop(state: Leadership) -> bool:
    """A stop was asked already: another request is the same stop."""
    return state.stopping


def refusal(
    state: Leadership, command: Literal["command", "reload", "handover"]
) -> tuple[Refusal, str] | None:
    """Why an operator ``command`` that only a leader serves is refused here (its code and
    message), or None."""
    if not state.standing_by:
        return None
    if command == "reload":
        why = "this daemon is a standby: restart it to apply a new config before it leads"
        return Refusal.NOT_LEADER, why
    return Refusal.NOT_LEADER, f"this daemon is a standby; the leader is {state.leader or '?'}"


# --------------------------------------------------------------------------------------
# Events: past-tense facts, and the answers to the I/O actions.


@record
class LockTaken:
    """Answer to ``TryLock``: the lock is ours, and ``epoch`` was written under it."""

    epoch: int
    #: How we named ourselves in the lock file.
    leader: str
    #: When the lock was taken (monotonic), before the epoch and the run files were written.
    locked_at: float


@record
class LockBusy:
    """Answer to ``TryLock``: another daemon holds the lock (``holder``: "" unknown)."""

    holder: str
    #: The lock file, for the operator's message.
    lock_file: str = ""


@record
class LockFailed:
    """Answer to ``TryLock``: the try failed (the run root's I/O error)."""

    reason: str


@record
class LockChecked:
    """Answer to ``CheckLock``: whether we still hold the lock (``reason`` why not) and the
    epoch on disk (None: unreadable)."""

    held: bool
    epoch_on_disk: int | None
    reason: str = ""


@record
class ViewRead:
    """Answer to ``ReadView``: the run directory was read for the standby's status, and the
    epoch there (None: unreadable)."""

    epoch_on_disk: int | None


@record
class LockLooked:
    """Answer to ``LookAtLock``: who holds the lock now ("" nobody, or nobody can tell)."""

    holder: str


@record
class Fenced:
    """A host's agent refused a launch or terminate of ``host``: the run directory's epoch
    is higher than ours."""

    host: str
    reason: str


@record
class CheckAsked:
    """The shell saw a sign that we may no longer lead (an I/O error on the run root,
    another epoch on disk): check now."""


@record
class Serving:
    """The shell is ready to act for us: control socket bound, tasks running."""


@record
class ServingEnded:
    """The fleet is over and the shell saves what it must: no more checks."""


@record
class LockReleased:
    """The shell let go of the run lock (if it held it): the daemon is about to exit."""


@record
class StatusAsked:
    """An operator asked for this daemon's status."""


@record
class HandoverAsked:
    """An operator asked the leader to hand over; answer ``Reply(token)``."""

    token: int


@record
class StopAsked:
    """A stop was asked (a signal, the ``stop`` command, a handover)."""


@record
class FleetSettled:
    """The fleet's start-up is over: every host adopted or found unreachable."""


@record
class WatchdogDue:
    """Time to ping the service manager's watchdog, if we are healthy; ``watcher_healthy``
    is the file watcher's own health."""

    watcher_healthy: bool


@record
class DeadlinePassed:
    """The shell's timer for ``deadline_at`` fired (maybe early, late or twice)."""


Event = (
    LockTaken
    | LockBusy
    | LockFailed
    | LockChecked
    | ViewRead
    | LockLooked
    | Fenced
    | CheckAsked
    | Serving
    | ServingEnded
    | LockReleased
    | StatusAsked
    | HandoverAsked
    | StopAsked
    | FleetSettled
    | WatchdogDue
    | DeadlinePassed
)

# --------------------------------------------------------------------------------------
# Actions: what the shell must do. I/O actions are answered by one event each.


@record
class TryLock:
    """Take the run lock if it is free, then write the next epoch and the run files under
    it; answer ``LockTaken``, ``LockBusy`` or ``LockFailed``."""


@record
class CheckLock:
    """Check that the lock is still ours and read the epoch; answer ``LockChecked``."""


@record
class ReadView:
    """Read the run directory for the standby's status (and the epoch); answer ``ViewRead``."""


@record
class LookAtLock:
    """Look who holds the run lock, taking nothing; answer ``LockLooked``."""


@record
class StandBy:
    """Wait as a standby: keep every host's connection warm (its agent started), show
    ``summary`` and say READY (logged as ``ha.standby``)."""

    leader: str
    poll_interval_s: float
    summary: str


@record
class LeaderChanged:
    """Another daemon holds the lock now (logged as ``ha.leader_changed``)."""

    leader: str


@record
class TakeoverFailed:
    """A try of the lock failed; the next comes in ``retry_in_s`` (``ha.takeover_failed``)."""

    reason: str
    retry_in_s: float


@record
class Leading:
    """We took the lock under ``epoch`` (logged as ``ha.leading``; after ``took_over``, with
    the standby's warm connections)."""

    epoch: int
    leader: str
    took_over: bool


@record
class Lead:
    """Boot the fleet under ``epoch``: load the restart history, adopt every host."""

    epoch: int


@record
class Announce:
    """Show ``text`` as the service's status line (``STATUS=``)."""

    text: str


@record
class InCharge:
    """A takeover is complete: every host adopted (logged as ``ha.in_charge``)."""

    epoch: int
    since_lock_s: float
    since_lock_free_s: float


@record
class StandDown:
    """A standby stops: nothing to lead; say STOPPING and end the fleet unbooted."""


@record
class Deposed:
    """Another daemon leads now (or we cannot tell): stop acting at once (touch no worker,
    write no file), tell the fleet, and exit EXIT_DEPOSED (logged as ``ha.deposed``)."""

    epoch: int
    epoch_on_disk: int | None
    reason: str


@record
class HandOver:
    """Stop with the workers left running (detach); the lock goes once the files are saved
    (logged as ``ha.handover``)."""

    epoch: int
    hold_s: float


@record
class HandedOver:
    """Another daemon took the lock after our handover (logged as ``ha.handed_over``)."""

    leader: str


@record
class HandoverUnclaimed:
    """Nobody took the lock within the hold-off (logged as ``ha.handover_unclaimed``)."""

    waited_s: float


@record
class Reply:
    """Answer the command ``token``: done (with ``result``), or refused."""

    token: int
    result: Mapping[str, object] | None = None
    refusal: Refusal | None = None
    message: str = ""


@record
class CannotStart:
    """Exit EXIT_CANNOT_START without serving (logged as ``daemon.cannot_start``)."""

    reason: str


@record
class PingWatchdog:
    """Ping the service manager's watchdog (WATCHDOG=1)."""


@record
class WithholdWatchdog:
    """Do not ping the watchdog: we are not healthy (logged as ``daemon.watchdog_withheld``)."""

    reason: str


@record
class RoleChanged:
    """This daemon's role changed (logged as ``ha.role``)."""

    from_: Role
    to: Role
    reason: str


Action = (
    TryLock
    | CheckLock
    | ReadView
    | LookAtLock
    | StandBy
    | LeaderChanged
    | TakeoverFailed
    | Leading
    | Lead
    | Announce
    | InCharge
    | StandDown
    | Deposed
    | HandOver
    | HandedOver
    | HandoverUnclaimed
    | Reply
    | CannotStart
    | PingWatchdog
    | WithholdWatchdog
    | RoleChanged
)


# --------------------------------------------------------------------------------------
# The machine.

R = Role
#: A handler takes the event type its row names (the table pairs them).
_Handler = Callable[[Leadership, Any, float, Policy, list[Action]], Leadership]


def step(
    state: Leadership, event: Event, now: float, policy: Policy
) -> tuple[Leadership, list[Action]]:
    """Apply one event seen at monotonic ``now``; return the new state and what to do."""
    out: list[Action] = []
    handler = TRANSITIONS.get((state.role, type(event)))
    if handler is not None:
        state = handler(state, event, now, policy, out)
    else:
        state = _in_any_role(state, event, now, policy, out)
    return _reconcile(state, out, now, policy)


def _in_any_role(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    """An event the table has no row for in this role: the rules of every role, or old news."""
    match event:
        case WatchdogDue():
            out.append(_watchdog(state, event, now, policy))
        case HandoverAsked():
            out.append(_refuse_handover(state, event))
        case StopAsked():
            return replace(state, stopping=True)
        case (
            LockTaken()
            | LockBusy()
            | LockFailed()
            | LockChecked()
            | ViewRead()
            | LockLooked()
            | Fenced()
            | CheckAsked()
            | Serving()
            | ServingEnded()
            | LockReleased()
            | StatusAsked()
            | FleetSettled()
            | DeadlinePassed()
        ):
            pass  # not this role's business (an answer to nothing in flight, news too late)
        case _:
            assert_never(event)
    return state


def _enter(state: Leadership, role: Role, reason: str, out: list[Action]) -> Leadership:
    """Move to ``role``, saying so."""
    out.append(RoleChanged(from_=state.role, to=role, reason=reason))
    return replace(state, role=role)


def _holder(name: str) -> str:
    return name or "unknown"


# --- starting --------------------------------------------------------------------------


def _first_lock_taken(
    state: Leadership, event: LockTaken, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    out.append(Leading(epoch=event.epoch, leader=event.leader, took_over=False))
    state = replace(
        state,
        led=True,
        epoch=event.epoch,
        epoch_on_disk=event.epoch,
        leader=event.leader,
        locked_at=event.locked_at,
    )
    return _enter(state, R.LEADER, f"took the run lock (epoch {event.epoch})", out)


def _first_lock_busy(
    state: Leadership, event: LockBusy, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    state = replace(state, leader=event.holder)
    held = f"the run lock is held by {_holder(event.holder)}"
    if state.stopping:
        out.append(StandDown())
        return _enter(state, R.STOPPED, f"{held}; stopped before standing by", out)
    if not policy.standby:
        where = event.lock_file or "the run lock"
        out.append(
            CannotStart(
                reason=f"another reward-supervisor already runs this run ({where} is locked by"
                f" {_holder(event.holder)}; [ha] standby = true or --standby waits)"
            )
        )
        return _enter(replace(state, exit_code=EXIT_CANNOT_START), R.STOPPED, held, out)
    return _enter(state, R.STANDBY, held, out)


def _first_lock_failed(
    state: Leadership, event: LockFailed, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    out.append(CannotStart(reason=event.reason))
    return _enter(replace(state, exit_code=EXIT_CANNOT_START), R.STOPPED, event.reason, out)


# --- standby ---------------------------------------------------------------------------


def _stand_by(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.serving:
        return state
    summary = f"standby, leader: {_holder(state.leader)}"
    out.append(
        StandBy(leader=state.leader, poll_interval_s=policy.poll_interval_s, summary=summary)
    )
    out.append(ReadView())
    return replace(state, serving=True, tick_at=now, op="view", op_at=now)


def _took_over(
    state: Leadership, event: LockTaken, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "try":
        return state  # an answer to no try in flight: cannot be trusted
    out.append(Leading(epoch=event.epoch, leader=event.leader, took_over=True))
    out.append(Announce(text=f"taking over (epoch {event.epoch})"))
    out.append(Lead(epoch=event.epoch))
    state = replace(
        state,
        led=True,
        took_over=True,
        epoch=event.epoch,
        epoch_on_disk=event.epoch,
        leader=event.leader,
        free_seen_at=state.op_at,
        locked_at=event.locked_at,
        op=None,
        op_at=None,
        next_at=now + policy.check_interval_s,
    )
    return _enter(state, R.LEADER, f"took the run lock (epoch {event.epoch})", out)


def _still_busy(
    state: Leadership, event: LockBusy, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "try":
        return state
    changed = event.holder != state.leader
    if changed:
        out.append(LeaderChanged(leader=event.holder))
        out.append(Announce(text=f"standby, leader: {_holder(event.holder)}"))
    state = replace(state, leader=event.holder, op=None, op_at=None)
    asked = state.view_asked_at is not None and now - state.view_asked_at <= STANDBY_VIEW_ASKED_S
    stale = state.view_at is None or now - state.view_at >= STANDBY_VIEW_INTERVAL_S
    if changed or (asked and stale):
        out.append(ReadView())
        return replace(state, op="view", op_at=now)
    return replace(state, next_at=now + policy.poll_interval_s)


def _try_failed(
    state: Leadership, event: LockFailed, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "try":
        return state
    out.append(TakeoverFailed(reason=event.reason, retry_in_s=policy.poll_interval_s))
    return replace(state, op=None, op_at=None, next_at=now + policy.poll_interval_s)


def _view_read(
    state: Leadership, event: ViewRead, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "view":
        return state
    return replace(
        state,
        epoch_on_disk=event.epoch_on_disk,
        view_at=now,
        op=None,
        op_at=None,
        next_at=now + policy.poll_interval_s,
    )


def _status_asked(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    return replace(state, view_asked_at=now)


def _standby_stops(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    # A try in flight is abandoned: should it take the lock, the shell releases it unused.
    out.append(StandDown())
    state = replace(state, stopping=True, next_at=None)
    return _enter(state, R.STOPPED, "stopped as a standby", out)


# --- leading ---------------------------------------------------------------------------


def _lead(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.serving:
        return state  # a standby that took over leads already
    out.append(Lead(epoch=state.epoch))
    return replace(state, serving=True, next_at=now + policy.check_interval_s)


def _checked(
    state: Leadership, event: LockChecked, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "check":
        return state
    state = replace(state, op=None, op_at=None, epoch_on_disk=event.epoch_on_disk)
    if not event.held:
        return _depose(state, event.epoch_on_disk, event.reason or "the run lock is lost", out)
    why = not_ours(state.epoch, event.epoch_on_disk)
    if why is not None:
        return _depose(state, event.epoch_on_disk, why, out)
    due = now if state.check_asked else now + policy.check_interval_s
    return replace(state, next_at=due, check_asked=False)


def _check_asked(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op == "check":
        return replace(state, check_asked=True)  # once this check answers, another
    if not state.serving:
        return state
    return replace(state, next_at=now)


def _fenced(
    state: Leadership, event: Fenced, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    return _depose(state, None, f"{event.host}: fenced: {event.reason}", out)


def _leader_deadline(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "check" or state.op_at is None or now < state.op_at + CHECK_TIMEOUT_S:
        return state  # early: _reconcile issues the check when it is due
    reason = f"the run lock could not be checked within {CHECK_TIMEOUT_S:g}s (the run root hangs)"
    return _depose(replace(state, epoch_on_disk=None), None, reason, out)


def _depose(
    state: Leadership, epoch_on_disk: int | None, reason: str, out: list[Action]
) -> Leadership:
    """Stop at once: ``Deposed``, and nothing more is ever tried or checked."""
    out.append(Deposed(epoch=state.epoch, epoch_on_disk=epoch_on_disk, reason=reason))
    state = replace(
        state, exit_code=EXIT_DEPOSED, op=None, op_at=None, next_at=None, check_asked=False
    )
    return _enter(state, R.DEPOSED, reason, out)


def _settled(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if not state.took_over or state.locked_at is None or state.free_seen_at is None:
        return state
    out.append(
        InCharge(
            epoch=state.epoch,
            since_lock_s=round(now - state.locked_at, 3),
            since_lock_free_s=round(now - state.free_seen_at, 3),
        )
    )
    return replace(state, took_over=False)  # said once


def _hand_over(
    state: Leadership, event: HandoverAsked, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.stopping:
        out.append(_refuse_handover(state, event))
        return state
    out.append(HandOver(epoch=state.epoch, hold_s=policy.handover_hold_s))
    result = {"handing_over": True, "leader": state.leader, "epoch": state.epoch}
    out.append(Reply(token=event.token, result=result))
    state = replace(state, handover_asked=True, exit_code=EXIT_DEPOSED)
    return _enter(state, R.HANDING_OVER, "handover asked", out)


def _serving_ended(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    # A try or check in flight is abandoned: its answer finds none in flight (a lock it
    # took is released unused when the daemon exits).
    return replace(state, serving=False, op=None, op_at=None, next_at=None)


def _released(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    state = replace(state, serving=False, op=None, op_at=None, next_at=None)
    if not state.handover_asked:
        return _enter(state, R.STOPPED, "the run lock released", out)
    state = replace(state, next_at=now, hold_from=now, hold_until=now + policy.handover_hold_s)
    return _enter(state, R.HOLDING_OFF, "the run lock released for a handover", out)


# --- holding off -----------------------------------------------------------------------


def _looked(
    state: Leadership, event: LockLooked, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    if state.op != "look":
        return state
    state = replace(state, op=None, op_at=None)
    if event.holder and event.holder != state.leader:
        out.append(HandedOver(leader=event.holder))
        return _enter(state, R.STOPPED, f"handed over to {event.holder}", out)
    return replace(state, next_at=now + min(HANDOVER_LOOK_S, policy.poll_interval_s))


def _hold_deadline(
    state: Leadership, event: Event, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    until, since = state.hold_until, state.hold_from
    if until is None or since is None or now < until:
        return state
    if state.op == "look":
        # The last look never answered: the run root hangs, and nobody can take the lock
        # through it either. Nothing to report.
        state = replace(state, op=None, op_at=None, next_at=None)
        return _enter(state, R.STOPPED, "the run root hangs", out)
    out.append(HandoverUnclaimed(waited_s=round(until - since, 3)))
    return _enter(replace(state, next_at=None), R.STOPPED, "no daemon took the run lock", out)


# --- stopped ---------------------------------------------------------------------------


def _late_lock_taken(
    state: Leadership, event: LockTaken, now: float, policy: Policy, out: list[Action]
) -> Leadership:
    """A standby stopped while its try was in flight, and the try took the lock: it leads
    nothing (the shell releases the lock for the next one) but says that the epoch moved."""
    if state.led or not state.stopping:
        return state
    out.append(Leading(epoch=event.epoch, leader=event.leader, took_over=True))
    return replace(
        state, led=True, epoch=event.epoch, epoch_on_disk=event.epoch, leader=event.leader
    )


# --- the rules of every role -----------------------------------------------------------


def _watchdog(state: Leadership, event: WatchdogDue, now: float, policy: Policy) -> Action:
    """A standby's one job is its wait for the lock: healthy while that wait turns. Anyone
    else is as healthy as its file watcher."""
    if state.role is R.STANDBY:
        window = max(STANDBY_HEALTH_MIN_S, 4 * policy.poll_interval_s)
        if state.tick_at is not None and now - state.tick_at <= window:
            return PingWatchdog()
        return WithholdWatchdog(reason=f"the wait for the run lock did not turn in {window:g}s")
    if event.watcher_healthy:
        return PingWatchdog()
    return WithholdWatchdog(reason="file watcher not healthy")


def _refuse_handover(state: Leadership, event: HandoverAsked) -> Reply:
    refused = refusal(state, "handover")
    if refused is not None:
        code, why = refused
        return Reply(token=event.token, refusal=code, message=why)
    if state.role is R.DEPOSED:
        message = "this daemon was deposed: another daemon leads"
        return Reply(token=event.token, refusal=Refusal.NOT_LEADER, message=message)
    message = "the daemon is already stopping"
    return Reply(token=event.token, refusal=Refusal.SHUTTING_DOWN, message=message)


def _reconcile(
    state: Leadership, out: list[Action], now: float, policy: Policy
) -> tuple[Leadership, list[Action]]:
    """Issue the I/O the role calls for when it is due and none is in flight; set the
    deadline."""
    due = state.op is None and state.next_at is not None and state.next_at <= now
    if due and state.serving and state.role is R.STANDBY:
        out.append(TryLock())
        state = replace(state, op="try", op_at=now, tick_at=now, next_at=None)
    elif due and state.serving and state.role in ACTING_ROLES:
        out.append(CheckLock())
        state = replace(state, op="check", op_at=now, next_at=None, check_asked=False)
    elif due and state.role is R.HOLDING_OFF:
        out.append(LookAtLock())
        state = replace(state, op="look", op_at=now, next_at=None)
    return replace(state, deadline_at=_deadline(state)), out


def _deadline(state: Leadership) -> float | None:
    """The next instant at which time alone could change this daemon's leadership."""
    if state.role is R.HOLDING_OFF:
        times = [t for t in (state.next_at, state.hold_until) if t is not None]
        return min(times) if times else None
    if not state.serving:
        return None
    if state.op == "check" and state.op_at is not None:
        return state.op_at + CHECK_TIMEOUT_S
    return state.next_at


def _each(
    roles: frozenset[Role], event: type[Event], handler: _Handler
) -> dict[tuple[Role, type[Event]], _Handler]:
    return {(role, event): handler for role in roles}


_BEFORE_HOLD_OFF: Final = frozenset({R.STARTING, R.STANDBY, R.LEADER, R.HANDING_OVER, R.DEPOSED})

#: (role, event type) -> handler. A pair not listed changes nothing, but for the rules of
#: every role (``_in_any_role``): the watchdog's, a refused handover, a stop remembered.
#: ``_reconcile`` then issues the try, check or look that is due.
TRANSITIONS: Final[Mapping[tuple[Role, type[Event]], _Handler]] = {
    (R.STARTING, LockTaken): _first_lock_taken,
    (R.STARTING, LockBusy): _first_lock_busy,
    (R.STARTING, LockFailed): _first_lock_failed,
    (R.STANDBY, Serving): _stand_by,
    (R.STANDBY, LockTaken): _took_over,
    (R.STANDBY, LockBusy): _still_busy,
    (R.STANDBY, LockFailed): _try_failed,
    (R.STANDBY, ViewRead): _view_read,
    (R.STANDBY, StatusAsked): _status_asked,
    (R.STANDBY, StopAsked): _standby_stops,
    (R.LEADER, Serving): _lead,
    (R.LEADER, HandoverAsked): _hand_over,
    **_each(ACTING_ROLES, LockChecked, _checked),
    **_each(ACTING_ROLES, CheckAsked, _check_asked),
    **_each(ACTING_ROLES, Fenced, _fenced),
    **_each(ACTING_ROLES, DeadlinePassed, _leader_deadline),
    **_each(ACTING_ROLES, FleetSettled, _settled),
    **_each(ACTING_ROLES | {R.STANDBY, R.DEPOSED}, ServingEnded, _serving_ended),
    **_each(_BEFORE_HOLD_OFF, LockReleased, _released),
    (R.HOLDING_OFF, LockLooked): _looked,
    (R.HOLDING_OFF, DeadlinePassed): _hold_deadline,
    (R.STOPPED, LockTaken): _late_lock_taken,
}
