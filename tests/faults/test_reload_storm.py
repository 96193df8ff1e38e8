"""Twenty SIGHUPs in two seconds, valid and broken configs in turn: the last valid one wins."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import (
    READY_S,
    FaultRun,
    events,
    host_row,
    pid_of,
    wait_event,
    worker_args,
)
from tests.sshd import OpenSsh
from tests.system.daemonproc import all_ready, pid_alive

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

SIGHUPS = 20
PACE_S = 0.1  # 20 signals in 2 s
#: The daemon's own shutdown deadline is stop_grace_s + 15 s; past this it is hung.
STOP_DEADLINE_S = 30.0


def variant(fault_run: FaultRun, name: str) -> dict[str, Any]:
    """A valid config: A has two hosts; B adds worker-2 and gives worker-0 concurrency 3;
    C gives worker-1 concurrency 3. ``run.experiment`` names the variant (the manifest
    shows which one the daemon applied last)."""
    raw = fault_run.raw(3 if name == "B" else 2, run={"experiment": f"v{name}"})
    if name == "B":
        raw["hosts"][0]["concurrency"] = 3
    if name == "C":
        raw["hosts"][1]["concurrency"] = 3
    return raw


def broken(fault_run: FaultRun, n: int) -> dict[str, Any] | str:
    """The n-th broken config: not TOML, a bad value, an unknown key, a duplicate shard."""
    raw = variant(fault_run, "A")
    match n % 4:
        case 0:
            return "[run\nroot = 'not toml"
        case 1:
            raw["health"]["heartbeat_stale_s"] = -1.0
        case 2:
            raw["health"]["heartbeat_stale_secs"] = 3.0
        case _:
            raw["hosts"][1]["shard"] = 0
    return raw


def concurrency(pid: int) -> int:
    """The ``--concurrency`` a running worker was started with."""
    args = worker_args(pid)
    return int(args[args.index("--concurrency") + 1])


async def test_reload_storm_settles_on_the_last_valid_config(fault_run: FaultRun) -> None:
    """Broken and valid configs alternate under 20 SIGHUPs in 2 s, ending with a valid one:
    the daemon survives, ends with exactly that config's hosts, launch parameters and
    manifest, one worker per shard throughout; a broken file after that changes nothing, and
    the daemon still stops cleanly on SIGTERM."""
    fault_run.write(variant(fault_run, "A"))
    daemon = await fault_run.start(ready=2)
    order = ["B", "C", "A"]
    last = ""
    for i in range(SIGHUPS):
        if i % 2 == 0:
            fault_run.write(broken(fault_run, i // 2))
        else:
            last = order[(i // 2) % len(order)]
            fault_run.write(variant(fault_run, last))
        daemon.send_signal(signal.SIGHUP)
        await asyncio.sleep(PACE_S)  # wait-ok: the storm's pace is the fault
    assert last == "B"
    stormed_at = time.monotonic()
    manifest = fault_run.root / "manifest.json"

    def settled(s: dict[str, Any]) -> bool:
        """Variant B is applied, its three hosts ready with B's launch parameters."""
        return (
            all_ready(s, 3)
            and json.loads(manifest.read_text())["experiment_name"] == "vB"
            and s["daemon"]["last_reload_errors"] == []
            and concurrency(pid_of(s, "worker-0")) == 3
        )

    status = await daemon.wait_status(settled, READY_S, "variant B applied and ready")
    fault_run.recovered("last of 20 SIGHUPs: final config running", stormed_at)
    assert events(daemon, "config.reload_failed"), "no broken config was ever read"
    assert concurrency(pid_of(status, "worker-1")) == 2
    assert concurrency(pid_of(status, "worker-2")) == 2
    assert set(status["hosts"]) == {"worker-0", "worker-1", "worker-2"}

    pids = {h: pid_of(status, h) for h in status["hosts"]}
    reloads = len(events(daemon, "config.reload_failed"))
    fault_run.write(broken(fault_run, 1))
    daemon.send_signal(signal.SIGHUP)
    await daemon.wait_until(
        lambda: len(events(daemon, "config.reload_failed")) > reloads, READY_S, "refusal"
    )
    status = await daemon.status()
    assert all_ready(status, 3)
    assert {h: pid_of(status, h) for h in status["hosts"]} == pids
    assert any("heartbeat_stale_s" in e for e in status["daemon"]["last_reload_errors"])
    # Nothing the storm started is left dangling: the daemon still stops cleanly.
    daemon.send_signal(signal.SIGTERM)
    assert await daemon.wait_exit(STOP_DEADLINE_S) == 0
    assert events(daemon, "daemon.stopped")


@pytest.fixture
def own_sshd(tmp_path: Path) -> Iterator[OpenSsh]:
    """An OpenSSH server of this test alone (127.0.0.6 and .7), free to stop and start; ask
    for it before ``fault_run`` so it outlives the daemon's stop."""
    server = OpenSsh.create(tmp_path / "own-sshd", addresses=("127.0.0.6", "127.0.0.7"))
    try:
        yield server
    finally:
        server.stop()


def handover_config(
    fault_run: FaultRun, server: OpenSsh, hosts: list[tuple[str, int, int]]
) -> None:
    """Hosts ``(name, shard, concurrency)`` on ``server``, worker-0 on .6, the rest on .7."""
    raw = fault_run.raw(1, openssh=server)
    template = raw["hosts"][0]
    raw["hosts"] = [
        {**template, "name": name, "shard": shard, "concurrency": conc, "address": address}
        for name, shard, conc in hosts
        for address in [server.addresses[0 if name == "worker-0" else 1]]
    ]
    fault_run.write(raw)


async def test_reloads_during_a_stalled_shard_handover(
    own_sshd: OpenSsh, fault_run: FaultRun
) -> None:
    """A host removed while SSH is down leaves its shard to a successor that must wait, two
    more reloads (changing the successor, then dropping it) are taken without a crash, and
    once the old host is confirmed stopped the dropped successor is not started."""
    handover_config(fault_run, own_sshd, [("worker-0", 0, 2), ("worker-9", 1, 2)])
    daemon = await fault_run.start(ready=2)
    old = pid_of(await daemon.status(), "worker-9")
    own_sshd.stop()
    try:
        await daemon.wait_status(
            lambda s: all(r["ssh"] == "unreachable" for r in s["hosts"].values()),
            READY_S,
            "ssh down",
        )
        for n, hosts in enumerate(
            [
                [("worker-0", 0, 2), ("worker-1", 1, 2)],  # handover: worker-1 waits
                [("worker-0", 0, 2), ("worker-1", 1, 3)],  # the waiting host changes
                [("worker-0", 0, 2)],  # and is dropped before it ever started
            ]
        ):
            handover_config(fault_run, own_sshd, hosts)
            daemon.send_signal(signal.SIGHUP)
            await wait_event(daemon, "config.reloaded", count=n + 1)
        status = await daemon.status()
        assert host_row(status, "worker-9")["state"] == "stopping"
        assert "worker-1" not in status["hosts"]
    finally:
        own_sshd.start()
    await wait_event(daemon, "host.removed", host="worker-9")
    status = await daemon.wait_status(lambda s: all_ready(s, 1), READY_S, "worker-0 alone")
    assert set(status["hosts"]) == {"worker-0"}
    assert events(daemon, "host.added") == []
    assert fault_run.monitor.pids_seen(1) == [old]
    assert not pid_alive(old)
