"""Reward probes in the per-host core: every (scenario, answer) pair with the state, the
remote actions and the cause expected, worked out from health.py's rule 11; then the timing
of the probes themselves.

Each scenario is reached through ``step`` from ``new_host`` with probes on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from supervisor import health as h
from supervisor.health import Cause
from supervisor.health import HostState as S

POLICY = h.Policy(
    heartbeat_stale_s=10,
    ready_timeout_s=20,
    restart_cooldown_s=5,
    backoff_max_s=40,
    backoff_reset_s=100,
    stop_grace_s=3,
    probe_interval_s=30,
    probe_timeout_s=4,
    probe_task='{"reward_fn":"pkg.mod.fn"}',
    probe_expect=1.0,
)
PID = 100


@dataclass(frozen=True)
class Scenario:
    """A host reached with probes on, the time it was reached at and its last actions."""

    host: h.Host
    now: float
    actions: tuple[h.Action, ...]


def _drive(steps: list[tuple[h.Event, float]], host: h.Host | None = None) -> Scenario:
    """Feed ``steps`` (event, time) to ``host`` (or a new one); the scenario reached."""
    host = host or h.new_host("w-0", 0.0)
    now, actions = 0.0, list[h.Action]()
    for event, now in steps:
        host, actions = h.step(host, event, now, POLICY)
    return Scenario(host, now, tuple(actions))


def _beat(at: float, pid: int = PID) -> h.HeartbeatSeen:
    """A ready heartbeat of ``pid`` whose stamp is new at ``at``."""
    return h.HeartbeatSeen(pid=pid, ready=True, remote_heartbeat_at=5000.0 + at)


def _scored(pid: int = PID) -> h.RewardProbeAnswered:
    """A probe answer of ``pid`` that scored as expected."""
    return h.RewardProbeAnswered(pid=pid, status="ok", score=1.0, round_trip_s=0.1)


ANSWERS: dict[str, h.RewardProbeAnswered] = {
    "scored": _scored(),
    "error": h.RewardProbeAnswered(
        pid=PID, status="error", error="ModuleNotFoundError: No module named 'x'"
    ),
    "wrong": h.RewardProbeAnswered(pid=PID, status="ok", score=0.0, round_trip_s=0.1),
    "no-score": h.RewardProbeAnswered(pid=PID, status="ok", score=None),
    "unanswered": h.RewardProbeAnswered(pid=PID, status=None, error="no result within 4s"),
    "worker-timeout": h.RewardProbeAnswered(pid=PID, status="timeout", error="verify timeout"),
    "older-worker": _scored(pid=99),
}


def _scenarios() -> dict[str, Scenario]:
    """Every named scenario, each reached through step() from new_host."""
    launched = _drive(
        [
            (h.StatusMissing(reason="missing"), 0.0),
            (h.SshRestored(), 0.0),
            (h.ProbeResult(pid=None), 0.05),
            (h.Launched(pid=PID), 0.1),
        ]
    )
    probing = _drive([(_beat(1.0), 1.0)], launched.host)
    ready = _drive(
        [(_scored(), 1.2), (_beat(30.0), 30.0), (h.DeadlinePassed(), 31.0)], probing.host
    )
    frozen = _drive([(h.FleetFrozen(reason="most hosts silent"), 31.1)], ready.host)
    held = _drive(
        [
            (h.RestartHeld(reason="3 hosts failed their reward probe the same way"), 1.1),
            (ANSWERS["error"], 1.2),
            (_beat(30.0), 30.0),  # it heartbeats on, ready: true, all along
            (h.DeadlinePassed(), 31.0),
        ],
        probing.host,
    )
    return {
        "starting:probe in flight": probing,
        "ready:probe in flight": ready,
        "ready:frozen, probe in flight": frozen,
        "cooling_down:held after a failed probe, probe in flight": held,
    }


SCENARIOS = _scenarios()

# scenario -> answer -> (state after, remote actions, cause code of the host after)
EXPECTED: dict[str, dict[str, tuple[S, tuple[str, ...], Cause | None]]] = {
    "starting:probe in flight": {
        "scored": (S.READY, (), None),
        "error": (S.STALE, ("Terminate",), Cause.PROBE_FAILED),
        "wrong": (S.STALE, ("Terminate",), Cause.PROBE_WRONG),
        "no-score": (S.STALE, ("Terminate",), Cause.PROBE_WRONG),
        "unanswered": (S.STALE, ("Terminate",), Cause.PROBE_TIMEOUT),
        "worker-timeout": (S.STALE, ("Terminate",), Cause.PROBE_TIMEOUT),
        # An answer naming another pid proves nothing of this worker.
        "older-worker": (S.STARTING, (), None),
    },
    "ready:probe in flight": {
        "scored": (S.READY, (), None),
        "error": (S.STALE, ("Terminate",), Cause.PROBE_FAILED),
        "wrong": (S.STALE, ("Terminate",), Cause.PROBE_WRONG),
        "no-score": (S.STALE, ("Terminate",), Cause.PROBE_WRONG),
        "unanswered": (S.STALE, ("Terminate",), Cause.PROBE_TIMEOUT),
        "worker-timeout": (S.STALE, ("Terminate",), Cause.PROBE_TIMEOUT),
        "older-worker": (S.READY, (), None),
    },
    "ready:frozen, probe in flight": {
        "scored": (S.READY, (), None),
        # An answer is an answer, frozen or not; only silence is the filesystem's.
        "error": (S.STALE, (), Cause.PROBE_FAILED),  # a live worker: the freeze holds it
        "wrong": (S.STALE, (), Cause.PROBE_WRONG),
        "no-score": (S.STALE, (), Cause.PROBE_WRONG),
        "unanswered": (S.READY, (), None),
        "worker-timeout": (S.READY, (), None),
        "older-worker": (S.READY, (), None),
    },
    "cooling_down:held after a failed probe, probe in flight": {
        "scored": (S.READY, (), Cause.PROBE_FAILED),  # recovered; the last cause is kept
        "error": (S.COOLING_DOWN, (), Cause.PROBE_FAILED),
        "wrong": (S.COOLING_DOWN, (), Cause.PROBE_FAILED),
        "no-score": (S.COOLING_DOWN, (), Cause.PROBE_FAILED),
        "unanswered": (S.COOLING_DOWN, (), Cause.PROBE_FAILED),
        "worker-timeout": (S.COOLING_DOWN, (), Cause.PROBE_FAILED),
        "older-worker": (S.COOLING_DOWN, (), Cause.PROBE_FAILED),
    },
}


def test_scenarios_are_in_their_state_with_a_probe_in_flight() -> None:
    """Each scenario is in the state its name says and waits for a probe's answer."""
    for name, scenario in SCENARIOS.items():
        assert scenario.host.state == S(name.split(":")[0]), name
        assert scenario.host.probe_at is not None, name


def test_table_covers_every_answer_for_every_scenario() -> None:
    """No (scenario, answer) pair is left out of the expectations."""
    for name in SCENARIOS:
        assert set(EXPECTED[name]) == set(ANSWERS), name


@pytest.mark.parametrize(
    ("name", "answer"), [(n, a) for n in EXPECTED for a in ANSWERS], ids=lambda x: str(x)
)
def test_probe_answer(name: str, answer: str) -> None:
    """The answer moves the scenario's host to the expected state, actions and cause."""
    scenario = SCENARIOS[name]
    host, actions = h.step(scenario.host, ANSWERS[answer], scenario.now + 0.5, POLICY)
    remote = tuple(type(a).__name__ for a in actions if not isinstance(a, h.StateChanged))
    state, expected_actions, cause = EXPECTED[name][answer]
    assert (host.state, remote, host.cause_code) == (state, expected_actions, cause)
    assert host.probe_at is None


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_every_answer_to_a_probe_in_flight_is_reported_once_with_the_core_s_verdict(
    answer: str,
) -> None:
    """What a probe found is judged by the core once: its failure code and words (None when
    it scored), whichever worker the answer names; the presenter judges nothing."""
    scenario = SCENARIOS["ready:probe in flight"]
    event = ANSWERS[answer]
    report = h.probe_report(scenario.host, event, POLICY)
    verdict = h.probe_verdict(event, POLICY)
    assert [report] == [
        h.ProbeReport(
            answer=event,
            cause=None if verdict is None else verdict[0],
            error=None if verdict is None else verdict[1],
            busy=False,
        )
    ]
    assert report is not None
    assert (report.cause is None) == (answer in ("scored", "older-worker"))


def test_an_answer_nobody_asked_for_is_not_reported() -> None:
    """A probe answer with no probe in flight is not trusted, and not reported."""
    ready = SCENARIOS["ready:probe in flight"].host
    idle = replace(ready, probe_at=None)
    assert h.probe_report(idle, ANSWERS["scored"], POLICY) is None


def test_a_new_worker_is_probed_at_its_first_heartbeat_and_waits_for_the_score() -> None:
    """The first heartbeat of a launched worker sends a probe (the configured task, the
    timeout) and leaves it starting, saying it waits for the score."""
    scenario = SCENARIOS["starting:probe in flight"]
    assert [a for a in scenario.actions if isinstance(a, h.SendRewardProbe)] == [
        h.SendRewardProbe(pid=PID, task=POLICY.probe_task, timeout_s=POLICY.probe_timeout_s)
    ]
    assert "waiting for its first reward probe" in scenario.host.reason
    again, actions = h.step(scenario.host, _beat(2.0), 2.0, POLICY)
    assert again.state is S.STARTING and actions == []  # one probe at a time


def test_a_ready_worker_is_probed_again_every_interval() -> None:
    """After a score the next probe is due one interval after the last was sent: an early
    timer sends nothing, the timer at the interval sends one, and the deadline says so."""
    probing = SCENARIOS["starting:probe in flight"]
    ready, _ = h.step(probing.host, _scored(), 1.2, POLICY)
    assert ready.state is S.READY
    for t in range(2, 31, 2):
        ready, _ = h.step(ready, _beat(float(t)), float(t), POLICY)
        early, actions = h.step(ready, h.DeadlinePassed(), float(t) + 0.5, POLICY)
        assert actions == [] and early.probe_at is None
    assert ready.deadline_at == 1.0 + POLICY.probe_interval_s  # the probe's, before staleness
    due, actions = h.step(ready, h.DeadlinePassed(), 31.0, POLICY)
    assert [type(a) for a in actions] == [h.SendRewardProbe]
    assert due.probe_at == 31.0


def test_a_probe_failed_worker_does_not_recover_by_heartbeating() -> None:
    """A held worker whose probe failed keeps heartbeating ready: it stays cooling down until
    a probe scores."""
    held = SCENARIOS["cooling_down:held after a failed probe, probe in flight"]
    host, _ = h.step(held.host, _beat(40.0), 40.0, POLICY)
    assert host.state is S.COOLING_DOWN
    host, _ = h.step(host, _scored(), 40.5, POLICY)
    assert host.state is S.READY
    assert host.reason == "recovered: reward probe scored again"


def test_an_answer_nobody_asked_for_changes_nothing() -> None:
    """An answer when no probe is in flight is not trusted: the host is unchanged."""
    ready = SCENARIOS["ready:probe in flight"].host
    idle = replace(ready, probe_at=None)
    host, actions = h.step(idle, ANSWERS["error"], 32.0, POLICY)
    assert (host.state, actions, host.last_probe) == (S.READY, [], ready.last_probe)


def test_the_verdict_names_the_workers_error_and_the_wrong_score() -> None:
    """The reason quotes the worker's error text on one line, and a wrong score with both
    numbers ("alive but wrong")."""
    error = h.RewardProbeAnswered(pid=1, status="error", error="Traceback\nKeyError: 'a'")
    assert h.probe_verdict(error, POLICY) == (
        Cause.PROBE_FAILED,
        "reward probe failed: Traceback KeyError: 'a'",
    )
    wrong = h.RewardProbeAnswered(pid=1, status="ok", score=0.5)
    assert h.probe_verdict(wrong, POLICY) == (
        Cause.PROBE_WRONG,
        "alive but wrong: reward probe scored 0.5, not 1",
    )
    any_score = replace(POLICY, probe_expect=None)
    assert h.probe_verdict(wrong, any_score) is None
    bare = h.RewardProbeAnswered(pid=1, status="crashed")
    assert h.probe_verdict(bare, POLICY) == (Cause.PROBE_FAILED, "reward probe failed: crashed")


def test_probe_failure_is_what_the_fleet_counts() -> None:
    """``probe_failure`` gives the reason only for a failing answer to the current worker's
    probe in starting or ready, and not for silence while frozen."""
    probing = SCENARIOS["starting:probe in flight"].host
    assert h.probe_failure(probing, ANSWERS["error"], POLICY) is not None
    assert h.probe_failure(probing, ANSWERS["scored"], POLICY) is None
    assert h.probe_failure(probing, ANSWERS["older-worker"], POLICY) is None
    frozen = SCENARIOS["ready:frozen, probe in flight"].host
    assert h.probe_failure(frozen, ANSWERS["unanswered"], POLICY) is None
    held = SCENARIOS["cooling_down:held after a failed probe, probe in flight"].host
    assert h.probe_failure(held, ANSWERS["error"], POLICY) is None


def test_an_unanswered_probe_behind_tasks_the_worker_finishes_is_busy_not_broken() -> None:
    """A ready worker whose probe goes unanswered while it finishes tasks sent after the probe
    (it waits in the inbox behind the trainer's backlog) stays ready, the fleet does not count
    it, and the summary says why; the same silence from a worker that finished nothing since
    the probe was sent fails it (probe_timeout)."""
    probing = SCENARIOS["ready:probe in flight"]
    sent_at = probing.host.probe_at
    assert sent_at is not None
    working = replace(probing.host, progress_at=sent_at + 1.0)
    silence = ANSWERS["unanswered"]
    assert h.probe_failure(working, silence, POLICY) is None
    report = h.probe_report(working, silence, POLICY)
    assert report is not None and report.busy and report.cause is None
    host, actions = h.step(working, silence, sent_at + 4.0, POLICY)
    assert host.state is S.READY and actions == []
    assert host.last_probe_busy and "not counted" in (host.last_probe or "")
    idle = replace(probing.host, progress_at=sent_at - 1.0)
    assert h.probe_failure(idle, silence, POLICY) is not None
    failed, _ = h.step(idle, silence, sent_at + 4.0, POLICY)
    assert failed.cause_code is Cause.PROBE_TIMEOUT and not failed.last_probe_busy
    answered = replace(probing.host, progress_at=sent_at + 1.0)
    error, _ = h.step(answered, ANSWERS["error"], sent_at + 2.0, POLICY)
    assert error.cause_code is Cause.PROBE_FAILED  # an answer is judged, busy or not


def test_without_probes_a_heartbeat_alone_makes_a_worker_ready() -> None:
    """With probes off (no [probe] table), nothing is sent and readiness is the heartbeat's."""
    off = replace(POLICY, probe_interval_s=0.0)
    host = h.new_host("w-0", 0.0)
    steps: list[tuple[h.Event, float]] = [
        (h.StatusMissing(reason="missing"), 0.0),
        (h.SshRestored(), 0.0),
        (h.ProbeResult(pid=None), 0.05),
        (h.Launched(pid=PID), 0.1),
    ]
    for event, now in steps:
        host, _ = h.step(host, event, now, off)
    host, actions = h.step(host, _beat(1.0), 1.0, off)
    assert host.state is S.READY
    assert not [a for a in actions if isinstance(a, h.SendRewardProbe)]
