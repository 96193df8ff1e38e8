"""Progress liveness, permanent exits and held restarts: one host's stories (DESIGN §4, and
the worker contract's ``processed`` / ``in_flight``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from supervisor import health as h
from supervisor.health import HostState as S
from tests.unit.freshread import step_answering

#: A worker is replaced the contract's way here (SIGTERM, the grace, then the kill rules),
#: which these stories are about; the default, replacing by an immediate kill, has its own.
POLICY = h.Policy(
    heartbeat_stale_s=10,
    ready_timeout_s=20,
    restart_cooldown_s=5,
    progress_stale_s=300,
    permanent_exit_codes=frozenset({2}),
    restart_stop="drain",
)


def run(
    host: h.Host, *steps: tuple[h.Event, float], policy: h.Policy = POLICY
) -> tuple[h.Host, list[h.Action]]:
    """Feed the events in order; return the host and every action emitted."""
    actions: list[h.Action] = []
    for event, now in steps:
        host, more = step_answering(host, event, now, policy)
        actions += more
    return host, actions


def remote(actions: list[h.Action]) -> list[h.Action]:
    """The actions that are not state-change notes."""
    return [a for a in actions if not isinstance(a, h.StateChanged)]


def beat(
    pid: int, stamp: float, processed: int | None = None, in_flight: int | None = None
) -> h.HeartbeatSeen:
    """A ready heartbeat of ``pid`` with the worker's stamp and progress fields."""
    return h.HeartbeatSeen(
        pid=pid, ready=True, remote_heartbeat_at=stamp, processed=processed, in_flight=in_flight
    )


def ready(pid: int = 7, processed: int | None = 0, in_flight: int | None = 0) -> h.Host:
    """A host whose launched worker ``pid`` is ready at t=1."""
    host, _ = run(
        h.new_host("w", 0.0),
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.0),
        (h.Launched(pid=pid), 0.0),
        (beat(pid, 1.0, processed, in_flight), 1.0),
    )
    assert host.state is S.READY
    return host


def beats(
    host: h.Host,
    start: float,
    end: float,
    progress: Callable[[float], tuple[int | None, int | None]],
    policy: h.Policy = POLICY,
) -> tuple[h.Host, list[h.Action]]:
    """A heartbeat every second from ``start`` to ``end``, with ``progress(t)`` fields."""
    actions: list[h.Action] = []
    t = start
    while t <= end:
        processed, in_flight = progress(t)
        for event in (h.DeadlinePassed(), beat(7, 1000.0 + t, processed, in_flight)):
            host, more = step_answering(host, event, t, policy)
            actions += more
        t += 1.0
    return host, actions


def test_a_worker_with_work_in_flight_that_finishes_nothing_is_stuck_and_replaced() -> None:
    """Heartbeats keep coming but no task finishes for progress_stale_s: stuck, terminated
    with its evidence asked for, under the same rules as a stale worker."""
    host, actions = beats(ready(), 2.0, 400.0, lambda t: (10 if t >= 50 else int(t) // 5, 4))
    stuck = [a for a in actions if isinstance(a, h.StateChanged) and a.to is S.STALE]
    assert len(stuck) == 1
    assert host.cause_code is h.Cause.STUCK
    terminate = [a for a in remote(actions) if isinstance(a, h.Terminate)]
    # Killed after the grace although kill_after_grace is off: the hung call ignores SIGTERM.
    assert terminate == [
        h.Terminate(pid=7, grace_s=POLICY.stop_grace_s, kill=True, collect_evidence=True)
    ]
    assert host.state is S.STALE and host.op == "terminate" and host.quarantine_due == 4


def test_by_default_a_worker_being_replaced_is_killed_at_once_after_its_evidence() -> None:
    """restart_stop = "kill": a stuck or silent worker gets no grace (its drain would end in
    ``ready: false``, failing the trainer's calls); its evidence is still taken first."""
    policy = replace(POLICY, restart_stop="kill")
    stuck, actions = beats(ready(), 2.0, 400.0, lambda t: (0, 1), policy=policy)
    terminate = [a for a in remote(actions) if isinstance(a, h.Terminate)]
    assert terminate == [h.Terminate(pid=7, grace_s=0.0, kill=True, collect_evidence=True)]
    assert stuck.quarantine_due == 1
    host, actions = run(ready(), (h.DeadlinePassed(), 12.0), policy=policy)
    assert host.cause_code is h.Cause.HEARTBEAT_STALE
    assert [a for a in remote(actions) if isinstance(a, h.Terminate)] == [
        h.Terminate(pid=7, grace_s=0.0, kill=True, collect_evidence=True)
    ]


def test_a_stuck_worker_s_tasks_in_flight_are_quarantined_before_its_successor() -> None:
    """A worker replaced for being stuck leaves its tasks in flight due for the quarantine:
    once it is confirmed dead they are quarantined (the core waits for the answer), and only
    then is its successor launched. A silent worker's, and any with the quarantine off, are
    none: the successor is launched at once."""
    stuck, _ = beats(ready(), 2.0, 400.0, lambda t: (0, 3))
    assert stuck.quarantine_due == 3
    dead, actions = run(stuck, (h.TerminateConfirmed(pid=7), 401.0))
    assert remote(actions) == [h.Quarantine(count=3)]
    assert dead.op == "quarantine" and dead.pid is None
    after, actions = run(dead, (h.Quarantined(count=3), 401.5))
    assert [type(a) for a in remote(actions)] == [h.Launch]
    assert after.quarantine_due == 0
    off = replace(POLICY, quarantine_stuck_tasks=False)
    host, _ = beats(ready(), 2.0, 400.0, lambda t: (0, 3), policy=off)
    assert host.quarantine_due == 0
    _, actions = run(host, (h.TerminateConfirmed(pid=7), 401.0), policy=off)
    assert [type(a) for a in remote(actions)] == [h.Launch]
    silent, _ = run(ready(in_flight=3), (h.DeadlinePassed(), 12.0))
    assert silent.quarantine_due == 0


def test_a_quarantine_waits_for_the_stuck_worker_s_death_and_survives_a_stop() -> None:
    """Nothing is quarantined while the stuck worker may live (a failed terminate); a stop
    asked meanwhile still quarantines before the host is stopped; an answer nobody asked
    for changes nothing."""
    stuck, _ = beats(ready(), 2.0, 400.0, lambda t: (0, 2))
    alive, actions = run(stuck, (h.TerminateFailed(pid=7, reason="still alive"), 401.0))
    assert not [a for a in actions if isinstance(a, h.Quarantine)] and alive.pid == 7
    assert run(alive, (h.Quarantined(count=2), 401.2))[0] == replace(
        alive, deadline_at=alive.deadline_at
    )
    stopping, _ = run(alive, (h.StopRequested(reason="operator"), 402.0))
    assert stopping.quarantine_due == 2
    gone, actions = run(stopping, (h.WorkerExited(pid=7, exit_code=0), 403.0))
    assert remote(actions) == [h.Quarantine(count=2)] and gone.state is S.STOPPING
    done, _ = run(gone, (h.Quarantined(count=0), 404.0))
    assert done.state is S.STOPPED and done.quarantine_due == 0


def test_a_stop_still_drains_under_the_kill_restart_mode() -> None:
    """restart_stop only concerns a worker that is replaced: a stop keeps SIGTERM and the
    grace, with kill_after_grace deciding the rest."""
    policy = replace(POLICY, restart_stop="kill")
    host, actions = run(ready(), (h.StopRequested(reason="operator"), 5.0), policy=policy)
    assert host.state is S.STOPPING
    assert [a for a in remote(actions) if isinstance(a, h.Terminate)] == [
        h.Terminate(pid=7, grace_s=POLICY.stop_grace_s, kill=False, collect_evidence=False)
    ]


def test_with_kill_stuck_off_a_stuck_worker_is_only_asked_to_stop() -> None:
    """health.kill_stuck = false: a stuck worker gets SIGTERM and the grace, like any other
    (it is then replaced only if it exits, or with kill_after_grace)."""
    policy = replace(POLICY, kill_stuck=False)
    _, actions = beats(ready(), 2.0, 400.0, lambda t: (0, 1), policy=policy)
    terminate = [a for a in remote(actions) if isinstance(a, h.Terminate)]
    assert terminate == [
        h.Terminate(pid=7, grace_s=POLICY.stop_grace_s, kill=False, collect_evidence=True)
    ]


def test_only_a_stuck_worker_is_killed_without_kill_after_grace() -> None:
    """A worker whose heartbeat went stale is asked to stop and not killed (the contract's
    kill_after_grace = false): it may be a slow disk, and its tasks may still finish."""
    host, actions = run(ready(), (h.DeadlinePassed(), 12.0))
    assert host.cause_code is h.Cause.HEARTBEAT_STALE
    terminate = [a for a in remote(actions) if isinstance(a, h.Terminate)]
    assert [t.kill for t in terminate] == [False]


def test_an_idle_worker_is_never_restarted_for_lack_of_progress() -> None:
    """Nothing in flight means nothing is owed, however long nothing finishes."""
    host, actions = beats(ready(), 2.0, 2000.0, lambda t: (0, 0))
    assert host.state is S.READY and not remote(actions)


def test_a_slow_but_advancing_worker_is_never_restarted() -> None:
    """One task every 200 s with 48 in flight is slow, not stuck."""
    host, actions = beats(ready(), 2.0, 2000.0, lambda t: (int(t) // 200, 48))
    assert host.state is S.READY and not remote(actions)


def test_a_worker_that_reports_no_progress_is_judged_by_its_heartbeat_alone() -> None:
    """Without processed and in_flight no progress is tracked, and none is ever judged."""
    host, actions = beats(
        ready(processed=None, in_flight=None), 2.0, 2000.0, lambda t: (None, None)
    )
    assert host.state is S.READY and not remote(actions)
    assert host.processed is None and host.in_flight is None and host.progress_at is None


def test_stuck_is_not_judged_while_the_fleet_is_frozen_and_is_timed_anew_after_the_thaw() -> None:
    """A common-mode stall holds stuck restarts like silent ones; the clock restarts at the
    thaw."""
    host = ready(processed=5, in_flight=4)
    host, _ = run(host, (h.FleetFrozen(reason="most hosts stalled"), 2.0))
    host, actions = beats(host, 3.0, 600.0, lambda t: (5, 4))
    assert host.state is S.READY and not remote(actions)
    host, _ = run(host, (h.FleetThawed(), 601.0))
    host, actions = beats(host, 602.0, 850.0, lambda t: (5, 4))
    assert host.state is S.READY and not remote(actions)
    host, actions = beats(host, 851.0, 905.0, lambda t: (5, 4))
    assert host.cause_code is h.Cause.STUCK


def test_a_stuck_worker_that_heartbeats_while_cooling_down_recovers_only_by_finishing_a_task() -> (
    None
):
    """In cooling_down its heartbeat alone is not recovery (it beat all along); a finished
    task is."""
    patient = replace(POLICY, restart_cooldown_s=5000)
    host = ready(processed=5, in_flight=4)
    host = replace(host, failures=3)  # a backoff is due: the stuck host waits
    host, _ = beats(host, 2.0, 320.0, lambda t: (5, 4), policy=patient)
    assert host.state is S.COOLING_DOWN and host.cause_code is h.Cause.STUCK
    host, actions = beats(host, 321.0, 330.0, lambda t: (5, 4), policy=patient)
    assert host.state is S.COOLING_DOWN and not remote(actions)
    host, actions = run(host, (beat(7, 5000.0, 6, 3), 331.0), policy=patient)
    # Recovered in place: the same worker, nothing launched or killed.
    assert host.state is S.READY and host.pid == 7 and not remote(actions)


def test_an_exit_with_a_permanent_code_fails_the_host_at_once_with_the_log_s_last_line() -> None:
    """Exit 2 (the policy's permanent code) is failed, not restarted; the reason carries the
    code and the log line that says why."""
    tail = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'x'\n"
    host, actions = run(ready(), (h.WorkerExited(pid=7, exit_code=2, log_tail=tail), 5.0))
    assert host.state is S.FAILED and host.cause_code is h.Cause.EXITED and not remote(actions)
    # What the operator reads is this test's subject: the code and the log's line, in words.
    assert host.reason == (
        "exited with code 2: permanent (health.permanent_exit_codes);"
        " log: ModuleNotFoundError: No module named 'x'"
    )
    assert host.last_log_tail == tail


def test_other_exits_and_signals_restart_as_before() -> None:
    """Exit 1 and a kill by signal 2 are ordinary failures: replaced at once."""
    for exited in (h.WorkerExited(pid=7, exit_code=1), h.WorkerExited(pid=7, signal=2)):
        host, actions = run(ready(), (exited, 5.0))
        assert host.state is S.STARTING and [type(a) for a in remote(actions)] == [h.Launch]


def test_a_held_host_waits_without_a_timer_until_released_then_keeps_its_backoff() -> None:
    """Under a hold a crash waits in cooling_down with no deadline; the release restarts it
    as its backoff says; an operator's restart does not wait for the release."""
    host, _ = run(ready(), (h.RestartHeld(reason="3 hosts crashed the same way"), 2.0))
    host, actions = run(host, (h.WorkerExited(pid=7, exit_code=1), 3.0))
    assert host.state is S.COOLING_DOWN and not remote(actions)
    assert host.cause_code is h.Cause.EXITED and host.held == "3 hosts crashed the same way"
    assert host.deadline_at is None
    host, actions = run(host, (h.DeadlinePassed(), 100.0))
    assert host.state is S.COOLING_DOWN and not remote(actions)
    released, actions = run(host, (h.RestartReleased(), 101.0))
    assert released.state is S.STARTING and [type(a) for a in remote(actions)] == [h.Launch]
    restarted, actions = run(host, (h.RestartRequested(), 101.0))
    assert restarted.state is S.STARTING and restarted.held is None


def test_tasks_per_minute_are_measured_over_at_least_a_minute_of_our_clock() -> None:
    """Rate marks are taken a minute apart on our clock, whatever the worker's stamps say."""
    host, _ = beats(ready(), 2.0, 130.0, lambda t: (int(t) * 2, 4))
    assert host.rate_base is not None and host.rate_mark is not None
    (base_at, base_n), (mark_at, mark_n) = host.rate_base, host.rate_mark
    assert mark_at - base_at >= h.RATE_MARK_S
    assert (mark_n - base_n) / (mark_at - base_at) * 60 == 120.0


def test_a_permanent_exit_without_a_log_line_says_so_without_one() -> None:
    """No log tail (an adopted worker's, or an empty log): the reason names the code alone."""
    for tail in (None, "", "  \n\n"):
        host, _ = run(ready(), (h.WorkerExited(pid=7, exit_code=2, log_tail=tail), 5.0))
        assert host.state is S.FAILED and host.cause_code is h.Cause.EXITED
        # What the operator reads is this test's subject.
        assert host.reason == "exited with code 2: permanent (health.permanent_exit_codes)"


EVIDENCE = h.Evidence(
    pid=7,
    stacks='Thread 0x1 (most recent call first):\n  File "w.py", line 3 in hung\n',
    stacks_via="faulthandler",
    log_tail="worker.ready\n",
    elapsed_s=0.4,
)


def stuck_and_terminating() -> h.Host:
    """A ready worker found stuck at t=305, its terminate (with evidence) in flight."""
    host, _ = beats(ready(), 2.0, 400.0, lambda t: (0, 1))
    assert host.state is S.STALE and host.op == "terminate"
    return host


def test_the_evidence_of_a_terminate_goes_into_the_restart_s_state_change_and_the_host() -> None:
    """The terminate's result brings the evidence: the stale -> starting change that
    announces the replacement carries it, and the host keeps it, with the cause it was
    taken for, for status HOST."""
    host = stuck_and_terminating()
    host, actions = run(
        host,
        (h.TerminateConfirmed(pid=7, evidence=EVIDENCE), 401.0),
        (h.Quarantined(count=1), 401.0),  # its task in flight, before the replacement
    )
    changes = [a for a in actions if isinstance(a, h.StateChanged)]
    assert [(c.from_, c.to, c.evidence) for c in changes] == [(S.STALE, S.STARTING, EVIDENCE)]
    assert host.evidence == EVIDENCE and host.evidence_at == 401.0
    assert host.evidence_cause == "stuck: no task finished in 300 s with 1 in flight"
    assert host.last_exit == "confirmed dead" and host.last_exit_at == 401.0
    assert host.last_exit_code is None and host.last_exit_signal is None
    assert host.last_exit_pid == 7


def test_evidence_of_a_failed_terminate_is_kept_though_no_state_changes() -> None:
    """A worker that survives its terminate still leaves its evidence with the host."""
    host = stuck_and_terminating()
    host, actions = run(host, (h.TerminateFailed(pid=7, reason="alive", evidence=EVIDENCE), 401.0))
    assert host.state is S.STALE and host.evidence == EVIDENCE
    assert not [a for a in actions if isinstance(a, h.StateChanged)]


def test_a_late_terminate_result_still_records_its_evidence() -> None:
    """Results for no operation in flight change nothing but what they prove: the evidence."""
    host = ready()
    host, actions = run(host, (h.TerminateFailed(pid=7, reason="late", evidence=EVIDENCE), 5.0))
    assert host.state is S.READY and host.evidence == EVIDENCE and not actions


def test_state_changes_of_other_events_carry_no_evidence() -> None:
    """Only a terminate's result hands evidence on; an exit's change carries none."""
    host, actions = run(ready(), (h.WorkerExited(pid=7, signal=9), 5.0))
    changes = [a for a in actions if isinstance(a, h.StateChanged)]
    assert changes and all(c.evidence is None for c in changes)
    assert (host.last_exit_signal, host.last_exit_code, host.last_exit_at) == (9, None, 5.0)


def test_no_evidence_is_asked_for_when_the_timeout_is_zero() -> None:
    """health.evidence_timeout_s = 0 terminates a stuck worker without capturing anything."""
    policy = replace(POLICY, evidence_timeout_s=0.0)
    _, actions = beats(ready(), 2.0, 400.0, lambda t: (0, 1), policy=policy)
    terminate = [a for a in remote(actions) if isinstance(a, h.Terminate)]
    assert terminate == [
        h.Terminate(pid=7, grace_s=POLICY.stop_grace_s, kill=True, collect_evidence=False)
    ]


def test_tasks_per_minute_need_a_minute_of_reports() -> None:
    """No rate before two marks a minute apart; then the count over their span, per minute."""
    host = ready()
    assert h.tasks_per_minute(host) is None
    host, _ = beats(host, 2.0, 130.0, lambda t: (int(t) * 2, 4))
    rate = h.tasks_per_minute(host)
    assert rate is not None and abs(rate - 120.0) < 1e-6


def areal_beat(
    stamp: float,
    done: int,
    in_flight: int,
    queue: int,
    slots: int = 4,
    verify_ms: float | None = None,
) -> h.HeartbeatSeen:
    """A heartbeat of pid 7 with the AReaL worker's figures: queue depth, slots, and its
    calls' p95 time when given."""
    stats = h.WorkerStats(
        queue_depth=queue, concurrency=slots, completed=done, errors=0, verify_ms_p95=verify_ms
    )
    return h.HeartbeatSeen(
        pid=7,
        ready=True,
        remote_heartbeat_at=stamp,
        processed=done,
        in_flight=in_flight,
        stats=stats,
    )


def _backlogged(
    old_tasks: int | None, verify_ms: float | None = None
) -> tuple[h.Host, list[h.Action]]:
    """A worker that keeps finishing new tasks but leaves two in its inbox with slots free,
    until the core asks for a fresh read (and the shard's old tasks), answered with
    ``old_tasks``."""
    host, actions, t = ready(), [], 2.0
    while t <= 320.0:
        host, more = h.step(host, h.DeadlinePassed(), t, POLICY)
        actions += more
        if any(isinstance(a, h.RecheckStatus) for a in more):
            [ask] = [a for a in more if isinstance(a, h.RecheckStatus)]
            assert ask.tasks_older_than_s == POLICY.progress_stale_s
            beat = areal_beat(1000.0 + t - 1, int(t) - 1, 1, 3, verify_ms=verify_ms)
            answer = h.StatusRechecked(beat=beat, old_tasks=old_tasks)
            host, more = h.step(host, answer, t, POLICY)
            return host, actions + more
        beat = areal_beat(1000.0 + t, int(t), 1, 3, verify_ms=verify_ms)
        host, more = h.step(host, beat, t, POLICY)
        actions += more
        t += 1.0
    raise AssertionError("no recheck asked")


def test_tasks_left_waiting_with_slots_free_make_a_worker_not_taking_and_replaced() -> None:
    """A broken pool's tasks: the worker keeps finishing new tasks (progress) but leaves two
    in its inbox with slots free; after progress_stale_s of that, and the inbox showing
    three old task files for its one in flight, it is replaced, its stacks asked for first,
    nothing quarantined (the tasks were never taken: the successor does them)."""
    host, actions = _backlogged(old_tasks=3)
    assert host.state is S.STALE and host.cause_code is h.Cause.NOT_TAKING
    assert [a for a in remote(actions) if isinstance(a, h.Terminate)] == [
        h.Terminate(pid=7, grace_s=POLICY.stop_grace_s, kill=False, collect_evidence=True)
    ]


def test_a_worker_whose_calls_are_quick_is_not_taking_with_one_old_file_beside_a_new_call() -> None:
    """The broken pool's one abandoned task, and one new call in flight: a worker whose calls
    take 30 ms (p95) has no call in flight as old as the stuck limit, so the old file is one
    it left."""
    host, _ = _backlogged(old_tasks=1, verify_ms=30.0)
    assert host.state is S.STALE and host.cause_code is h.Cause.NOT_TAKING
    slow, _ = _backlogged(old_tasks=1, verify_ms=400_000.0)
    assert slow.state is S.READY  # its call in flight may be that old: not confirmed


@pytest.mark.parametrize("old_tasks", [None, 0, 1])
def test_a_backlog_the_inbox_does_not_confirm_only_starts_the_clock_again(
    old_tasks: int | None,
) -> None:
    """No old task file beyond those in flight (tasks that arrive at every heartbeat look
    like a backlog), or no count at all: no verdict, and the backlog is timed anew."""
    host, actions = _backlogged(old_tasks=old_tasks)
    assert host.state is S.READY and not [a for a in actions if isinstance(a, h.Terminate)]
    # Asked at 302 s (300 s of backlog from 2 s): timed again from there.
    assert host.recheck_at is None and host.backlog_since_at == 302.0


def test_tasks_waiting_while_every_slot_is_busy_are_judged_once_a_slot_is_free() -> None:
    """A broken pool's task waits while new calls keep both slots busy: no verdict while the
    slots are full, and the wait counts from when it began, so once a slot has stayed free
    for SLOT_FREE_CONFIRM_S past the limit the check is asked for."""
    host = ready()
    asked = None
    for t in range(2, 400):
        full = t < 350
        beat = areal_beat(1000.0 + t, t, 4 if full else 1, 5, verify_ms=20.0)
        host, actions = h.step(host, beat, float(t), POLICY)
        host, more = h.step(host, h.DeadlinePassed(), float(t), POLICY)
        if any(isinstance(a, h.RecheckStatus) for a in actions + more):
            asked = t
            break
    assert asked == 350 + h.SLOT_FREE_CONFIRM_S and host.backlog_since_at == 2.0


def test_a_slow_busy_worker_between_two_tasks_is_never_not_taking() -> None:
    """One slot, tasks of 2 s queued for minutes: a heartbeat now and then falls between two
    tasks (a slot free, tasks waiting); the next shows the slot busy again. No fresh read is
    ever asked for, so no verdict can come."""
    host = ready()
    for t in range(2, 400):
        between = t % 3 == 0  # one beat in three lands between two tasks
        beat = areal_beat(1000.0 + t, t // 2, 0 if between else 1, 6, slots=1, verify_ms=2000.0)
        host, actions = h.step(host, beat, float(t), POLICY)
        host, more = h.step(host, h.DeadlinePassed(), float(t) + 0.9, POLICY)
        assert not any(isinstance(a, h.RecheckStatus) for a in actions + more), t
        assert host.state is S.READY, t


def test_a_backlog_that_clears_or_a_full_pool_is_never_not_taking() -> None:
    """Tasks waiting while every slot is busy, or a backlog that clears now and then, are a
    worker at work: never replaced for it."""
    host = ready()
    for t in range(2, 800):
        full = areal_beat(1000.0 + t, t, 4, 9)  # every slot busy: waiting is normal
        clears = areal_beat(1000.0 + t, t, 1, 1 if t % 50 == 0 else 3)
        host, actions = step_answering(host, full if t < 400 else clears, float(t), POLICY)
        assert host.state is S.READY and not remote(actions), t


def test_a_backlog_check_that_never_answers_gives_no_verdict() -> None:
    """The fresh read and count do not come back in time: no task count, no verdict, and
    the backlog is timed anew from then."""
    host, t = ready(), 2.0
    while host.recheck_at is None:
        host, _ = h.step(host, h.DeadlinePassed(), t, POLICY)
        if host.recheck_at is None:
            host, _ = h.step(host, areal_beat(1000.0 + t, int(t), 1, 3), t, POLICY)
            t += 1.0
    late = t + h.RECHECK_TIMEOUT_S
    host, actions = h.step(host, h.DeadlinePassed(), late, POLICY)
    assert host.state is S.READY and not actions and host.backlog_since_at == late


def test_a_backlog_is_timed_anew_after_a_thaw() -> None:
    """Like silence and stuck-ness, tasks left waiting during a freeze count only from the
    thaw (the worker could not see or answer its inbox through a stalled filesystem)."""
    host = ready()
    host, _ = h.step(host, areal_beat(1002.0, 2, 1, 3), 2.0, POLICY)
    assert host.backlog_since_at == 2.0
    host, _ = h.step(host, h.FleetFrozen(reason="stall"), 3.0, POLICY)
    host, _ = h.step(host, h.FleetThawed(), 250.0, POLICY)
    for t in range(251, 560):
        host, actions = h.step(host, h.DeadlinePassed(), float(t), POLICY)
        if any(isinstance(a, h.RecheckStatus) for a in actions):
            assert t == 550  # 300 s after the thaw, not after the backlog began
            break
        host, _ = h.step(host, areal_beat(1000.0 + t, t, 1, 3), float(t), POLICY)
    else:
        raise AssertionError("never judged")


def test_stuck_at_counts_down_only_while_nothing_finishes_and_is_the_cores_own_deadline() -> None:
    """A busy worker whose last heartbeat came with a finished task is counting towards
    nothing; one whose heartbeat came without one is, to the very instant ``step`` calls it
    stuck (a DeadlinePassed there makes it stale)."""
    host, _ = run(ready(processed=5, in_flight=4), (beat(7, 2.0, 6, 4), 2.0))
    assert h.stuck_at(host, POLICY) is None  # a task finished at its last beat: healthy
    host, _ = run(host, (beat(7, 3.0, 6, 4), 3.0))
    deadline = h.stuck_at(host, POLICY)
    assert deadline == 2.0 + POLICY.progress_stale_s
    host, _ = beats(host, 4.0, deadline - 1.0, lambda t: (6, 4))
    assert host.state is S.READY and h.stuck_at(host, POLICY) == deadline
    stuck, _ = run(host, (h.DeadlinePassed(), deadline))
    assert stuck.state is S.STALE and stuck.cause_code is h.Cause.STUCK
    assert h.stuck_at(stuck, POLICY) is None  # not ready: no count is under way


@pytest.mark.parametrize(
    "change",
    [
        {"frozen": True},
        {"in_flight": 0},
        {"progress_at": None},
        {"alive_at": None},
    ],
    ids=["frozen", "nothing in flight", "no progress reported", "no heartbeat"],
)
def test_no_stuck_count_without_work_owed_or_while_frozen(change: dict[str, object]) -> None:
    """A ready worker with nothing in flight, no progress reported, no heartbeat seen, or a
    frozen fleet (whose silence is the filesystem's) has no stuck deadline; nor has any with
    the rule off."""
    host, _ = run(ready(processed=5, in_flight=4), (beat(7, 2.0, 5, 4), 2.0))
    assert h.stuck_at(host, POLICY) is not None
    assert h.stuck_at(replace(host, **change), POLICY) is None  # type: ignore[arg-type]
    assert h.stuck_at(host, replace(POLICY, progress_stale_s=0)) is None


def test_an_exit_without_log_lines_shows_none_not_the_last_exits() -> None:
    """The last exit's log tail is that exit's own: a worker that wrote nothing after one
    that crashed with a traceback leaves no tail, not its predecessor's."""
    tail = "Traceback (most recent call last):\nKeyError: 'x'\n"
    host, _ = run(ready(), (h.WorkerExited(pid=7, exit_code=1, log_tail=tail), 5.0))
    assert host.last_log_tail == tail
    host, _ = run(host, (h.Launched(pid=8), 6.0), (beat(8, 7.0, 0, 0), 7.0))
    host, _ = run(host, (h.WorkerExited(pid=8, signal=9), 8.0))
    assert (host.last_exit_pid, host.last_log_tail) == (8, None)
