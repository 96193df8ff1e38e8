"""The fleet: every host's ``health.step`` and the rules that span hosts. Pure, like health.py.

Rules (DESIGN §4); everything that decides across hosts lives in this file:

1. Membership. A host joins only when no other member holds its name or its shard (one
   worker per shard: a host a reload added waits while a retiring host of that shard is
   still stopping). A joining host's files are read before it is connected, so a stop
   sentinel is known before anything could launch. A removed host is stopped, then dropped.
2. Common-mode failures are not worker failures. When at least ``freeze_fraction`` of the
   hosts that should run (and at least 2) fall silent together, the likely cause is the
   shared filesystem, the network or this node's mount: the fleet freezes, and health.py
   holds every restart that silence alone would cause (exits are still acted on). Silence
   is judged at half the stale threshold, so the freeze lands before any host reaches its
   own restart deadline; "together" means last heartbeats within ``freeze_window_s``.
3. Thaw. The fleet thaws when heartbeats return (fewer than the threshold still without a
   fresh heartbeat among the hosts that froze it or fell silent while it was frozen; a
   host whose worker died and was replaced counts as silent until the new worker beats),
   or when an operator says so; after an operator's thaw, silences that began before it no
   longer count (else it would freeze again at once).
4. Launch budget. Launches pass a budget: at most ``max_concurrent_launches`` in flight and
   ``max_launches_per_minute`` begun, longest-waiting first, so a mass failure restarts in
   waves instead of stampeding the shared filesystem with model loads. A launch that has
   not begun is given up when its host leaves ``starting``; a finished launch gives its
   slot back before its result is applied, so a relaunch asked for at once can have it.
5. Start-up settles when every host has answered (its probe and any launch it led to) or
   could not be reached, or at the start-up deadline, whichever is first.
6. Shutdown completes when every host is stopped, or unreachable with nothing in flight,
   or at the shutdown deadline; the hosts left unstopped are named. "Unreachable" means its
   connection's first outcome came and was a failure: a host still connecting (a daemon
   stopped during its start-up, a standby that just took over) is waited for, so that the
   workers it runs are found and stopped, not left behind. For the same reason hosts whose
   files are being read when a stop begins still join, only to be stopped; a detach lets
   nobody join. A stop asked for before the boot is begun right after it.
7. The pointer file (``run.pointer_file``, the seed's "this run's workers are up" marker) is
   written once, when the fleet is first all ready; a failed write is retried with a
   doubling delay whatever the fleet does meanwhile, and never stops anything.
8. Crash signatures. When ``crash_signature_hosts`` hosts exit the same way (the exit code
   or a crash signal, and the last line of the log with its numbers blurred) within
   ``crash_signature_window_s``, the cause is common to them (a bad deploy), not theirs:
   restarting every host into it only hides it. The fleet holds their restarts, except on
   one canary host at a time, which restarts under its own backoff. The hold ends when the
   canary runs again (ready), when a reload changes what the workers run, or when an
   operator unfreezes. Signals someone sends (SIGKILL, SIGTERM, SIGINT, SIGHUP: the OOM
   killer, an operator) are never a signature: a random ``kill -9`` is restarted as before.
   Reward probes that fail the same way (the same cause and error text, numbers blurred) on
   that many hosts within the window are a probe signature, held and released the same
   way; a reload that changes the probe's task (its reward function) releases it too.
9. Operator commands. An unknown or retiring host is refused by name; a restart of a host
   held by its stop sentinel is refused (start-host is the way); stop-host has the sentinel
   written before the host is stopped and start-host has it removed before the host starts,
   so the file, which outlives the daemon, always agrees with what was done.
10. Leadership is not the fleet's to decide (``leadership.py`` decides it). The fleet boots
   when the shell leads (``Booted``) and halts when told that this daemon does not, or no
   longer, lead (``LeadershipEnded``: deposed, or a standby that stops): at once and in
   every phase, nothing more is done, not even what the same batch asked for before the
   news came: no stop, no launch, no reply, no history write (the new leader owns it).

Theory of operation. ``Fleet`` is a sans-I/O state machine in the manner of h11's
connection: the shell feeds batches of events with ``now`` (a monotonic reading) and
performs the actions returned; the result of every action comes back later as an event.
Hosts are immutable ``health.Host`` values; the fleet object holds them and changes only in
``step``. ``deadline_at`` is the one instant at which time alone could change something (a
host's deadline, a freeze assessment, a budget slot, start-up or shutdown); early, late or
repeated ``DeadlinePassed`` events are harmless. Nothing here sleeps, logs or does I/O.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final, assert_never

from supervisor import health
from supervisor.health import WANT_RUNNING_STATES, Host, HostState
from supervisor.policies import FleetPolicy as FleetPolicy
from supervisor.policies import Member as Member
from supervisor.refusals import Refusal as Refusal

S = HostState

#: The state ``status`` shows for a configured host that waits for its shard or its name to
#: be free (a reload moved a shard while its old host still stops): not a ``HostState``, as
#: such a host has no health yet.
WAITING: Final = "waiting"
#: Why such a host waits, as ``status`` says it.
WAITING_REASON: Final = "shard busy"

#: The budget counts launches over this sliding window (the per-minute limit).
BUDGET_WINDOW_S: Final = 60.0


# --------------------------------------------------------------------------------------
# Events: past-tense facts the shell observed or results of actions it performed.


@dataclass(frozen=True, slots=True, kw_only=True)
class Booted:
    """The daemon holds the run: its members may join, with the restart history a previous
    daemon left (so a daemon that keeps crashing cannot reset every host's backoff)."""

    histories: Mapping[str, health.History] = field(default_factory=dict)
    #: Which machine served each shard when the previous daemon last saved (failover).
    seats: SavedSeats | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedSeats:
    """The seats as the state file keeps them across daemon restarts and takeovers: where a
    shard was moved, which machines are fenced or drained, and what a fenced one may still
    run. Read from a hostile file: ``Fleet`` keeps only what fits the config."""

    #: label -> machine, for labels not served by their own machine.
    serving: Mapping[str, str] = field(default_factory=dict)
    fenced: frozenset[str] = frozenset()
    drained: frozenset[str] = frozenset()
    held: frozenset[str] = frozenset()
    #: fenced machine -> (label, shard, pid) of the worker it may still run.
    left: Mapping[str, tuple[str, int, int | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeadershipEnded:
    """This daemon does not lead (a standby that stops) or no longer does (deposed): the
    fleet halts at once, whatever it was doing."""


@dataclass(frozen=True, slots=True)
class HostObserved:
    """Something about one host: a file, SSH, or the answer to a remote operation."""

    host: str
    event: health.Event


@dataclass(frozen=True, slots=True, kw_only=True)
class FilesScanned:
    """The files of joining ``hosts`` were read; ``sentinels`` have ``ctl/<host>.stop``."""

    hosts: frozenset[str]
    sentinels: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadlinePassed:
    """The shell's timer for ``Fleet.deadline_at`` fired (maybe early, late or twice)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconfigured:
    """A reload validated a new config: its members and rules replace the old ones."""

    members: tuple[Member, ...]
    health: health.Policy
    policy: FleetPolicy
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartHostRequested:
    """An operator asked for a fresh worker on ``host``."""

    host: str
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StopHostRequested:
    """An operator asked for ``host`` to stop and stay stopped."""

    host: str
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartHostRequested:
    """An operator asked for ``host`` to run again (clears its sentinel and ``failed``)."""

    host: str
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UnfreezeRequested:
    """An operator lifted the freeze."""

    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShutdownRequested:
    """The daemon is to stop: stop every worker first, or leave them running (``detach``;
    None: as ``FleetPolicy.detach_on_exit`` says, the operator's ``run.on_exit``)."""

    detach: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StopSentinelWritten:
    """The shell wrote ``ctl/<host>.stop`` for a stop-host (``error`` if it could not)."""

    host: str
    token: int
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StopSentinelDeleted:
    """The shell removed ``ctl/<host>.stop`` for a start-host (``error`` if it could not)."""

    host: str
    token: int
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PointerWritten:
    """The shell wrote the pointer file at ``path`` (``error`` if it could not)."""

    path: str
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FilesystemDiagnosed:
    """What the shell found when it checked the run root during a freeze."""

    finding: str
    free_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SpareObserved:
    """A machine serving no shard (a spare, or one that lost its shard) connected or lost
    its connection."""

    machine: str
    up: bool
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeftoversKilled:
    """The answer to ``KillLeftovers``: nothing of ours runs on ``machine`` now, or why not."""

    machine: str
    #: None: done; else why not (tried again while it stays connected).
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainRequested:
    """Operator: move the shard ``host`` serves to a spare, and keep ``host`` out."""

    host: str
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UndrainRequested:
    """Operator: a drained ``host`` goes back to the pool, as a spare."""

    host: str
    token: int


FleetEvent = (
    Booted
    | SpareObserved
    | LeftoversKilled
    | DrainRequested
    | UndrainRequested
    | FilesScanned
    | DeadlinePassed
    | Reconfigured
    | RestartHostRequested
    | StopHostRequested
    | StartHostRequested
    | UnfreezeRequested
    | ShutdownRequested
    | StopSentinelWritten
    | StopSentinelDeleted
    | PointerWritten
    | FilesystemDiagnosed
    | LeadershipEnded
)
Event = HostObserved | FleetEvent

# --------------------------------------------------------------------------------------
# Actions: what the shell must do. Remote operations and file writes answer with events.


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanFiles:
    """Read the status, exit and sentinel files of joining hosts; answer FilesScanned, then
    their observations."""

    hosts: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Connect:
    """``host`` joined: open and keep its SSH connection (SSH news comes back as events)."""

    host: str
    shard: int
    #: False for the members present at start-up (the shell logs joins after it only).
    added: bool
    #: The machine serving its shard: the host itself, or a spare it was moved to before a
    #: daemon restart.
    machine: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Disconnect:
    """``host`` left the fleet: cancel its operations and close its connection."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """``host`` left the fleet while the spare ``machine`` served it: cancel its operations
    and keep the connection as the spare's, serving none."""

    host: str
    machine: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconnect:
    """A reload changed ``host``'s settings: apply them to its connection."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchAsked:
    """``host`` needs a worker: its launch waits for the budget (logged as ``host.launch``)."""

    host: str
    reason: str
    is_restart: bool
    #: Why the worker is replaced (automatic restarts only).
    cause: health.Cause | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """Start ``host``'s worker now (the budget let it begin); answer with a launch result."""

    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Terminate:
    """Stop ``pid`` on ``host``; answer TerminateConfirmed or TerminateFailed."""

    host: str
    pid: int
    grace_s: float
    kill: bool
    #: Capture the worker's stacks and log tail first (``health.Terminate.collect_evidence``).
    collect_evidence: bool = False
    #: Then quarantine this many of its shard's tasks (``health.Terminate.quarantine``).
    quarantine: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """Find ``host``'s live worker; answer ProbeResult or ProbeFailed."""

    host: str
    pid: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SendRewardProbe:
    """Write ``task`` (with a probe's id) into ``shard``'s inbox and await its result for
    ``timeout_s``; answer with ``HostObserved(host, RewardProbeAnswered(pid=pid, ...))``."""

    host: str
    shard: int
    pid: int
    task: str
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RecheckStatus:
    """Read ``host``'s status file again now, by content (and count its shard's task files
    this old, if ``tasks_older_than_s``); answer with
    ``HostObserved(host, health.StatusRechecked(...))``."""

    host: str
    tasks_older_than_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HostStateChanged:
    """``host`` moved between states; logged as ``event="host.state"``."""

    host: str
    from_: HostState
    to: HostState
    reason: str
    pid: int | None
    cause: health.Cause | None
    #: What the replaced worker was doing, when the change follows a terminate that took it.
    evidence: health.Evidence | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchesWaiting:
    """Launches wait for the budget: ``waiting`` of them."""

    waiting: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteStopSentinel:
    """Write ``ctl/<host>.stop``; answer StopSentinelWritten."""

    host: str
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteStopSentinel:
    """Remove ``ctl/<host>.stop``; answer StopSentinelDeleted."""

    host: str
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """Answer the operator command ``token``: done (with ``result``), or refused."""

    token: int
    result: Mapping[str, object] | None = None
    refusal: Refusal | None = None
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class FreezeChanged:
    """The fleet froze (``frozen``) or thawed; tell the operator."""

    frozen: bool
    reason: str
    hosts: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnoseFilesystem:
    """Check whether the run root is hung or full; answer FilesystemDiagnosed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FreezeExplained:
    """The frozen fleet's filesystem check found ``finding``; tell the operator."""

    finding: str
    free_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Settled:
    """Start-up is over (READY=1); ``slow`` hosts had not answered by the deadline."""

    slow: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShutdownBegan:
    """Shutdown has begun (STOPPING=1)."""

    detach: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ShutdownDone:
    """Shutdown is over: ``incomplete`` were still stopping at the deadline, ``unreachable``
    could not be stopped over SSH (their workers may still run)."""

    incomplete: tuple[str, ...] = ()
    unreachable: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class WritePointer:
    """Write the pointer file at ``path`` atomically; answer PointerWritten."""

    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PointerNotWritten:
    """The pointer write failed (``attempt`` so far); it is tried again at ``retry_at``."""

    path: str
    reason: str
    attempt: int
    retry_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashSignatureFound:
    """Hosts crashed (or failed their reward probe) the same way: restarts on it are held
    but for the ``canary``."""

    signature: str
    hosts: tuple[str, ...]
    canary: str
    log_tail: str | None
    #: "crash" (exits) or "probe" (reward probes).
    kind: str = "crash"


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashSignatureCleared:
    """A crash signature no longer holds restarts (``reason`` says why)."""

    signature: str
    reason: str
    released: tuple[str, ...]
    kind: str = "crash"


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryChanged:
    """Restart history changed: persist ``Fleet.histories()`` soon."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Seats:
    """Which machine serves each label, and the machines serving none."""

    #: label -> machine serving its shard (the label's own host until a failover).
    serving: Mapping[str, str]
    #: label -> shard.
    shards: Mapping[str, int]
    #: Free spares, in the order they are given shards (config order, then returns).
    spares: tuple[str, ...] = ()
    #: Machines that lost their label and whose leftovers are not yet known killed.
    fenced: frozenset[str] = frozenset()
    #: Fenced machines drained by an operator (out of service until ``undrain``).
    drained: frozenset[str] = frozenset()
    #: Drained machines cleaned up and waiting for ``undrain``.
    held: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class Sighting:
    """What the daemon knows of one machine's reachability and its worker's heartbeat."""

    connected: bool
    #: When its connection was last seen going down (None: up, or not tried yet).
    down_since: float | None = None
    #: Its worker's last heartbeat, wall clock (None: none seen).
    beat_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Failover:
    """Launch ``label``'s shard on ``to_machine`` (``--host label --shard shard``)."""

    label: str
    shard: int
    from_machine: str
    to_machine: str
    #: "host_lost" or "drain".
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class KillLeftovers:
    """Kill whatever ``machine`` still runs for us before it is given anything: the worker
    ``pid`` of ``label`` it served (None: none known, nothing to kill; the shard lock fences
    what may run there); answer ``LeftoversKilled``."""

    machine: str
    label: str = ""
    shard: int = 0
    pid: int | None = None
    #: SIGTERM and this long before the SIGKILL (0: SIGKILL at once).
    grace_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepSpare:
    """Connect to the spare ``machine`` and keep it connected (its news: ``SpareObserved``)."""

    machine: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NoFreeSpare:
    """``label``'s machine is lost and no spare is free: the shard stays unserved."""

    label: str
    shard: int
    machine: str


FailoverAction = Failover | KillLeftovers | NoFreeSpare


Action = (
    ScanFiles
    | Failover
    | KillLeftovers
    | NoFreeSpare
    | KeepSpare
    | Connect
    | Disconnect
    | Release
    | Reconnect
    | LaunchAsked
    | Launch
    | Terminate
    | Probe
    | SendRewardProbe
    | RecheckStatus
    | HostStateChanged
    | LaunchesWaiting
    | WriteStopSentinel
    | DeleteStopSentinel
    | Reply
    | FreezeChanged
    | DiagnoseFilesystem
    | FreezeExplained
    | Settled
    | ShutdownBegan
    | ShutdownDone
    | WritePointer
    | PointerNotWritten
    | CrashSignatureFound
    | CrashSignatureCleared
    | HistoryChanged
)

_HISTORY_CHANGED: Final = HistoryChanged()
#: How soon killing a returned machine's leftovers is tried again after it failed (while it
#: stays connected; a reconnect tries at once).
LEFTOVERS_RETRY_S: Final = 5.0

_RESULTS_OF_LAUNCH: Final = (health.Launched, health.LaunchFailed, health.LaunchRefused)

# --------------------------------------------------------------------------------------
# The fleet.


class Fleet:
    """Every member, its health, and the fleet-wide rules. Change it only through ``step``."""

    def __init__(
        self,
        members: Iterable[Member],
        health_policy: health.Policy,
        policy: FleetPolicy,
        spares: Iterable[str] = (),
    ) -> None:
        self._health = health_policy
        self._policy = policy
        #: Histories a previous daemon left for hosts that have not joined.
        self._histories: dict[str, health.History] = {}
        #: ``health.history_of`` of every joined host, replaced only when it changes: the
        #: shell saves the history after every change and re-encodes only new objects.
        self._joined_histories: dict[str, health.History] = {}
        #: Configured members, joined or not, in config order.
        self._configured: dict[str, Member] = {m.name: m for m in members}
        #: Members that joined: their files are read and their connection is kept.
        self._hosts: dict[str, Host] = {}
        self._members: dict[str, Member] = {}
        #: Joining: files being read.
        self._joining: dict[str, Member] = {}
        self._retiring: set[str] = set()
        self._booted = False
        #: A stop (not a detach) asked for before the boot: done right after it.
        self._stop_at_boot = False
        #: Joining as the daemon starts (not "added" by a reload).
        self._at_boot: set[str] = set()
        self.freeze = Freeze()
        #: What the filesystem check said about the current freeze.
        self.finding: str | None = None
        self.budget = Budget()
        # Start-up.
        self._settled = False
        self._connect_seen: set[str] = set()
        self._unsettled: set[str] = set()
        self._startup_deadline_at: float | None = None
        # Shutdown.
        self._shutting_down = False
        self._finished = False
        self._stop_pending: set[str] = set()
        #: Hosts with a stop sentinel written or removed now, and the stop-host/start-host
        #: commands that wait for it, in the order they came: one file operation per host
        #: at a time, so the last command is the one whose effect stays.
        self._sentinel_queues: dict[str, list[StopHostRequested | StartHostRequested]] = {}
        self._shutdown_deadline_at: float | None = None
        # Per-host deadlines: a heap of (when, host); ``_armed[host]`` is the live entry.
        self._timers: list[tuple[float, str]] = []
        self._armed: dict[str, float] = {}
        self._assess_at: float | None = None
        self._assess_due = False
        #: Joined hosts in WANT_RUNNING_STATES, counted as they change (``survey``'s
        #: ``expected`` without the look).
        self._expected = 0
        #: No more ready hosts than this are silent before ``_assess_at``; None: unknown.
        #: The look at every host that a state change calls for is skipped while too few
        #: hosts can be silent to freeze the fleet (``_no_freeze_possible``).
        self._silent_bound: int | None = None
        #: The pointer file's progress (written at most once per path).
        self.pointer = Pointer()
        self._pointer_due = False
        #: Recent crashes by signature: (when, host), oldest first.
        self._crashes: dict[str, list[tuple[float, str]]] = {}
        #: Signatures that hold restarts now.
        self.signatures: dict[str, CrashSignature] = {}
        #: Hosts whose restarts are held, and by which signature.
        self.held: dict[str, str] = {}
        #: The names of joined and joining hosts; a new object whenever they change.
        self.names: frozenset[str] = frozenset()
        #: Told that this daemon does not lead (``LeadershipEnded``): nothing more is done.
        self._halted = False
        # Failover (issue 32): which machine serves each member's shard, what each machine
        # was last seen as, and the work a machine that lost its shard still owes.
        self.seats = new_seats((), tuple(spares))
        self._sparing = bool(self.seats.spares)
        self._sightings: dict[str, Sighting] = {m: Sighting(connected=False) for m in spares}
        #: Machines serving a member whose connection is down (where a loss can begin), and
        #: the member each serves.
        self._down: dict[str, str] = {}
        #: A spare became free since the last look: a member lost with none free may move.
        self._spare_freed = False
        #: A machine that lost its shard: the worker it may still run (label, shard, pid).
        self._left: dict[str, tuple[str, int, int | None]] = {}
        #: Fenced machines whose leftovers are being killed, or when to try again.
        self._killing: set[str] = set()
        self._kill_retry_at: dict[str, float] = {}
        #: Drained machine -> the member whose launch on its spare waits for the kill.
        self._release_waits: dict[str, str] = {}
        #: Members lost with no free spare, said once until served again.
        self._unserved: set[str] = set()
        self._failover_at: float | None = None
        #: Shards moved to a spare since start, by reason (``host_lost``/``drain``).
        self.failovers: dict[str, int] = {}
        #: Members a previous daemon left on another machine, until they join.
        self._restored: dict[str, str] = {}
        #: The seats as last saved: a change is saved with the restart history.
        self._seats_saved = self.seats

    # --- queries -----------------------------------------------------------------------

    @property
    def hosts(self) -> Mapping[str, Host]:
        """Every joined host's health, by name."""
        return self._hosts

    @property
    def members(self) -> Mapping[str, Member]:
        """Every joined host's membership, by name."""
        return self._members

    @property
    def joining(self) -> Mapping[str, Member]:
        """Hosts whose files are being read before they join."""
        return self._joining

    @property
    def waiting(self) -> Mapping[str, Member]:
        """Configured hosts that wait for their shard or name to be free."""
        return {
            name: m
            for name, m in self._configured.items()
            if name not in self._joining and (name not in self._members or name in self._retiring)
        }

    def shown(self, now: float) -> dict[str, Host | Member]:
        """Every configured host as ``status`` shows it: a joined host's health; a joining one
        (its files are being read) as the host it is about to become; one that waits for its
        shard or name to be free as its ``Member``, shown in state ``WAITING``."""
        shown: dict[str, Host | Member] = dict(self._hosts)
        for name in self._joining:
            shown[name] = health.new_host(name, now, history=self._histories.get(name))
        shown.update(self.waiting)
        return shown

    @property
    def all_ready(self) -> bool:
        """The fleet is up: every host not stopped on purpose is ``ready`` (at least one),
        and none is still joining or waiting for its shard. The one meaning of "all ready":
        the pointer, ``wait-ready``, the status's ``all_ready`` and the demo use it."""
        return not self._joining and not self.waiting and fleet_all_ready(self._hosts.values())

    def held_by(self, signature: str) -> list[str]:
        """The hosts whose restarts ``signature`` holds, by name."""
        return sorted(name for name, held in self.held.items() if held == signature)

    def history(self, name: str) -> health.History | None:
        """The restart history a previous daemon left for ``name``, if it has not joined."""
        return self._histories.get(name)

    @property
    def health_policy(self) -> health.Policy:
        """The per-host rules in force."""
        return self._health

    @property
    def settled(self) -> bool:
        """Start-up is over."""
        return self._settled

    @property
    def finished(self) -> bool:
        """Shutdown is over: nothing more will happen."""
        return self._finished

    @property
    def history_is_ours(self) -> bool:
        """The restart history is this fleet's to save: it booted (it holds the history a
        previous daemon left) and was not halted (then the new leader owns the file)."""
        return self._booted and not self._halted

    def is_retiring(self, name: str) -> bool:
        """``name`` was removed from the config and is being stopped."""
        return name in self._retiring

    def histories(self) -> dict[str, health.History]:
        """What of every host must survive a restart of the daemon; a host's object is the
        same one until its history changes."""
        return {**self._histories, **self._joined_histories}

    @property
    def deadline_at(self) -> float | None:
        """The next instant at which time alone could change something."""
        candidates = [
            t
            for t in (
                self._timers[0][0] if self._timers else None,
                self._assess_at,
                next_grant_at(self.budget, self._policy),
                None if self._settled else self._startup_deadline_at,
                self._shutdown_deadline_at if not self._finished else None,
                self.pointer.retry_at,
                self._failover_at,
                min(self._kill_retry_at.values(), default=None),
            )
            if t is not None
        ]
        return min(candidates) if candidates else None

    # --- step --------------------------------------------------------------------------

    def step(self, events: Iterable[Event], now: float) -> list[Action]:
        """Apply a batch of events seen at monotonic ``now``; return what to do, in order."""
        out: list[Action] = []
        for event in events:
            if self._finished:
                break  # nothing happens after shutdown
            if isinstance(event, HostObserved):
                self._observed(event.host, event.event, now, out)
            else:
                self._fleet_event(event, now, out)
        if self._halted:
            return []  # whatever this batch asked for before the news came is not done either
        if self._finished:
            return out
        if self._down:
            self._fail_over_lost(now, out)
        if self.seats is not self._seats_saved and self._sparing:
            self._seats_saved = self.seats
            out.append(_HISTORY_CHANGED)
        # A batch matters to the freeze only if the fleet is frozen (heartbeats thaw it) or
        # a host changed state (the count of hosts that should run sets the threshold):
        # heartbeats alone only shorten silences, so they cannot freeze it.
        if self._assess_due or self.freeze.frozen:
            self._assess(now, out)
        if self._pointer_due:
            self._write_pointer_if_due(now, out)
        return out

    def _fleet_event(self, event: FleetEvent, now: float, out: list[Action]) -> None:
        match event:
            case Booted():
                self._boot(event, now, out)
            case FilesScanned():
                self._files_scanned(event, now, out)
            case DeadlinePassed():
                self._deadline_passed(now, out)
            case Reconfigured():
                self._reconfigure(event, now, out)
            case RestartHostRequested():
                self._restart_host(event, now, out)
            case StopHostRequested() | StartHostRequested():
                self._sentinel_command(event, out)
            case StopSentinelWritten():
                self._sentinel_written(event, now, out)
                self._next_sentinel_command(event.host, out)
            case StopSentinelDeleted():
                self._sentinel_deleted(event, now, out)
                self._next_sentinel_command(event.host, out)
            case UnfreezeRequested():
                self._clear_signatures("operator unfreeze", now, out)
                was = self.freeze.frozen
                self.freeze, change = unfreeze(self.freeze, now)
                if change is not None:
                    self._apply_freeze(change, now, out)
                out.append(Reply(token=event.token, result={"frozen": False, "was_frozen": was}))
            case ShutdownRequested() if not self._booted and not self._detaches(event):
                # Before the boot (a signal while the shell read the history): the stop
                # comes once the members are known, so their workers are found and stopped.
                self._stop_at_boot = True
            case ShutdownRequested():
                self._shutdown(self._detaches(event), now, out)
            case PointerWritten():
                self._pointer_written(event, now, out)
            case FilesystemDiagnosed():
                if self.freeze.frozen:  # thawed meanwhile: old news
                    self.finding = event.finding
                    out.append(FreezeExplained(finding=event.finding, free_bytes=event.free_bytes))
            case LeadershipEnded():
                self._halt()
            case SpareObserved():
                self._spare_observed(event, now, out)
            case LeftoversKilled():
                self._leftovers_killed(event, now, out)
            case DrainRequested():
                self._drain(event, now, out)
            case UndrainRequested():
                self._undrain(event, out)
            case _:
                assert_never(event)

    # --- one host ------------------------------------------------------------------------

    def _observed(self, name: str, event: health.Event, now: float, out: list[Action]) -> None:
        if name not in self._hosts:
            return  # a host that left (or has not joined): its news is moot
        if type(event) is health.SshLost or type(event) is health.SshRestored:
            self._sighted(
                self.seats.serving.get(name, name), type(event) is health.SshRestored, now
            )
        if type(event) is health.WorkerExited:
            # Decided before the exit is applied: a held host must not restart at once.
            self._crashed(name, event, now, out)
        elif type(event) is health.RewardProbeAnswered:
            self._probe_failed(name, event, now, out)
        if type(event) in _RESULTS_OF_LAUNCH and name in self.budget.in_flight:
            # The slot goes back before the result is applied: a relaunch the core asks for
            # at once (the first failure after a healthy spell) must find it free.
            self.budget = launch_done(self.budget, name)
            self._feed(name, event, now, out)
            self._grant(now, out)
            return
        self._feed(name, event, now, out)
        if (type(event) is health.SshRestored or type(event) is health.SshLost) and (
            name in self._hosts
        ):
            # The first outcome of connecting settles an unreachable host even when it
            # changes nothing else (a host that was never up and still is not).
            self._connect_seen.add(name)
            self._track(name, out)

    def _feed(self, name: str, event: health.Event, now: float, out: list[Action]) -> None:
        """Step one host and act on what it says."""
        before = self._hosts[name]
        host, actions = health.step(before, event, now, self._health)
        self._hosts[name] = host
        if host.state is not before.state:
            self._expected += (host.state in WANT_RUNNING_STATES) - (
                before.state in WANT_RUNNING_STATES
            )
        alive_at = host.alive_at
        if (
            host.state is S.READY
            and alive_at is not None
            and (before.state is not S.READY or (alive_at != before.alive_at and alive_at != now))
        ):
            # Ready now, or its last heartbeat moved other than to now (a routine beat):
            # its silence may begin sooner than the next crossing the last look found.
            self._track_silence(alive_at, now)
        for action in actions:
            self._host_action(name, host, action, now, out)
        self._arm(name, host.deadline_at)
        if health.history_changed(before, host):
            self._joined_histories[name] = health.history_of(host)
            out.append(_HISTORY_CHANGED)
        if host.state is not before.state or host.ssh_up != before.ssh_up or host.op != before.op:
            self._after_change(name, before, now, out)

    def _host_action(
        self, name: str, host: Host, action: health.Action, now: float, out: list[Action]
    ) -> None:
        match action:
            case health.StateChanged():
                pid = host.pid if host.pid is not None else host.last_pid
                cause = host.cause_code if action.to in health.UNHEALTHY_STATES else None
                out.append(
                    HostStateChanged(
                        host=name,
                        from_=action.from_,
                        to=action.to,
                        reason=action.reason,
                        pid=pid,
                        cause=cause,
                        evidence=action.evidence,
                    )
                )
            case health.Launch():
                out.append(
                    LaunchAsked(
                        host=name,
                        reason=action.reason,
                        is_restart=action.is_restart,
                        cause=action.cause,
                    )
                )
                self.budget = want_launch(self.budget, name, now)
                self._grant(now, out)
            case health.Terminate():
                out.append(
                    Terminate(
                        host=name,
                        pid=action.pid,
                        grace_s=action.grace_s,
                        kill=action.kill,
                        collect_evidence=action.collect_evidence,
                        quarantine=action.quarantine,
                    )
                )
            case health.Probe():
                out.append(Probe(host=name, pid=action.pid))
            case health.RecheckStatus():
                out.append(RecheckStatus(host=name, tasks_older_than_s=action.tasks_older_than_s))
            case health.SendRewardProbe():
                out.append(
                    SendRewardProbe(
                        host=name,
                        shard=self._members[name].shard,
                        pid=action.pid,
                        task=action.task,
                        timeout_s=action.timeout_s,
                    )
                )
            case _:
                assert_never(action)

    def _after_change(self, name: str, before: Host, now: float, out: list[Action]) -> None:
        host = self._hosts[name]
        if host.state is not before.state:
            self._assess_due = True
            self._pointer_due = True
            if host.state is S.READY and self.signatures:
                self._ran_again(name, now, out)
        if host.state is not S.STARTING and is_waiting(self.budget, name):
            # It left ``starting`` (stopped, restarted...) while its launch waited: the
            # launch will never begin, and the core must hear that it did not happen.
            self.budget = launch_done(self.budget, name)
            self._feed(name, health.LaunchFailed(reason="cancelled before it began"), now, out)
            return
        if name in self._retiring and host.state is S.STOPPED:
            self._drop(name, now, out)
            return
        self._track(name, out)

    def _track(self, name: str, out: list[Action]) -> None:
        """Re-check what start-up and shutdown wait for, for the host that changed."""
        host = self._hosts[name]
        if not self._settled:
            if self._host_settled(name, host):
                self._unsettled.discard(name)
            else:
                self._unsettled.add(name)
            if not self._unsettled and self._booted and not self._joining:
                self._settle((), out)
        if self._shutting_down:
            if self._stop_done(name, host):
                self._stop_pending.discard(name)
            else:
                self._stop_pending.add(name)
            if not self._stop_pending:
                self._finish(out)

    def _host_settled(self, name: str, host: Host) -> bool:
        """Start-up is done for this host: it answered, or it cannot be reached."""
        if name not in self._connect_seen:
            return False
        if not host.ssh_up:
            return True
        return not host.needs_probe and host.op not in ("probe", "launch")

    # --- membership ------------------------------------------------------------------------

    def _boot(self, event: Booted, now: float, out: list[Action]) -> None:
        if self._booted:
            return
        self._booted = True
        self._histories = dict(event.histories)
        idle = self._restore(event.seats) if event.seats is not None else self.seats.spares
        out.extend(KeepSpare(machine=m) for m in idle)
        self._admit(now, out)
        self._at_boot = set(self._joining)
        if self._stop_at_boot:
            self._shutdown(False, now, out)
            return
        if not self._joining:
            self._settle((), out)

    def _admit(self, now: float, out: list[Action]) -> None:
        """Let configured hosts join whose shard and name no member holds."""
        if self._shutting_down:
            return
        busy_shards = {m.shard for m in self._members.values()}
        busy_shards.update(m.shard for m in self._joining.values())
        joining: list[str] = []
        for name, member in self._configured.items():
            if name in self._members or name in self._joining or member.shard in busy_shards:
                continue
            self._joining[name] = member
            busy_shards.add(member.shard)
            joining.append(name)
        if joining:
            self._names_changed()
            out.append(ScanFiles(hosts=tuple(joining)))

    def _files_scanned(self, event: FilesScanned, now: float, out: list[Action]) -> None:
        # A stop under way (a detach has finished already): they join only to be stopped,
        # so that a worker already running there is found and stopped, not left behind.
        stopping = self._shutting_down
        if self._startup_deadline_at is None:
            self._startup_deadline_at = now + self._policy.startup_timeout_s
        # In the order they joined, which is the config's: hosts connect as listed.
        for name in [n for n in self._joining if n in event.hosts]:
            member = self._joining.pop(name)
            if self._configured.get(name) != member:
                # A reload removed or changed it meanwhile: admitted afresh below (not while
                # stopping: commands are refused then, so it changed before the stop).
                self._stop_pending.discard(name)
                continue
            host = health.new_host(
                name,
                now,
                stop_sentinel=name in event.sentinels,
                history=self._histories.pop(name, None),
            )
            self._hosts[name] = host
            self._joined_histories[name] = health.history_of(host)
            self._expected += host.state in WANT_RUNNING_STATES
            self._members[name] = member
            if not self._settled:
                self._unsettled.add(name)
            added = name not in self._at_boot
            self._at_boot.discard(name)
            machine = self._seat(name, member.shard)
            moved = machine if machine != name else ""
            out.append(Connect(host=name, shard=member.shard, added=added, machine=moved))
            if stopping:
                self._feed(name, _SHUTDOWN_STOP, now, out)
            elif self.freeze.frozen:
                self._feed(name, health.FleetFrozen(reason=self.freeze.reason), now, out)
            self._arm(name, self._hosts[name].deadline_at)
        self._names_changed()
        if stopping:
            if not self._stop_pending:
                self._finish(out)
            return
        self._admit(now, out)
        if not self._settled and not self._unsettled and not self._joining:
            self._settle((), out)

    def _drop(self, name: str, now: float, out: list[Action]) -> None:
        """``name`` is stopped and no longer configured: it leaves, and others may join."""
        self._expected -= self._hosts.pop(name).state in WANT_RUNNING_STATES
        del self._joined_histories[name]
        del self._members[name]
        self._retiring.discard(name)
        self._armed.pop(name, None)
        self._unsettled.discard(name)
        self._stop_pending.discard(name)
        self._connect_seen.discard(name)
        self.held.pop(name, None)
        self.budget = launch_done(self.budget, name)
        machine = self.seats.serving[name]
        self._unseat(name)
        self._names_changed()
        out.append(
            Disconnect(host=name) if machine == name else Release(host=name, machine=machine)
        )
        if not self._shutting_down:
            self._admit(now, out)
        if self._shutting_down and not self._stop_pending:
            self._finish(out)

    def _names_changed(self) -> None:
        self.names = frozenset(self._members.keys() | self._joining.keys())

    def _reconfigure(self, event: Reconfigured, now: float, out: list[Action]) -> None:
        old = self._configured
        new = {m.name: m for m in event.members}
        self._configured = new
        probe_changed = (event.health.probe_task, event.health.probe_expect) != (
            self._health.probe_task,
            self._health.probe_expect,
        )
        self._health = event.health
        # Another stale threshold moves every crossing: the next assessment looks at all.
        self._silent_bound = None
        self._assess_due = True
        if event.policy.pointer_file != self._policy.pointer_file:
            self.pointer = Pointer()  # another file: it has never been written
            self._pointer_due = True
        self._policy = event.policy
        removed = [n for n in old if n not in new]
        added = [n for n in new if n not in old]
        both = [n for n in new if n in old]
        restarted = [n for n in both if old[n].launch_key != new[n].launch_key]
        # A host moved to another shard leaves and joins again: its new shard may still be
        # held by a host that is stopping, and one worker per shard comes first.
        for name in removed:
            self._retire(name, "removed from config by reload", now, out)
        for name in [n for n in both if old[n].shard != new[n].shard]:
            self._retire(name, f"moved to shard {new[name].shard} by reload", now, out)
        for name in both:
            if name in self._members and name not in self._retiring:
                self._members[name] = new[name]
                if self.machine_of(name) == name:  # a spare serving it keeps its own settings
                    out.append(Reconnect(host=name))
        if restarted:
            self._clear_signatures("a reload changed what the workers run", now, out)
        elif probe_changed:
            self._clear_signatures("a reload changed the reward probe", now, out, kind="probe")
        for name in restarted:
            if name in self._hosts and name not in self._retiring:
                reason = "launch parameters changed by reload"
                self._feed(name, health.RestartRequested(reason=reason), now, out)
        self._admit(now, out)
        for name in list(self._hosts):  # new timings: recompute every deadline
            self._feed(name, health.DeadlinePassed(), now, out)
        result = {"added": added, "removed": removed, "restarted": restarted, "updated": both}
        out.append(Reply(token=event.token, result=result))

    def _retire(self, name: str, reason: str, now: float, out: list[Action]) -> None:
        if name in self._joining:
            del self._joining[name]  # never connected: nothing to stop
            self._names_changed()
            if self._shutting_down:  # a stop waited for it to join: no longer
                self._stop_pending.discard(name)
                if not self._stop_pending:
                    self._finish(out)
            return
        if name not in self._hosts or name in self._retiring:
            return
        self._retiring.add(name)
        stop = health.StopRequested(reason=reason, cause=health.StopCause.REMOVED)
        self._feed(name, stop, now, out)
        if name in self._hosts and self._hosts[name].state is S.STOPPED:
            self._drop(name, now, out)

    # --- failover (issue 32) ----------------------------------------------------------------

    def machine_of(self, name: str) -> str:
        """The machine serving member ``name``'s shard (its own, or a spare's)."""
        return self.seats.serving.get(name, name)

    def spare_rows(self) -> list[dict[str, object]]:
        """Every machine that is or was a spare, for ``status``: its name, whether it is
        connected, and what it is (``free``, ``serving`` a member, ``fenced`` until its
        leftovers are killed, ``drained`` until ``undrain``, ``down``)."""
        seats = self.seats
        serves = {m: label for label, m in seats.serving.items() if m != label}
        rows: list[dict[str, object]] = []
        for machine, sighting in self._sightings.items():
            if machine in serves:
                role = "serving"
            elif machine in seats.fenced:
                role = "fenced"
            elif machine in seats.held:
                role = "drained"
            elif machine in seats.spares:
                role = "free" if sighting.connected else "down"
            else:
                continue  # a member's own machine, serving it
            rows.append(
                {
                    "name": machine,
                    "role": role,
                    "connected": sighting.connected,
                    "serves": serves.get(machine),
                }
            )
        return rows

    def moving(self) -> list[dict[str, object]]:
        """Failovers in progress, for ``status`` and the fleet page's banner: each member
        served by another machine and not ready there yet, and each lost one no spare took."""
        moves: list[dict[str, object]] = []
        for label in sorted(self.seats.serving):
            machine, host = self.seats.serving[label], self._hosts.get(label)
            if label in self._unserved:
                moves.append(
                    {
                        "host": label,
                        "shard": self.seats.shards[label],
                        "to": None,
                        "state": "no free spare",
                    }
                )
            elif machine != label and host is not None and host.state is not S.READY:
                moves.append(
                    {
                        "host": label,
                        "shard": self.seats.shards[label],
                        "to": machine,
                        "state": host.state.value,
                    }
                )
        return moves

    @property
    def free_spares(self) -> int:
        """Spares a shard could move to now."""
        return len(free_spares(self.seats, self._sightings))

    def _seat(self, name: str, shard: int) -> str:
        """A member joined: it serves its shard on its own machine, or on the one a previous
        daemon moved it to (``_restore``); that machine."""
        machine = self._restored.pop(name, name)
        self.seats = replace(
            self.seats,
            serving={**self.seats.serving, name: machine},
            shards={**self.seats.shards, name: shard},
        )
        self._sightings.setdefault(machine, Sighting(connected=False))
        return machine

    def _restore(self, saved: SavedSeats) -> list[str]:
        """Take the seats a previous daemon saved, as far as they fit this config (else the
        config's: every member on its own machine); the machines serving nothing."""
        spares = self.seats.spares
        machines = set(self._configured) | set(spares)
        own = {label: label for label in self._configured}
        moved = {
            label: m
            for label, m in saved.serving.items()
            if label in own and m in machines and m != label
        }
        serving = {**own, **moved}
        if len(set(serving.values())) != len(serving):
            return list(spares)  # two shards on one machine: not a state we could have saved
        idle = [m for m in (*spares, *self._configured) if m not in serving.values()]
        fenced = saved.fenced & set(idle)
        held = saved.held & set(idle) - fenced
        self._restored = moved
        self._left = {
            m: entry
            for m, entry in saved.left.items()
            if m in fenced and entry[0] in self._configured
        }
        self.seats = replace(
            self.seats,
            spares=tuple(m for m in idle if m not in fenced and m not in held),
            fenced=frozenset(fenced),
            drained=frozenset(saved.drained & fenced),
            held=frozenset(held),
        )
        for m in idle:
            self._sightings.setdefault(m, Sighting(connected=False))
        return idle

    def saved_seats(self) -> SavedSeats | None:
        """What the state file keeps of the seats (None without spares: nothing to keep)."""
        if not self._sparing:
            return None
        seats = self.seats
        return SavedSeats(
            serving={label: m for label, m in seats.serving.items() if m != label},
            fenced=seats.fenced,
            drained=seats.drained,
            held=seats.held,
            left=dict(self._left),
        )

    def _unseat(self, name: str) -> None:
        """A member left: a spare that served it is free again (its worker was stopped)."""
        machine = self.seats.serving[name]
        serving = {k: v for k, v in self.seats.serving.items() if k != name}
        shards = {k: v for k, v in self.seats.shards.items() if k != name}
        spares = self.seats.spares
        if machine != name:
            spares = (*spares, machine)
        else:
            self._sightings.pop(machine, None)
            self._down.pop(machine, None)
        self.seats = replace(self.seats, serving=serving, shards=shards, spares=spares)
        self._spare_freed = self._spare_freed or machine != name
        self._unserved.discard(name)

    def _sighted(self, machine: str, up: bool, now: float) -> None:
        """``machine``'s connection came up or went down."""
        before = self._sightings.get(machine, Sighting(connected=False))
        if up:
            self._sightings[machine] = replace(before, connected=True, down_since=None)
            self._down.pop(machine, None)
            self._spare_freed = self._spare_freed or machine in self.seats.spares
        elif before.connected or before.down_since is None:
            self._sightings[machine] = replace(before, connected=False, down_since=now)
        # Without a spare nothing can move: no machine is watched for a loss.
        if not up and self._sparing:
            label = next((lb for lb, m in self.seats.serving.items() if m == machine), None)
            if label is not None:
                self._down[machine] = label
        if not self._down:
            self._failover_at = None

    def _fresh_sightings(self) -> dict[str, Sighting]:
        """Sightings with each serving machine's last heartbeat (of the member it serves)."""
        sightings = dict(self._sightings)
        for label, machine in self.seats.serving.items():
            beat_at = self._hosts[label].beat_changed_at
            sightings[machine] = replace(sightings[machine], beat_at=beat_at)
        return sightings

    def _fail_over_lost(self, now: float, out: list[Action]) -> None:
        """Move the shards of lost machines to free spares (rules 1-3)."""
        if self._shutting_down:
            self._failover_at = None
            return
        # Each batch while a machine is down: only the down machines are looked at; the
        # whole fleet's sightings only when one of them is lost and may move.
        after = self._policy.failover_after_s
        lost: list[str] = []
        pending: list[float] = []
        for machine, label in self._down.items():
            beat_at = self._hosts[label].beat_changed_at
            at = lost_at(replace(self._sightings[machine], beat_at=beat_at), after)
            at = math.inf if at is None else at  # (a down machine's loss always has a time)
            if at <= now:
                lost.append(label)
            else:
                pending.append(at)
        self._failover_at = min((t for t in pending if t < math.inf), default=None)
        movable = any(label not in self._unserved for label in lost)
        if not movable and not (lost and self._spare_freed):
            return
        self._spare_freed = False
        self.seats, actions = fail_over(self.seats, self._fresh_sightings(), now, after)
        for action in actions:
            if isinstance(action, Failover):
                self._down.pop(action.from_machine, None)
                self._left[action.from_machine] = (
                    action.label,
                    action.shard,
                    self._hosts[action.label].pid,
                )
                out.append(action)
                self._relocate(action, now, out, wait_release=False)
            elif isinstance(action, NoFreeSpare) and action.label not in self._unserved:
                self._unserved.add(action.label)
                out.append(action)

    def _relocate(
        self, move: Failover, now: float, out: list[Action], *, wait_release: bool
    ) -> None:
        """``move.label`` starts afresh on ``move.to_machine``: what its old machine runs is
        fenced (the shard lock, the epoch, ``KillLeftovers``), never waited for."""
        label = move.label
        self._unserved.discard(label)
        self.failovers[move.reason] = self.failovers.get(move.reason, 0) + 1
        before = self._hosts[label]
        if label in self.budget.in_flight or is_waiting(self.budget, label):
            self.budget = launch_done(self.budget, label)
        why = "host lost" if move.reason == "host_lost" else "drained"
        reason = f"moving to {move.to_machine}: {move.from_machine} {why}"
        host = replace(
            health.new_host(label, now, history=health.history_of(before)),
            reason=reason,
            next_restart_at=None,
            # A free spare runs nothing of ours (a machine is one only once its leftovers are
            # killed): no probe, the launch goes at once.
            needs_probe=False,
            held=before.held,
            frozen=before.frozen,
            # The same status file: what was seen of it stands, so the new worker's first
            # heartbeat counts at once.
            beat_pid=before.beat_pid,
            beat_ready=before.beat_ready,
            remote_heartbeat_at=before.remote_heartbeat_at,
            remote_seq=before.remote_seq,
            beat_changed_at=before.beat_changed_at,
            status_seen=before.status_seen,
            status_problem=before.status_problem,
        )
        self._hosts[label] = host
        self._expected += (host.state in WANT_RUNNING_STATES) - (
            before.state in WANT_RUNNING_STATES
        )
        out.append(
            HostStateChanged(
                host=label,
                from_=before.state,
                to=host.state,
                reason=reason,
                pid=before.pid if before.pid is not None else before.last_pid,
                cause=None,
                evidence=None,
            )
        )
        if wait_release:
            self._release_waits[move.from_machine] = label
        else:  # a free spare is a connected one
            self._feed(label, health.SshRestored(), now, out)
        self._arm(label, self._hosts[label].deadline_at)
        self._assess_due = True
        self._pointer_due = True

    def _spare_observed(self, event: SpareObserved, now: float, out: list[Action]) -> None:
        machine = event.machine
        if machine not in self._sightings:
            return  # not ours (any more)
        self._sighted(machine, event.up, now)
        if event.up and seen_again(self.seats, machine):
            self._kill_leftovers(machine, now, out)
        label = next((lb for lb, m in self.seats.serving.items() if m == machine), None)
        if label is not None and label in self._hosts:
            # A spare serving a member: its connection is that member's.
            ssh: health.Event = (
                health.SshRestored() if event.up else health.SshLost(reason=event.reason)
            )
            self._feed(label, ssh, now, out)

    def _kill_leftovers(self, machine: str, now: float, out: list[Action]) -> None:
        if machine in self._killing or self._shutting_down:
            return
        self._kill_retry_at.pop(machine, None)
        label, shard, pid = self._left.get(machine, (machine, 0, None))
        grace = 0.0
        if machine in self._release_waits and self._health.restart_stop != "kill":
            grace = self._health.stop_grace_s  # a drain ends its worker as a restart does
        self._killing.add(machine)
        out.append(KillLeftovers(machine=machine, label=label, shard=shard, pid=pid, grace_s=grace))

    def _leftovers_killed(self, event: LeftoversKilled, now: float, out: list[Action]) -> None:
        machine = event.machine
        self._killing.discard(machine)
        if event.error is not None:
            if self._sightings.get(machine, Sighting(connected=False)).connected:
                self._kill_retry_at[machine] = now + LEFTOVERS_RETRY_S
            return
        self._left.pop(machine, None)
        self.seats = leftovers_killed(self.seats, machine)
        self._spare_freed = True
        label = self._release_waits.pop(machine, None)
        if (
            label is not None
            and label in self._hosts
            and self._sightings[self.machine_of(label)].connected
        ):
            self._feed(label, health.SshRestored(), now, out)

    def _retry_kills(self, now: float, out: list[Action]) -> None:
        for machine, at in list(self._kill_retry_at.items()):
            if at <= now:
                del self._kill_retry_at[machine]
                if self._sightings.get(machine, Sighting(connected=False)).connected:
                    self._kill_leftovers(machine, now, out)

    def _drain(self, event: DrainRequested, now: float, out: list[Action]) -> None:
        if self._shutting_down:
            message = "the daemon is stopping"
            out.append(Reply(token=event.token, refusal=Refusal.SHUTTING_DOWN, message=message))
            return
        machine = event.host
        if machine not in self._sightings:
            known = ", ".join(sorted(self._sightings)) or "none"
            message = f"unknown host {machine!r} (known: {known})"
            out.append(Reply(token=event.token, refusal=Refusal.UNKNOWN_HOST, message=message))
            return
        result = drain(self.seats, machine, self._fresh_sightings())
        if isinstance(result, Refusal):
            message = {
                Refusal.NO_FREE_SPARE: "no spare is free (connected, serving nothing, cleaned)",
                Refusal.NOT_SERVING: f"{machine!r} serves no shard",
            }.get(result, str(result))
            out.append(Reply(token=event.token, refusal=result, message=message))
            return
        self.seats, move = result
        host = self._hosts[move.label]
        self._left[machine] = (move.label, move.shard, host.pid)
        out.append(move)
        self._relocate(move, now, out, wait_release=True)
        self._kill_leftovers(machine, now, out)
        result_fields = {"label": move.label, "shard": move.shard, "to": move.to_machine}
        out.append(Reply(token=event.token, result=result_fields))

    def _undrain(self, event: UndrainRequested, out: list[Action]) -> None:
        result = undrain(self.seats, event.host)
        if isinstance(result, Refusal):
            message = f"{event.host!r} is not drained (or its worker is still being stopped)"
            out.append(Reply(token=event.token, refusal=result, message=message))
            return
        self.seats = result
        self._spare_freed = True
        out.append(Reply(token=event.token, result={"spare": event.host}))

    # --- operator commands -----------------------------------------------------------------

    def _refuse_unknown(self, name: str, token: int, out: list[Action]) -> bool:
        """Refuse a command for a host that is not a member (or is leaving)."""
        if self._shutting_down:
            out.append(
                Reply(token=token, refusal=Refusal.SHUTTING_DOWN, message="the daemon is stopping")
            )
            return True
        if name in self._hosts and name not in self._retiring:
            return False
        known = ", ".join(sorted(n for n in self._hosts if n not in self._retiring)) or "none"
        message = f"unknown host {name!r} (known: {known})"
        out.append(Reply(token=token, refusal=Refusal.UNKNOWN_HOST, message=message))
        return True

    def _restart_host(self, event: RestartHostRequested, now: float, out: list[Action]) -> None:
        if self._refuse_unknown(event.host, event.token, out):
            return
        refusal = health.restart_refusal(self._hosts[event.host])
        if refusal is not None:
            message = f"host {event.host!r} is {refusal}"
            out.append(Reply(token=event.token, refusal=Refusal.SENTINEL_HELD, message=message))
            return
        self._feed(event.host, health.RestartRequested(reason="operator restart"), now, out)
        out.append(Reply(token=event.token))

    def _sentinel_command(
        self, event: StopHostRequested | StartHostRequested, out: list[Action]
    ) -> None:
        """stop-host writes the host's stop sentinel, start-host removes it; a command that
        comes while the other's file operation is under way waits for its result. Run at
        once, a remove could finish before an earlier write (two threads): start-host would
        be answered, and the sentinel written after it would keep the host stopped."""
        queue = self._sentinel_queues.get(event.host)
        if queue is not None:
            queue.append(event)
            return
        if self._refuse_unknown(event.host, event.token, out):
            return
        self._sentinel_queues[event.host] = []
        if isinstance(event, StopHostRequested):
            out.append(WriteStopSentinel(host=event.host, token=event.token))
        else:
            out.append(DeleteStopSentinel(host=event.host, token=event.token))

    def _next_sentinel_command(self, host: str, out: list[Action]) -> None:
        """The host's sentinel operation is done: the next command waiting for it, if any."""
        waiting = self._sentinel_queues.pop(host, [])
        for event in waiting:
            if host in self._sentinel_queues:
                self._sentinel_queues[host].append(event)
            else:
                self._sentinel_command(event, out)

    def _sentinel_written(self, event: StopSentinelWritten, now: float, out: list[Action]) -> None:
        if event.error is not None:
            message = f"cannot write the stop sentinel of {event.host!r}: {event.error}"
            out.append(Reply(token=event.token, refusal=Refusal.FILE_ERROR, message=message))
            return
        if self._refuse_unknown(event.host, event.token, out):
            return
        self._feed(event.host, health.StopSentinelAppeared(), now, out)
        out.append(Reply(token=event.token))

    def _sentinel_deleted(self, event: StopSentinelDeleted, now: float, out: list[Action]) -> None:
        if event.error is not None:
            message = f"cannot remove the stop sentinel of {event.host!r}: {event.error}"
            out.append(Reply(token=event.token, refusal=Refusal.FILE_ERROR, message=message))
            return
        if self._refuse_unknown(event.host, event.token, out):
            return
        self._feed(event.host, health.StopSentinelRemoved(), now, out)
        self._feed(event.host, health.StartRequested(reason="operator start"), now, out)
        out.append(Reply(token=event.token))

    # --- start-up and shutdown ---------------------------------------------------------------

    def _settle(self, slow: tuple[str, ...], out: list[Action]) -> None:
        self._settled = True
        self._unsettled.clear()
        out.append(Settled(slow=slow))

    def _detaches(self, event: ShutdownRequested) -> bool:
        """Whether this stop leaves the workers running."""
        return self._policy.detach_on_exit if event.detach is None else event.detach

    def _shutdown(self, detach: bool, now: float, out: list[Action]) -> None:
        if self._shutting_down:
            return
        if not self._settled:
            self._settle(tuple(sorted(self._unsettled | self._joining.keys())), out)
        self._shutting_down = True
        out.append(ShutdownBegan(detach=detach))
        if detach:
            self._finish(out, detached=True)  # workers keep running; the next daemon adopts them
            return
        self._shutdown_deadline_at = now + self._policy.shutdown_timeout_s
        # Hosts whose files are being read join once they are, only to be stopped.
        self._stop_pending = set(self._hosts) | set(self._joining)
        for name in list(self._hosts):
            # Feeding one host can only drop that host (a removed one, now stopped).
            self._feed(name, _SHUTDOWN_STOP, now, out)
            self._track_stop(name)
        if not self._stop_pending:
            self._finish(out)

    def _stop_done(self, name: str, host: Host) -> bool:
        """Shutdown is done with this host: stopped, or unreachable (its connection's first
        outcome came, a failure) with nothing in flight."""
        if host.state is S.STOPPED:
            return True
        return not host.ssh_up and host.op is None and name in self._connect_seen

    def _track_stop(self, name: str) -> None:
        host = self._hosts.get(name)
        if host is not None and self._stop_done(name, host):
            self._stop_pending.discard(name)

    def _finish(self, out: list[Action], *, detached: bool = False) -> None:
        if self._finished:
            return
        self._finished = True
        self._joining.clear()
        if detached:
            out.append(ShutdownDone())
        elif self._stop_pending:
            out.append(ShutdownDone(incomplete=tuple(sorted(self._stop_pending))))
        else:
            # A host we cannot reach cannot be stopped: say so, or a stop would read as a
            # promise kept for workers that may well run on.
            unreachable = tuple(n for n, h in self._hosts.items() if h.state is not S.STOPPED)
            out.append(ShutdownDone(unreachable=unreachable))

    # --- leadership ------------------------------------------------------------------------------

    def _halt(self) -> None:
        """Stop at once: nothing more is asked for, whatever was under way."""
        self._halted = True
        self._finished = True
        self._joining.clear()

    # --- crash signatures ------------------------------------------------------------------------

    def _crashed(
        self, name: str, event: health.WorkerExited, now: float, out: list[Action]
    ) -> None:
        """Count a crash of ``name`` by its signature; hold its restart if others crashed
        the same way (unless it is the canary)."""
        if self._policy.crash_signature_hosts <= 0 or not health.exit_applies(
            self._hosts[name], event
        ):
            return
        signature = crash_signature(event)
        if signature is None:
            return
        self._failed_alike(name, signature, "crash", event.log_tail, now, out)

    def _probe_failed(
        self, name: str, event: health.RewardProbeAnswered, now: float, out: list[Action]
    ) -> None:
        """Count a failed reward probe of ``name`` by its signature, like a crash."""
        if self._policy.crash_signature_hosts <= 0:
            return
        reason = health.probe_failure(self._hosts[name], event, self._health)
        if reason is None:
            return
        self._failed_alike(name, f"probe: {_blurred(reason)}", "probe", None, now, out)

    def _failed_alike(
        self,
        name: str,
        signature: str,
        kind: str,
        log_tail: str | None,
        now: float,
        out: list[Action],
    ) -> None:
        """``name`` failed with ``signature``: a new signature once enough hosts have within
        the window, and a hold on this host unless it is the signature's canary."""
        window = self._policy.crash_signature_window_s
        recent = [(t, h) for t, h in self._crashes.get(signature, ()) if now - t < window]
        recent.append((now, name))
        self._crashes[signature] = recent
        active = self.signatures.get(signature)
        if active is None:
            hosts = {h for _, h in recent}
            if len(hosts) < self._policy.crash_signature_hosts:
                return
            active = CrashSignature(
                signature=signature, since_at=now, hosts=frozenset(hosts), canary=name, kind=kind
            )
            self.signatures[signature] = active
            out.append(
                CrashSignatureFound(
                    signature=signature,
                    hosts=tuple(sorted(hosts)),
                    canary=name,
                    log_tail=log_tail,
                    kind=kind,
                )
            )
            for other in sorted(hosts - {name}):
                if other in self._hosts and self._hosts[other].state is not S.READY:
                    self._hold(other, signature, now, out)
            return
        active = replace(active, hosts=active.hosts | {name})
        if active.canary not in self._hosts:
            active = replace(active, canary=name)  # the canary left: this one tries next
        self.signatures[signature] = active
        if active.canary != name:
            self._hold(name, signature, now, out)

    def _hold(self, name: str, signature: str, now: float, out: list[Action]) -> None:
        self.held[name] = signature
        count = len(self.signatures[signature].hosts)
        how = (
            "failed their reward probe" if self.signatures[signature].kind == "probe" else "crashed"
        )
        reason = f"{count} hosts {how} the same way ({signature})"
        self._feed(name, health.RestartHeld(reason=reason), now, out)

    def _ran_again(self, name: str, now: float, out: list[Action]) -> None:
        """``name`` is ready again: it is held no more, and a canary that runs clears its
        signature (whatever crashed it is gone)."""
        self.held.pop(name, None)
        for signature, active in list(self.signatures.items()):
            if active.canary == name:
                self._clear(signature, f"the canary {name} is ready", now, out)

    def _clear_signatures(
        self, reason: str, now: float, out: list[Action], kind: str | None = None
    ) -> None:
        for signature, active in list(self.signatures.items()):
            if kind is None or active.kind == kind:
                self._clear(signature, reason, now, out)

    def _clear(self, signature: str, reason: str, now: float, out: list[Action]) -> None:
        kind = self.signatures.pop(signature).kind
        self._crashes.pop(signature, None)
        released = sorted(n for n, s in self.held.items() if s == signature)
        out.append(
            CrashSignatureCleared(
                signature=signature, reason=reason, released=tuple(released), kind=kind
            )
        )
        for name in released:
            del self.held[name]
            self._feed(name, health.RestartReleased(), now, out)

    # --- the pointer file ----------------------------------------------------------------------

    def _write_pointer_if_due(self, now: float, out: list[Action]) -> None:
        self._pointer_due = False
        path = self._policy.pointer_file
        if path is not None and pointer_due(self.pointer, self._hosts.values(), now):
            self.pointer = pointer_started(self.pointer)
            out.append(WritePointer(path=path))

    def _pointer_written(self, event: PointerWritten, now: float, out: list[Action]) -> None:
        if event.path != self._policy.pointer_file:
            return  # a reload named another file meanwhile: this one is not wanted
        if event.error is None:
            self.pointer = pointer_written(self.pointer)
            return
        self.pointer = pointer_failed(self.pointer, now, event.error)
        retry_at = self.pointer.retry_at if self.pointer.retry_at is not None else now
        out.append(
            PointerNotWritten(
                path=event.path,
                reason=event.error,
                attempt=self.pointer.failures,
                retry_at=retry_at,
            )
        )

    # --- time ----------------------------------------------------------------------------------

    def _arm(self, name: str, deadline_at: float | None) -> None:
        """Keep one timer entry per host that is due no later than its deadline."""
        armed = self._armed.get(name)
        if armed is not None and deadline_at is not None and armed <= deadline_at:
            # Every heartbeat moves a ready host's deadline later; an early wake-up only
            # makes the core say when to come back.
            return
        if deadline_at is None:
            self._armed.pop(name, None)
            return
        # The entry this one supersedes stays in the heap until its time, then is skipped:
        # only a deadline that moves earlier (a state change, never a heartbeat) adds one,
        # so the heap holds the hosts plus the changes of one deadline horizon at most.
        self._armed[name] = deadline_at
        heapq.heappush(self._timers, (deadline_at, name))

    def _deadline_passed(self, now: float, out: list[Action]) -> None:
        if self._assess_at is not None and now >= self._assess_at:
            # Before the hosts' own deadlines: a timer that fires late (a stalled loop, a
            # suspended VM) must still freeze the fleet before silence restarts anyone.
            self._assess(now, out)
        due: list[str] = []
        while self._timers and self._timers[0][0] <= now:
            when, name = heapq.heappop(self._timers)
            if self._armed.get(name) == when:
                del self._armed[name]
                due.append(name)
        for name in due:  # a host that left was disarmed (_drop): every one is a member
            self._feed(name, health.DeadlinePassed(), now, out)
        grant_at = next_grant_at(self.budget, self._policy)
        if grant_at is not None and now >= grant_at:
            self._grant(now, out)
        if self.pointer.retry_at is not None and now >= self.pointer.retry_at:
            self._pointer_due = True
        deadline = self._startup_deadline_at
        if not self._settled and deadline is not None and now >= deadline:
            self._settle(tuple(sorted(self._unsettled | self._joining.keys())), out)
        if self._shutdown_deadline_at is not None and now >= self._shutdown_deadline_at:
            self._finish(out)
        if self._kill_retry_at:
            self._retry_kills(now, out)

    # --- freeze and budget ----------------------------------------------------------------------

    def _assess(self, now: float, out: list[Action]) -> None:
        self._assess_due = False
        if self._no_freeze_possible(now):
            return
        hosts = self._hosts.values()
        silent_after_s = self._health.heartbeat_stale_s / 2
        surveyed = survey(self.freeze, hosts, now, silent_after_s)
        self.freeze, change = assess(
            self.freeze, hosts, now, self._policy, silent_after_s, surveyed=surveyed
        )
        if change is not None:
            self._apply_freeze(change, now, out)
            # The freeze's ignore_before_at and the hosts may have changed: look again.
            surveyed = survey(self.freeze, self._hosts.values(), now, silent_after_s)
        self._assess_at = surveyed.next_at
        self._silent_bound = len(surveyed.silent)

    def _no_freeze_possible(self, now: float) -> bool:
        """Too few hosts can be silent to freeze the fleet, so the look can be skipped.

        A state change (a crash among them) calls for an assessment, and at a thousand
        hosts looking at every one was most of what stood between a pushed exit and its
        relaunch (docs/BENCHMARKS.md). Between looks silence only shrinks (heartbeats,
        hosts leaving ``ready``) until the next crossing, except where ``_track_silence``
        says otherwise; the threshold follows the hosts that should run.
        """
        return (
            not self.freeze.frozen
            and self._silent_bound is not None
            and (self._assess_at is None or now < self._assess_at)
            and self._silent_bound < threshold(self._expected, self._policy)
        )

    def _track_silence(self, alive_at: float, now: float) -> None:
        """Keep the bound and the next crossing true for a host that became ready, or whose
        last heartbeat was moved back to ``alive_at`` (``survey``'s tests, host by host).

        A heartbeat from before an unfreeze, which ``survey`` leaves out, is taken as it
        comes: at worst an early wake-up or a full look, both harmless.
        """
        silent_after_s = self._health.heartbeat_stale_s / 2
        if now - alive_at >= silent_after_s:
            self._silent_bound = None  # silent already: the next assessment looks
            self._assess_due = True
            return
        crossing = _crossing_at(alive_at, now, silent_after_s)
        if self._assess_at is None or crossing < self._assess_at:
            self._assess_at = crossing

    def _apply_freeze(self, change: FreezeChange, now: float, out: list[Action]) -> None:
        self.finding = None
        self._silent_bound = None
        out.append(
            FreezeChanged(
                frozen=change.frozen, reason=change.reason, hosts=tuple(sorted(self.freeze.hosts))
            )
        )
        if change.frozen:
            out.append(DiagnoseFilesystem())
        event: health.Event = (
            health.FleetFrozen(reason=change.reason) if change.frozen else health.FleetThawed()
        )
        for name in list(self._hosts):
            self._feed(name, event, now, out)

    def _grant(self, now: float, out: list[Action]) -> None:
        """Begin the queued launches the budget allows now (longest waiting first)."""
        self.budget, granted = grant(self.budget, now, self._policy)
        for name in granted:  # a host that left gave up its place (_drop): every one is a member
            self._feed(name, health.LaunchBegan(), now, out)
            out.append(Launch(host=name))
        if self.budget.waiting:
            out.append(LaunchesWaiting(waiting=len(self.budget.waiting)))


_SHUTDOWN_STOP: Final = health.StopRequested(
    reason="daemon shutdown", cause=health.StopCause.SHUTDOWN
)


# --------------------------------------------------------------------------------------
# Crash signatures


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashSignature:
    """A way of crashing that several hosts share, holding their restarts."""

    signature: str
    since_at: float
    hosts: frozenset[str]
    #: The one host that keeps restarting (under its own backoff) to find out if it is over.
    canary: str
    #: "crash" (exits) or "probe" (reward probes).
    kind: str = "crash"


#: SIGHUP, SIGINT, SIGKILL, SIGTERM: sent to a worker by someone (the OOM killer, an operator,
#: a scheduler), so they say nothing about what the worker runs.
_SENT_SIGNALS: Final = frozenset({1, 2, 9, 15})
#: How much of the log's last line a signature keeps.
_SIGNATURE_LINE: Final = 160
_NUMBERS: Final = re.compile(r"0x[0-9a-fA-F]+|\d+")
_SPACE: Final = re.compile(r"\s+")


def _blur(number: re.Match[str]) -> str:
    return "0x?" if number.group().startswith("0x") else "N"


def crash_signature(event: health.WorkerExited) -> str | None:
    """How the worker crashed, alike for alike crashes on different hosts; None for an exit
    that says nothing about what the worker runs (a signal someone sent)."""
    if event.signal is not None:
        if event.signal in _SENT_SIGNALS:
            return None
        head = f"signal {event.signal}"
    elif event.exit_code is not None:
        head = f"exit {event.exit_code}"
    else:
        return None
    line = health.last_log_line(event.log_tail)
    if not line:
        return head
    return f"{head}: {_blurred(line)}"


def _blurred(line: str) -> str:
    """``line`` alike on every host: pids, addresses, times and counts differ from host to
    host; the words do not."""
    return _SPACE.sub(" ", _NUMBERS.sub(_blur, line)).strip()[:_SIGNATURE_LINE]


# --------------------------------------------------------------------------------------
# Common-mode freeze


@dataclass(frozen=True, slots=True, kw_only=True)
class Freeze:
    """The freeze state of the fleet."""

    frozen: bool = False
    reason: str = ""
    since_at: float | None = None
    #: The hosts whose silence froze the fleet.
    hosts: frozenset[str] = frozenset()
    #: Silences that began before this instant do not count (an operator thawed over them).
    ignore_before_at: float = -math.inf


@dataclass(frozen=True, slots=True)
class FreezeChange:
    """The fleet froze (``frozen=True``) or thawed."""

    frozen: bool
    reason: str


def threshold(expected: int, policy: FleetPolicy) -> int:
    """How many hosts must fall silent together to freeze a fleet of ``expected``."""
    return max(2, math.ceil(policy.freeze_fraction * expected))


@dataclass(frozen=True, slots=True)
class Survey:
    """What one look at every host tells the freeze (``survey``)."""

    #: Hosts that should have a worker running (the freeze's threshold counts them).
    expected: int
    #: Ready hosts silent for ``silent_after_s`` or longer, newest silence first.
    silent: list[Host]
    #: When the next ready host will cross the silence threshold, if nothing else happens.
    next_at: float | None


def survey(freeze: Freeze, hosts: Iterable[Host], now: float, silent_after_s: float) -> Survey:
    """How many hosts should run, which ready hosts are silent, and when the next one will
    be (the freeze's next assessment), in one pass over the fleet: a look costs O(hosts)
    once, not three times (docs/BENCHMARKS.md).
    """
    expected = 0
    silent: list[Host] = []
    next_at: float | None = None
    ignore_before_at = freeze.ignore_before_at
    ready = HostState.READY
    for h in hosts:
        state = h.state
        if state in WANT_RUNNING_STATES:
            expected += 1
        alive_at = h.alive_at
        if state is not ready or alive_at is None or alive_at < ignore_before_at:
            continue
        if now - alive_at >= silent_after_s:
            silent.append(h)
            continue
        crossing = _crossing_at(alive_at, now, silent_after_s)
        if next_at is None or crossing < next_at:
            next_at = crossing
    silent.sort(key=lambda h: h.alive_at or 0.0, reverse=True)
    return Survey(expected=expected, silent=silent, next_at=next_at)


def _crossing_at(alive_at: float, now: float, silent_after_s: float) -> float:
    """When a host not yet silent at ``now`` (heartbeat at ``alive_at``) will be: always
    after ``now``.

    In floating point ``alive_at + silent_after_s`` may round to ``now`` or below while
    ``now - alive_at`` is still short of ``silent_after_s`` (11.899283843798594 + 5 is
    16.899283843798592): such a host would be neither silent nor due, and no look would
    come until something else happened. The next representable time after ``now`` looks
    again.
    """
    crossing = alive_at + silent_after_s
    return crossing if crossing > now else math.nextafter(now, math.inf)


def assess(
    freeze: Freeze,
    hosts: Iterable[Host],
    now: float,
    policy: FleetPolicy,
    silent_after_s: float,
    *,
    surveyed: Survey | None = None,
) -> tuple[Freeze, FreezeChange | None]:
    """Freeze, thaw, or leave the fleet as it is, given every host at ``now`` (and
    ``surveyed``, their ``survey`` at ``now`` with this ``freeze``, if the caller has it).

    A ready host is "silent" once its heartbeat is ``silent_after_s`` old (half the stale
    threshold, so the freeze lands before any host's own restart deadline).
    """
    if surveyed is None:
        hosts = list(hosts)
        surveyed = survey(freeze, hosts, now, silent_after_s)
    expected = surveyed.expected
    needed = threshold(expected, policy)
    silent = surveyed.silent
    if not freeze.frozen:
        together = _largest_group(silent, policy.freeze_window_s)
        if expected < 2 or len(together) < needed:
            return freeze, None
        reason = (
            f"{len(together)}/{expected} hosts fell silent together (no heartbeat for"
            f" {silent_after_s:g}s): suspect the shared filesystem, the network or"
            " this node's mount, not the workers; restarts for silence are frozen"
        )
        names = frozenset(h.name for h in together)
        return replace(freeze, frozen=True, reason=reason, since_at=now, hosts=names), (
            FreezeChange(frozen=True, reason=reason)
        )
    hosts = list(hosts)
    # Hosts that fall silent while frozen are part of the same stall: the thaw waits for them.
    joined = freeze.hosts | {h.name for h in silent}
    if joined != freeze.hosts:
        freeze = replace(freeze, hosts=joined)
    # Only a heartbeat ends a host's part in the stall. A frozen host whose worker really
    # died is replaced, but its new worker writes through the same stalled filesystem:
    # until it beats, the host is as silent as before (counting it as recovered would thaw
    # the fleet, and restart every other stalled host, on the strength of one crash).
    still_silent = [
        h
        for h in hosts
        if h.name in freeze.hosts
        and h.state in WANT_RUNNING_STATES
        and not _beating(h, now, silent_after_s)
    ]
    if len(still_silent) >= needed:
        return freeze, None
    back = sum(1 for h in hosts if h.name in freeze.hosts and _beating(h, now, silent_after_s))
    reason = f"heartbeats returned ({back} of {len(freeze.hosts)} stalled hosts beating again)"
    return _thawed(freeze), FreezeChange(frozen=False, reason=reason)


def _beating(host: Host, now: float, silent_after_s: float) -> bool:
    """The host's current worker has beaten within ``silent_after_s``."""
    return host.alive_at is not None and now - host.alive_at < silent_after_s


def unfreeze(freeze: Freeze, now: float) -> tuple[Freeze, FreezeChange | None]:
    """An operator lifts the freeze; silences older than now stop counting."""
    thawed = replace(_thawed(freeze), ignore_before_at=now)
    if not freeze.frozen:
        return thawed, None
    return thawed, FreezeChange(frozen=False, reason="operator unfreeze")


def _thawed(freeze: Freeze) -> Freeze:
    return replace(freeze, frozen=False, reason="", since_at=None, hosts=frozenset())


def _largest_group(silent: list[Host], window_s: float) -> list[Host]:
    """The largest set of silent hosts whose last heartbeats lie within ``window_s``."""
    stamps = sorted(silent, key=lambda h: h.alive_at or 0.0)
    best: list[Host] = []
    start = 0
    for end, host in enumerate(stamps):
        while (host.alive_at or 0.0) - (stamps[start].alive_at or 0.0) > window_s:
            start += 1
        if end - start + 1 > len(best):
            best = stamps[start : end + 1]
    return best


# --------------------------------------------------------------------------------------
# Launch budget


@dataclass(frozen=True, slots=True, kw_only=True)
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


# --------------------------------------------------------------------------------------
# The pointer file (``run.pointer_file``): the seed's "this run's workers are up" marker

#: A failed pointer write is retried after this long, doubling up to POINTER_RETRY_MAX_S: a
#: missing directory or a read-only mount is fixed by a person, in minutes, not milliseconds.
POINTER_RETRY_MIN_S = 1.0
POINTER_RETRY_MAX_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
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


# --------------------------------------------------------------------------------------
# Failover (issue 32): which machine serves each label's shard. A label is a [[hosts]]
# name; the machine serving it is that host, or the spare its shard was moved to. The
# status file keeps the label's name (the worker runs with ``--host <label>``), so the
# trainer sees the same hosts whichever machine serves them.
#
# Rules:
# 1. A machine is lost when its connection is seen down AND the heartbeat of what it serves
#    is ``after_s`` old: a partition alone (the worker still beats on the shared
#    filesystem) or a hung worker alone (health.py restarts it) is not a lost machine.
# 2. A lost machine's label goes to the first free spare (connected, not lost, serving
#    nothing, not fenced); none free: the label stays and ``NoFreeSpare`` says so.
# 3. A machine that lost its label (lost or drained) is fenced: it is given nothing until
#    its leftovers are killed (``KillLeftovers`` when it is seen again). Then it becomes a
#    spare (lost) or stays out until ``undrain`` (drained): it never flaps back.
# 4. The shard lock on the shared filesystem is the last fence: a launch on the spare
#    waits on it, so a lost machine's worker that is alive after all never serves beside it.


def new_seats(hosts: Iterable[tuple[str, int]], spares: Iterable[str]) -> Seats:
    """Every label served by its own host, every spare free."""
    pairs = tuple(hosts)
    return Seats(
        serving={label: label for label, _ in pairs},
        shards={label: shard for label, shard in pairs},
        spares=tuple(spares),
    )


def lost_at(sighting: Sighting, after_s: float) -> float | None:
    """When the machine is lost if nothing changes: its connection seen down (not merely
    untried) and its heartbeat ``after_s`` old. The heartbeat's age is the clock, since an
    SSH keepalive may notice a dead peer late; without a heartbeat seen, the connection's
    loss is (a daemon that started beside a dead host still gives it ``after_s``)."""
    if sighting.connected or sighting.down_since is None:
        return None
    since = sighting.beat_at if sighting.beat_at is not None else sighting.down_since
    return since + after_s


def is_lost(sighting: Sighting, now: float, after_s: float) -> bool:
    """The machine is lost at ``now`` (``lost_at``)."""
    at = lost_at(sighting, after_s)
    return at is not None and now >= at


def free_spares(seats: Seats, sightings: Mapping[str, Sighting]) -> tuple[str, ...]:
    """The spares a shard may be moved to now: connected, serving nothing, not fenced."""
    busy = set(seats.serving.values()) | seats.fenced | seats.held
    return tuple(
        m
        for m in seats.spares
        if m not in busy and (s := sightings.get(m)) is not None and s.connected
    )


def _move(seats: Seats, label: str, to: str, drained: bool) -> Seats:
    machine = seats.serving[label]
    serving = dict(seats.serving)
    serving[label] = to
    return replace(
        seats,
        serving=serving,
        spares=tuple(m for m in seats.spares if m != to),
        fenced=seats.fenced | {machine},
        drained=seats.drained | {machine} if drained else seats.drained,
    )


def fail_over(
    seats: Seats, sightings: Mapping[str, Sighting], now: float, after_s: float
) -> tuple[Seats, list[FailoverAction]]:
    """Move every lost machine's label to a free spare (rules 1-3), labels in name order."""
    out: list[FailoverAction] = []
    for label in sorted(seats.serving):
        machine = seats.serving[label]
        sighting = sightings.get(machine)
        if sighting is None or not is_lost(sighting, now, after_s):
            continue
        free = free_spares(seats, sightings)
        shard = seats.shards[label]
        if not free:
            out.append(NoFreeSpare(label=label, shard=shard, machine=machine))
            continue
        seats = _move(seats, label, free[0], drained=False)
        out.append(
            Failover(
                label=label,
                shard=shard,
                from_machine=machine,
                to_machine=free[0],
                reason="host_lost",
            )
        )
    return seats, out


def seen_again(seats: Seats, machine: str) -> list[FailoverAction]:
    """``machine`` connected: a fenced one's leftovers are killed before anything else."""
    return [KillLeftovers(machine=machine)] if machine in seats.fenced else []


def leftovers_killed(seats: Seats, machine: str) -> Seats:
    """``machine`` runs nothing of ours: a spare again, or held until ``undrain``."""
    if machine not in seats.fenced:
        return seats
    fenced = seats.fenced - {machine}
    if machine in seats.drained:
        return replace(
            seats, fenced=fenced, drained=seats.drained - {machine}, held=seats.held | {machine}
        )
    return replace(seats, fenced=fenced, spares=(*seats.spares, machine))


def drain(
    seats: Seats, machine: str, sightings: Mapping[str, Sighting]
) -> tuple[Seats, Failover] | Refusal:
    """Move ``machine``'s label to a free spare for maintenance; it is fenced, then held."""
    label = next((lb for lb, m in sorted(seats.serving.items()) if m == machine), None)
    if label is None:
        return Refusal.NOT_SERVING
    free = free_spares(seats, sightings)
    if not free:
        return Refusal.NO_FREE_SPARE
    new = _move(seats, label, free[0], drained=True)
    move = Failover(
        label=label,
        shard=seats.shards[label],
        from_machine=machine,
        to_machine=free[0],
        reason="drain",
    )
    return new, move


def undrain(seats: Seats, machine: str) -> Seats | Refusal:
    """A drained machine, cleaned up, goes back to the pool as a spare."""
    if machine not in seats.held:
        return Refusal.NOT_DRAINED
    return replace(seats, held=seats.held - {machine}, spares=(*seats.spares, machine))
