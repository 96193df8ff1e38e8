"""Every (scenario, event type) pair of the state machine, with the state and actions expected.

Each scenario is a host in a settled state reached through ``step`` from ``new_host`` (so the
test exercises only reachable hosts); the expectations were worked out from DESIGN §4, not
recorded from the code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from supervisor import health as h
from supervisor.health import HostState as S

POLICY = h.Policy(
    heartbeat_stale_s=10,
    ready_timeout_s=20,
    restart_cooldown_s=5,
    backoff_max_s=40,
    backoff_reset_s=100,
    max_restarts=2,
    restart_window_s=1000,
    stop_grace_s=3,
    kill_after_grace=False,
)


@dataclass(frozen=True)
class Scenario:
    """A named host and the monotonic time it was reached at."""

    host: h.Host
    now: float


def _drive(steps: list[tuple[h.Event, float]], host: h.Host | None = None) -> Scenario:
    """Feed ``steps`` (event, time) to ``host`` (or a new one); the scenario reached."""
    host = host or h.new_host("w-0", 0.0)
    now = 0.0
    for event, now in steps:
        host, _ = h.step(host, event, now, POLICY)
    return Scenario(host, now)


def _scenarios() -> dict[str, Scenario]:
    """Every named scenario, each reached through step() from new_host."""
    probing = _drive([(h.StatusMissing(reason="missing"), 0.0), (h.SshRestored(), 0.0)])
    launching = _drive([(h.ProbeResult(pid=None), 0.05)], probing.host)
    launched = _drive([(h.Launched(pid=100), 0.1)], launching.host)
    beat = h.HeartbeatSeen(pid=100, ready=True, remote_heartbeat_at=5000.0)
    ready = _drive([(beat, 1.0)], launched.host)
    # The verdict waits for a fresh read of the file; the read finds the same stamp.
    rechecking = _drive([(h.DeadlinePassed(), 11.0)], ready.host)
    stale_terminating = _drive([(h.StatusRechecked(beat=beat), 11.0)], rechecking.host)
    stale_ssh_down = _drive(
        [
            (h.SshLost(reason="eof"), 2.0),
            (h.DeadlinePassed(), 11.0),
            (h.StatusRechecked(beat=beat), 11.0),
        ],
        ready.host,
    )
    cooling = _drive(
        [
            (h.TerminateConfirmed(pid=100), 11.5),
            (h.Launched(pid=101), 11.6),
            (h.WorkerExited(pid=101, exit_code=1), 12.0),
        ],
        stale_terminating.host,
    )
    failed = _drive(
        [
            (h.DeadlinePassed(), 17.0),
            (h.Launched(pid=102), 17.1),
            (h.WorkerExited(pid=102, exit_code=1), 18.0),
        ],
        cooling.host,
    )
    stopping = _drive([(h.StopRequested(reason="operator stop"), 2.0)], ready.host)
    stopped = _drive([(h.TerminateConfirmed(pid=100), 2.5)], stopping.host)
    return {
        "starting:probing": probing,
        "starting:launching": launching,
        "starting:launched": launched,
        "ready": ready,
        "ready:rechecking": rechecking,
        "stale:terminating": stale_terminating,
        "stale:ssh-down": stale_ssh_down,
        "cooling_down": cooling,
        "failed": failed,
        "stopping": stopping,
        "stopped": stopped,
    }


SCENARIOS = _scenarios()


def _pid(host: h.Host) -> int:
    """The pid an event about this host's worker should name."""
    return host.pid if host.pid is not None else host.last_pid if host.last_pid else 100


EVENTS: dict[type[h.Event], Callable[[h.Host], h.Event]] = {
    h.HeartbeatSeen: lambda host: h.HeartbeatSeen(
        pid=_pid(host), ready=True, remote_heartbeat_at=(host.remote_heartbeat_at or 0.0) + 1
    ),
    h.StatusMissing: lambda host: h.StatusMissing(reason="missing"),
    h.WorkerExited: lambda host: h.WorkerExited(pid=_pid(host), exit_code=1),
    h.Launched: lambda host: h.Launched(pid=500),
    h.LaunchFailed: lambda host: h.LaunchFailed(reason="python not found"),
    h.LaunchRefused: lambda host: h.LaunchRefused(holder_pid=600),
    h.TerminateConfirmed: lambda host: h.TerminateConfirmed(pid=_pid(host)),
    h.TerminateFailed: lambda host: h.TerminateFailed(pid=_pid(host), reason="still alive"),
    h.ProbeResult: lambda host: h.ProbeResult(pid=None),
    h.ProbeFailed: lambda host: h.ProbeFailed(reason="agent died"),
    h.SshLost: lambda host: h.SshLost(reason="eof"),
    h.SshRestored: lambda host: h.SshRestored(),
    h.DeadlinePassed: lambda host: h.DeadlinePassed(),
    h.StartRequested: lambda host: h.StartRequested(),
    h.StopRequested: lambda host: h.StopRequested(reason="operator stop"),
    h.RestartRequested: lambda host: h.RestartRequested(),
    h.StopSentinelAppeared: lambda host: h.StopSentinelAppeared(),
    h.StopSentinelRemoved: lambda host: h.StopSentinelRemoved(),
    h.FleetFrozen: lambda host: h.FleetFrozen(reason="most hosts silent"),
    h.FleetThawed: lambda host: h.FleetThawed(),
    h.LaunchBegan: lambda host: h.LaunchBegan(),
    h.RestartHeld: lambda host: h.RestartHeld(reason="5 hosts crashed the same way"),
    h.RestartReleased: lambda host: h.RestartReleased(),
    # A fresh read that finds what was seen already (the same stamp, or still no file).
    h.StatusRechecked: lambda host: h.StatusRechecked(
        beat=h.StatusMissing(reason="missing")
        if host.remote_heartbeat_at is None
        else h.HeartbeatSeen(
            pid=host.beat_pid or _pid(host),
            ready=host.beat_ready,
            remote_heartbeat_at=host.remote_heartbeat_at,
        )
    ),
    h.RewardProbeAnswered: lambda host: h.RewardProbeAnswered(
        pid=_pid(host), status="error", error="ModuleNotFoundError: No module named 'x'"
    ),
    # No quarantine was asked in any scenario: an answer to none is ignored.
    h.Quarantined: lambda host: h.Quarantined(count=1),
    h.AgentStarted: lambda host: h.AgentStarted(),
    h.UsageMeasured: lambda host: h.UsageMeasured(
        pid=_pid(host), rss_bytes=2**30, processes=5, via="pss"
    ),
    # The fleet moved the shard to a connected spare.
    h.Relocated: lambda host: h.Relocated(reason="moving to s0: w-0 host lost", ssh_up=True),
}

E = h
# scenario -> event type -> (state after, remote actions emitted)
EXPECTED: dict[str, dict[type[h.Event], tuple[S, tuple[str, ...]]]] = {
    "starting:probing": {
        E.HeartbeatSeen: (S.READY, ()),  # a changing heartbeat adopts before the probe answers
        E.StatusMissing: (S.STARTING, ()),
        E.WorkerExited: (S.STARTING, ()),
        E.Launched: (S.STARTING, ()),
        E.LaunchFailed: (S.STARTING, ()),
        E.LaunchRefused: (S.STARTING, ()),
        E.TerminateConfirmed: (S.STARTING, ()),
        E.TerminateFailed: (S.STARTING, ()),
        E.ProbeResult: (S.STARTING, ("Launch",)),
        E.ProbeFailed: (S.STARTING, ()),
        E.SshLost: (S.STARTING, ()),
        E.SshRestored: (S.STARTING, ()),
        E.DeadlinePassed: (S.STARTING, ()),
        E.StartRequested: (S.STARTING, ()),
        E.StopRequested: (S.STOPPING, ()),
        E.RestartRequested: (S.STALE, ()),
        E.StopSentinelAppeared: (S.STOPPING, ()),
        E.StopSentinelRemoved: (S.STARTING, ()),
        E.FleetFrozen: (S.STARTING, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STARTING, ()),
        E.LaunchBegan: (S.STARTING, ()),
        E.RestartHeld: (S.STARTING, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STARTING, ()),
        E.StatusRechecked: (S.STARTING, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STARTING, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),  # the spare runs nothing of ours: no probe
        E.Quarantined: (S.STARTING, ()),
        E.AgentStarted: (S.STARTING, ()),
        E.UsageMeasured: (S.STARTING, ()),  # shown, never judged
    },
    "starting:launching": {
        E.HeartbeatSeen: (S.STARTING, ()),
        E.StatusMissing: (S.STARTING, ()),
        E.WorkerExited: (S.STARTING, ()),
        E.Launched: (S.STARTING, ()),
        E.LaunchFailed: (S.STARTING, ("Launch",)),  # first failure: immediate retry
        E.LaunchRefused: (S.STARTING, ()),  # adopt the holder, wait for its heartbeat
        E.TerminateConfirmed: (S.STARTING, ()),
        E.TerminateFailed: (S.STARTING, ()),
        E.ProbeResult: (S.STARTING, ()),
        E.ProbeFailed: (S.STARTING, ()),
        E.SshLost: (S.STARTING, ()),
        E.SshRestored: (S.STARTING, ()),
        E.DeadlinePassed: (S.STALE, ()),  # launch still in flight: nothing new until it answers
        E.StartRequested: (S.STARTING, ()),
        E.StopRequested: (S.STOPPING, ()),
        E.RestartRequested: (S.STALE, ()),
        E.StopSentinelAppeared: (S.STOPPING, ()),
        E.StopSentinelRemoved: (S.STARTING, ()),
        E.FleetFrozen: (S.STARTING, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STARTING, ()),
        E.LaunchBegan: (S.STARTING, ()),
        E.RestartHeld: (S.STARTING, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STARTING, ()),
        E.StatusRechecked: (S.STARTING, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STARTING, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),
        E.Quarantined: (S.STARTING, ()),
        E.AgentStarted: (S.STARTING, ()),
        E.UsageMeasured: (S.STARTING, ()),  # shown, never judged
    },
    "starting:launched": {
        E.HeartbeatSeen: (S.READY, ()),
        E.StatusMissing: (S.STARTING, ()),
        E.WorkerExited: (S.STARTING, ("Launch",)),
        E.Launched: (S.STARTING, ()),
        E.LaunchFailed: (S.STARTING, ()),
        E.LaunchRefused: (S.STARTING, ()),
        E.TerminateConfirmed: (S.STARTING, ("Launch",)),
        E.TerminateFailed: (S.STARTING, ()),
        E.ProbeResult: (S.STARTING, ()),
        E.ProbeFailed: (S.STARTING, ()),
        E.SshLost: (S.STARTING, ()),
        E.SshRestored: (S.STARTING, ()),
        E.DeadlinePassed: (S.STALE, ("Terminate",)),
        E.StartRequested: (S.STARTING, ()),
        E.StopRequested: (S.STOPPING, ("Terminate",)),
        E.RestartRequested: (S.STALE, ("Terminate",)),
        E.StopSentinelAppeared: (S.STOPPING, ("Terminate",)),
        E.StopSentinelRemoved: (S.STARTING, ()),
        E.FleetFrozen: (S.STARTING, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STARTING, ()),
        E.LaunchBegan: (S.STARTING, ()),
        E.RestartHeld: (S.STARTING, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STARTING, ()),
        E.StatusRechecked: (S.STARTING, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STARTING, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),  # the old launch is the old machine's
        E.Quarantined: (S.STARTING, ()),
        E.AgentStarted: (S.STARTING, ("Watch",)),
        E.UsageMeasured: (S.STARTING, ()),  # shown, never judged
    },
    "ready": {
        E.HeartbeatSeen: (S.READY, ()),
        E.StatusMissing: (S.READY, ()),  # no heartbeat is an observation; the deadline decides
        E.WorkerExited: (S.STARTING, ("Launch",)),
        E.Launched: (S.READY, ()),
        E.LaunchFailed: (S.READY, ()),
        E.LaunchRefused: (S.READY, ()),
        E.TerminateConfirmed: (S.STARTING, ("Launch",)),
        E.TerminateFailed: (S.READY, ()),
        E.ProbeResult: (S.READY, ()),
        E.ProbeFailed: (S.READY, ()),
        E.SshLost: (S.READY, ()),  # SSH down is not worker down
        E.SshRestored: (S.READY, ()),
        E.DeadlinePassed: (S.READY, ("RecheckStatus",)),  # the verdict waits for a fresh read
        E.StartRequested: (S.READY, ()),
        E.StopRequested: (S.STOPPING, ("Terminate",)),
        E.RestartRequested: (S.STALE, ("Terminate",)),
        E.StopSentinelAppeared: (S.STOPPING, ("Terminate",)),
        E.StopSentinelRemoved: (S.READY, ()),
        E.FleetFrozen: (S.READY, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.READY, ()),
        E.LaunchBegan: (S.READY, ()),
        E.RestartHeld: (S.READY, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.READY, ()),
        E.StatusRechecked: (S.READY, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.READY, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),
        E.Quarantined: (S.READY, ()),
        E.AgentStarted: (S.READY, ("Watch",)),
        E.UsageMeasured: (S.READY, ()),  # shown, never judged
    },
    "ready:rechecking": {
        E.HeartbeatSeen: (S.READY, ()),  # a fresh beat ends the silence before the verdict
        E.StatusMissing: (S.READY, ()),  # no heartbeat is an observation; the deadline decides
        E.WorkerExited: (S.STARTING, ("Launch",)),
        E.Launched: (S.READY, ()),
        E.LaunchFailed: (S.READY, ()),
        E.LaunchRefused: (S.READY, ()),
        E.TerminateConfirmed: (S.STARTING, ("Launch",)),
        E.TerminateFailed: (S.READY, ()),
        E.ProbeResult: (S.READY, ()),
        E.ProbeFailed: (S.READY, ()),
        E.SshLost: (S.READY, ()),  # SSH down is not worker down
        E.SshRestored: (S.READY, ()),
        E.DeadlinePassed: (S.STALE, ("Terminate",)),  # no answer in time: the verdict stands
        E.StartRequested: (S.READY, ()),
        E.StopRequested: (S.STOPPING, ("Terminate",)),
        E.RestartRequested: (S.STALE, ("Terminate",)),
        E.StopSentinelAppeared: (S.STOPPING, ("Terminate",)),
        E.StopSentinelRemoved: (S.READY, ()),
        E.FleetFrozen: (S.READY, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.READY, ()),
        E.LaunchBegan: (S.READY, ()),
        E.RestartHeld: (S.READY, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.READY, ()),
        E.StatusRechecked: (S.STALE, ("Terminate",)),  # the fresh read confirms the silence
        E.RewardProbeAnswered: (S.READY, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),
        E.Quarantined: (S.READY, ()),
        E.AgentStarted: (S.READY, ("Watch",)),
        E.UsageMeasured: (S.READY, ()),  # shown, never judged
    },
    "stale:terminating": {
        E.HeartbeatSeen: (S.STALE, ()),  # the terminate is already under way
        E.StatusMissing: (S.STALE, ()),
        E.WorkerExited: (S.STALE, ()),  # the terminate's own answer comes next
        E.Launched: (S.STALE, ()),
        E.LaunchFailed: (S.STALE, ()),
        E.LaunchRefused: (S.STALE, ()),
        E.TerminateConfirmed: (S.STARTING, ("Launch",)),
        E.TerminateFailed: (S.STALE, ()),  # retried after restart_cooldown_s
        E.ProbeResult: (S.STALE, ()),
        E.ProbeFailed: (S.STALE, ()),
        E.SshLost: (S.STALE, ()),
        E.SshRestored: (S.STALE, ()),
        E.DeadlinePassed: (S.STALE, ()),
        E.StartRequested: (S.STALE, ()),
        E.StopRequested: (S.STOPPING, ()),
        E.RestartRequested: (S.STALE, ()),
        E.StopSentinelAppeared: (S.STOPPING, ()),
        E.StopSentinelRemoved: (S.STALE, ()),
        E.FleetFrozen: (S.STALE, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STALE, ()),
        E.LaunchBegan: (S.STALE, ()),
        E.RestartHeld: (S.STALE, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STALE, ()),
        E.StatusRechecked: (S.STALE, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STALE, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),  # its old worker is fenced, not waited for
        E.Quarantined: (S.STALE, ()),
        E.AgentStarted: (S.STALE, ()),
        E.UsageMeasured: (S.STALE, ()),  # shown, never judged
    },
    "stale:ssh-down": {
        E.HeartbeatSeen: (S.READY, ()),  # untouched and beating again: it was slow, not dead
        E.StatusMissing: (S.STALE, ()),
        E.WorkerExited: (S.STALE, ()),  # dead, but a launch waits for SSH
        E.Launched: (S.STALE, ()),
        E.LaunchFailed: (S.STALE, ()),
        E.LaunchRefused: (S.STALE, ()),
        E.TerminateConfirmed: (S.STALE, ()),
        E.TerminateFailed: (S.STALE, ()),
        E.ProbeResult: (S.STALE, ()),
        E.ProbeFailed: (S.STALE, ()),
        E.SshLost: (S.STALE, ()),
        E.SshRestored: (S.STALE, ("Terminate",)),  # remote actions wait for the reconnect
        E.DeadlinePassed: (S.STALE, ()),
        E.StartRequested: (S.STALE, ()),
        E.StopRequested: (S.STOPPING, ()),
        E.RestartRequested: (S.STALE, ()),
        E.StopSentinelAppeared: (S.STOPPING, ()),
        E.StopSentinelRemoved: (S.STALE, ()),
        E.FleetFrozen: (S.STALE, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STALE, ()),
        E.LaunchBegan: (S.STALE, ()),
        E.RestartHeld: (S.STALE, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STALE, ()),
        E.StatusRechecked: (S.STALE, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STALE, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),
        E.Quarantined: (S.STALE, ()),
        E.AgentStarted: (S.STALE, ("Watch",)),
        E.UsageMeasured: (S.STALE, ()),  # shown, never judged
    },
    "cooling_down": {
        E.HeartbeatSeen: (S.COOLING_DOWN, ()),  # the dead pid's file cannot revive it
        E.StatusMissing: (S.COOLING_DOWN, ()),
        E.WorkerExited: (S.COOLING_DOWN, ()),
        E.Launched: (S.COOLING_DOWN, ()),
        E.LaunchFailed: (S.COOLING_DOWN, ()),
        E.LaunchRefused: (S.COOLING_DOWN, ()),
        E.TerminateConfirmed: (S.COOLING_DOWN, ()),
        E.TerminateFailed: (S.COOLING_DOWN, ()),
        E.ProbeResult: (S.COOLING_DOWN, ()),
        E.ProbeFailed: (S.COOLING_DOWN, ()),
        E.SshLost: (S.COOLING_DOWN, ()),
        E.SshRestored: (S.COOLING_DOWN, ()),
        E.DeadlinePassed: (S.STARTING, ("Launch",)),
        E.StartRequested: (S.STARTING, ("Launch",)),  # an operator skips the cooldown
        E.StopRequested: (S.STOPPED, ()),
        E.RestartRequested: (S.STARTING, ("Launch",)),
        E.StopSentinelAppeared: (S.STOPPED, ()),
        E.StopSentinelRemoved: (S.COOLING_DOWN, ()),
        E.FleetFrozen: (S.COOLING_DOWN, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.COOLING_DOWN, ()),
        E.LaunchBegan: (S.COOLING_DOWN, ()),
        E.RestartHeld: (S.COOLING_DOWN, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.COOLING_DOWN, ()),
        E.StatusRechecked: (S.COOLING_DOWN, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.COOLING_DOWN, ()),  # probes off: none was asked for
        E.Relocated: (S.STARTING, ("Launch",)),
        E.Quarantined: (S.COOLING_DOWN, ()),
        E.AgentStarted: (S.COOLING_DOWN, ()),
        E.UsageMeasured: (S.COOLING_DOWN, ()),  # shown, never judged
    },
    "failed": {
        E.HeartbeatSeen: (S.FAILED, ()),
        E.StatusMissing: (S.FAILED, ()),
        E.WorkerExited: (S.FAILED, ()),
        E.Launched: (S.FAILED, ()),
        E.LaunchFailed: (S.FAILED, ()),
        E.LaunchRefused: (S.FAILED, ()),
        E.TerminateConfirmed: (S.FAILED, ()),
        E.TerminateFailed: (S.FAILED, ()),
        E.ProbeResult: (S.FAILED, ()),
        E.ProbeFailed: (S.FAILED, ()),
        E.SshLost: (S.FAILED, ()),
        E.SshRestored: (S.FAILED, ()),
        E.DeadlinePassed: (S.FAILED, ()),  # no timer brings a failed host back
        E.StartRequested: (S.STARTING, ("Launch",)),
        E.StopRequested: (S.STOPPED, ()),
        E.RestartRequested: (S.STARTING, ("Launch",)),
        E.StopSentinelAppeared: (S.STOPPED, ()),
        E.StopSentinelRemoved: (S.FAILED, ()),
        E.FleetFrozen: (S.FAILED, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.FAILED, ()),
        E.LaunchBegan: (S.FAILED, ()),
        E.RestartHeld: (S.FAILED, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.FAILED, ()),
        E.StatusRechecked: (S.FAILED, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.FAILED, ()),  # probes off: none was asked for
        E.Relocated: (S.FAILED, ()),  # given up on stays given up on, wherever it is
        E.Quarantined: (S.FAILED, ()),
        E.AgentStarted: (S.FAILED, ()),
        E.UsageMeasured: (S.FAILED, ()),  # shown, never judged
    },
    "stopping": {
        E.HeartbeatSeen: (S.STOPPING, ()),
        E.StatusMissing: (S.STOPPING, ()),
        E.WorkerExited: (S.STOPPING, ()),
        E.Launched: (S.STOPPING, ()),
        E.LaunchFailed: (S.STOPPING, ()),
        E.LaunchRefused: (S.STOPPING, ()),
        E.TerminateConfirmed: (S.STOPPED, ()),
        E.TerminateFailed: (S.STOPPING, ()),
        E.ProbeResult: (S.STOPPING, ()),
        E.ProbeFailed: (S.STOPPING, ()),
        E.SshLost: (S.STOPPING, ()),
        E.SshRestored: (S.STOPPING, ()),
        E.DeadlinePassed: (S.STOPPING, ()),
        E.StartRequested: (S.STALE, ()),  # finish the terminate, then launch
        E.StopRequested: (S.STOPPING, ()),
        E.RestartRequested: (S.STALE, ()),
        E.StopSentinelAppeared: (S.STOPPING, ()),
        E.StopSentinelRemoved: (S.STOPPING, ()),  # stopped by an operator, not by a file
        E.FleetFrozen: (S.STOPPING, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STOPPING, ()),
        E.LaunchBegan: (S.STOPPING, ()),
        E.RestartHeld: (S.STOPPING, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STOPPING, ()),
        E.StatusRechecked: (S.STOPPING, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STOPPING, ()),  # probes off: none was asked for
        E.Relocated: (S.STOPPED, ()),  # stopped on purpose stays so; the old worker is fenced
        E.Quarantined: (S.STOPPING, ()),
        E.AgentStarted: (S.STOPPING, ()),
        E.UsageMeasured: (S.STOPPING, ()),  # shown, never judged
    },
    "stopped": {
        E.HeartbeatSeen: (S.STOPPED, ()),
        E.StatusMissing: (S.STOPPED, ()),
        E.WorkerExited: (S.STOPPED, ()),
        E.Launched: (S.STOPPED, ()),
        E.LaunchFailed: (S.STOPPED, ()),
        E.LaunchRefused: (S.STOPPED, ()),
        E.TerminateConfirmed: (S.STOPPED, ()),
        E.TerminateFailed: (S.STOPPED, ()),
        E.ProbeResult: (S.STOPPED, ()),
        E.ProbeFailed: (S.STOPPED, ()),
        E.SshLost: (S.STOPPED, ()),
        E.SshRestored: (S.STOPPED, ()),
        E.DeadlinePassed: (S.STOPPED, ()),
        E.StartRequested: (S.STARTING, ("Launch",)),
        E.StopRequested: (S.STOPPED, ()),
        E.RestartRequested: (S.STARTING, ("Launch",)),
        E.StopSentinelAppeared: (S.STOPPED, ()),
        E.StopSentinelRemoved: (S.STOPPED, ()),
        E.FleetFrozen: (S.STOPPED, ()),  # the freeze changes no state by itself
        E.FleetThawed: (S.STOPPED, ()),
        E.LaunchBegan: (S.STOPPED, ()),
        E.RestartHeld: (S.STOPPED, ()),  # a hold only matters at the next failure
        E.RestartReleased: (S.STOPPED, ()),
        E.StatusRechecked: (S.STOPPED, ()),  # the same stamp: nothing new
        E.RewardProbeAnswered: (S.STOPPED, ()),  # probes off: none was asked for
        E.Relocated: (S.STOPPED, ()),
        E.Quarantined: (S.STOPPED, ()),
        E.AgentStarted: (S.STOPPED, ()),
        E.UsageMeasured: (S.STOPPED, ()),  # shown, never judged
    },
}

CASES = [
    pytest.param(name, event_type, id=f"{name}-{event_type.__name__}")
    for name in EXPECTED
    for event_type in h.EVENT_TYPES
]


def test_scenarios_reach_the_states_they_are_named_for() -> None:
    """Each scenario really is in the state its name says, so the table covers every state."""
    for name, scenario in SCENARIOS.items():
        assert scenario.host.state == S(name.split(":")[0]), name
    assert {s.host.state for s in SCENARIOS.values()} == set(S)


def test_table_covers_every_event_type_for_every_scenario() -> None:
    """No (scenario, event type) pair is left out of the expectations."""
    for name, row in EXPECTED.items():
        assert set(row) == set(h.EVENT_TYPES), name


@pytest.mark.parametrize(("name", "event_type"), CASES)
def test_transition(name: str, event_type: type[h.Event]) -> None:
    """The event moves the scenario's host to the expected state with the expected actions."""
    scenario = SCENARIOS[name]
    event = EVENTS[event_type](scenario.host)
    deadline = scenario.host.deadline_at
    now = (
        max(scenario.now + 0.5, deadline)
        if event_type is h.DeadlinePassed and deadline
        else (scenario.now + 0.5)
    )
    host, actions = h.step(scenario.host, event, now, POLICY)
    expected_state, expected_actions = EXPECTED[name][event_type]
    remote = tuple(type(a).__name__ for a in actions if not isinstance(a, h.StateChanged))
    assert (host.state, remote) == (expected_state, expected_actions)
    _assert_state_changes_chain(scenario.host.state, host.state, actions)


def _assert_state_changes_chain(before: S, after: S, actions: list[h.Action]) -> None:
    """StateChanged actions form an unbroken chain from ``before`` to ``after``."""
    changes = [a for a in actions if isinstance(a, h.StateChanged)]
    state = before
    for change in changes:
        assert change.from_ == state and change.to != state and change.reason
        state = change.to
    assert state == after
