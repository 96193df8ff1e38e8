"""Workers that die or hang: each is noticed, confirmed dead and replaced, never doubled."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from supervisor import control
from tests.faults.harness import (
    READY_S,
    FaultRun,
    Workload,
    events,
    host_row,
    kill,
    pid_of,
    wall,
)
from tests.system.daemonproc import DaemonProcess, all_ready, pid_alive, poll_until

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]


async def wait_ready_pid(daemon: DaemonProcess, host: str, other_than: int) -> int:
    """The pid of the first ``ready`` transition of ``host`` to another pid than ``other_than``,
    after the last state change that still named ``other_than``."""
    found: list[int] = []

    def seen() -> bool:
        """A ready transition to a new pid has been logged."""
        changes = events(daemon, "host.state", host=host)
        last_old = max((i for i, c in enumerate(changes) if c.get("pid") == other_than), default=-1)
        for line in changes[last_old + 1 :]:
            if line["to"] == "ready" and isinstance(line.get("pid"), int):
                found.append(line["pid"])
                return True
        return False

    await daemon.wait_until(seen, READY_S, f"{host} ready with a new pid")
    return found[0]


async def test_killed_worker_is_replaced_at_once_and_no_task_is_lost(
    fault_run: FaultRun,
) -> None:
    """kill -9 of a busy worker: its exit record (not a heartbeat timeout) makes the host stale,
    one new worker replaces it, the other host is untouched, and every task gets its result."""
    fault_run.write(fault_run.raw(2, env={"REWARD_WORKER_TASK_DELAY_S": "0.002"}))
    daemon = await fault_run.start(ready=2)
    before = await daemon.status()
    victim, bystander = pid_of(before, "worker-0"), pid_of(before, "worker-1")
    work = Workload(fault_run.root, shards=2, total=2000, duration_s=3.0).start()
    try:
        await poll_until(lambda: len(work.results()) >= 300, READY_S, "tasks in flight")
        killed_at = time.monotonic()
        kill(victim)
        stale = await daemon.wait_log("host.state", host="worker-0", to="stale")
        fault_run.recovered("kill -9: exit noticed", killed_at)
        assert stale["reason"] == "killed by signal 9 (SIGKILL)"
        replacement = await wait_ready_pid(daemon, "worker-0", other_than=victim)
        fault_run.recovered("kill -9: replacement ready", killed_at)
        await work.wait_done()
    finally:
        work.close()
    work.assert_all_done_once()
    status = await daemon.status()
    assert pid_of(status, "worker-0") == replacement
    assert host_row(status, "worker-0")["restarts"] == 1
    assert pid_of(status, "worker-1") == bystander
    assert [e["to"] for e in events(daemon, "host.state", host="worker-1")] == ["ready"]
    assert fault_run.monitor.pids_seen(0) == [victim, replacement]


@pytest.mark.parametrize(
    ("fault", "reason", "code"),
    [
        ("crash:after=1:code=3", "exited with code 3", 3),
        ("exit0:after=1", "exited with code 0 (unexpected)", 0),
    ],
    ids=["non-zero", "zero"],
)
async def test_worker_exit_is_reported_with_its_code_and_replaced(
    fault_run: FaultRun, fault: str, reason: str, code: int
) -> None:
    """A worker that exits by itself, with an error code or an unexpected 0, is seen dead with
    its code (from the agent's push or the shepherd's exit record, whichever comes first) and
    replaced by exactly one new worker."""
    fault_run.write(fault_run.raw(1, env={"REWARD_WORKER_FAULT": fault}))
    daemon = await fault_run.start(ready=1)
    first = pid_of(await daemon.status(), "worker-0")
    stale = await daemon.wait_log("host.state", host="worker-0", to="stale")
    assert stale["reason"] == reason
    exit_record = fault_run.root / "ctl" / "worker-0.exit.json"
    # The agent's push can come before the shepherd has written the record.
    await poll_until(exit_record.exists, READY_S, "the exit record")
    record = json.loads(exit_record.read_text())
    second = await wait_ready_pid(daemon, "worker-0", other_than=first)
    if record["pid"] == first:  # the replacement may already have crashed in turn
        assert (record["exit_code"], record["signal"]) == (code, None)
        ready = events(daemon, "host.state", host="worker-0", to="ready", pid=second)[0]
        fault_run.record(f"{fault}: exit noticed", wall(stale) - record["exited_at"])
        fault_run.record(f"{fault}: replacement ready", wall(ready) - record["exited_at"])
    # The monitor's latest scan can predate the replacement: look after two more.
    taken = fault_run.monitor.samples
    await daemon.wait_until(
        lambda: fault_run.monitor.samples >= taken + 2, READY_S, "two fresh monitor samples"
    )
    assert fault_run.monitor.pids_seen(0)[:2] == [first, second]
    assert not pid_alive(first)


@pytest.mark.parametrize(("restart_stop", "outcome"), [("kill", "killed"), ("drain", "terminated")])
async def test_stopped_worker_is_terminated_then_replaced(
    fault_run: FaultRun, restart_stop: str, outcome: str
) -> None:
    """SIGSTOP: the heartbeat goes stale, the stopped worker is killed at once (the default:
    a drain would end in ``ready: false``) or, with restart_stop = "drain", continued and
    terminated (it exits on SIGTERM); only once it is confirmed dead does its replacement
    start."""
    fault_run.write(fault_run.raw(1, health={"restart_stop": restart_stop}))
    daemon = await fault_run.start(ready=1)
    hung = pid_of(await daemon.status(), "worker-0")
    stopped_at = time.monotonic()
    kill(hung, signal.SIGSTOP)
    stale = await daemon.wait_log("host.state", host="worker-0", to="stale")
    fault_run.recovered("SIGSTOP: stale (heartbeat_stale_s=3)", stopped_at)
    assert stale["reason"].startswith("heartbeat stale"), stale
    terminated = await daemon.wait_log("remote.terminated", host="worker-0", pid=hung)
    assert terminated["outcome"] == outcome
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=hung)
    fault_run.recovered("SIGSTOP: replacement ready", stopped_at)
    assert not pid_alive(hung)
    assert fault_run.monitor.pids_seen(0) == [hung, replacement]
    launches = events(daemon, "host.launch", host="worker-0")
    assert len(launches) == 2, launches


async def test_worker_ignoring_sigterm_is_killed_after_grace_when_allowed(
    fault_run: FaultRun,
) -> None:
    """kill_after_grace = true: a hung worker that ignores SIGTERM is SIGKILLed after
    stop_grace_s, and replaced."""
    fault_run.write(
        fault_run.raw(
            1,
            env={"REWARD_WORKER_FAULT": "hang_ignore_term:after=0.5"},
            health={"kill_after_grace": True, "stop_grace_s": 1.0},
        )
    )
    daemon = await fault_run.start(ready=1)
    hung = pid_of(await daemon.status(), "worker-0")
    terminated = await daemon.wait_log("remote.terminated", host="worker-0", pid=hung)
    assert terminated["outcome"] == "killed"
    replacement = await wait_ready_pid(daemon, "worker-0", other_than=hung)
    stale = events(daemon, "host.state", host="worker-0", to="stale")[0]
    ready = events(daemon, "host.state", host="worker-0", to="ready", pid=replacement)[0]
    fault_run.record(
        "ignores SIGTERM: stale -> replacement ready (grace 1 s)", wall(ready) - wall(stale)
    )
    assert not pid_alive(hung)
    assert fault_run.monitor.pids_seen(0)[:2] == [hung, replacement]


async def test_worker_ignoring_sigterm_is_reported_and_never_doubled_without_kill(
    fault_run: FaultRun,
) -> None:
    """kill_after_grace = false, replacing by a drain: terminating a worker that ignores
    SIGTERM fails, is retried and reported, and no second worker is ever started beside it;
    an operator's stop-host and kill -9 then end it and nothing replaces it."""
    fault_run.write(
        fault_run.raw(
            1,
            env={"REWARD_WORKER_FAULT": "hang_ignore_term:after=0.5"},
            health={"kill_after_grace": False, "stop_grace_s": 1.0, "restart_stop": "drain"},
        )
    )
    daemon = await fault_run.start(ready=1)
    hung = pid_of(await daemon.status(), "worker-0")

    def failures() -> list[dict[str, Any]]:
        """Failed terminates of the hung worker so far."""
        return events(daemon, "host.terminate_failed", host="worker-0", pid=hung)

    await daemon.wait_until(lambda: len(failures()) >= 3, READY_S, "3 failed terminates")
    assert "kill_after_grace=false" in failures()[0]["reason"]
    status = await daemon.status()
    assert host_row(status, "worker-0")["state"] == "stale"
    assert pid_of(status, "worker-0") == hung
    assert pid_alive(hung)
    assert fault_run.monitor.pids_seen(0) == [hung]
    assert len(events(daemon, "host.launch", host="worker-0")) == 1

    await control.request(daemon.socket, "stop-host", host="worker-0")
    await daemon.wait_log("host.state", host="worker-0", to="stopping")
    kill(hung)
    await daemon.wait_log("host.state", host="worker-0", to="stopped")
    status = await daemon.status()
    assert not all_ready(status)
    assert fault_run.monitor.pids_seen(0) == [hung]
    assert len(events(daemon, "host.launch", host="worker-0")) == 1
