"""Named end-to-end stories of one host: adoption, sentinels, refusals, odd answers."""

from __future__ import annotations

from supervisor import health as h
from supervisor.health import HostState as S
from tests.unit.freshread import step_answering

POLICY = h.Policy(heartbeat_stale_s=10, ready_timeout_s=20, restart_cooldown_s=5)


def run(host: h.Host, *steps: tuple[h.Event, float]) -> tuple[h.Host, list[h.Action]]:
    """Feed the events in order; return the host and every action emitted."""
    actions: list[h.Action] = []
    for event, now in steps:
        host, more = step_answering(host, event, now, POLICY)
        actions += more
    return host, actions


def remote(actions: list[h.Action]) -> list[h.Action]:
    """The actions that are not state-change notes."""
    return [a for a in actions if not isinstance(a, h.StateChanged)]


def beat(pid: int, stamp: float, ready: bool = True) -> h.HeartbeatSeen:
    """A heartbeat of ``pid`` with the worker's stamp."""
    return h.HeartbeatSeen(pid=pid, ready=ready, remote_heartbeat_at=stamp)


def test_daemon_restart_adopts_a_running_worker_found_by_the_probe() -> None:
    """Probe finds pid 7; once its heartbeat changes, the host is ready with no launch."""
    host, actions = run(
        h.new_host("w", 0.0),
        (beat(7, 100.0), 0.0),  # baseline read at start-up
        (h.SshRestored(), 0.1),
        (h.ProbeResult(pid=7), 0.2),
    )
    assert host.state is S.STARTING and host.pid == 7 and host.cause_code is None
    host, more = run(host, (beat(7, 101.0), 1.0))
    assert host.state is S.READY and host.pid == 7
    assert not [a for a in actions + more if isinstance(a, h.Launch | h.Terminate)]


def test_probe_answer_after_heartbeats_already_changed_adopts_at_once() -> None:
    """If the worker's heartbeat changed before the probe answered, adoption is immediate."""
    host, _ = run(
        h.new_host("w", 0.0),
        (beat(7, 100.0), 0.0),
        (beat(7, 101.0), 0.5),  # changing: taken as the candidate while SSH is down
    )
    assert host.state is S.READY and host.pid == 7 and host.needs_probe
    host, actions = run(host, (h.SshRestored(), 1.0))
    assert remote(actions) == [h.Probe(pid=7)]
    host, actions = run(host, (h.ProbeResult(pid=7), 1.1))
    assert host.state is S.READY and not remote(actions)


def test_adopted_worker_that_never_beats_is_replaced_after_ready_timeout() -> None:
    """A probed-alive pid whose heartbeat never changes is terminated, then replaced."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=7), 0.1),
    )
    host, actions = run(host, (h.DeadlinePassed(), 20.1))
    # Replaced, so killed at once (restart_stop "kill"), after its evidence is taken.
    assert host.state is S.STALE and remote(actions) == [
        h.Terminate(pid=7, grace_s=0.0, kill=True, collect_evidence=True)
    ]
    host, actions = run(host, (h.TerminateConfirmed(pid=7), 20.5))
    assert host.state is S.STARTING and [type(a) for a in remote(actions)] == [h.Launch]


def test_probe_in_ready_that_finds_nothing_restarts_the_host() -> None:
    """A heartbeat-adopted pid that the probe says is not ours or not alive is replaced."""
    host, _ = run(h.new_host("w", 0.0), (beat(7, 1.0), 0.0), (beat(7, 2.0), 0.5))
    host, _ = run(host, (h.SshRestored(), 1.0))
    host, actions = run(host, (h.ProbeResult(pid=None), 1.1))
    assert host.state is S.STARTING and [type(a) for a in remote(actions)] == [h.Launch]


def test_probe_in_ready_that_finds_another_pid_switches_to_it() -> None:
    """The probe's pid becomes the host's worker; the old candidate's beats stop counting."""
    host, _ = run(h.new_host("w", 0.0), (beat(7, 1.0), 0.0), (beat(7, 2.0), 0.5))
    host, _ = run(host, (h.SshRestored(), 1.0), (h.ProbeResult(pid=8), 1.1))
    assert host.state is S.READY and host.pid == 8
    host, _ = run(host, (beat(7, 3.0), 2.0), (h.DeadlinePassed(), 10.6))
    assert host.state is S.STALE


def test_a_refused_launch_without_a_holder_pid_probes_first() -> None:
    """Refused but holder unknown: find out what runs before doing anything else."""
    host, _ = run(h.new_host("w", 0.0), (h.SshRestored(), 0.0), (h.ProbeResult(pid=None), 0.0))
    host, actions = run(host, (h.LaunchRefused(holder_pid=None), 0.1))
    assert host.state is S.STARTING and remote(actions) == [h.Probe(pid=None)]


def test_uncertain_launch_is_probed_and_the_started_worker_adopted() -> None:
    """A launch cut off by a lost connection is not retried blindly: probe, then adopt."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
    )
    host, actions = run(
        host,
        (h.SshLost(reason="connection lost"), 0.5),
        (h.LaunchFailed(reason="connection lost", uncertain=True), 0.5),
    )
    assert host.state is S.STARTING and host.failures == 0 and not remote(actions)
    host, actions = run(host, (h.SshRestored(), 1.0))
    assert remote(actions) == [h.Probe(pid=None)]
    host, actions = run(host, (h.ProbeResult(pid=11), 1.1), (beat(11, 5.0), 1.5))
    assert host.state is S.READY and host.pid == 11
    assert not [a for a in actions if isinstance(a, h.Launch)]


def test_host_added_with_a_stop_sentinel_stops_whatever_runs() -> None:
    """A sentinel present at start-up: probe, terminate the worker found, stay stopped."""
    host = h.new_host("w", 0.0, stop_sentinel=True)
    assert host.state is S.STOPPING
    host, actions = run(host, (h.SshRestored(), 0.0))
    assert remote(actions) == [h.Probe(pid=None)]
    host, actions = run(host, (h.ProbeResult(pid=5), 0.1))
    assert [type(a) for a in remote(actions)] == [h.Terminate]
    host, _ = run(host, (h.TerminateConfirmed(pid=5), 0.2))
    assert host.state is S.STOPPED
    host, actions = run(host, (h.StartRequested(), 1.0))
    assert host.state is S.STOPPED and not actions  # the file wins over a start request
    host, actions = run(host, (h.StopSentinelRemoved(), 2.0))
    assert host.state is S.STARTING and [type(a) for a in remote(actions)] == [h.Launch]


def test_operator_stop_then_sentinel_then_removal_starts_again() -> None:
    """An operator-stopped host adopts the sentinel as its cause; removing the file starts it."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.StopRequested(reason="operator stop"), 0.1),
        (h.Launched(pid=3), 0.2),
        (h.TerminateConfirmed(pid=3), 0.3),
    )
    assert host.state is S.STOPPED and host.stop_cause == "operator"
    host, _ = run(host, (h.StopSentinelAppeared(), 1.0))
    assert host.stop_cause == "sentinel"
    host, _ = run(host, (h.StopSentinelRemoved(), 2.0))
    assert host.state is S.STARTING


def test_shutdown_stop_is_not_undone_by_a_sentinel_removal() -> None:
    """A host stopped for daemon shutdown does not restart when a sentinel comes and goes."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StopRequested(reason="daemon shutdown", cause=h.StopCause.SHUTDOWN), 0.0),
        (h.SshRestored(), 0.1),
        (h.ProbeResult(pid=None), 0.2),
        (h.StopSentinelAppeared(), 1.0),
        (h.StopSentinelRemoved(), 2.0),
    )
    assert host.state is S.STOPPED


def test_worker_reporting_not_ready_too_long_is_restarted() -> None:
    """Ready, then ready:false heartbeats for longer than ready_timeout_s: unhealthy."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=4), 0.1),
        (beat(4, 1.0), 1.0),
    )
    assert host.state is S.READY
    now = 1.0
    for i in range(2, 26):
        now = float(i)
        host, _ = run(host, (beat(4, float(i), ready=False), now), (h.DeadlinePassed(), now))
        if host.state is not S.READY:
            break
    assert host.state is S.STALE and host.cause_code is h.Cause.NOT_READY
    assert now >= 2.0 + POLICY.ready_timeout_s


def test_early_wakeups_in_cooling_down_change_nothing() -> None:
    """A timer that fires before next_restart_at is harmless."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=1), 0.1),
        (h.WorkerExited(pid=1, exit_code=2), 0.2),  # failure 1: immediate restart
        (h.Launched(pid=2), 0.3),
        (h.WorkerExited(pid=2, signal=9), 0.4),  # failure 2: cooldown
    )
    assert host.state is S.COOLING_DOWN and host.next_restart_at == 0.4 + 5
    host, actions = run(host, (h.DeadlinePassed(), 1.0), (h.DeadlinePassed(), 2.0))
    assert host.state is S.COOLING_DOWN and not actions
    assert host.cause_code is h.Cause.KILLED and host.next_restart_at == 0.4 + 5


def test_operator_start_gives_a_surviving_worker_a_chance() -> None:
    """A worker that survived a failed terminate is watched again, not replaced blindly."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=6), 0.0),
        (h.StopRequested(reason="operator stop"), 0.1),
        (h.TerminateFailed(pid=6, reason="still alive after 60s"), 61.0),
    )
    assert host.state is S.STOPPING and host.pid == 6
    host, actions = run(host, (h.StartRequested(), 62.0))
    assert host.state is S.STARTING and host.found_running and not remote(actions)
    host, _ = run(host, (beat(6, 1.0), 62.5), (beat(6, 2.0), 63.0))
    assert host.state is S.READY


def test_exit_descriptions_name_code_or_signal() -> None:
    """Exit reasons in logs say what happened in words an operator reads."""
    assert h.describe_exit(h.WorkerExited(pid=1, exit_code=0)) == "exited with code 0 (unexpected)"
    assert h.describe_exit(h.WorkerExited(pid=1, exit_code=3)) == "exited with code 3"
    assert h.describe_exit(h.WorkerExited(pid=1, signal=9)) == "killed by signal 9 (SIGKILL)"
    assert h.describe_exit(h.WorkerExited(pid=1, signal=64)) == "killed by signal 64"
    assert h.describe_exit(h.WorkerExited(pid=1)) == "exited (how is not known)"


def test_display_helpers_measure_on_our_clock() -> None:
    """Heartbeat age and restarts-in-window come from local monotonic instants."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=1), 0.0),
    )
    assert h.heartbeat_age_s(host, 5.0) is None
    host, _ = run(host, (beat(1, 99999.0), 2.0))
    assert h.heartbeat_age_s(host, 5.0) == 3.0
    assert h.restarts_in_window(host, 5.0, POLICY) == 0
    host, _ = run(host, (h.WorkerExited(pid=1, exit_code=1), 6.0))
    assert h.restarts_in_window(host, 6.0, POLICY) == 1
    assert h.restarts_in_window(host, 6.0 + POLICY.restart_window_s, POLICY) == 0


def test_early_wakeups_in_ready_change_nothing() -> None:
    """A timer that fires before the heartbeat deadline leaves a ready host alone."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=1), 0.0),
        (beat(1, 1.0), 1.0),
    )
    host, actions = run(host, (h.DeadlinePassed(), 5.0), (h.DeadlinePassed(), 10.9))
    assert host.state is S.READY
    assert not actions
    assert host.deadline_at == 11.0


def test_restored_backoff_defers_the_launch_after_a_daemon_restart() -> None:
    """A daemon restarted mid-cooldown keeps waiting instead of launching at once."""
    history = h.History(failures=3, restarts=2, next_restart_at=50.0, cause="exited with code 1")
    host = h.new_host("w", 10.0, history=history)
    host, actions = run(host, (h.SshRestored(), 10.0), (h.ProbeResult(pid=None), 10.1))
    assert host.state is S.COOLING_DOWN
    assert not [a for a in actions if isinstance(a, h.Launch)]
    host, actions = run(host, (h.DeadlinePassed(), 50.0))
    assert [type(a) for a in remote(actions)] == [h.Launch]
    assert host.restarts == 3


def test_restored_failed_host_stays_failed_until_an_operator_acts() -> None:
    """A host that had given up before the daemon restarted does not launch on its own."""
    history = h.History(failures=5, restarts=3, failed="gave up after 3 restarts")
    host = h.new_host("w", 0.0, history=history)
    assert host.state is S.FAILED
    host, actions = run(host, (h.SshRestored(), 0.0), (h.ProbeResult(pid=None), 0.1))
    assert host.state is S.FAILED
    assert not [a for a in actions if isinstance(a, h.Launch)]
    assert h.history_of(host).failed == "gave up after 3 restarts"
    before = host
    host, actions = run(host, (h.StartRequested(), 1.0))
    assert host.state is S.STARTING
    assert h.history_of(host).failures == 0
    assert h.history_of(host).failed is None
    # Leaving failed is a change of history the shell must save, and staying is none.
    assert h.history_changed(before, host)
    assert not h.history_changed(before, before)


def test_with_auto_restart_off_a_failure_is_final() -> None:
    """The seed's --no-respawn: a dead worker is reported, not replaced."""
    policy = h.Policy(auto_restart=False)
    host = h.new_host("w", 0.0)
    for event in (h.SshRestored(), h.ProbeResult(pid=None), h.Launched(pid=1)):
        host, _ = h.step(host, event, 0.0, policy)
    host, actions = h.step(host, h.WorkerExited(pid=1, exit_code=1), 1.0, policy)
    assert host.state is S.FAILED and host.cause_code is h.Cause.EXITED
    assert host.restart_is_automatic and host.next_restart_at is None
    assert not remote(actions)


def ready_host(pid: int = 1) -> h.Host:
    """A host whose worker ``pid`` is ready at t=1."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=pid), 0.0),
        (beat(pid, 1.0), 1.0),
    )
    assert host.state is S.READY
    return host


def test_a_frozen_fleet_holds_restarts_for_silence_until_it_thaws() -> None:
    """Frozen: a silent heartbeat causes nothing (no timer even); thawed: the host still
    silent gets a full stale threshold from the thaw, then is stale and terminated."""
    host, actions = run(ready_host(), (h.FleetFrozen(reason="18/20 silent"), 5.0))
    assert host.deadline_at is None
    host, actions = run(host, (h.DeadlinePassed(), 100.0))
    assert host.state is S.READY
    assert not actions
    host, actions = run(host, (h.FleetThawed(), 101.0))
    assert host.state is S.READY
    assert not actions
    assert host.deadline_at == 101.0 + POLICY.heartbeat_stale_s
    host, actions = run(host, (h.DeadlinePassed(), 101.0 + POLICY.heartbeat_stale_s))
    assert host.state is S.STALE
    # The silence is confirmed by a fresh read of the file first (health rule 10).
    assert [type(a) for a in remote(actions)] == [h.RecheckStatus, h.Terminate]


def test_a_host_that_beats_soon_after_a_thaw_is_kept() -> None:
    """A worker that resumes a moment after the fleet thaws (its NFS client was slower to
    recover) is never restarted, however old its last heartbeat before the outage."""
    host, _ = run(ready_host(), (h.FleetFrozen(reason="18/20 silent"), 5.0))
    host, _ = run(host, (h.FleetThawed(), 101.0))
    host, actions = run(host, (beat(1, 102.0), 102.0), (h.DeadlinePassed(), 111.0))
    assert host.state is S.READY
    assert not remote(actions)
    assert host.restarts == 0


def test_a_thaw_without_a_freeze_changes_no_clock() -> None:
    """A thaw a host never froze for (it joined during the freeze) restarts no timer."""
    host = ready_host()
    before = host.deadline_at
    host, actions = run(host, (h.FleetThawed(), 3.0))
    assert host.thawed_at is None
    assert host.deadline_at == before
    assert not actions


def test_a_frozen_fleet_still_replaces_a_worker_that_exited() -> None:
    """An observed crash is a real failure whatever the rest of the fleet does."""
    host, _ = run(ready_host(), (h.FleetFrozen(reason="silent"), 5.0))
    host, actions = run(host, (h.WorkerExited(pid=1, exit_code=1), 6.0))
    assert host.state is S.STARTING
    assert [type(a) for a in remote(actions)] == [h.Launch]


def test_a_stale_worker_is_not_terminated_while_frozen() -> None:
    """A host that went stale with SSH down waits, frozen, instead of being terminated."""
    host, _ = run(ready_host(), (h.SshLost(reason="eof"), 2.0), (h.DeadlinePassed(), 11.0))
    assert host.state is S.STALE
    host, actions = run(host, (h.FleetFrozen(reason="silent"), 11.5), (h.SshRestored(), 12.0))
    assert not remote(actions)
    host, actions = run(host, (h.FleetThawed(), 13.0))
    assert [type(a) for a in remote(actions)] == [h.Terminate]


def test_a_starting_worker_is_not_failed_while_frozen() -> None:
    """A new worker cannot report ready through a stalled filesystem: no ready timeout."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=3), 0.1),
        (h.FleetFrozen(reason="silent"), 1.0),
    )
    host, actions = run(host, (h.DeadlinePassed(), 50.0))
    assert host.state is S.STARTING
    assert not actions
    host, _ = run(host, (h.FleetThawed(), 51.0))
    assert host.state is S.STARTING  # its model load stalled too: the full time from now
    assert host.deadline_at == 51.0 + POLICY.ready_timeout_s
    host, _ = run(host, (h.DeadlinePassed(), 51.0 + POLICY.ready_timeout_s))
    assert host.state is S.STALE


def test_readiness_is_timed_from_when_a_queued_launch_began() -> None:
    """A launch that waited in the fleet's queue gets its full ready_timeout_s."""
    host, _ = run(h.new_host("w", 0.0), (h.SshRestored(), 0.0), (h.ProbeResult(pid=None), 0.0))
    assert host.deadline_at == 20.0
    host, _ = run(host, (h.LaunchBegan(), 15.0))
    assert host.deadline_at == 35.0
    host, _ = run(host, (h.Launched(pid=4), 15.2), (h.DeadlinePassed(), 30.0))
    assert host.state is S.STARTING


def test_a_failed_terminate_is_retried_after_the_cooldown() -> None:
    """A worker that survives its terminate is tried again once restart_cooldown_s has
    passed, not before, and never replaced while it may be alive."""
    host, actions = run(ready_host(), (h.DeadlinePassed(), 11.0))
    assert host.state is S.STALE
    assert [type(a) for a in remote(actions)] == [h.RecheckStatus, h.Terminate]
    host, actions = run(host, (h.TerminateFailed(pid=1, reason="still alive after 5s"), 16.0))
    assert not remote(actions)
    assert host.deadline_at == 16.0 + POLICY.restart_cooldown_s
    host, actions = run(host, (h.DeadlinePassed(), 18.0))
    assert not remote(actions)  # too early: the wait is not over
    host, actions = run(host, (h.DeadlinePassed(), 21.0))
    assert [type(a) for a in remote(actions)] == [h.Terminate]
    assert host.op_retry_at is None


def test_a_heartbeat_a_cache_hid_is_found_by_the_fresh_read_and_saves_the_worker() -> None:
    """At the stale deadline the core asks for a fresh read instead of a verdict; the read
    finds a newer stamp (an NFS attribute cache had shown the old one): no restart, and the
    next deadline is a full stale limit after the read."""
    host = ready_host()
    host, actions = h.step(host, h.DeadlinePassed(), 11.0, POLICY)
    assert host.state is S.READY and actions == [h.RecheckStatus()]
    assert host.deadline_at == 11.0 + h.RECHECK_TIMEOUT_S
    seen = h.StatusRechecked(beat=beat(1, 9.5))
    host, actions = h.step(host, seen, 11.2, POLICY)
    assert host.state is S.READY and not actions
    assert host.recheck_at is None and host.deadline_at == 11.2 + POLICY.heartbeat_stale_s


def test_a_fresh_read_that_never_answers_gives_the_verdict_at_its_timeout() -> None:
    """A read that does not come back within RECHECK_TIMEOUT_S holds the verdict no longer:
    a hung worker is still replaced, two seconds later at most."""
    host = ready_host()
    host, _ = h.step(host, h.DeadlinePassed(), 11.0, POLICY)
    host, actions = h.step(host, h.DeadlinePassed(), 12.0, POLICY)
    assert host.state is S.READY and not actions  # early wake-up: still waiting
    host, actions = h.step(host, h.DeadlinePassed(), 11.0 + h.RECHECK_TIMEOUT_S, POLICY)
    assert host.state is S.STALE and host.cause_code is h.Cause.HEARTBEAT_STALE
    assert [type(a) for a in actions if not isinstance(a, h.StateChanged)] == [h.Terminate]


def test_a_beat_that_comes_while_the_read_is_pending_ends_the_silence() -> None:
    """The worker's next heartbeat arrives before the fresh read answers: no verdict, and
    the late answer (the same stamp, read meanwhile) changes nothing."""
    host = ready_host()
    host, _ = h.step(host, h.DeadlinePassed(), 11.0, POLICY)
    host, actions = h.step(host, beat(1, 9.0), 11.1, POLICY)
    assert host.state is S.READY and not actions and host.recheck_at is None
    host, actions = h.step(host, h.StatusRechecked(beat=beat(1, 9.0)), 11.3, POLICY)
    assert host.state is S.READY and not actions


def test_a_fresh_read_that_failed_gives_the_verdict_at_once() -> None:
    """The read could not be made (StatusRechecked without a beat): nothing new was seen,
    so the silence stands."""
    host = ready_host()
    host, _ = h.step(host, h.DeadlinePassed(), 11.0, POLICY)
    host, _ = h.step(host, h.StatusRechecked(beat=None), 11.5, POLICY)
    assert host.state is S.STALE and host.cause_code is h.Cause.HEARTBEAT_STALE


def test_an_operator_restart_is_no_fault_and_is_counted_as_planned() -> None:
    """restart-host replaces a healthy worker: its changes are not faults, its launch says who
    asked, and it counts as a planned restart, never as an automatic one."""
    host, actions = run(ready_host(7), (h.RestartRequested(reason="operator restart"), 5.0))
    changes = [a for a in actions if isinstance(a, h.StateChanged)]
    assert [(c.to, c.fault) for c in changes] == [(S.STALE, False)]
    host, actions = run(host, (h.TerminateConfirmed(pid=7), 5.1))
    [launch] = [a for a in actions if isinstance(a, h.Launch)]
    assert (launch.is_restart, launch.planned, launch.cause) == (False, h.Planned.OPERATOR, None)
    assert host.restarts == 0 and host.planned_restarts == ((h.Planned.OPERATOR, 1),)
    assert all(not c.fault for c in actions if isinstance(c, h.StateChanged))


def test_a_reload_s_restart_is_planned_by_the_reload_and_a_crash_is_a_fault() -> None:
    """A reload that changed the worker counts as the reload's planned restart; a worker that
    dies by itself is a fault, restarted automatically and counted so."""
    reload = h.RestartRequested(reason="changed by reload", planned=h.Planned.RELOAD)
    host, _ = run(ready_host(7), (reload, 5.0), (h.TerminateConfirmed(pid=7), 5.1))
    assert host.planned_restarts == ((h.Planned.RELOAD, 1),)
    host, _ = run(host, (h.Launched(pid=8), 5.2), (beat(8, 6.0), 6.0))
    host, actions = run(host, (h.WorkerExited(pid=8, exit_code=1), 100.0))
    changes = [a for a in actions if isinstance(a, h.StateChanged)]
    assert changes and changes[0].fault
    [launch] = [a for a in actions if isinstance(a, h.Launch)]
    assert launch.is_restart and launch.planned is None
    assert host.restarts == 1 and host.planned_restarts == ((h.Planned.RELOAD, 1),)


def test_a_restart_asked_then_stopped_counts_no_planned_restart() -> None:
    """A restart overtaken by a stop, then a start, is not a planned restart."""
    host, _ = run(
        ready_host(7),
        (h.RestartRequested(), 5.0),
        (h.StopRequested(reason="operator"), 5.05),
        (h.TerminateConfirmed(pid=7), 5.1),
        (h.StartRequested(), 6.0),
    )
    assert host.planned_restarts == () and host.planned is None
