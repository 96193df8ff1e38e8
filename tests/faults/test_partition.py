"""A network partition between the supervisor and a worker host, in namespaces of our own.

The worker host is a network namespace with its own sshd; the daemon runs in a second one;
a veth pair with private addresses is the only link between them, and the test takes it
down and up. Nothing is added to the machine's own network namespace. Both namespaces see
the same filesystem, so the run root is shared exactly as NFS would share it.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import (
    HEALTH,
    READY_S,
    FaultRun,
    Partition,
    Workload,
    events,
    hold_for,
    host_row,
    in_netns,
    kill,
    pid_of,
)
from tests.faults.test_worker_faults import wait_ready_pid
from tests.sshd import OpenSsh

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

_tags = itertools.count()


@pytest.fixture
def partition() -> Iterator[Partition]:
    """Two fresh network namespaces joined by one veth pair; removed afterwards."""
    try:
        part = Partition.create(f"{os.getpid() % 100000}-{next(_tags)}")
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"NETWORK NAMESPACES UNAVAILABLE (needs root and iproute2): {exc}")
    try:
        yield part
    finally:
        part.delete()


@pytest.fixture
def host_sshd(partition: Partition, tmp_path: Path) -> Iterator[OpenSsh]:
    """A real OpenSSH sshd inside the worker host's namespace, on its private address."""
    with in_netns(partition.host):
        server = OpenSsh.create(tmp_path / "sshd-host", addresses=(partition.host_address,))
    try:
        yield server
    finally:
        server.stop()


async def test_partition_keeps_the_worker_and_defers_its_restart_until_healed(
    partition: Partition, host_sshd: OpenSsh, fault_run: FaultRun
) -> None:
    """Link down: SSH is declared lost but the worker, still heartbeating through the shared
    filesystem, is untouched; when it then hangs it goes stale, yet nothing is started
    beside it while the host is unreachable; link up: it is terminated and replaced, and
    every task fed throughout gets its result."""
    fault_run.write(fault_run.raw(1, openssh=host_sshd))
    with in_netns(partition.supervisor):
        daemon = await fault_run.start()
    status = await daemon.wait_status(
        lambda s: host_row(s, "worker-0")["state"] == "ready", READY_S, "ready across the link"
    )
    worker = pid_of(status, "worker-0")
    work = Workload(fault_run.root, shards=1, total=1500, duration_s=10.0).start()
    try:
        mark = len(daemon.lines)
        cut_at = time.monotonic()
        partition.cut()
        try:
            lost = await daemon.wait_log("ssh.down", host="worker-0", timeout_s=READY_S)
            fault_run.recovered("link down: ssh.down (keepalive 1 s x 3)", cut_at)
            assert daemon.lines.index(lost) >= mark

            def untouched() -> None:
                """No state change, and still the one worker."""
                assert events(daemon, "host.state")[1:] == []
                assert fault_run.monitor.pids_seen(0) == [worker]

            # Heartbeats stay fresh across the partition: longer than the stale threshold.
            await hold_for(float(HEALTH["heartbeat_stale_s"]) + 1.0, untouched)
            row = host_row(await daemon.status(), "worker-0")
            assert (row["state"], row["ssh"], row["pid"]) == ("ready", "unreachable", worker)

            kill(worker, signal.SIGSTOP)
            stale = await daemon.wait_log("host.state", host="worker-0", to="stale")
            assert stale["reason"].startswith("heartbeat stale"), stale

            def deferred() -> None:
                """Nothing terminated or launched while the host cannot be reached."""
                assert events(daemon, "host.terminate") == []
                assert events(daemon, "host.launch")[1:] == []
                assert fault_run.monitor.pids_seen(0) == [worker]

            await hold_for(2.0, deferred)
        finally:
            partition.heal()
            healed_at = time.monotonic()
        replacement = await wait_ready_pid(daemon, "worker-0", other_than=worker)
        fault_run.recovered("link up: stale worker replaced", healed_at)
        await work.wait_done()
    finally:
        work.close()
    work.assert_all_done_once()
    assert fault_run.monitor.pids_seen(0) == [worker, replacement]
    assert events(daemon, "host.terminated", host="worker-0", pid=worker)
