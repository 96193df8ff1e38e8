"""Exits pushed by the agent: a crash is acted on at once even where the run directory gives
no file events, the exit record still drives the replacement when the channel is down, and
the two reports of one exit start one worker."""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import (
    READY_S,
    FaultRun,
    events,
    hold_for,
    kill,
    pid_of,
    wait_event,
    wall,
)
from tests.faults.test_worker_faults import wait_ready_pid
from tests.system.daemonproc import DaemonProcess, poll_until

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: The poll interval of a run directory that gives no events (NFS): far longer than a
#: replacement takes, so only the pushed exit can explain a replacement within a second.
SLOW_POLL_S = 30.0
#: "Within a second": generous for a push and a launch on loopback (tens of milliseconds),
#: and a thirtieth of the poll interval.
PUSHED_REPLACEMENT_S = 1.0


def launches_after(daemon: DaemonProcess, host: str, mark: int) -> list[dict[str, object]]:
    """The ``host.launch`` lines of ``host`` logged after line ``mark``."""
    return [
        line
        for line in daemon.lines[mark:]
        if line.get("event") == "host.launch" and line.get("host") == host
    ]


async def test_worker_killed_under_a_30s_poll_is_replaced_within_a_second(
    fault_run: FaultRun,
) -> None:
    """With the status directory polled every 30 s, a kill -9 is pushed by the agent and the
    replacement is launched within a second of the kill (by the daemon's own log clock)."""
    raw = fault_run.raw(
        1,
        health={"heartbeat_stale_s": 2 * SLOW_POLL_S + 1, "ready_timeout_s": 3 * SLOW_POLL_S},
        watch={"mode": "poll", "poll_interval_s": SLOW_POLL_S},
    )
    fault_run.write(raw)
    daemon = await fault_run.start(ready=1)
    victim = pid_of(await daemon.status(), "worker-0")
    mark = len(daemon.lines)
    killed_wall = time.time()
    kill(victim)
    launched = await wait_event(daemon, "host.launched", after=mark, host="worker-0")
    replacement = launched["pid"]
    assert isinstance(replacement, int) and replacement != victim
    took_s = wall(launched) - killed_wall
    fault_run.record("kill -9 under a 30 s poll: replacement launched", took_s)
    assert took_s < PUSHED_REPLACEMENT_S, f"replaced {took_s:.2f}s after the kill"
    pushed = events(daemon, "worker.exit_reported", host="worker-0", pid=victim)
    assert [p["via"] for p in pushed] == ["agent"], "only the agent can have told so soon"
    stale = events(daemon, "host.state", host="worker-0", to="stale")[-1]
    assert stale["reason"] == "killed by signal 9 (SIGKILL)"
    assert len(launches_after(daemon, "worker-0", mark)) == 1
    await poll_until(
        lambda: fault_run.monitor.pids_seen(0) == [victim, replacement],
        READY_S,
        "the monitor to see the replacement, and no other worker",
    )


async def test_exit_while_the_channel_is_down_is_taken_from_the_exit_record(
    fault_run: FaultRun,
) -> None:
    """sshd down (no agent, no push) when the worker is killed: its exit record makes the host
    unhealthy while SSH is still down, and once sshd is back exactly one worker replaces it."""
    fault_run.write(fault_run.raw(1))
    daemon = await fault_run.start(ready=1)
    victim = pid_of(await daemon.status(), "worker-0")
    mark = len(daemon.lines)
    fault_run.openssh.stop()
    try:
        await wait_event(daemon, "ssh.down", after=mark, host="worker-0")
        kill(victim)
        seen = await wait_event(daemon, "worker.exit_reported", after=mark, pid=victim)
        assert seen["via"] == "record"
        unhealthy = await wait_event(daemon, "host.state", after=mark, host="worker-0", to="stale")
        assert unhealthy["reason"] == "killed by signal 9 (SIGKILL)"
        assert not [
            line
            for line in daemon.lines[mark:]
            if line.get("event") == "ssh.up" and line.get("host") == "worker-0"
        ], "the exit was acted on while the channel was down"
        assert launches_after(daemon, "worker-0", mark) == []
    finally:
        fault_run.openssh.start()
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=victim)

    def one_launch() -> None:
        """The one replacement, and no other launch."""
        assert len(launches_after(daemon, "worker-0", mark)) == 1

    await hold_for(2.0, one_launch)
    assert fault_run.monitor.pids_seen(0) == [victim, replacement]


async def test_a_pushed_exit_and_its_record_start_one_worker(fault_run: FaultRun) -> None:
    """Three kills in a row, each told twice (the agent's push and the shepherd's record,
    whichever comes first): each is one restart, one launch, one new worker."""
    fault_run.write(fault_run.raw(1))
    daemon = await fault_run.start(ready=1)
    pids = [pid_of(await daemon.status(), "worker-0")]
    mark = len(daemon.lines)
    for round_ in range(1, 4):
        victim = pids[-1]
        kill(victim)
        for via in ("agent", "record"):
            await daemon.wait_log("worker.exit_reported", host="worker-0", pid=victim, via=via)
        pids.append(await wait_ready_pid(daemon, "worker-0", other_than=victim))

        def counted(round_: int = round_) -> None:
            """One launch per exit so far."""
            assert len(launches_after(daemon, "worker-0", mark)) == round_

        await hold_for(1.0, counted)
    assert fault_run.monitor.pids_seen(0) == pids
