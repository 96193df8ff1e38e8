"""The per-host health state machine: events and the time in, a new host and actions out.

Rules (DESIGN §4); everything that decides a host's health lives in this file:

1. At most one live worker per shard, always. ``Launch`` is emitted only when no pid of this
   host may still be alive: every pid is confirmed dead by an exit record, a terminate that
   saw it die, or a probe, and an unknown outcome (a launch cut off by a lost connection, a
   daemon that just started) is cleared by a ``Probe`` first.
2. Skew-immune heartbeats. A heartbeat counts when the worker's stamp (``heartbeat_at`` and
   ``seq``) *changes*, and its age is measured on our monotonic clock from the moment we saw
   the change. The worker's clock is never compared with ours, so hours of skew, or a stamp
   that goes backwards, change no decision. The first stamp we ever see is only a baseline:
   a file left by a worker that died yesterday must not look alive.
3. Identity. Only heartbeats from the host's current pid count; in ``starting`` the file
   left by the previous worker cannot make the new one look ready.
4. SSH down is not worker down. Losing the connection changes no state; remote actions
   simply wait until it is back, and a worker whose heartbeat stays fresh stays ``ready``.
5. Backoff. The first restart after a healthy period is immediate; the n-th consecutive
   failure waits ``restart_cooldown_s * 2**(n-2)``, capped at ``backoff_max_s``; the count
   resets after ``backoff_reset_s`` in ``ready``. More than ``max_restarts`` (when > 0)
   automatic restarts within ``restart_window_s`` means ``failed``: no more restarts until
   an operator asks.
6. Common-mode failures are not worker failures. While the fleet is frozen (``FleetFrozen``,
   decided by ``fleet.py``), a silent heartbeat or a missing ready report causes no restart
   and a stale worker is not terminated; an observed exit is still acted on. After the
   thaw a host still silent gets a full ``heartbeat_stale_s`` (a starting one its full
   ``ready_timeout_s``) from the thaw: after a shared-filesystem outage, clients resume
   one by one, and judging the slower ones against their pre-outage heartbeat would end
   the outage in the restart storm the freeze was there to prevent.
7. Progress. A ``ready`` worker that reports tasks in flight and whose count of finished
   tasks does not change for ``progress_stale_s`` is stuck: unhealthy like a stale one,
   under the same backoff and freeze. Like heartbeats, progress is timed on our clock from
   when we saw the count change; a worker with nothing in flight is never stuck, and one
   that reports neither field is judged by its heartbeat alone. A stuck worker heartbeating
   in ``cooling_down`` is not "recovered" until it finishes a task.
8. Permanent exits. A worker that exits with one of ``permanent_exit_codes`` (a broken
   install, a reward function that cannot be imported) is ``failed`` at once: restarting
   it cannot help.
9. Held restarts. While the fleet holds a host's restarts (``RestartHeld``: many hosts
   crashed the same way, decided by ``fleet.py``), a failure waits in ``cooling_down`` with
   no restart time until ``RestartReleased`` or an operator acts.
10. A verdict from silence is confirmed first. Before a ready worker is called hung, stuck
   or not ready, its status file is read again by content (``RecheckStatus``), which no
   attribute cache can answer from memory: an NFS client may show a directory or a file's
   times up to a minute old, while the trainer's own read of the file is fresh. Only the
   answer (``StatusRechecked``), or ``RECHECK_TIMEOUT_S`` without one, gives the verdict.
11. Reward probes (``[probe]``, ``probe_interval_s > 0``). A heartbeat says a worker lives,
   not that it can score: with probes on, a known task goes through the shard's own queue
   (``SendRewardProbe``) as soon as a new worker heartbeats and every ``probe_interval_s``
   after, and a worker is ``ready`` only once a probe sent to it has scored. An answer that
   is an error, none within ``probe_timeout_s`` or a score other than ``probe_expect``
   makes it unhealthy (``PROBE_FAILED``, ``PROBE_TIMEOUT``, ``PROBE_WRONG``: "alive but
   wrong") under the same backoff, freeze and holds as any failure; an unanswered probe
   while the fleet is frozen is the filesystem's silence, not the worker's. A worker made
   unhealthy by a probe recovers only when a later probe scores, not by heartbeating.
12. Odd input is an observation, not an error: an event that does not apply in a state is
   recorded (stamps, pids, SSH) and otherwise ignored. Only impossible input raises.

Theory of operation. The shell feeds every observation as an event with ``now`` (a
``time.monotonic()`` reading) and performs the returned actions. At most one remote
operation (launch, terminate, probe) is in flight per host; the shell answers each with
exactly one result event. After every event ``_reconcile`` looks at the state and, if SSH is
up and nothing is in flight, starts the next operation the state calls for. ``deadline_at``
is the next instant at which time alone could change something; the shell feeds
``DeadlinePassed`` then, and the core re-checks ``now`` itself, so early, late or repeated
wake-ups are harmless.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Final, Literal, assert_never, cast

from supervisor.policies import HealthPolicy
from supervisor.records import record


class HostState(StrEnum):
    """The states of a host (contract: these strings appear in status output and logs)."""

    #: Launch issued (or a running worker found); waiting for a ready heartbeat from its pid.
    STARTING = "starting"
    #: Heartbeat advancing and ``ready: true``.
    READY = "ready"
    #: Unhealthy and a restart is allowed now: terminate the old pid, confirm it, launch.
    STALE = "stale"
    #: Unhealthy, but backoff says wait until ``next_restart_at``; a heartbeat recovers it.
    COOLING_DOWN = "cooling_down"
    #: Gave up after too many restarts; stays until an operator starts or restarts the host.
    FAILED = "failed"
    #: Terminating the worker on request (operator, sentinel, shutdown, removal).
    STOPPING = "stopping"
    #: No worker, and none wanted.
    STOPPED = "stopped"


S = HostState
ALL_STATES: Final = frozenset(HostState)
#: States in which the host should have a worker and we act to keep one.
WANT_RUNNING_STATES: Final = frozenset({S.STARTING, S.READY, S.STALE, S.COOLING_DOWN})
#: States that count as unhealthy in summaries.
UNHEALTHY_STATES: Final = frozenset({S.STALE, S.COOLING_DOWN, S.FAILED})
#: States reached on purpose: no restarts happen from here.
STOP_STATES: Final = frozenset({S.STOPPING, S.STOPPED})


Op = Literal["launch", "terminate", "probe", "quarantine"]


class StopCause(StrEnum):
    """Who wanted the host stopped: decides what starts it again."""

    #: ``stop-host`` (written as a sentinel, so it outlives the daemon).
    OPERATOR = "operator"
    #: ``ctl/<host>.stop`` appeared: removing it starts the host again.
    SENTINEL = "sentinel"
    #: The daemon is stopping.
    SHUTDOWN = "shutdown"
    #: A reload removed the host from the config.
    REMOVED = "removed"


class Cause(StrEnum):
    """Why a worker was found unhealthy, as a code beside the human reason (metrics labels,
    alerting and tests read the code, never the sentence)."""

    #: It exited with a code (its exit record or the agent said so).
    EXITED = "exited"
    #: It was killed by a signal.
    KILLED = "killed"
    #: Its heartbeat stopped changing for ``heartbeat_stale_s``.
    HEARTBEAT_STALE = "heartbeat_stale"
    #: It did not report ready in time, or reported ``ready: false`` for too long.
    NOT_READY = "not_ready"
    #: The launch did not start a worker.
    LAUNCH_FAILED = "launch_failed"
    #: A probe found no live worker where one should run.
    NO_WORKER = "no_worker"
    #: A terminate confirmed the worker dead while it should have been running.
    GONE = "gone"
    #: Tasks were in flight and none finished for ``progress_stale_s``.
    STUCK = "stuck"
    #: Tasks waited in its inbox for ``progress_stale_s`` while it had slots free: it no
    #: longer takes them (the AReaL worker drops the tasks a broken process pool held).
    NOT_TAKING = "not_taking"
    #: Its reward probe came back as an error (the worker's own error text is the reason).
    PROBE_FAILED = "probe_failed"
    #: Its reward probe scored, but not ``probe_expect``: alive but wrong.
    PROBE_WRONG = "probe_wrong"
    #: Its reward probe was not answered within ``probe_timeout_s``.
    PROBE_TIMEOUT = "probe_timeout"


class Planned(StrEnum):
    """Who replaced a healthy worker on purpose: not a fault, counted apart from restarts."""

    #: ``restart-host``.
    OPERATOR = "operator"
    #: A reload that changed what the worker runs.
    RELOAD = "reload"


#: Timing and budget rules; ``config.py`` builds it from ``[health]``. Defined apart
#: (``policies.py``) so that reading a config imports no core.
Policy = HealthPolicy


# --------------------------------------------------------------------------------------
# Events: past-tense facts the shell observed.


@record
class Evidence:
    """What a live but unhealthy worker was doing just before it was terminated: bounded text
    the shell collected from its host. The core keeps it and hands it on; it never reads it."""

    pid: int
    #: All threads' Python stacks, and how they were taken ("py-spy", "faulthandler").
    stacks: str | None = None
    stacks_via: str | None = None
    #: The last lines of ``ctl/<host>.log`` before the stacks were taken.
    log_tail: str | None = None
    #: What could not be collected, and why (py-spy missing, no signal handler, a timeout).
    notes: tuple[str, ...] = ()
    #: How long collecting took (it holds back the terminate, within ``evidence_timeout_s``).
    elapsed_s: float = 0.0


@record
class WorkerStats:
    """What else a worker's heartbeat says of its work (the AReaL worker's fields): carried
    to status and metrics, never judged here. None: not reported."""

    #: Tasks it finished with a score, and with an error result.
    completed: int | None = None
    errors: int | None = None
    #: Task files waiting in its shard's inbox (in-flight ones included).
    queue_depth: int | None = None
    #: Tasks finished per second over its last few seconds, on its clock.
    qps: float | None = None
    concurrency: int | None = None
    rss_gib: float | None = None
    verify_ms_p95: float | None = None
    #: Finished tasks that scored exactly 0.
    semantic_zero: int | None = None


@record
class HeartbeatSeen:
    """The status file parsed; its fields as the worker wrote them."""

    pid: int
    ready: bool
    remote_heartbeat_at: float  # worker's clock: only ever compared with its own previous value
    remote_seq: int | None = None
    #: Tasks finished so far (only grows) and tasks started and not finished, if reported.
    processed: int | None = None
    in_flight: int | None = None
    stats: WorkerStats | None = None


@record
class StatusMissing:
    """The status file is missing, empty, partial, not JSON or lacks fields: no heartbeat."""

    reason: str


@record
class WorkerExited:
    """``pid`` ended with ``exit_code`` or was killed by ``signal`` (neither: not known).

    Told by the shepherd's exit record or, sooner, pushed by the host's agent: the same exit
    comes twice, and only the first applies (the second names a pid no longer current).
    """

    pid: int
    exit_code: int | None = None
    signal: int | None = None
    #: The last lines of the worker's log, as its shepherd saw them at the exit (bounded).
    log_tail: str | None = None
    #: Processes of its session the reporter killed after it (None: it did not sweep).
    reaped: int | None = None


@record
class Launched:
    """The launch we asked for started a worker with this pid."""

    pid: int
    #: Its start time (``/proc/PID/stat`` field 22), which tells it from a later process
    #: with its pid (None: not known).
    start_time: int | None = None


@record
class LaunchFailed:
    """The launch did not start a worker; ``uncertain`` when it may have (connection lost)."""

    reason: str
    uncertain: bool = False


@record
class LaunchRefused:
    """The remote side refused: a live worker (``holder_pid`` if known) holds the shard."""

    holder_pid: int | None
    reason: str = "shard held by a live worker"


@record
class TerminateConfirmed:
    """``pid`` is confirmed gone (or was never alive)."""

    pid: int
    #: Captured before the terminate, when it was asked for (``Terminate.collect_evidence``).
    evidence: Evidence | None = None
    #: Processes of its session killed with or after it (None: its session was not swept).
    reaped: int | None = None


@record
class TerminateFailed:
    """``pid`` could not be confirmed dead (survived the grace period, or remote error)."""

    pid: int
    reason: str
    evidence: Evidence | None = None


@record
class ProbeResult:
    """What runs for this shard on the host: a live worker pid of ours, or None."""

    pid: int | None


@record
class ProbeFailed:
    """The probe could not be answered; what runs on the host is still unknown."""

    reason: str


@record
class SshLost:
    """The SSH connection to the host went away."""

    reason: str


@record
class SshRestored:
    """The SSH connection to the host is up (first connect or reconnect)."""


@record
class DeadlinePassed:
    """The shell's timer for ``deadline_at`` fired (maybe early, late or twice)."""


@record
class StatusRechecked:
    """The answer to ``RecheckStatus``: the status file as a fresh read found it (None:
    it could not be read in time)."""

    beat: HeartbeatSeen | StatusMissing | None
    #: Task files in the shard's inbox at least ``RecheckStatus.tasks_older_than_s`` old,
    #: when that was asked (None: not asked, or they could not be counted).
    old_tasks: int | None = None


@record
class StartRequested:
    """An operator asked for the host to run (clears ``failed``)."""

    reason: str = "operator start"


@record
class StopRequested:
    """Someone asked for the host's worker to stop."""

    reason: str
    cause: StopCause = StopCause.OPERATOR


@record
class RestartRequested:
    """An operator (or a reload that changed launch parameters) asked for a fresh worker."""

    reason: str = "operator restart"
    planned: Planned = Planned.OPERATOR


@record
class StopSentinelAppeared:
    """``ctl/<host>.stop`` exists: keep this host stopped."""


@record
class StopSentinelRemoved:
    """``ctl/<host>.stop`` is gone."""


@record
class FleetFrozen:
    """Most of the fleet fell silent at once: hold restarts that silence alone would cause."""

    reason: str


@record
class FleetThawed:
    """The fleet-wide freeze is over (heartbeats returned, or an operator said so)."""


@record
class LaunchBegan:
    """The fleet's launch budget let our queued launch start: readiness is timed from now."""


@record
class RestartHeld:
    """The fleet holds this host's automatic restarts (``reason`` says why)."""

    reason: str


@record
class RestartReleased:
    """The fleet no longer holds this host's restarts."""


@record
class RewardProbeAnswered:
    """The answer to ``SendRewardProbe``: the result the worker wrote for the probe, as it
    wrote it (``status`` "ok", "error" or "timeout"), or ``status`` None when none came within
    the timeout or it could not be read (``error`` says which)."""

    #: The worker the probe was sent to (``SendRewardProbe.pid``).
    pid: int
    status: str | None
    score: float | None = None
    error: str | None = None
    #: Written to result read, on our clock.
    round_trip_s: float = 0.0


@record
class UsageMeasured:
    """The host's agent measured worker ``pid``'s session (it and every process it started):
    ``rss_bytes`` over ``processes``, counted ``via`` "pss" or "rss"; shown, not judged."""

    pid: int
    rss_bytes: int
    processes: int
    via: str


@record
class AgentStarted:
    """A new agent started on the host's connection (each connection's first, or one that
    replaced an agent that died): it watches no worker until told."""


@record
class Quarantined:
    """The answer to ``Quarantine``: ``count`` tasks were taken out of the shard's inbox
    (0: none could be, or the run root did not answer)."""

    count: int


@record
class Relocated:
    """The fleet moved this host's shard to another machine (a failover or a drain). What
    ran on the old machine is fenced there (the shard lock, the epoch, its leftovers
    killed), never waited for; the new machine runs nothing of ours, so nothing is probed:
    the worker is launched as soon as ``ssh_up`` (False: a drain's, until the old worker is
    killed, then ``SshRestored``)."""

    reason: str
    ssh_up: bool


Event = (
    HeartbeatSeen
    | StatusMissing
    | WorkerExited
    | Launched
    | LaunchFailed
    | LaunchRefused
    | TerminateConfirmed
    | TerminateFailed
    | ProbeResult
    | ProbeFailed
    | SshLost
    | SshRestored
    | DeadlinePassed
    | StartRequested
    | StopRequested
    | RestartRequested
    | StopSentinelAppeared
    | StopSentinelRemoved
    | FleetFrozen
    | FleetThawed
    | LaunchBegan
    | RestartHeld
    | RestartReleased
    | StatusRechecked
    | RewardProbeAnswered
    | Quarantined
    | Relocated
    | AgentStarted
    | UsageMeasured
)
EVENT_TYPES: Final[tuple[type[Event], ...]] = Event.__args__

# --------------------------------------------------------------------------------------
# Actions: what the shell must do. Each remote action is answered by one result event.


@record
class Launch:
    """Start a worker; answer with Launched, LaunchFailed or LaunchRefused."""

    reason: str
    is_restart: bool
    #: Why the worker is replaced (automatic restarts only).
    cause: Cause | None = None
    #: Who replaced a worker on purpose (a planned restart; None: not one).
    planned: Planned | None = None


@record
class Terminate:
    """Stop ``pid`` (TERM, wait ``grace_s``, KILL if ``kill``); answer TerminateConfirmed/Failed."""

    pid: int
    grace_s: float
    kill: bool
    #: A live but unhealthy worker (stuck, stale, never ready): capture its stacks and log
    #: tail before it dies, to tell why.
    collect_evidence: bool = False


@record
class Probe:
    """Find the live worker of this shard on the host; answer ProbeResult or ProbeFailed."""

    pid: int | None


@record
class StateChanged:
    """The host moved from one state to another; logged as ``event="host.state"``."""

    from_: HostState
    to: HostState
    reason: str
    #: The evidence of the terminate whose result caused this change, if it brought any.
    evidence: Evidence | None = None
    #: Something went wrong (said as a warning): not an operator's or a reload's doing.
    fault: bool = False


@record
class RecheckStatus:
    """Read the status file again now, by content; answer with StatusRechecked."""

    #: Also count the shard's task files at least this old (a worker said to leave tasks
    #: waiting: the old ones not in flight are the ones it does not take).
    tasks_older_than_s: float | None = None


@record
class SendRewardProbe:
    """Write the probe task into the shard's inbox, wait ``timeout_s`` for its result, take
    both files away; answer RewardProbeAnswered exactly once."""

    pid: int
    task: str
    timeout_s: float


@record
class Quarantine:
    """Take the ``count`` oldest tasks out of the shard's inbox, each answered with an error
    result the trainer reads at once: the tasks a stuck worker hung on, before its successor
    starts (it would hang on them too). Answer with Quarantined exactly once."""

    count: int


@record
class Watch:
    """Have the host's agent watch ``pid`` (a new agent watches nothing yet), so its exit is
    pushed at once; best effort, unanswered: the exit record is the fallback."""

    pid: int
    start_time: int | None


@record
class ProbeReport:
    """What a reward probe found, as the core judged it (``probe_report``): for people."""

    answer: RewardProbeAnswered
    #: Why it failed (None: it scored, or waited behind the worker's backlog), and the words.
    cause: Cause | None
    error: str | None
    #: It went unanswered while the worker finished tasks sent after it: busy, not counted.
    busy: bool = False


#: A fresh read of one small file that has not answered in this long will not: the verdict
#: it holds back is given without it (a mount that hangs is the freeze's business).
RECHECK_TIMEOUT_S: Final = 2.0

Action = (
    Launch | Terminate | Probe | StateChanged | RecheckStatus | SendRewardProbe | Quarantine | Watch
)

# --------------------------------------------------------------------------------------
# The host.


# Not slotted: a routine heartbeat copies this record (``_evolve``), and copying an
# instance dict is one C call where fifty slots are fifty (~1 KB more per host).
@dataclass(frozen=True, kw_only=True)
class Host:
    """Everything the core knows about one host. Instants (``*_at``) are local monotonic."""

    name: str
    state: HostState
    reason: str
    since_at: float
    #: The worker that may be alive; None once confirmed dead (or never launched).
    pid: int | None = None
    #: Its start time, when its launch said (it tells it from a later process with its pid).
    start_time: int | None = None
    #: Tasks to quarantine once the worker is confirmed dead, before anything is launched.
    quarantine_due: int = 0
    #: Something may run that we do not know of; a Probe must answer before any Launch.
    needs_probe: bool = True
    #: ``pid`` was found running (probe, refused launch, heartbeat), not launched by us.
    found_running: bool = False
    #: The pid we last had, kept for display after it died.
    last_pid: int | None = None
    last_exit: str | None = None
    #: When the last worker was seen to end, and how (an exit record's code or signal).
    last_exit_at: float | None = None
    last_exit_pid: int | None = None
    last_exit_code: int | None = None
    last_exit_signal: int | None = None
    #: How many processes of its session were killed after it, the most any report said.
    last_exit_reaped: int | None = None
    #: The remote operation in flight, if any.
    op: Op | None = None
    #: After a failed terminate or probe, the next attempt waits until then.
    op_retry_at: float | None = None
    last_error: str | None = None
    ssh_up: bool = False
    ssh_reason: str = "not connected yet"
    # The last status-file observation, whoever wrote it.
    beat_pid: int | None = None
    beat_ready: bool = False
    remote_heartbeat_at: float | None = None
    remote_seq: int | None = None
    #: When we last saw the status file's stamp change, whoever wrote it.
    beat_changed_at: float | None = None
    #: We have looked at the status file at least once (found or missing): the next stamp
    #: that differs from what we saw was written after we looked, so it is fresh.
    status_seen: bool = False
    status_problem: str | None = None
    #: When we last saw a heartbeat of ``pid`` change: freshness counts from here.
    alive_at: float | None = None
    #: Since when ``pid`` has been reporting ``ready: false`` while in ``ready``.
    not_ready_since_at: float | None = None
    #: When the current launch was issued or the running worker found (``starting`` only).
    launched_at: float | None = None
    #: The current worker's reported progress (None: it reports none).
    processed: int | None = None
    in_flight: int | None = None
    #: When we last saw ``processed`` change, or nothing in flight: stuck-ness counts from here.
    progress_at: float | None = None
    #: (when, processed) marks at least a minute apart, for a rate of tasks per minute.
    rate_mark: tuple[float, int] | None = None
    rate_base: tuple[float, int] | None = None
    #: The rest of what the current worker reports of its work, as its last heartbeat said.
    stats: WorkerStats | None = None
    #: Its session's memory as the host's agent last measured it, and when (any pid's).
    usage: UsageMeasured | None = None
    usage_at: float | None = None
    #: Since when its heartbeats say tasks wait in its inbox (slots free or not), and since
    #: when, without a break, they have said so with a slot free.
    backlog_since_at: float | None = None
    slot_free_since_at: float | None = None
    #: The last lines of the log the last exit record carried.
    last_log_tail: str | None = None
    #: The last evidence captured before a terminate, when, and the cause it was taken for.
    evidence: Evidence | None = None
    evidence_at: float | None = None
    evidence_cause: str | None = None
    #: Why the fleet holds this host's restarts, if it does.
    held: str | None = None
    # Restart budget.
    failures: int = 0
    healthy_since_at: float | None = None
    restart_times_at: tuple[float, ...] = ()
    restarts: int = 0
    #: Replacements of a healthy worker on purpose, by who asked, since the daemon started.
    planned_restarts: tuple[tuple[Planned, int], ...] = ()
    #: Who asked for the replacement under way, if it is planned.
    planned: Planned | None = None
    next_restart_at: float | None = None
    #: Why the worker was last found unhealthy, in words and as a code.
    cause: str | None = None
    cause_code: Cause | None = None
    #: Whether leaving ``stale`` with a Launch counts as an automatic restart.
    restart_is_automatic: bool = True
    stop_sentinel: bool = False
    stop_cause: StopCause | None = None
    #: A fleet-wide freeze holds restarts that only a silent heartbeat would justify.
    frozen: bool = False
    #: When the last freeze ended: silence and readiness are timed from no earlier than this.
    thawed_at: float | None = None
    #: When a verdict from silence asked for a fresh read of the status file (rule 10);
    #: None while none is awaited.
    recheck_at: float | None = None
    #: The reward probe in flight: when it was sent (None: none is).
    probe_at: float | None = None
    #: The worker the last probe was sent to, and when the next one is due.
    probe_for_pid: int | None = None
    probe_next_at: float | None = None
    #: The worker whose last answered probe scored (None: the last answer failed).
    probe_scored_pid: int | None = None
    #: What the last answered probe found, when, its round trip and its failure code.
    last_probe: str | None = None
    last_probe_at: float | None = None
    last_probe_round_trip_s: float | None = None
    last_probe_cause: Cause | None = None
    #: The last probe went unanswered while the worker finished tasks ahead of it: it waited
    #: its turn behind the trainer's backlog, which is busy, not broken.
    last_probe_busy: bool = False
    #: When ``DeadlinePassed`` should be fed next; None when only events can change things.
    deadline_at: float | None = None


@record
class History:
    """Restart history that outlives the daemon (the shell stores it, converting instants)."""

    failures: int = 0
    restarts: int = 0
    restart_times_at: tuple[float, ...] = ()
    next_restart_at: float | None = None
    cause: str | None = None
    cause_code: Cause | None = None
    #: Why the host was ``failed`` when the previous daemon stopped; None if it was not.
    failed: str | None = None


def history_of(host: Host) -> History:
    """What of ``host`` must survive a restart of the daemon."""
    return History(
        failures=host.failures,
        restarts=host.restarts,
        restart_times_at=host.restart_times_at,
        next_restart_at=host.next_restart_at,
        cause=host.cause,
        cause_code=host.cause_code,
        failed=host.reason if host.state is S.FAILED else None,
    )


def history_changed(before: Host, after: Host) -> bool:
    """Whether ``history_of`` differs between the two; cheap, as the shell asks after every
    event (a thousand heartbeats a second)."""
    if before.state is S.FAILED or after.state is S.FAILED:
        return history_of(before) != history_of(after)
    return (
        before.failures != after.failures
        or before.restarts != after.restarts
        or before.restart_times_at != after.restart_times_at
        or before.next_restart_at != after.next_restart_at
        or before.cause != after.cause
        or before.cause_code is not after.cause_code
    )


def new_host(
    name: str, now: float, *, stop_sentinel: bool = False, history: History | None = None
) -> Host:
    """A host joining the fleet: find out what runs there before launching anything.

    With ``history`` from a previous daemon, backoff and ``failed`` carry over, so a daemon
    that keeps crashing cannot reset every host's cooldown.
    """
    history = history or History()
    host = Host(
        name=name,
        state=S.STARTING,
        reason="looking for a running worker",
        since_at=now,
        failures=history.failures,
        restarts=history.restarts,
        restart_times_at=history.restart_times_at,
        next_restart_at=history.next_restart_at,
        cause=history.cause,
        cause_code=history.cause_code,
    )
    if stop_sentinel:
        return replace(
            host,
            state=S.STOPPING,
            reason="stop sentinel present",
            stop_sentinel=True,
            stop_cause=StopCause.SENTINEL,
        )
    if history.failed is not None:
        return replace(host, state=S.FAILED, reason=history.failed)
    return host


def backoff_delay_s(failures: int, policy: Policy) -> float:
    """Delay before the restart that answers the ``failures``-th consecutive failure."""
    if failures <= 1:
        return 0.0
    # 2.0**k overflows a float past k = 1023; anything that large is the cap anyway.
    exponent = min(failures - 2, 1023)
    return float(min(policy.restart_cooldown_s * 2.0**exponent, policy.backoff_max_s))


def heartbeat_age_s(host: Host, now: float) -> float | None:
    """Seconds since the current worker's heartbeat last changed, on our clock."""
    return None if host.alive_at is None else max(0.0, now - host.alive_at)


def stuck_at(host: Host, policy: Policy) -> float | None:
    """When this ready host's worker will be found stuck unless a task finishes first: the
    deadline ``step`` keeps. None while no such count is under way: not ready, frozen,
    nothing in flight, progress not reported, the rule off, or its last heartbeat came with
    a finished task (a busy, healthy worker)."""
    if host.state is not HostState.READY or host.frozen:
        return None
    if host.alive_at is None or host.progress_at is None or host.progress_at >= host.alive_at:
        return None
    return _stuck_at(host, policy)


def tasks_per_minute(host: Host) -> float | None:
    """The current worker's finished tasks per minute over its last minute or more of
    reports, on our clock (None until there is such a span)."""
    if host.rate_base is None or host.rate_mark is None:
        return None
    (base_at, base_n), (mark_at, mark_n) = host.rate_base, host.rate_mark
    return max(0, mark_n - base_n) * 60.0 / (mark_at - base_at)


def restarts_in_window(host: Host, now: float, policy: Policy) -> int:
    """Automatic restarts within the last ``restart_window_s``."""
    return sum(1 for t in host.restart_times_at if now - t < policy.restart_window_s)


def exit_applies(host: Host, event: WorkerExited) -> bool:
    """Whether an exit record reports the end of this host's current worker while it should
    run (and so counts as a failure), rather than old news or a stop we asked for."""
    return event.pid == host.pid and (host.state, WorkerExited) in TRANSITIONS


def describe_exit(event: WorkerExited) -> str:
    """A short human reason for an exit record."""
    if event.signal is not None:
        name = _SIGNAL_NAMES.get(event.signal)
        return f"killed by signal {event.signal}" + (f" ({name})" if name else "")
    if event.exit_code == 0:
        return "exited with code 0 (unexpected)"
    if event.exit_code is None:
        return "exited (how is not known)"
    return f"exited with code {event.exit_code}"


# Linux numbers of the signals that end workers in practice; others print as numbers.
_SIGNAL_NAMES: Final[Mapping[int, str]] = {
    1: "SIGHUP",
    2: "SIGINT",
    6: "SIGABRT",
    9: "SIGKILL",
    11: "SIGSEGV",
    15: "SIGTERM",
}

# --------------------------------------------------------------------------------------
# step()


def step(host: Host, event: Event, now: float, policy: Policy) -> tuple[Host, list[Action]]:
    """Apply one event seen at monotonic ``now``; return the new host and what to do."""
    if type(event) is HeartbeatSeen:
        routine = _routine_beat(host, event, now, policy)
        if routine is not None:
            return routine, []
    elif type(event) is DeadlinePassed:
        early = _early_deadline(host, now, policy)
        if early is not None:
            return early, []
    return _step_in_full(host, event, now, policy)


def _step_in_full(
    host: Host, event: Event, now: float, policy: Policy
) -> tuple[Host, list[Action]]:
    """``step`` through observation, transition and reconciliation; the reference that the
    shortcuts (a routine heartbeat, an early timer) must agree with
    (tests/unit/test_health_properties.py)."""
    changes: list[Action] = []
    state = host.state
    before_recheck_at = host.recheck_at
    host, applies = _observe(host, event, now, policy)
    handler = TRANSITIONS.get((host.state, type(event))) if applies else None
    if handler is not None:
        host = handler(host, event, now, policy)
    # A terminate's evidence goes with the change its result causes (the restart, usually),
    # so the log line that says the worker was replaced also says what it was doing.
    evidence = event.evidence if isinstance(event, TerminateConfirmed | TerminateFailed) else None
    if type(event) is Quarantined and applies:
        # The stuck worker's tasks were quarantined between its death and its replacement:
        # the replacement's change still says what the worker was doing.
        evidence = host.evidence
    if host.state is not state:
        changes.append(_changed(state, host, evidence))
    if host.recheck_at is not None and host.recheck_at != before_recheck_at:
        changes.append(_recheck(host, now, policy))
    state = host.state
    host, actions = _reconcile(host, now, policy)
    if type(event) is AgentStarted and host.pid is not None and host.op is None:
        # A new agent watches nothing yet: the worker's exit would be known only from its
        # record until the agent is told (a launch or a probe in flight tells it).
        actions.append(Watch(pid=host.pid, start_time=host.start_time))
    due = _probe_due(host, policy)
    if due is not None and now >= due[0]:
        actions.append(_send_probe(due[1], policy))
        host = replace(
            host, probe_at=now, probe_for_pid=due[1], probe_next_at=now + policy.probe_interval_s
        )
    if host.state is not state:
        changes.append(_changed(state, host, evidence))
    return replace(host, deadline_at=_deadline(host, policy)), changes + actions


def _changed(before: HostState, host: Host, evidence: Evidence | None) -> StateChanged:
    """The change to ``host``'s state: a fault when it is unhealthy by no one's wish (an
    operator's or a reload's restart passes through ``stale`` too)."""
    fault = host.state in UNHEALTHY_STATES and host.restart_is_automatic
    return StateChanged(
        from_=before, to=host.state, reason=host.reason, evidence=evidence, fault=fault
    )


def _observe(host: Host, event: Event, now: float, policy: Policy) -> tuple[Host, bool]:
    """Bookkeeping true in every state; also says whether the event concerns this worker.

    Operation results clear ``op``, pids get confirmed dead or adopted, stamps are recorded.
    An exit record or heartbeat of some other pid, or a second copy of one already seen,
    "does not apply": it is recorded and changes no state.
    """
    if (
        host.failures
        and host.state is S.READY
        and host.healthy_since_at is not None
        and now - host.healthy_since_at >= policy.backoff_reset_s
    ):
        host = replace(host, failures=0)
    match event:
        case HeartbeatSeen():
            return _record_beat(host, event, now)
        case StatusMissing():
            return replace(host, status_problem=event.reason, status_seen=True), True
        case WorkerExited():
            if event.pid != host.pid:
                # An older worker's record; that pid was settled already.
                return _more_reaped(host, event.pid, event.reaped), False
            return replace(
                host,
                pid=None,
                last_exit=describe_exit(event),
                last_exit_at=now,
                last_exit_pid=event.pid,
                last_exit_code=event.exit_code,
                last_exit_signal=event.signal,
                last_exit_reaped=event.reaped,
                # This exit's own: an earlier one's would be shown as this one's.
                last_log_tail=event.log_tail,
            ), True
        # The shell answers each remote action with exactly one result, so a result for an
        # operation that is not in flight cannot happen; it is ignored rather than trusted.
        case Launched() | LaunchFailed() | LaunchRefused() if host.op != "launch":
            return host, False
        case ProbeResult() | ProbeFailed() if host.op != "probe":
            return host, False
        case Launched():
            host = replace(host, op=None, needs_probe=False, last_error=None)
            host = _assign_pid(host, event.pid, found_running=False)
            return replace(host, start_time=event.start_time), True
        case LaunchFailed():
            host = replace(host, op=None, last_error=f"launch failed: {event.reason}")
            return replace(host, needs_probe=host.needs_probe or event.uncertain), True
        case LaunchRefused():
            host = replace(host, op=None, last_error=f"launch refused: {event.reason}")
            if event.holder_pid is None:
                return replace(host, needs_probe=True), True
            return _assign_pid(host, event.holder_pid, found_running=True), True
        case TerminateConfirmed():
            # A confirmed death is a fact even when it arrives late: record it regardless.
            host = _keep_evidence(host, event.evidence, now)
            if host.op == "terminate":
                host = replace(host, op=None, last_error=None)
            if event.pid != host.pid:
                return _more_reaped(host, event.pid, event.reaped), False
            return replace(
                host,
                pid=None,
                last_exit="confirmed dead",
                last_exit_at=now,
                last_exit_pid=event.pid,
                last_exit_code=None,
                last_exit_signal=None,
                last_exit_reaped=event.reaped,
            ), True
        case TerminateFailed():
            host = _keep_evidence(host, event.evidence, now)
            if host.op != "terminate":
                return host, False
            error = f"terminate pid {event.pid} failed: {event.reason}"
            retry_at = now + policy.restart_cooldown_s
            return replace(host, op=None, op_retry_at=retry_at, last_error=error), True
        case ProbeResult():
            host = replace(host, op=None, needs_probe=False, last_error=None)
            if event.pid is None:
                return replace(host, pid=None), True
            return _assign_pid(host, event.pid, found_running=host.pid != event.pid), True
        case ProbeFailed():
            retry_at = now + policy.restart_cooldown_s
            error = f"probe failed: {event.reason}"
            return replace(host, op=None, op_retry_at=retry_at, last_error=error), True
        case SshLost():
            return replace(host, ssh_up=False, ssh_reason=event.reason), True
        case SshRestored():
            return replace(host, ssh_up=True, ssh_reason="connected", op_retry_at=None), True
        case StopSentinelAppeared():
            return replace(host, stop_sentinel=True), True
        case StopSentinelRemoved():
            return replace(host, stop_sentinel=False), True
        case FleetFrozen():
            return replace(host, frozen=True), True
        case FleetThawed():
            return replace(
                host, frozen=False, thawed_at=now if host.frozen else host.thawed_at
            ), True
        case LaunchBegan():
            if host.op != "launch" or host.state is not S.STARTING:
                return host, False
            return replace(host, launched_at=now), True
        case RestartHeld():
            return replace(host, held=event.reason), True
        case RestartReleased():
            return replace(host, held=None), host.held is not None
        case StatusRechecked():
            host = replace(host, recheck_at=None)
            if isinstance(event.beat, HeartbeatSeen):
                host, _ = _record_beat(host, event.beat, now)
            elif isinstance(event.beat, StatusMissing):
                host = replace(host, status_problem=event.beat.reason, status_seen=True)
            return host, True
        case UsageMeasured():
            return replace(host, usage=event, usage_at=now), event.pid == host.pid
        case Quarantined():
            if host.op != "quarantine":
                return host, False
            return replace(host, op=None, quarantine_due=0), True
        case RewardProbeAnswered():
            if host.probe_at is None:
                return host, False  # not asked for: not trusted
            verdict = probe_verdict(event, policy)
            busy = _waited_behind_work(host, event, host.probe_at)
            host = replace(
                host,
                probe_at=None,
                last_probe_busy=busy,
                last_probe=_probe_summary(event, verdict)
                + (
                    " (it waited behind tasks the worker was finishing: not counted)"
                    if busy
                    else ""
                ),
                last_probe_at=now,
                last_probe_round_trip_s=event.round_trip_s,
                last_probe_cause=None if verdict is None else verdict[0],
            )
            if event.pid != host.pid:
                return host, False  # an earlier worker's answer
            scored = host.pid if verdict is None else (host.probe_scored_pid if busy else None)
            return replace(host, probe_scored_pid=scored), True
        case (
            DeadlinePassed()
            | StartRequested()
            | StopRequested()
            | RestartRequested()
            | Relocated()
            | AgentStarted()
        ):
            return host, True
        case _:
            assert_never(event)


def _more_reaped(host: Host, pid: int, reaped: int | None) -> Host:
    """A later report of the last exit (the shepherd, the agent and a terminate may each tell
    it): its count of processes reaped is kept when it is larger. Each reports the ones it
    killed itself; they sweep at once, and the first to finish its look saw them all."""
    if pid != host.last_exit_pid or reaped is None:
        return host
    if host.last_exit_reaped is not None and host.last_exit_reaped >= reaped:
        return host
    return replace(host, last_exit_reaped=reaped)


def _keep_evidence(host: Host, evidence: Evidence | None, now: float) -> Host:
    """Record the evidence a terminate brought, with the cause it was taken for."""
    if evidence is None:
        return host
    return replace(host, evidence=evidence, evidence_at=now, evidence_cause=host.cause)


def _routine_beat(host: Host, beat: HeartbeatSeen, now: float, policy: Policy) -> Host | None:
    """The ready worker's next heartbeat, or None when the full step must look at the event.

    At a thousand hosts nearly every event is this one, and all it can change is the stamps
    and the stale deadline: no transition handles it in ``ready`` and, with no failures to
    forgive, no probe owed and no retry pending, ``_reconcile`` has nothing to do. Skipping
    the general path cuts a heartbeat's cost by two thirds (docs/BENCHMARKS.md).
    """
    if not (
        _steady(host)
        and host.status_seen
        and beat.ready
        and beat.pid == host.pid
        and (
            beat.remote_heartbeat_at != host.remote_heartbeat_at
            or beat.remote_seq != host.remote_seq
        )
    ):
        return None
    beaten = _evolve(
        host,
        beat_pid=beat.pid,
        beat_ready=True,
        remote_heartbeat_at=beat.remote_heartbeat_at,
        remote_seq=beat.remote_seq,
        beat_changed_at=now,
        status_problem=None,
        alive_at=now,
        **_progress(host, beat, now),
    )
    # Still under construction (no one else holds it): completed in place, not copied again.
    object.__setattr__(beaten, "deadline_at", _deadline(beaten, policy))
    return beaten


def _early_deadline(host: Host, now: float, policy: Policy) -> Host | None:
    """A steady ready host's timer, fired before its stale deadline (which heartbeats moved
    on since it was armed): nothing is due. None when the full step must look.

    The shell keeps a timer that is due no later than the deadline rather than re-arm it on
    every heartbeat, so each ready host wakes once per stale period for nothing.
    """
    if not (_steady(host) and not host.frozen and now < _judged_at(host, policy)):
        return None
    due = _probe_due(host, policy)
    if due is not None and now >= due[0]:
        return None
    deadline = _deadline(host, policy)
    return host if deadline == host.deadline_at else _evolve(host, deadline_at=deadline)


def _steady(host: Host) -> bool:
    """Ready with nothing pending that time or an event could act on: no ``ready: false``
    being timed, no failures to forgive, no probe owed, no retry waiting."""
    return (
        host.state is S.READY
        and host.not_ready_since_at is None
        and host.failures == 0
        and host.op_retry_at is None
        and not host.needs_probe
        and host.recheck_at is None
    )


def _evolve(host: Host, **changes: Any) -> Host:
    """``dataclasses.replace(host, **changes)`` at an eighth of the cost, for the hot path.

    ``replace`` re-runs the generated ``__init__``, whose frozen-class assignments go
    through ``object.__setattr__`` one field at a time. Host has no ``__post_init__`` and no
    field with ``init=False``, so a copy of its instance dict with the changes is the same
    value (tests/unit/test_health_properties.py compares the two).
    """
    state = host.__dict__.copy()
    state.update(changes)
    new = object.__new__(Host)
    object.__setattr__(new, "__dict__", state)
    return new


def _record_beat(host: Host, beat: HeartbeatSeen, now: float) -> tuple[Host, bool]:
    stamp = (beat.pid, beat.remote_heartbeat_at, beat.remote_seq)
    previous = (host.beat_pid, host.remote_heartbeat_at, host.remote_seq)
    # Freshness counts from when *we* saw the stamp change, so a remote clock that is hours
    # off can neither age a healthy worker nor hide a dead one. The first file we read is
    # only a baseline: the file of a worker that died yesterday looks just like a live one.
    changed = host.status_seen and stamp != previous
    # One copy of the host per heartbeat where possible: at a thousand heartbeats a second,
    # each dataclasses.replace of this record costs ~1% of a core (docs/BENCHMARKS.md).
    seen: dict[str, Any] = {
        "beat_pid": beat.pid,
        "beat_ready": beat.ready,
        "remote_heartbeat_at": beat.remote_heartbeat_at,
        "remote_seq": beat.remote_seq,
        "beat_changed_at": now if changed else host.beat_changed_at,
        "status_problem": None,
        "status_seen": True,
    }
    if not changed:
        return replace(host, **seen), False
    if host.pid is None and host.needs_probe and host.state is S.STARTING and host.op != "launch":
        # Nothing launched, and SSH has not answered the probe yet: a changing heartbeat is
        # proof enough that beat.pid runs. Adopt it as the candidate; the probe checks it.
        host = _assign_pid(replace(host, **seen), beat.pid, found_running=True)
        seen = {}
    if beat.pid != host.pid:
        return replace(host, **seen), False
    if beat.ready:
        not_ready_since_at = None
    elif host.not_ready_since_at is None:
        not_ready_since_at = now
    else:
        not_ready_since_at = host.not_ready_since_at
    progress = _progress(host, beat, now)
    # A fresh beat answers any recheck that was pending: nothing is silent any more.
    return replace(
        host,
        **seen,
        **progress,
        alive_at=now,
        not_ready_since_at=not_ready_since_at,
        recheck_at=None,
    ), True


def _progress(host: Host, beat: HeartbeatSeen, now: float) -> Mapping[str, Any]:
    """What the current worker's heartbeat at ``now`` says about its progress."""
    if beat.processed is None and beat.in_flight is None:
        return _NO_PROGRESS if beat.stats is None else {**_NO_PROGRESS, "stats": beat.stats}
    # Timed on our clock from the moment the count changed, like heartbeats; nothing in
    # flight means nothing is owed, so the clock starts again.
    advanced = host.progress_at is None or beat.processed != host.processed
    at = now if advanced or not beat.in_flight else host.progress_at
    out: dict[str, Any] = {
        "processed": beat.processed,
        "in_flight": beat.in_flight,
        "progress_at": at,
        "stats": beat.stats,
        "backlog_since_at": _backlog_since(host, beat, now),
        "slot_free_since_at": _slot_free_since(host, beat, now),
    }
    if beat.processed is not None and (
        host.rate_mark is None or now - host.rate_mark[0] >= RATE_MARK_S
    ):
        out["rate_base"] = host.rate_mark
        out["rate_mark"] = (now, beat.processed)
    return out


def _slot_free_since(host: Host, beat: HeartbeatSeen, now: float) -> float | None:
    """Since when every heartbeat has said tasks wait with a slot free (None: the last one
    did not). A busy worker shows one such beat now and then, between two tasks; only one
    that keeps a slot free over SLOT_FREE_CONFIRM_S does not take what waits."""
    stats = beat.stats
    if stats is None or stats.queue_depth is None or stats.concurrency is None:
        return None
    busy = beat.in_flight or 0
    if stats.queue_depth <= busy or busy >= stats.concurrency:
        return None
    return now if host.slot_free_since_at is None else host.slot_free_since_at


def _backlog_since(host: Host, beat: HeartbeatSeen, now: float) -> float | None:
    """Since when tasks have waited in the worker's inbox, by its heartbeats (None: none
    waits, or it does not say). A worker takes a waiting task within one scan of its inbox
    once a slot is free, so a wait that outlives many heartbeats with slots free is tasks it
    will never take; while every slot is busy, waiting is normal, and judged later."""
    stats = beat.stats
    if stats is None or stats.queue_depth is None or stats.concurrency is None:
        return None
    if stats.queue_depth <= (beat.in_flight or 0):
        return None
    return now if host.backlog_since_at is None else host.backlog_since_at


#: Tasks waiting with a slot free this long without a break (three heartbeats of the AReaL
#: worker, one a second) are not a beat that fell between two tasks of a busy worker.
SLOT_FREE_CONFIRM_S: Final = 2.0
#: A rate of tasks per minute is taken over at least this long.
RATE_MARK_S: Final = 60.0
_NO_PROGRESS: Final[Mapping[str, Any]] = {
    "processed": None,
    "in_flight": None,
    "progress_at": None,
    "rate_mark": None,
    "rate_base": None,
    "stats": None,
    "backlog_since_at": None,
    "slot_free_since_at": None,
}


def _assign_pid(host: Host, pid: int, *, found_running: bool) -> Host:
    """Make ``pid`` the host's worker; a heartbeat of it already seen counts from its time."""
    alive_at = host.alive_at if pid == host.pid else None
    seen_since_launch = host.launched_at is None or (
        host.beat_changed_at is not None and host.beat_changed_at >= host.launched_at
    )
    if host.beat_pid == pid and host.beat_changed_at is not None and seen_since_launch:
        # The new worker's first heartbeat can overtake the launch's answer.
        alive_at = host.beat_changed_at if alive_at is None else max(alive_at, host.beat_changed_at)
    if pid != host.pid:  # another worker: its progress starts from its own first report
        host = replace(host, start_time=None, **_NO_PROGRESS)
    return replace(host, pid=pid, last_pid=pid, alive_at=alive_at, found_running=found_running)


def _fresh_ready(host: Host, now: float, policy: Policy) -> bool:
    """The current pid's heartbeat changed recently and says ready."""
    return (
        host.pid is not None
        and host.beat_pid == host.pid
        and host.beat_ready
        and host.alive_at is not None
        and now - host.alive_at < policy.heartbeat_stale_s
    )


# --------------------------------------------------------------------------------------
# Transition handlers: (host, event, now, policy) -> host. They change the state;
# _reconcile turns the state into remote operations.

_Handler = Callable[[Host, Event, float, Policy], Host]


def _enter(host: Host, state: HostState, reason: str, now: float) -> Host:
    """Move to ``state``, dropping what only made sense in the old one."""
    entering = state is not host.state
    return replace(
        host,
        state=state,
        reason=reason,
        since_at=now if entering else host.since_at,
        healthy_since_at=(now if entering else host.healthy_since_at) if state is S.READY else None,
        next_restart_at=host.next_restart_at if state is S.COOLING_DOWN else None,
        launched_at=host.launched_at if state is S.STARTING else None,
        not_ready_since_at=host.not_ready_since_at if state is S.READY else None,
        recheck_at=None if entering else host.recheck_at,
    )


def _permanent(why: str, event: WorkerExited) -> str:
    """The reason of a permanent exit: the code, and the log's last line that says why."""
    last = last_log_line(event.log_tail)
    return f"{why}: permanent (health.permanent_exit_codes)" + (f"; log: {last}" if last else "")


def last_log_line(tail: str | None) -> str | None:
    """The last non-blank line of a log tail, shortened for a one-line reason."""
    if not tail:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:MAX_REASON_LINE] if lines else None


#: A log line quoted in a state's reason is cut here: reasons are one line for humans.
MAX_REASON_LINE: Final = 200


def _give_up(host: Host, code: Cause, reason: str, now: float) -> Host:
    """The worker failed in a way no restart can mend: ``failed`` now."""
    host = replace(
        host, failures=host.failures + 1, restart_is_automatic=True, cause=reason, cause_code=code
    )
    return _enter(host, S.FAILED, reason, now)


def _fail(host: Host, code: Cause, reason: str, now: float, policy: Policy) -> Host:
    """The worker is unhealthy: restart now, after a cooldown, or give up."""
    failures = host.failures + 1
    window = tuple(t for t in host.restart_times_at if now - t < policy.restart_window_s)
    host = replace(
        host,
        failures=failures,
        restart_times_at=window,
        restart_is_automatic=True,
        cause=reason,
        cause_code=code,
    )
    if not policy.auto_restart:
        return _enter(host, S.FAILED, f"{reason} (auto_restart is off)", now)
    if policy.max_restarts > 0 and len(window) >= policy.max_restarts:
        why = (
            f"gave up after {len(window)} restarts within {policy.restart_window_s:g}s"
            f" (max_restarts={policy.max_restarts}); last: {reason}"
        )
        return _enter(host, S.FAILED, why, now)
    delay = backoff_delay_s(failures, policy)
    if host.held is not None:
        # Waits with its backoff time kept, to be honoured when the hold is released.
        host = replace(host, next_restart_at=now + delay)
        return _enter(host, S.COOLING_DOWN, f"{reason}; restart held: {host.held}", now)
    if delay <= 0:
        return _enter(host, S.STALE, reason, now)
    host = replace(host, next_restart_at=now + delay)
    return _enter(host, S.COOLING_DOWN, f"{reason}; restart in {delay:g}s", now)


def _maybe_ready(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if not _fresh_ready(host, now, policy):
        return host
    if not _probe_scored(host, policy):
        return replace(host, reason="heartbeat ready; waiting for its first reward probe to score")
    reason = "adopted running worker" if host.found_running else "heartbeat ready"
    return _enter(host, S.READY, reason, now)


def _recover(host: Host, event: Event, now: float, policy: Policy) -> Host:
    # A worker that heartbeats again before we touched it was slow, not dead; a stuck one
    # heartbeats all along, and has recovered only once it finishes a task.
    stuck_at = _stuck_at(host, policy)
    stuck = stuck_at is not None and now >= stuck_at
    if host.op is None and _fresh_ready(host, now, policy) and not stuck:
        if not _probe_scored(host, policy):
            return host  # a worker that heartbeats all along is not mended until it scores
        how = "reward probe scored" if isinstance(event, RewardProbeAnswered) else "heartbeat"
        return _enter(host, S.READY, f"recovered: {how} again", now)
    return host


def _probe_judged(host: Host, event: Event, now: float, policy: Policy) -> Host:
    """A probe sent to the current worker came back: a failure is a failure like any other
    (an unanswered one excepted while the fleet is frozen), a score may make it ready."""
    verdict = probe_verdict(event, policy) if isinstance(event, RewardProbeAnswered) else None
    if verdict is None:
        return _maybe_ready(host, event, now, policy)
    if verdict[0] is Cause.PROBE_TIMEOUT and (host.frozen or host.last_probe_busy):
        # A frozen fleet: the shared filesystem stalls the queue, the freeze is its business.
        # A busy worker: the probe waits behind the trainer's tasks while they finish; a
        # worker that finishes nothing is the stuck and not-taking rules' to judge.
        return host
    return _fail(host, *verdict, now, policy)


def _waited_behind_work(host: Host, event: RewardProbeAnswered, sent_at: float) -> bool:
    """The probe went unanswered while the worker finished tasks after it was sent."""
    return event.status is None and host.progress_at is not None and host.progress_at > sent_at


def probe_verdict(event: RewardProbeAnswered, policy: Policy) -> tuple[Cause, str] | None:
    """Why a probe's answer says the worker cannot score (cause and reason), or None when it
    scored as it should."""
    error = (event.error or "").strip().replace("\n", " ")[:MAX_REASON_LINE]
    if event.status is None:
        return Cause.PROBE_TIMEOUT, f"reward probe unanswered: {error or 'no result'}"
    if event.status == "timeout":
        return Cause.PROBE_TIMEOUT, f"reward probe timed out in the worker: {error or '?'}"
    if event.status != "ok":
        return Cause.PROBE_FAILED, f"reward probe failed: {error or event.status[:40]}"
    score, expect = event.score, policy.probe_expect
    if score is None or score != score:
        return Cause.PROBE_WRONG, "alive but wrong: the reward probe scored no number"
    if expect is not None and abs(score - expect) > PROBE_SCORE_TOLERANCE:
        return Cause.PROBE_WRONG, f"alive but wrong: reward probe scored {score:g}, not {expect:g}"
    return None


#: Scores travel as JSON floats: an expected 1.0 read back as 0.9999999999 is still 1.0.
PROBE_SCORE_TOLERANCE: Final = 1e-6


def probe_failure(host: Host, event: RewardProbeAnswered, policy: Policy) -> str | None:
    """The reason a probe's answer makes ``host`` unhealthy now (its current worker, in a
    state where that counts), or None: what the fleet counts as a probe signature."""
    if host.probe_at is None or event.pid != host.pid or host.state not in _STARTING_OR_READY:
        return None
    verdict = probe_verdict(event, policy)
    if verdict is None:
        return None
    if verdict[0] is Cause.PROBE_TIMEOUT and (
        host.frozen or _waited_behind_work(host, event, host.probe_at)
    ):
        return None
    return verdict[1]


def _probe_summary(event: RewardProbeAnswered, verdict: tuple[Cause, str] | None) -> str:
    """What the last probe found, in words, for ``status HOST``."""
    took = f" in {event.round_trip_s:.2f}s"
    if verdict is None:
        return f"scored {event.score:g}{took}"
    return verdict[1] + ("" if event.status is None else took)


def _probe_scored(host: Host, policy: Policy) -> bool:
    """Probes are off, or the current worker's last answered probe scored."""
    return policy.probe_interval_s <= 0 or (
        host.pid is not None and host.probe_scored_pid == host.pid
    )


#: States in which a live worker is probed: one being judged, one running, and one waiting
#: out a backoff or a hold (a later score is how it recovers).
_PROBED_STATES: Final = frozenset({S.STARTING, S.READY, S.COOLING_DOWN})


def _probe_due(host: Host, policy: Policy) -> tuple[float, int] | None:
    """When the next probe goes out and to which worker (None: none will until something
    changes): at once to a worker that has heartbeated and was never probed, then every
    ``probe_interval_s``."""
    pid = host.pid
    if (
        policy.probe_interval_s <= 0
        or host.probe_at is not None
        or pid is None
        or host.beat_pid != pid
        or host.alive_at is None
        or host.state not in _PROBED_STATES
    ):
        return None
    if host.probe_for_pid != pid or host.probe_next_at is None:
        return host.alive_at, pid
    return host.probe_next_at, pid


def probe_report(host: Host, event: RewardProbeAnswered, policy: Policy) -> ProbeReport | None:
    """What an answer to ``host``'s probe in flight is judged to be, for people: a failure
    with its code and words, or none (it scored, or it waited behind the worker's backlog:
    busy). None for an answer nobody asked for. The one judgement ``step`` acts on too."""
    if host.probe_at is None:
        return None
    busy = _waited_behind_work(host, event, host.probe_at)
    verdict = None if busy else probe_verdict(event, policy)
    return ProbeReport(
        answer=event,
        cause=None if verdict is None else verdict[0],
        error=None if verdict is None else verdict[1],
        busy=busy,
    )


def _send_probe(pid: int, policy: Policy) -> SendRewardProbe:
    return SendRewardProbe(pid=pid, task=policy.probe_task, timeout_s=policy.probe_timeout_s)


def _worker_gone(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if host.pid is not None:
        return host  # a probe found a different live pid; its heartbeat decides
    if isinstance(event, WorkerExited):
        code = Cause.EXITED if event.signal is None else Cause.KILLED
        why = host.last_exit or describe_exit(event)
        if event.signal is None and event.exit_code in policy.permanent_exit_codes:
            return _give_up(host, code, _permanent(why, event), now)
        return _fail(host, code, why, now, policy)
    if isinstance(event, TerminateConfirmed):
        return _fail(host, Cause.GONE, host.last_exit or "confirmed dead", now, policy)
    return _fail(host, Cause.NO_WORKER, "probe found no live worker", now, policy)


def _launch_failed(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if isinstance(event, LaunchFailed) and event.uncertain:
        # The worker may well be running: find out (the probe) rather than count a failure.
        # The ready deadline of this launch still bounds the wait.
        return replace(host, reason=f"launch outcome unknown ({event.reason}); probing")
    return _fail(host, Cause.LAUNCH_FAILED, host.last_error or "launch failed", now, policy)


def _launch_refused(host: Host, event: Event, now: float, policy: Policy) -> Host:
    # The shard is held by a live worker: an earlier launch whose answer was lost, or one
    # started outside us. Wait for its heartbeat exactly as for an adopted worker.
    host = replace(host, launched_at=now)
    host = _enter(
        host, S.STARTING, f"adopting the worker holding the shard ({host.last_error})", now
    )
    return _maybe_ready(host, event, now, policy)


def _probe_answered(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if host.pid is None:
        if host.next_restart_at is not None and now < host.next_restart_at:
            # The previous daemon was waiting out a backoff: keep waiting.
            return _enter(host, S.COOLING_DOWN, f"{host.cause}; restart deferred (backoff)", now)
        return replace(host, reason="no running worker found")  # _reconcile launches
    host = replace(host, launched_at=host.launched_at if host.launched_at is not None else now)
    host = _enter(host, S.STARTING, f"adopting pid {host.pid}: waiting for its heartbeat", now)
    return _maybe_ready(host, event, now, policy)


def _ready_timeout_passed(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if host.frozen:
        return host  # a worker cannot report ready through a stalled filesystem
    if host.launched_at is not None and now >= _ready_by(host, policy):
        why = f"not ready within ready_timeout_s={policy.ready_timeout_s:g}"
        return _fail(host, Cause.NOT_READY, why, now, policy)
    return host


def _heartbeat_deadline_passed(host: Host, event: Event, now: float, policy: Policy) -> Host:
    verdict = _silence_verdict(host, now, policy)
    if verdict is None:
        return host if host.recheck_at is None else replace(host, recheck_at=None)
    answered = isinstance(event, StatusRechecked) or (
        host.recheck_at is not None and now >= host.recheck_at + RECHECK_TIMEOUT_S
    )
    if answered and verdict[0] is Cause.NOT_TAKING and not _not_taking_seen(host, event, policy):
        # Tasks just arrived at each heartbeat can look the same: the clock starts again.
        return replace(host, recheck_at=None, backlog_since_at=now)
    if answered:
        return _fail(host, *verdict, now, policy)
    # Rule 10: what we saw of the file may be a cache's; read it afresh before the verdict.
    return host if host.recheck_at is not None else replace(host, recheck_at=now)


def _recheck(host: Host, now: float, policy: Policy) -> RecheckStatus:
    """The fresh read a pending verdict needs: the status file, and the shard's old task
    files when the verdict is that the worker does not take them."""
    verdict = _silence_verdict(host, now, policy)
    if verdict is not None and verdict[0] is Cause.NOT_TAKING:
        return RecheckStatus(tasks_older_than_s=policy.progress_stale_s)
    return _RECHECK


_RECHECK: Final = RecheckStatus()


def _silence_verdict(host: Host, now: float, policy: Policy) -> tuple[Cause, str] | None:
    """Why a ready host is unhealthy at ``now`` by what its heartbeats said (or did not),
    or None while it is not."""
    if now >= _stale_at(host, policy) and not host.frozen:
        base = host.alive_at if host.alive_at is not None else host.since_at
        return Cause.HEARTBEAT_STALE, f"heartbeat stale for {now - base:.1f}s"
    stuck_at = _stuck_at(host, policy)
    if stuck_at is not None and now >= stuck_at and not host.frozen:
        idle_s = now - stuck_at + policy.progress_stale_s
        return (
            Cause.STUCK,
            f"stuck: no task finished in {idle_s:.0f} s with {host.in_flight} in flight",
        )
    backlog_at = _backlog_at(host, policy)
    if backlog_at is not None and now >= backlog_at and not host.frozen:
        return Cause.NOT_TAKING, _not_taking(host, now - backlog_at + policy.progress_stale_s)
    since = host.not_ready_since_at
    if since is not None and now >= since + policy.ready_timeout_s:
        return Cause.NOT_READY, f"not ready for {now - since:.1f}s"
    return None


def _not_taking_seen(host: Host, event: Event, policy: Policy) -> bool:
    """The inbox confirms a backlog the worker does not take: task files older than the
    stuck limit that cannot all be its calls in flight (one with a slot free takes a task
    within a scan of its inbox, so an old file not in flight is one it will never take).

    Its calls in flight may be that old only if its calls take that long: a worker that says
    its calls finish well within the limit (``verify_ms_p95``) has none, so any old file is
    one it left; otherwise only more old files than calls in flight tell."""
    if not isinstance(event, StatusRechecked) or event.old_tasks is None:
        return False
    p95 = host.stats.verify_ms_p95 if host.stats is not None else None
    quick = p95 is not None and p95 < 500.0 * policy.progress_stale_s
    return event.old_tasks > (0 if quick else host.in_flight or 0)


def _not_taking(host: Host, waited_s: float) -> str:
    stats = host.stats or WorkerStats()
    queue, slots, busy = stats.queue_depth or 0, stats.concurrency or 0, host.in_flight or 0
    return (
        f"not taking tasks: {queue - busy} waited {waited_s:.0f} s in its inbox"
        f" with {slots - busy} of {slots} slots free"
    )


def _backlog_at(host: Host, policy: Policy) -> float | None:
    """When tasks waiting with slots free make a ready host unhealthy (None: not while its
    last heartbeat had every slot busy, or nothing waits)."""
    free = host.slot_free_since_at
    if policy.progress_stale_s <= 0 or host.backlog_since_at is None or free is None:
        return None
    base = host.backlog_since_at
    if host.thawed_at is not None:
        base = max(base, host.thawed_at)
    return max(base + policy.progress_stale_s, free + SLOT_FREE_CONFIRM_S)


def _stuck_at(host: Host, policy: Policy) -> float | None:
    """When a ready host with work in flight and no progress becomes stuck (None: never)."""
    if policy.progress_stale_s <= 0 or not host.in_flight or host.progress_at is None:
        return None
    base = host.progress_at
    if host.thawed_at is not None:
        base = max(base, host.thawed_at)
    return base + policy.progress_stale_s


def _judged_at(host: Host, policy: Policy) -> float:
    """When a ready host's silence or lack of progress makes it unhealthy, if nothing
    changes first."""
    judged = _stale_at(host, policy)
    stuck_at = _stuck_at(host, policy)
    if stuck_at is not None and stuck_at < judged:
        judged = stuck_at
    if host.backlog_since_at is not None:
        backlog_at = _backlog_at(host, policy)
        if backlog_at is not None and backlog_at < judged:
            judged = backlog_at
    return judged


def _stale_at(host: Host, policy: Policy) -> float:
    """When a ready host's silence makes it stale (never sooner than a stale limit after a
    thaw)."""
    base = host.alive_at if host.alive_at is not None else host.since_at
    if host.thawed_at is not None:
        base = max(base, host.thawed_at)
    return base + policy.heartbeat_stale_s


def _ready_by(host: Host, policy: Policy) -> float:
    """When a starting host must have reported ready (a thaw restarts the clock)."""
    base = host.launched_at if host.launched_at is not None else host.since_at
    if host.thawed_at is not None:
        base = max(base, host.thawed_at)
    return base + policy.ready_timeout_s


def _cooldown_passed(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if host.held is not None:
        return host
    if host.next_restart_at is not None and now >= host.next_restart_at:
        return _enter(host, S.STALE, f"{host.cause}; cooldown over", now)
    return host


def _start(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if host.stop_sentinel:
        return host  # the sentinel wins: removing it is how a sentinel-stopped host starts
    if isinstance(event, StopSentinelRemoved):
        if host.stop_cause is not StopCause.SENTINEL:
            return host
        reason = "stop sentinel removed"
    else:
        reason = event.reason if isinstance(event, StartRequested) else "start"
    host = replace(
        host, failures=0, stop_cause=None, restart_is_automatic=False, held=None, planned=None
    )
    if host.state is S.COOLING_DOWN or host.op == "terminate":
        return _enter(host, S.STALE, reason, now)  # finish the terminate, then launch
    if host.state in WANT_RUNNING_STATES:
        return host
    if host.pid is not None:
        # A worker still runs (a terminate failed, or a failed host's worker is alive):
        # give it the chance to show it is healthy before replacing it.
        host = replace(host, launched_at=now, found_running=True)
    return _maybe_ready(_enter(host, S.STARTING, reason, now), event, now, policy)


def restart_refusal(host: Host) -> str | None:
    """Why an operator's restart of ``host`` does nothing, or None if it would act."""
    if host.stop_sentinel:
        return "held stopped by its stop sentinel; use start-host"
    return None


def _restart(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if restart_refusal(host) is not None:
        return host
    asked = cast(RestartRequested, event)  # the table routes only RestartRequested here
    reason, planned = asked.reason, asked.planned
    host = replace(
        host, failures=0, stop_cause=None, restart_is_automatic=False, held=None, planned=planned
    )
    if host.state is S.STARTING and host.pid is None and host.op is None:
        return replace(host, reason=reason)  # nothing runs: the coming launch is the restart
    return _enter(host, S.STALE, reason, now)


def _stop(host: Host, event: Event, now: float, policy: Policy) -> Host:
    if isinstance(event, StopRequested):
        reason, cause = event.reason, event.cause
    else:
        reason, cause = "stop sentinel present", StopCause.SENTINEL
    host = replace(host, stop_cause=cause, planned=None)
    if host.state is S.STOPPED:
        return replace(host, reason=reason)
    return _enter(host, S.STOPPING, reason, now)


def _sentinel_takes_over(host: Host, event: Event, now: float, policy: Policy) -> Host:
    # An operator stop becomes a sentinel stop, so removing the file starts the host again;
    # a shutdown or removal stays what it is.
    if host.stop_cause is StopCause.OPERATOR:
        return replace(host, stop_cause=StopCause.SENTINEL)
    return host


def _relocated(host: Host, event: Event, now: float, policy: Policy) -> Host:
    """Start afresh on the new machine: the history stays (a host that keeps failing over
    keeps backing off), and so do the fleet's holds and what was seen of the status file
    (the same file: the new worker's first heartbeat counts at once). A host stopped on
    purpose stays stopped; its old worker is the old machine's to kill."""
    moved = cast(Relocated, event)  # the table routes only Relocated here
    fresh = replace(
        new_host(host.name, now, history=history_of(host)),
        reason=moved.reason,
        next_restart_at=None,
        needs_probe=False,
        held=host.held,
        frozen=host.frozen,
        ssh_up=moved.ssh_up,
        ssh_reason="connected" if moved.ssh_up else "waiting for its old machine's worker",
        beat_pid=host.beat_pid,
        beat_ready=host.beat_ready,
        remote_heartbeat_at=host.remote_heartbeat_at,
        remote_seq=host.remote_seq,
        beat_changed_at=host.beat_changed_at,
        status_seen=host.status_seen,
        status_problem=host.status_problem,
        last_pid=host.pid if host.pid is not None else host.last_pid,
        # The tasks its old worker hung on would hang the new one too.
        quarantine_due=host.quarantine_due,
    )
    if host.state in STOP_STATES:
        return replace(
            fresh,
            state=S.STOPPED,
            stop_sentinel=host.stop_sentinel,
            stop_cause=host.stop_cause,
        )
    return fresh


def _each(
    states: frozenset[HostState], event: type[Event], handler: _Handler
) -> dict[tuple[HostState, type[Event]], _Handler]:
    return {(state, event): handler for state in states}


_STARTING_OR_READY: Final = frozenset({S.STARTING, S.READY})

#: (state, event type) -> handler, consulted only for events that concern the current
#: worker (see _observe). Pairs not listed change no state; _reconcile still acts on what
#: _observe recorded (an op finished, SSH came back, a pid was confirmed dead).
TRANSITIONS: Final[Mapping[tuple[HostState, type[Event]], _Handler]] = {
    (S.STARTING, HeartbeatSeen): _maybe_ready,
    (S.STARTING, Launched): _maybe_ready,
    (S.STARTING, ProbeResult): _probe_answered,
    (S.STARTING, LaunchFailed): _launch_failed,
    (S.STARTING, LaunchRefused): _launch_refused,
    **_each(_STARTING_OR_READY, WorkerExited, _worker_gone),
    **_each(_STARTING_OR_READY, TerminateConfirmed, _worker_gone),
    (S.READY, ProbeResult): _worker_gone,
    **_each(UNHEALTHY_STATES, HeartbeatSeen, _recover),
    (S.STARTING, DeadlinePassed): _ready_timeout_passed,
    (S.READY, DeadlinePassed): _heartbeat_deadline_passed,
    (S.READY, StatusRechecked): _heartbeat_deadline_passed,
    (S.COOLING_DOWN, DeadlinePassed): _cooldown_passed,
    (S.COOLING_DOWN, RestartReleased): _cooldown_passed,
    **_each(_STARTING_OR_READY, RewardProbeAnswered, _probe_judged),
    (S.COOLING_DOWN, RewardProbeAnswered): _recover,
    # Thawing re-checks what the freeze held back; silence and readiness are timed anew from
    # the thaw (_stale_at, _ready_by), a ready worker's own ready: false report is not.
    (S.STARTING, FleetThawed): _ready_timeout_passed,
    (S.READY, FleetThawed): _heartbeat_deadline_passed,
    **_each(ALL_STATES, StartRequested, _start),
    **_each(STOP_STATES, StopSentinelRemoved, _start),
    **_each(ALL_STATES, RestartRequested, _restart),
    **_each(ALL_STATES, StopRequested, _stop),
    **_each(ALL_STATES - STOP_STATES, StopSentinelAppeared, _stop),
    **_each(STOP_STATES, StopSentinelAppeared, _sentinel_takes_over),
    **_each(ALL_STATES, Relocated, _relocated),
}


def _reconcile(host: Host, now: float, policy: Policy) -> tuple[Host, list[Action]]:
    """Start the operation the state calls for, if none is in flight: the quarantine a dead
    stuck worker left due (file I/O: SSH need not be up), then a remote one if SSH is up."""
    idle = host.op is None
    if idle and host.pid is None and host.quarantine_due:
        return replace(host, op="quarantine"), [Quarantine(count=host.quarantine_due)]
    if host.state is S.STOPPING and idle and host.pid is None and not host.needs_probe:
        return _enter(host, S.STOPPED, host.reason, now), []
    if not (host.ssh_up and idle) or (host.op_retry_at is not None and now < host.op_retry_at):
        return host, []
    if host.op_retry_at is not None:
        host = replace(host, op_retry_at=None)  # the wait is over
    if host.needs_probe:
        return replace(host, op="probe"), [Probe(pid=host.pid)]
    # Frozen: an automatic restart of a live worker waits (a dead one is still replaced, and
    # an operator's restart goes ahead).
    held = host.frozen and host.state is S.STALE and host.restart_is_automatic
    if host.state in (S.STALE, S.STOPPING) and host.pid is not None and not held:
        automatic = host.state is S.STALE and host.restart_is_automatic
        # A worker being replaced is killed at once (restart_stop): its successor does its
        # in-flight tasks again, and a drain would end in ready: false, which fails every
        # trainer call until the successor beats.
        replace_now = host.state is S.STALE and policy.restart_stop == "kill"
        terminate = Terminate(
            pid=host.pid,
            grace_s=0.0 if replace_now else policy.stop_grace_s,
            kill=replace_now
            or policy.kill_after_grace
            or (policy.kill_stuck and automatic and host.cause_code is Cause.STUCK),
            collect_evidence=automatic
            and host.cause_code in _LIVE_BUT_UNHEALTHY
            and policy.evidence_timeout_s > 0,
        )
        quarantine = (
            (host.in_flight or 0)
            if automatic and host.cause_code is Cause.STUCK and policy.quarantine_stuck_tasks
            else 0
        )
        return replace(host, op="terminate", quarantine_due=quarantine), [terminate]
    if host.state in (S.STALE, S.STARTING) and host.pid is None:
        return _launch(host, now)
    return host, []


def _launch(host: Host, now: float) -> tuple[Host, list[Action]]:
    automatic = host.state is S.STALE and host.restart_is_automatic
    reason = f"launching: {host.reason}"
    planned = host.planned
    if automatic:
        host = replace(
            host, restart_times_at=(*host.restart_times_at, now), restarts=host.restarts + 1
        )
        reason = f"restarting after: {host.cause}"
    elif planned is not None:
        counts = dict(host.planned_restarts)
        counts[planned] = counts.get(planned, 0) + 1
        host = replace(host, planned_restarts=tuple(sorted(counts.items())))
    host = _enter(host, S.STARTING, reason, now)
    host = replace(
        host,
        op="launch",
        launched_at=now,
        alive_at=None,
        found_running=False,
        restart_is_automatic=True,
        planned=None,
    )
    cause = host.cause_code if automatic else None
    planned = None if automatic else planned
    return host, [Launch(reason=reason, is_restart=automatic, cause=cause, planned=planned)]


#: Causes that leave the worker alive: what it is doing is worth capturing before it dies.
_LIVE_BUT_UNHEALTHY: Final = frozenset(
    {
        Cause.STUCK,
        Cause.HEARTBEAT_STALE,
        Cause.NOT_READY,
        Cause.NOT_TAKING,
        # A probe unanswered may be a hung reward call; an error or a wrong score is
        # explained by the answer itself.
        Cause.PROBE_TIMEOUT,
    }
)


def _deadline(host: Host, policy: Policy) -> float | None:
    """The next instant at which time alone could change this host."""
    candidates: list[float] = []
    # A retry waits for SSH as much as for the clock; SshRestored clears it and wakes us.
    if host.op_retry_at is not None and host.op is None and host.ssh_up:
        candidates.append(host.op_retry_at)
    match host.state:
        case S.STARTING if host.launched_at is not None and not host.frozen:
            candidates.append(_ready_by(host, policy))
        case S.READY if host.recheck_at is not None:
            candidates.append(host.recheck_at + RECHECK_TIMEOUT_S)
        case S.READY:
            if not host.frozen:
                candidates.append(_judged_at(host, policy))
            if host.not_ready_since_at is not None:
                candidates.append(host.not_ready_since_at + policy.ready_timeout_s)
        case S.COOLING_DOWN if host.next_restart_at is not None and host.held is None:
            candidates.append(host.next_restart_at)
        case _:
            pass
    due = _probe_due(host, policy)
    if due is not None:
        candidates.append(due[0])
    return min(candidates) if candidates else None
