"""A fleet frozen by a common-mode stall must stay frozen until heartbeats really return."""

from __future__ import annotations

import signal

import pytest

from tests.faults.harness import (
    HEALTH,
    FaultRun,
    events,
    hold_for,
    kill,
    pid_of,
    wait_event,
    wall,
)
from tests.faults.test_worker_faults import wait_ready_pid

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

# Log timestamps are taken a little after the core's clock reading; never by more than this.
LOG_SLACK_S = 0.25


async def test_a_real_exit_inside_a_frozen_fleet_does_not_thaw_it(fault_run: FaultRun) -> None:
    """Two of three workers stall together and freeze the fleet; one of them then really
    dies: it is replaced at once, but the fleet thaws only when the replacement beats, and
    the other stalled worker gets a full stale threshold from the thaw before it is
    replaced (never beside itself)."""
    fault_run.write(fault_run.raw(3))
    daemon = await fault_run.start(ready=3)
    status = await daemon.status()
    dead, stalled = pid_of(status, "worker-0"), pid_of(status, "worker-1")
    kill(dead, signal.SIGSTOP)
    kill(stalled, signal.SIGSTOP)
    try:
        frozen = await wait_event(daemon, "fleet.frozen")
        assert sorted(frozen["hosts"]) == ["worker-0", "worker-1"]

        def held() -> None:
            """Frozen: nothing terminated or launched."""
            assert events(daemon, "host.terminate") == []
            assert events(daemon, "fleet.thawed") == []

        # Both are now silent for longer than the stale threshold.
        await hold_for(float(HEALTH["heartbeat_stale_s"]) + 0.5, held)
        mark = len(daemon.lines)
        kill(dead, signal.SIGKILL)  # a stopped process dies of SIGKILL all the same
        await wait_ready_pid(daemon, "worker-0", other_than=dead)
        launched = await wait_event(daemon, "host.launched", host="worker-0", after=mark)
        thawed = await wait_event(daemon, "fleet.thawed", after=mark)
        lines = daemon.lines
        assert lines.index(thawed) > lines.index(launched), "thawed before the new worker beat"
        assert thawed["reason"] == "heartbeats returned (1 of 2 stalled hosts beating again)"

        terminate = await wait_event(daemon, "host.terminate", host="worker-1", after=mark)
        assert terminate["pid"] == stalled
        waited = wall(terminate) - wall(thawed)
        assert waited >= float(HEALTH["heartbeat_stale_s"]) - LOG_SLACK_S, waited
        await wait_ready_pid(daemon, "worker-1", other_than=stalled)
    finally:
        kill(stalled, signal.SIGCONT)
