"""Properties of the leadership core under random events and time, in two worlds.

- Two daemons against one simulated run lock and epoch file: the world answers each I/O
  action when it likes (a try takes the lock only if it is free, and bumps the epoch), and
  meanwhile daemons are killed and restarted, stopped, asked to hand over, fenced, the lock
  file is replaced under its holder, or its lease lapses unnoticed (its own lock check still
  passes: only the epoch on disk can tell it). Never two daemons acting with the same epoch,
  never one acting without having taken the lock, a deposed daemon never acts again, a
  standby never writes, exit code 3 exactly when deposed or handed over.
- One daemon fed any event in any order: at most one I/O in flight, the epoch set only by
  a taken lock, the same exit-code rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor import leadership as ld
from supervisor.leadership import Role as R
from tests.examples import examples

POLICY = ld.Policy(standby=True, poll_interval_s=0.5, check_interval_s=2.0, handover_hold_s=1.0)
DAEMONS = 2

IO = (ld.TryLock, ld.CheckLock, ld.ReadView, ld.LookAtLock)
#: What a deposed daemon must never ask for again: every act of leading or trying to.
ACTS = (ld.TryLock, ld.CheckLock, ld.ReadView, ld.Lead, ld.Leading, ld.HandOver, ld.StandBy)


@dataclass
class Daemon:
    """One daemon process as the world sees it (a restart is a new incarnation)."""

    slot: int
    incarnation: int = 0
    state: ld.Leadership = field(default_factory=ld.new)
    #: The I/O action the world has not answered yet.
    pending: ld.Action | None = None
    #: Its fleet acts (``Lead`` performed, not yet halted or wound up).
    acting: bool = False
    #: The lock file generation it locked (its lock guards only that file).
    locked_generation: int | None = None
    deposed: bool = False
    handed_over: bool = False
    wound_up: bool = False
    token: int = 0

    @property
    def name(self) -> str:
        """How it names itself in the lock file (a new pid per incarnation)."""
        return f"node-{self.slot} pid {self.incarnation}"


class TwoDaemonsOneLock(RuleBasedStateMachine):
    """The run lock, the epoch file and the daemons that contend for them."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.holder: int | None = None  # the slot holding a lock on the current lock file
        self.generation = 0  # bumped when the lock file is replaced under its holder
        self.disk_epoch = 0
        self.unreadable_epoch = False
        #: Slots whose lock lapsed without their lock check noticing (an NFS lease).
        self.unnoticed: set[int] = set()
        self.daemons = [Daemon(slot=i) for i in range(DAEMONS)]
        for d in self.daemons:
            self.start(d)

    # --- the shell of each daemon, performed by the world -------------------------------

    def feed(self, d: Daemon, event: ld.Event) -> None:
        """Step ``d``'s core and perform its actions as its shell would."""
        was_standing_by = d.state.standing_by
        d.state, actions = ld.step(d.state, event, self.now, POLICY)
        io = [a for a in actions if isinstance(a, IO)]
        assert len(io) <= 1, actions
        for action in actions:
            if d.deposed:
                assert not isinstance(action, ACTS), (action, "after deposed")
            if was_standing_by and not isinstance(event, ld.LockTaken):
                # A standby never writes nor leads: it only tries and reads.
                assert not isinstance(action, ld.Lead | ld.CheckLock | ld.HandOver), action
            self.perform(d, action)

    def perform(self, d: Daemon, action: ld.Action) -> None:
        """Do what ``d``'s shell does with ``action`` (I/O waits for the world's answer)."""
        match action:
            case ld.TryLock() | ld.CheckLock() | ld.ReadView() | ld.LookAtLock():
                d.pending = action
            case ld.Lead():
                # Only the holder of the current lock boots a fleet, under the disk's epoch.
                assert self.holder == d.slot and d.locked_generation == self.generation
                assert action.epoch == self.disk_epoch
                d.acting = True
            case ld.Deposed():
                d.acting = False  # the fleet halts at once
                d.deposed = True
            case ld.StandDown():
                d.acting = False
            case ld.HandOver():
                d.handed_over = True
                self.feed(d, ld.StopAsked())  # the shell stops the fleet, detached
            case _:
                pass

    def start(self, d: Daemon) -> None:
        """A new process: its first try answered at once (before it serves), then serving."""
        d.incarnation += 1
        d.state, d.pending, d.acting, d.locked_generation = ld.new(), None, False, None
        d.deposed = d.handed_over = d.wound_up = False
        self.feed(d, self.try_lock(d))
        self.feed(d, ld.Serving())

    def try_lock(self, d: Daemon) -> ld.Event:
        """``TryLock`` performed: the lock taken if free (and the epoch bumped under it)."""
        if self.holder is None:
            self.holder = d.slot
            d.locked_generation = self.generation
            self.disk_epoch += 1  # under the lock
            return ld.LockTaken(epoch=self.disk_epoch, leader=d.name, locked_at=self.now)
        return ld.LockBusy(holder=self.daemons[self.holder].name)

    def release(self, d: Daemon) -> None:
        """``d`` lets go of its lock (its process ends or closes the descriptor)."""
        if self.holder == d.slot and d.locked_generation == self.generation:
            self.holder = None
        d.locked_generation = None
        self.unnoticed.discard(d.slot)

    def exit(self, d: Daemon) -> None:
        """The process ends: its exit code checked, its lock gone; systemd starts it again."""
        assert d.state.exit_code == (ld.EXIT_DEPOSED if d.deposed or d.handed_over else 0)
        self.release(d)
        self.start(d)

    # --- rules ---------------------------------------------------------------------------

    @precondition(lambda self: any(d.pending is not None for d in self.daemons))
    @rule(i=st.integers(0, DAEMONS - 1), garbled=st.booleans())
    def answer(self, i: int, garbled: bool) -> None:
        """The world performs a daemon's pending I/O now and answers it."""
        waiting = [d for d in self.daemons if d.pending is not None]
        d = waiting[i % len(waiting)]
        action, d.pending = d.pending, None
        on_disk = None if garbled and self.unreadable_epoch else self.disk_epoch
        match action:
            case ld.TryLock():
                self.feed(d, self.try_lock(d))
            case ld.CheckLock():
                held = self.holder == d.slot and d.locked_generation == self.generation
                held = held or d.slot in self.unnoticed
                self.feed(d, ld.LockChecked(held=held, epoch_on_disk=on_disk, reason=""))
                if not held or (on_disk is not None and on_disk != d.state.epoch):
                    assert not d.acting, "a check that shows another leadership deposes"
            case ld.ReadView():
                self.feed(d, ld.ViewRead(epoch_on_disk=on_disk))
            case ld.LookAtLock():
                holder = "" if self.holder is None else self.daemons[self.holder].name
                self.feed(d, ld.LockLooked(holder=holder))
            case _:
                pass
        if d.state.finished and d.pending is None:
            self.exit(d)

    @rule(dt=st.floats(0.0, 3.0))
    def time_passes(self, dt: float) -> None:
        """Time moves on; every daemon whose deadline passed is woken."""
        self.now += dt
        for d in self.daemons:
            if d.state.deadline_at is not None and d.state.deadline_at <= self.now:
                self.feed(d, ld.DeadlinePassed())
                if d.state.finished:
                    self.exit(d)

    @rule(i=st.integers(0, DAEMONS - 1))
    def sigkill(self, i: int) -> None:
        """A daemon dies at once: the kernel releases its lock."""
        d = self.daemons[i]
        self.release(d)
        self.start(d)

    @rule()
    def replace_lock_file(self) -> None:
        """The lock file is replaced: its holder's lock now guards nothing."""
        self.generation += 1
        self.holder = None

    @precondition(lambda self: self.holder is not None)
    @rule()
    def lease_lapses(self) -> None:
        """The holder's lock lapses (NFS lease) and its own lock check does not notice."""
        assert self.holder is not None
        self.unnoticed.add(self.holder)
        self.holder = None

    @rule()
    def garble_epoch_file(self) -> None:
        """The epoch file becomes unreadable to checks (it fences nothing then)."""
        self.unreadable_epoch = not self.unreadable_epoch

    @rule(i=st.integers(0, DAEMONS - 1))
    def stop(self, i: int) -> None:
        """SIGTERM."""
        self.feed(self.daemons[i], ld.StopAsked())

    @rule(i=st.integers(0, DAEMONS - 1))
    def handover(self, i: int) -> None:
        """``reward-supervisor handover`` sent to this daemon."""
        d = self.daemons[i]
        d.token += 1
        self.feed(d, ld.HandoverAsked(token=d.token))

    @precondition(lambda self: any(d.acting for d in self.daemons))
    @rule(i=st.integers(0, DAEMONS - 1))
    def fence(self, i: int) -> None:
        """An agent refuses this daemon's request: only when the disk's epoch is higher."""
        d = self.daemons[i]
        if d.acting and self.disk_epoch > d.state.epoch:
            self.feed(d, ld.Fenced(host="w", reason="epoch"))

    @rule(i=st.integers(0, DAEMONS - 1), healthy=st.booleans())
    def settle_and_ping(self, i: int, healthy: bool) -> None:
        """The fleet's start-up is over; the watchdog loop turns."""
        self.feed(self.daemons[i], ld.FleetSettled())
        self.feed(self.daemons[i], ld.WatchdogDue(watcher_healthy=healthy))

    @rule(i=st.integers(0, DAEMONS - 1))
    def wind_up(self, i: int) -> None:
        """A fleet that stopped or halted is over: the shell saves, releases, exits (after
        the hold-off, if one)."""
        d = self.daemons[i]
        over = d.state.stopping or d.state.role in (R.DEPOSED, R.STOPPED)
        if not over or d.wound_up:
            return
        d.wound_up, d.acting = True, False
        self.feed(d, ld.ServingEnded())
        self.release(d)
        self.feed(d, ld.LockReleased())
        if d.state.finished:
            self.exit(d)

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def never_two_acting_with_one_epoch(self) -> None:
        """Daemons whose fleets act do so under distinct epochs, none above the disk's."""
        epochs = [d.state.epoch for d in self.daemons if d.acting]
        assert len(epochs) == len(set(epochs))
        assert all(0 < e <= self.disk_epoch for e in epochs)

    @invariant()
    def the_holder_acts_under_the_disks_epoch(self) -> None:
        """A daemon acting while it holds the current lock does so under the latest epoch."""
        for d in self.daemons:
            if d.acting and self.holder == d.slot and d.locked_generation == self.generation:
                assert d.state.epoch == self.disk_epoch

    @invariant()
    def acting_means_leading(self) -> None:
        """A fleet acts only under a leader (handing over included), never deposed."""
        for d in self.daemons:
            if d.acting:
                assert d.state.role in ld.ACTING_ROLES and not d.deposed


TwoDaemonsOneLock.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=60, deadline=None
)
test_two_daemons_against_one_lock = TwoDaemonsOneLock.TestCase
test_two_daemons_against_one_lock.__doc__ = (
    "Two daemons, one lock, any interleaving: never two acting with the same epoch."
)


# --- one daemon, any events ---------------------------------------------------------------

events = st.one_of(
    st.builds(ld.LockTaken, epoch=st.integers(1, 9), leader=st.just("me"), locked_at=st.just(0.0)),
    st.builds(ld.LockBusy, holder=st.sampled_from(["", "a", "b"])),
    st.builds(ld.LockFailed, reason=st.just("EIO")),
    st.builds(
        ld.LockChecked,
        held=st.booleans(),
        epoch_on_disk=st.one_of(st.none(), st.integers(0, 9)),
    ),
    st.builds(ld.ViewRead, epoch_on_disk=st.one_of(st.none(), st.integers(0, 9))),
    st.builds(ld.LockLooked, holder=st.sampled_from(["", "me", "b"])),
    st.builds(ld.Fenced, host=st.just("w"), reason=st.just("epoch")),
    st.builds(ld.HandoverAsked, token=st.just(1)),
    st.builds(ld.WatchdogDue, watcher_healthy=st.booleans()),
    st.sampled_from(
        [
            ld.CheckAsked(),
            ld.Serving(),
            ld.ServingEnded(),
            ld.LockReleased(),
            ld.StatusAsked(),
            ld.StopAsked(),
            ld.FleetSettled(),
            ld.DeadlinePassed(),
        ]
    ),
)


@settings(max_examples=examples(500), deadline=None)
@given(
    standby=st.booleans(),
    script=st.lists(st.tuples(events, st.floats(0.0, 40.0)), max_size=60),
)
def test_one_daemon_fed_anything(standby: bool, script: list[tuple[ld.Event, float]]) -> None:
    """Any events at any times: at most one I/O in flight, exactly as the state says; the
    epoch is set once, by a taken lock; a deposed daemon never acts again; a wake-up at the
    deadline moves it on; the exit code is 3 iff deposed or handed over, 1 iff it could not
    start, else 0."""
    policy = ld.Policy(standby=standby, poll_interval_s=0.5, check_interval_s=2.0)
    state = ld.new()
    now = 0.0
    deposed = handed_over = cannot_start = False
    epoch_set_by: ld.Event | None = None
    for event, dt in script:
        now += dt
        before = state
        state, actions = ld.step(state, event, now, policy)
        io = [a for a in actions if isinstance(a, IO)]
        assert len(io) <= 1
        if io:
            assert state.op is not None and state.op_at == now
        if state.epoch != before.epoch:
            assert before.epoch == 0 and isinstance(event, ld.LockTaken)
            assert state.epoch == event.epoch and epoch_set_by is None
            epoch_set_by = event
        if deposed:
            assert not any(isinstance(a, (*ACTS, ld.Deposed)) for a in actions), actions
        deposed = deposed or any(isinstance(a, ld.Deposed) for a in actions)
        handed_over = handed_over or any(isinstance(a, ld.HandOver) for a in actions)
        cannot_start = cannot_start or any(isinstance(a, ld.CannotStart) for a in actions)
        changes = [a for a in actions if isinstance(a, ld.RoleChanged)]
        assert len(changes) == (state.role is not before.role)
        if isinstance(event, ld.DeadlinePassed):
            # A wake-up makes progress: the timer never spins on one instant. (Between
            # wake-ups a deadline may pass unnoticed: the shell's timer is due then.)
            assert state.deadline_at is None or state.deadline_at > now
    expected = 3 if deposed or handed_over else (1 if cannot_start else 0)
    assert state.exit_code == expected
    assert state.shown_role == ("leader" if epoch_set_by is not None else "standby")
