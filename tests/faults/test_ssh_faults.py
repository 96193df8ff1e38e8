"""SSH trouble is not worker trouble: dropped connections, a stopped sshd, silent addresses."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests import ports
from tests.faults.harness import (
    READY_S,
    FaultRun,
    SilentListener,
    Workload,
    events,
    hold_for,
    host_row,
    kill,
    pid_of,
    wait_event,
)
from tests.faults.test_worker_faults import wait_ready_pid
from tests.system.daemonproc import DaemonProcess, pid_alive

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: How long sshd stays down: long enough for ten stale thresholds and dozens of reconnects.
SSHD_OUTAGE_S = 30.0


def acted_on(daemon: DaemonProcess, host: str, since: int = 0) -> list[str]:
    """State changes, launches and terminates of ``host`` logged after line ``since``."""
    kinds = ("host.state", "host.launch", "host.terminate")
    return [
        f"{line['event']} {line.get('to', '')} {line.get('reason', '')}"
        for line in daemon.lines[since:]
        if line.get("event") in kinds and line.get("host") == host
    ]


async def test_dropped_connections_leave_workers_untouched(fault_run: FaultRun) -> None:
    """Killing the host's sshd session, again and again, only reconnects: the worker keeps its
    pid and state, nothing is launched or terminated, and its tasks all complete."""
    fault_run.write(fault_run.raw(2))
    daemon = await fault_run.start(ready=2)
    before = await daemon.status()
    pids = {h: pid_of(before, h) for h in ("worker-0", "worker-1")}
    mark = len(daemon.lines)
    work = Workload(fault_run.root, shards=2, total=1000, duration_s=2.0).start()
    try:
        for drop in range(1, 4):
            dropped_at = time.monotonic()
            assert fault_run.openssh.kill_sessions("127.0.0.1"), "no session to drop"
            await wait_event(daemon, "ssh.up", host="worker-0", count=drop + 1)
            fault_run.recovered("ssh session killed: reconnected", dropped_at)
        await work.wait_done()
    finally:
        work.close()
    work.assert_all_done_once()
    assert len(events(daemon, "ssh.down", host="worker-0")) == 3
    assert events(daemon, "ssh.down", host="worker-1") == []
    status = await daemon.status()
    assert {h: pid_of(status, h) for h in pids} == pids
    assert host_row(status, "worker-0")["ssh"] == "connected"
    assert acted_on(daemon, "worker-0", mark) == []
    assert acted_on(daemon, "worker-1", mark) == []


async def test_connection_dropped_in_the_middle_of_a_launch_never_doubles_the_worker(
    fault_run: FaultRun,
) -> None:
    """The connection is cut right after a launch was sent, three times: whatever the launch's
    fate, one worker runs afterwards, it is known to the daemon, and its death is still
    reported by its exit record rather than by a heartbeat timeout."""
    fault_run.write(fault_run.raw(1))
    daemon = await fault_run.start(ready=1)
    pid = pid_of(await daemon.status(), "worker-0")
    for _round in range(3):
        mark = len(daemon.lines)
        killed_at = time.monotonic()
        kill(pid)
        await wait_event(daemon, "host.launch_begin", host="worker-0", after=mark)
        fault_run.openssh.kill_sessions("127.0.0.1")
        pid = await wait_ready_pid(daemon, "worker-0", other_than=pid)
        fault_run.recovered("kill -9, then ssh cut mid-launch: worker ready", killed_at)
        assert fault_run.monitor.live_on(0) == [pid]
    # The last worker's shepherd must still be watching it: an exit is seen at once.
    mark = len(daemon.lines)
    kill(pid)
    left: list[dict[str, Any]] = []

    def left_ready() -> bool:
        """The host has left ``ready`` since the kill."""
        left[:] = [
            line
            for line in daemon.lines[mark:]
            if line.get("event") == "host.state" and line.get("from") == "ready"
        ]
        return bool(left)

    await daemon.wait_until(left_ready, READY_S, "the killed worker noticed")
    # Stale at once or after a cooldown (the failures add up), from the exit record; or from
    # the answer of a probe still in flight after the last cut (the worker's heartbeat can
    # make it ready before that answer): never from a heartbeat timeout.
    reason = left[0]["reason"]
    assert reason.startswith(("killed by signal 9 (SIGKILL)", "probe found no live worker")), left[
        0
    ]
    # Whichever came first, the shepherd watching the last worker reports its death.
    await wait_event(daemon, "worker.exit_reported", host="worker-0", pid=pid, signal=9, after=mark)
    await wait_ready_pid(daemon, "worker-0", other_than=pid)


async def test_sshd_down_for_30s_keeps_fresh_workers_and_defers_the_stale_one(
    fault_run: FaultRun,
) -> None:
    """sshd stopped for 30 s: a worker whose heartbeat stays fresh is untouched; one that hangs
    meanwhile goes stale but nothing is started beside it until sshd is back, when it is
    terminated and replaced; every task still gets its result."""
    fault_run.write(fault_run.raw(2))
    daemon = await fault_run.start(ready=2)
    before = await daemon.status()
    healthy, hung = pid_of(before, "worker-0"), pid_of(before, "worker-1")
    work = Workload(fault_run.root, shards=2, total=3000, duration_s=20.0).start()
    try:
        mark = len(daemon.lines)
        fault_run.openssh.stop()
        try:
            await daemon.wait_status(
                lambda s: all(r["ssh"] == "unreachable" for r in s["hosts"].values()),
                READY_S,
                "ssh down",
            )
            kill(hung, signal.SIGSTOP)

            async def outage_checks() -> None:
                """Hold the outage for its full length, checking all along."""

                def check() -> None:
                    """worker-0 untouched; each shard still has its one original worker."""
                    assert acted_on(daemon, "worker-0", mark) == []
                    assert fault_run.monitor.pids_seen(0) == [healthy]
                    assert fault_run.monitor.pids_seen(1) == [hung]
                    assert events(daemon, "host.launch")[2:] == []

                await hold_for(SSHD_OUTAGE_S, check)

            await outage_checks()
            status = await daemon.status()
            assert host_row(status, "worker-0")["state"] == "ready"
            assert host_row(status, "worker-0")["heartbeat_age_s"] < 3.0
            assert host_row(status, "worker-1")["state"] == "stale"
            assert pid_of(status, "worker-1") == hung
            assert fault_run.openssh.running is False
        finally:
            fault_run.openssh.start()
            back_at = time.monotonic()
        replacement = await wait_ready_pid(daemon, "worker-1", other_than=hung)
        fault_run.recovered("sshd back after 30 s: stale worker replaced", back_at)
        await work.wait_done()
    finally:
        work.close()
    work.assert_all_done_once()
    assert not pid_alive(hung)
    assert fault_run.monitor.pids_seen(1) == [hung, replacement]
    status = await daemon.status()
    assert pid_of(status, "worker-0") == healthy
    assert acted_on(daemon, "worker-0", mark) == []


@pytest.fixture
async def silent() -> AsyncIterator[SilentListener]:
    """A loopback address whose port accepts TCP and never speaks SSH."""
    listener = await SilentListener("127.0.0.4").start()
    yield listener
    await listener.aclose()


def free_port(address: str) -> int:
    """A port on ``address`` that nothing listens on (connections are refused), reserved for
    this process (tests/ports.py)."""
    return ports.reserve(address)


@pytest.mark.parametrize("kind", ["silent", "refused"])
async def test_host_that_never_answers_is_reported_and_the_rest_run(
    fault_run: FaultRun, silent: SilentListener, kind: str
) -> None:
    """A host whose address accepts and never speaks (or refuses): the daemon still gets
    READY, the other hosts run, that host is reported unreachable and nothing is launched
    for it, and the daemon keeps retrying without falling over."""
    raw = fault_run.raw(2, ssh={"connect_timeout_s": 1.5})
    port = silent.port if kind == "silent" else free_port("127.0.0.5")
    address = "127.0.0.4" if kind == "silent" else "127.0.0.5"
    raw["hosts"].append(
        {"name": "worker-2", "address": address, "port": port, "shard": 2, "concurrency": 2}
    )
    fault_run.write(raw)
    started_at = time.monotonic()
    daemon = await fault_run.start()
    await daemon.wait_notify("READY=1", timeout_s=READY_S)
    fault_run.recovered(f"daemon READY=1 with a {kind} host (connect_timeout_s=1.5)", started_at)
    status = await daemon.wait_status(
        lambda s: all(s["hosts"][h]["state"] == "ready" for h in ("worker-0", "worker-1")),
        READY_S,
        "reachable hosts ready",
    )
    await daemon.wait_until(
        lambda: len(events(daemon, "ssh.connect_failed", host="worker-2")) >= 2,
        READY_S,
        "two failed connects",
    )
    failure = events(daemon, "ssh.connect_failed", host="worker-2")[0]
    expected = "no SSH handshake within 1.5s" if kind == "silent" else "connection refused"
    assert failure["reason"] == f"{address}:{port}: {expected}"
    status = await daemon.status()
    row = host_row(status, "worker-2")
    assert (row["state"], row["ssh"], row["pid"]) == ("starting", "unreachable", None)
    assert events(daemon, "host.launch", host="worker-2") == []
    assert fault_run.monitor.pids_seen(2) == []
    if kind == "silent":
        assert silent.accepted >= 2


async def test_worker_on_a_host_gone_silent_is_adopted_by_heartbeat_and_never_doubled(
    fault_run: FaultRun, silent: SilentListener
) -> None:
    """A new daemon whose host's SSH never answers adopts the running worker from its fresh
    heartbeat alone; when that worker then hangs it goes stale, but with no way to confirm
    it dead nothing is launched beside it; a stop cannot reach it and says so."""
    fault_run.write(fault_run.raw(1))
    first = await fault_run.start(ready=1)
    worker = pid_of(await first.status(), "worker-0")
    first.send_signal(signal.SIGKILL)
    assert await first.wait_exit() == -signal.SIGKILL

    raw = fault_run.raw(1)
    raw["hosts"][0].update(address="127.0.0.4", port=silent.port)
    fault_run.write(raw)
    started_at = time.monotonic()
    second = await fault_run.start()
    status = await second.wait_status(
        lambda s: host_row(s, "worker-0")["state"] == "ready", READY_S, "adopted by heartbeat"
    )
    fault_run.recovered("new daemon, host silent: worker adopted by heartbeat", started_at)
    assert pid_of(status, "worker-0") == worker
    assert host_row(status, "worker-0")["ssh"] == "unreachable"
    kill(worker, signal.SIGSTOP)
    try:
        stale = await second.wait_log("host.state", host="worker-0", to="stale")
        assert stale["reason"].startswith("heartbeat stale"), stale

        def nobody_launched() -> None:
            """No launch at all, and still the one adopted worker."""
            assert events(second, "host.launch") == []
            assert fault_run.monitor.pids_seen(0) == [worker]

        # A few reconnect attempts' worth: the host stays stale, the worker alone.
        await hold_for(3.0, nobody_launched)
        # Stopping cannot reach it either: the daemon exits, and says the worker may run on.
        second.send_signal(signal.SIGTERM)
        assert await second.wait_exit() == 0
        incomplete = events(second, "daemon.stop_incomplete")
        assert [line["hosts"] for line in incomplete] == [["worker-0"]], incomplete
        assert "may still run" in incomplete[0]["reason"]
    finally:
        kill(worker, signal.SIGKILL)  # nothing can reach it: the operator's job
