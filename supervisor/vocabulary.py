"""The fleet's vocabulary: the events the shell feeds the fleet core and the actions it
returns (with the policy, membership and refusal codes of ``policies.py`` and
``refusals.py``, which the CLI imports alone). Pure values and no behaviour, so the shell
imports it without the fleet core behind it.

Events are past-tense facts the shell observed, or the results of actions it performed;
actions are imperative, each performed by one adapter (``Daemon._fleet_routes``), and a
remote operation or a file write answers with an event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Final

from supervisor import health
from supervisor.health import HostState
from supervisor.policies import FleetPolicy as FleetPolicy
from supervisor.policies import Member as Member
from supervisor.records import record
from supervisor.refusals import Refusal as Refusal

#: The state ``status`` shows for a configured host that waits for its shard or its name to
#: be free (a reload moved a shard while its old host still stops): not a ``HostState``, as
#: such a host has no health yet.
WAITING: Final = "waiting"
#: Why such a host waits, as ``status`` says it.
WAITING_REASON: Final = "shard busy"
#: The state ``status`` shows for a ``ready`` host whose rewards are named as lying
#: (``rewards.py``): its worker runs, but what it scores is wrong, so it is not ready.
LYING: Final = "lying"


# --------------------------------------------------------------------------------------
# Events: past-tense facts the shell observed or results of actions it performed.


@record
class Booted:
    """The daemon holds the run: its members may join, with the restart history a previous
    daemon left (so a daemon that keeps crashing cannot reset every host's backoff)."""

    histories: Mapping[str, health.History] = field(default_factory=dict)
    #: Which machine served each shard when the previous daemon last saved (failover).
    seats: SavedSeats | None = None


@record
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


@record
class LeadershipEnded:
    """This daemon does not lead (a standby that stops) or no longer does (deposed): the
    fleet halts at once, whatever it was doing."""


@record(kw_only=False)
class HostObserved:
    """Something about one host: a file, SSH, or the answer to a remote operation."""

    host: str
    event: health.Event


@record
class FilesScanned:
    """The files of joining ``hosts`` were read; ``sentinels`` have ``ctl/<host>.stop``."""

    hosts: frozenset[str]
    sentinels: frozenset[str]


@record
class DeadlinePassed:
    """The shell's timer for ``Fleet.deadline_at`` fired (maybe early, late or twice)."""


@record
class Reconfigured:
    """A reload validated a new config: its members and rules replace the old ones."""

    members: tuple[Member, ...]
    health: health.Policy
    policy: FleetPolicy
    token: int


@record
class RestartHostRequested:
    """An operator asked for a fresh worker on ``host``."""

    host: str
    token: int


@record
class StopHostRequested:
    """An operator asked for ``host`` to stop and stay stopped."""

    host: str
    token: int


@record
class StartHostRequested:
    """An operator asked for ``host`` to run again (clears its sentinel and ``failed``)."""

    host: str
    token: int


@record
class UnfreezeRequested:
    """An operator lifted the freeze."""

    token: int


@record
class ShutdownRequested:
    """The daemon is to stop: stop every worker first, or leave them running (``detach``;
    None: as ``FleetPolicy.detach_on_exit`` says, the operator's ``run.on_exit``)."""

    detach: bool | None = None


@record
class StopSentinelWritten:
    """The shell wrote ``ctl/<host>.stop`` for a stop-host (``error`` if it could not)."""

    host: str
    token: int
    error: str | None = None


@record
class StopSentinelDeleted:
    """The shell removed ``ctl/<host>.stop`` for a start-host (``error`` if it could not)."""

    host: str
    token: int
    error: str | None = None


@record
class PointerWritten:
    """The shell wrote the pointer file at ``path`` (``error`` if it could not)."""

    path: str
    error: str | None = None


@record
class FilesystemDiagnosed:
    """What the shell found when it checked the run root during a freeze."""

    finding: str
    free_bytes: int | None = None


@record(kw_only=False)
class MachineObserved:
    """News of one machine's connection: SSH up or down, a new agent, or what its agent
    pushed (a worker's exit, its session's memory). The fleet tells it to the member the
    machine serves, if any (links know machines, never which member a machine serves)."""

    machine: str
    event: (
        health.SshLost
        | health.SshRestored
        | health.WorkerExited
        | health.AgentStarted
        | health.UsageMeasured
    )


@record
class LeftoversKilled:
    """The answer to ``KillLeftovers``: nothing of ours runs on ``machine`` now, or why not."""

    machine: str
    #: None: done; else why not (tried again while it stays connected).
    error: str | None = None


@record
class DrainRequested:
    """Operator: move the shard ``host`` serves to a spare, and keep ``host`` out."""

    host: str
    token: int


@record
class UndrainRequested:
    """Operator: a drained ``host`` goes back to the pool, as a spare."""

    host: str
    token: int


FleetEvent = (
    Booted
    | MachineObserved
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


@record
class ScanFiles:
    """Read the status, exit and sentinel files of joining hosts; answer FilesScanned, then
    their observations."""

    hosts: tuple[str, ...]


@record
class Connect:
    """``host`` joined: open and keep its SSH connection (SSH news comes back as events)."""

    host: str
    shard: int
    #: False for the members present at start-up (the shell logs joins after it only).
    added: bool
    #: The machine serving its shard: the host itself, or a spare it was moved to before a
    #: daemon restart. Its connection may be open already (a spare's, a standby's).
    machine: str


@record
class Disconnect:
    """``host`` left the fleet: cancel its machine's operations and close its connection."""

    host: str
    machine: str


@record
class Release:
    """``host`` left the fleet while the spare ``machine`` served it: cancel its operations
    and keep the connection as the spare's, serving none."""

    host: str
    machine: str


@record
class Reconnect:
    """A reload changed ``host``'s settings: apply them to its own machine's connection."""

    host: str
    machine: str


@record
class LaunchAsked:
    """``host`` needs a worker: its launch waits for the budget (logged as ``host.launch``)."""

    host: str
    reason: str
    is_restart: bool
    #: Why the worker is replaced (automatic restarts only).
    cause: health.Cause | None
    #: Who replaced a healthy worker on purpose (a planned restart).
    planned: health.Planned | None = None


@record
class Launch:
    """Start ``host``'s worker now (the budget let it begin); answer with a launch result."""

    host: str
    #: The machine serving ``host``'s shard, where the work is done (``--host host --shard
    #: shard`` there).
    machine: str
    shard: int


@record
class Terminate:
    """Stop ``pid`` on ``host``; answer TerminateConfirmed or TerminateFailed."""

    host: str
    #: The machine serving ``host``'s shard, where the work is done (``--host host --shard
    #: shard`` there).
    machine: str
    shard: int
    pid: int
    grace_s: float
    kill: bool
    #: Capture the worker's stacks and log tail first (``health.Terminate.collect_evidence``).
    collect_evidence: bool = False


@record
class Probe:
    """Find ``host``'s live worker; answer ProbeResult or ProbeFailed."""

    host: str
    #: The machine serving ``host``'s shard, where the work is done (``--host host --shard
    #: shard`` there).
    machine: str
    shard: int
    pid: int | None


@record
class Watch:
    """Have ``machine``'s agent watch ``host``'s worker ``pid`` and push its exit (a new
    connection's agent watches nothing yet); best effort, unanswered."""

    host: str
    machine: str
    shard: int
    pid: int
    start_time: int | None


@record
class Quarantine:
    """Take the ``count`` oldest tasks out of ``shard``'s inbox, each answered with an error
    result, before ``host``'s next worker starts (``health.Quarantine``); answer with
    ``HostObserved(host, health.Quarantined(...))`` exactly once."""

    host: str
    shard: int
    count: int


@record
class ProbeReported:
    """What ``host``'s reward probe found, as its core judged it: logged and counted."""

    host: str
    report: health.ProbeReport


@record
class SendRewardProbe:
    """Write ``task`` (with a probe's id) into ``shard``'s inbox and await its result for
    ``timeout_s``; answer with ``HostObserved(host, RewardProbeAnswered(pid=pid, ...))``."""

    host: str
    shard: int
    pid: int
    task: str
    timeout_s: float


@record
class RecheckStatus:
    """Read ``host``'s status file again now, by content (and count its shard's task files
    this old, if ``tasks_older_than_s``); answer with
    ``HostObserved(host, health.StatusRechecked(...))``."""

    host: str
    shard: int
    tasks_older_than_s: float | None = None


@record
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
    #: The change is a fault (said as a warning), not an operator's or a reload's doing.
    fault: bool = False


@record
class LaunchesWaiting:
    """Launches wait for the budget: ``waiting`` of them."""

    waiting: int


@record
class WriteStopSentinel:
    """Write ``ctl/<host>.stop``; answer StopSentinelWritten."""

    host: str
    token: int


@record
class DeleteStopSentinel:
    """Remove ``ctl/<host>.stop``; answer StopSentinelDeleted."""

    host: str
    token: int


@record
class Reply:
    """Answer the operator command ``token``: done (with ``result``), or refused."""

    token: int
    result: Mapping[str, object] | None = None
    refusal: Refusal | None = None
    message: str = ""


@record
class FreezeChanged:
    """The fleet froze (``frozen``) or thawed; tell the operator."""

    frozen: bool
    reason: str
    hosts: tuple[str, ...]


@record
class DiagnoseFilesystem:
    """Check whether the run root is hung or full; answer FilesystemDiagnosed."""


@record
class FreezeExplained:
    """The frozen fleet's filesystem check found ``finding``; tell the operator."""

    finding: str
    free_bytes: int | None = None


@record
class Settled:
    """Start-up is over (READY=1); ``slow`` hosts had not answered by the deadline."""

    slow: tuple[str, ...]


@record
class ShutdownBegan:
    """Shutdown has begun (STOPPING=1)."""

    detach: bool


@record
class ShutdownDone:
    """Shutdown is over: ``incomplete`` were still stopping at the deadline, ``unreachable``
    could not be stopped over SSH (their workers may still run)."""

    incomplete: tuple[str, ...] = ()
    unreachable: tuple[str, ...] = ()


@record
class WritePointer:
    """Write the pointer file at ``path`` atomically; answer PointerWritten."""

    path: str


@record
class PointerNotWritten:
    """The pointer write failed (``attempt`` so far); it is tried again at ``retry_at``."""

    path: str
    reason: str
    attempt: int
    retry_at: float


@record
class CrashSignatureFound:
    """Hosts crashed (or failed their reward probe) the same way: restarts on it are held
    but for the ``canary``."""

    signature: str
    hosts: tuple[str, ...]
    canary: str
    log_tail: str | None
    #: "crash" (exits) or "probe" (reward probes).
    kind: str = "crash"


@record
class CrashSignatureCleared:
    """A crash signature no longer holds restarts (``reason`` says why)."""

    signature: str
    reason: str
    released: tuple[str, ...]
    kind: str = "crash"


@record
class HistoryChanged:
    """Restart history changed: persist ``Fleet.histories()`` soon."""


@record
class Failover:
    """Launch ``label``'s shard on ``to_machine`` (``--host label --shard shard``)."""

    label: str
    shard: int
    from_machine: str
    to_machine: str
    #: "host_lost", "drain" or "lying" (``rewards.py``).
    reason: str


@record
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


@record
class KeepSpare:
    """Connect to the spare ``machine`` and keep it connected (its news: ``MachineObserved``)."""

    machine: str


@record
class NoFreeSpare:
    """``label``'s machine is lost and no spare is free: the shard stays unserved."""

    label: str
    shard: int
    machine: str


FailoverAction = Failover | KillLeftovers | NoFreeSpare


@record
class ExitReported:
    """A machine's agent pushed a worker's exit: of ``host``'s worker, or (None) of a
    leftover of a machine that serves no member now; logged as the fleet tells it."""

    machine: str
    host: str | None
    pid: int
    exit_code: int | None = None
    signal: int | None = None
    reaped: int | None = None


@record
class LyingHostNamed:
    """``host``'s rewards are out of line with the rest of the fleet's (``reason`` gives its
    rates beside the fleet's): it is not ready from now on; logged as ``rewards.lying``."""

    host: str
    machine: str
    #: "zero" (scores of 0), "error" (error results), or both.
    kinds: tuple[str, ...]
    reason: str


@record
class LyingHostKept:
    """A host named as lying keeps serving its shard: it cannot be moved (``reason``)."""

    host: str
    machine: str
    reason: str


@record
class LyingHostCleared:
    """``host`` is no longer named as lying (``reason``)."""

    host: str
    machine: str
    reason: str


@record
class RewardSignatureFound:
    """Most of the fleet's rewards moved out of line with their own past at once: one cause
    (a deploy, a shared dependency); nothing is moved or restarted for it."""

    kinds: tuple[str, ...]
    hosts: tuple[str, ...]
    reason: str


@record
class RewardSignatureCleared:
    """The fleet-wide reward signature is over (``reason``)."""

    reason: str


@record
class ToHost:
    """Not for the shell: a sub-core's word to ``Fleet``, to feed ``event`` to ``host``'s
    health core in its place among the actions."""

    host: str
    event: health.Event


@record
class CrashSignature:
    """A way of crashing that several hosts share, holding their restarts."""

    signature: str
    since_at: float
    hosts: frozenset[str]
    #: The one host that keeps restarting (under its own backoff) to find out if it is over.
    canary: str
    #: "crash" (exits) or "probe" (reward probes).
    kind: str = "crash"


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
    | Watch
    | Quarantine
    | ProbeReported
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
    | ExitReported
    | LyingHostNamed
    | LyingHostKept
    | LyingHostCleared
    | RewardSignatureFound
    | RewardSignatureCleared
)

#: What a fleet sub-core says: actions for the shell, and words for the per-host cores.
Said = Action | ToHost
