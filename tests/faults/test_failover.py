"""Failover to a spare with the real OpenSSH server (issue 32).

A doomed host has an sshd of its own (127.0.0.8), so that the test can take the machine
away (its sshd and its sessions gone) while the other host and the spare stay on the
session's server. "Dead" is the sshd gone and the worker killed; "vanished" is the sshd gone
and the worker stopped (SIGSTOP) while its shepherd keeps the shard lock, as a machine that
dropped off the network keeps an NFS lock until its lease ends.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import control
from supervisor.errors import ControlError
from supervisor.refusals import Refusal
from tests import ports
from tests.faults.harness import READY_S, FaultRun, events, host_row, kill, pid_of, wait_event
from tests.faults.test_worker_faults import wait_ready_pid
from tests.sshd import OpenSsh
from tests.system.daemonproc import DaemonProcess, pid_alive, poll_until

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: Short, for the test's sake: the default is derived from the trainer's 15 s (11-12 s).
AFTER_S = 4.0
#: The trainer's client fails every call once a heartbeat is this old.
TRAINER_STALE_S = 15.0


@pytest.fixture
def doomed_sshd(tmp_path: Path) -> Iterator[OpenSsh]:
    """The doomed host's own OpenSSH server (127.0.0.8); asked for before ``fault_run`` so it
    outlives the daemon's stop."""
    server = OpenSsh.create(tmp_path / "doomed-sshd", addresses=("127.0.0.8",))
    try:
        yield server
    finally:
        server.stop()


def failover_config(fault_run: FaultRun, doomed: OpenSsh, spares: int = 1, **sections: Any) -> None:
    """worker-0 on the doomed server, worker-1 and ``spares`` spares on the session's one; one
    known_hosts and both client keys, as an operator's fleet would have."""
    raw: dict[str, Any] = fault_run.raw(2, failover={"after_s": AFTER_S}, **sections)
    session = fault_run.openssh
    known = fault_run.tmp_path / "known_hosts"
    known.write_text(session.known_hosts.read_text() + doomed.known_hosts.read_text())
    raw["ssh"]["known_hosts"] = str(known)
    raw["ssh"]["client_keys"] = [str(session.client_key), str(doomed.client_key)]
    raw["hosts"][0].update(address=doomed.addresses[0], port=doomed.port)
    raw["spares"] = [
        {"name": f"spare-{i}", "address": session.addresses[i % 2], "port": session.port}
        for i in range(spares)
    ]
    fault_run.write(raw)


def fetch(url: str) -> str:
    """GET ``url`` (the fleet page on loopback)."""
    with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - our own loopback
        return str(reply.read().decode("utf-8"))


def heartbeat_at(root: Path, host: str) -> float | None:
    """The wall-clock heartbeat of ``status/<host>.json`` (None: unreadable now)."""
    try:
        value = json.loads((root / "status" / f"{host}.json").read_text()).get("heartbeat_at")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def spare_roles(status: dict[str, Any]) -> dict[str, str]:
    """``{machine: role}`` of the status's spares."""
    return {row["name"]: row["role"] for row in status["daemon"]["spares"]}


def take_away(doomed: OpenSsh, pid: int, signum: int) -> None:
    """The doomed machine drops off: its sshd and sessions gone, its worker signalled."""
    doomed.stop()
    kill(pid, signum)


async def served_by(daemon: DaemonProcess, host: str, machine: str) -> dict[str, Any]:
    """The status once ``host`` is ready and served by ``machine``."""
    return await daemon.wait_status(
        lambda s: host_row(s, host)["state"] == "ready" and host_row(s, host)["machine"] == machine,
        READY_S,
        f"{host} ready on {machine}",
    )


async def test_a_dead_host_s_shard_is_served_by_the_spare_before_the_trainer_sees_it(
    doomed_sshd: OpenSsh, fault_run: FaultRun
) -> None:
    """worker-0's machine dies: after after_s its shard runs on the spare under its name, its
    heartbeat is never as old as the trainer's limit, the other host is untouched; when the
    machine comes back its leftovers are looked for and it becomes a free spare, while
    worker-0 stays on the spare (no flapping back)."""
    failover_config(fault_run, doomed_sshd)
    daemon = await fault_run.start(ready=2)
    status = await daemon.status()
    assert spare_roles(status) == {"spare-0": "free"}
    assert host_row(status, "worker-0")["machine"] == "worker-0"
    victim, other = pid_of(status, "worker-0"), pid_of(status, "worker-1")
    mark = len(daemon.lines)
    took_away = time.monotonic()
    take_away(doomed_sshd, victim, signal.SIGKILL)
    moved = await wait_event(daemon, "shard.failover", after=mark, timeout_s=READY_S)
    assert (moved["host"], moved["from_machine"], moved["to_machine"], moved["reason"]) == (
        "worker-0",
        "worker-0",
        "spare-0",
        "host_lost",
    ), moved
    # What the trainer's client checks before every call: the heartbeat's age, polled until
    # the spare's worker is ready (its oldest age is what the trainer would have seen).
    oldest = 0.0
    async with asyncio.timeout(READY_S):
        while True:
            beat = heartbeat_at(fault_run.root, "worker-0")
            if beat is not None:
                oldest = max(oldest, time.time() - beat)
            row = host_row(await daemon.status(), "worker-0")
            if row["machine"] == "spare-0" and row["state"] == "ready":
                break
            await asyncio.sleep(0.1)  # wait-ok: the tick of a poll with a deadline
    fault_run.recovered("dead host -> its shard ready on the spare", took_away)
    fault_run.record("oldest heartbeat of worker-0 seen", oldest)
    assert oldest < TRAINER_STALE_S, oldest
    status = await daemon.status()
    assert pid_of(status, "worker-1") == other
    assert spare_roles(status) == {"spare-0": "serving", "worker-0": "fenced"}
    assert status["daemon"]["failover_counts"] == {"host_lost": 1}
    assert status["daemon"]["free_spares"] == 0

    doomed_sshd.start()
    await wait_event(daemon, "spare.leftovers_killed", after=mark, machine="worker-0")
    status = await daemon.wait_status(
        lambda s: spare_roles(s).get("worker-0") == "free", READY_S, "worker-0 a free spare"
    )
    assert host_row(status, "worker-0")["machine"] == "spare-0"
    assert host_row(status, "worker-0")["state"] == "ready"
    assert await fault_run.stop(daemon) == 0


async def test_a_vanished_host_holding_the_shard_lock_is_fenced_until_it_returns(
    doomed_sshd: OpenSsh, fault_run: FaultRun
) -> None:
    """worker-0's machine vanishes with its worker stopped and the shard lock held (an NFS
    lock before its lease ends): the spare's launch is refused while the lock is held, never
    two workers on the shard; once the machine answers again its worker is killed first and
    the spare's worker takes the shard."""
    port = ports.reserve("127.0.0.1")
    failover_config(fault_run, doomed_sshd, metrics={"listen": f"127.0.0.1:{port}"})
    daemon = await fault_run.start(ready=2)
    victim = pid_of(await daemon.status(), "worker-0")
    mark = len(daemon.lines)
    take_away(doomed_sshd, victim, signal.SIGSTOP)
    try:
        await wait_event(daemon, "shard.failover", after=mark, timeout_s=READY_S)
        refused = await wait_event(
            daemon, "host.launch_refused", after=mark, host="worker-0", timeout_s=READY_S
        )
        assert refused["holder_pid"] is not None, refused
        status = await daemon.status()
        assert host_row(status, "worker-0")["state"] != "ready"
        assert [m["host"] for m in status["daemon"]["failovers"]] == ["worker-0"]
        # The fleet page says so too: a FAILOVER banner naming the host and the spare.
        html = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/")
        banner = re.search(r'class="banner b-warn"><b>FAILOVER</b>([^<]*)<', html)
        assert banner is not None, html[:2000]
        assert "worker-0" in banner[1] and "spare-0" in banner[1], banner[1]
    finally:
        doomed_sshd.start()
    killed = await wait_event(daemon, "spare.leftovers_killed", after=mark, machine="worker-0")
    assert killed["pid"] == victim, killed
    await served_by(daemon, "worker-0", "spare-0")
    await poll_until(lambda: not pid_alive(victim), READY_S, f"pid {victim} dead")
    assert await fault_run.stop(daemon) == 0


async def test_drain_moves_a_shard_to_the_spare_and_undrain_gives_the_host_back(
    doomed_sshd: OpenSsh, fault_run: FaultRun
) -> None:
    """``drain worker-1``: its worker is stopped, then its shard runs on the spare; another
    drain is refused (no free spare) with the reason; ``undrain`` makes worker-1 a spare."""
    failover_config(fault_run, doomed_sshd)
    daemon = await fault_run.start(ready=2)
    old = pid_of(await daemon.status(), "worker-1")
    reply = await control.request(daemon.socket, "drain", host="worker-1")
    assert (reply["label"], reply["shard"], reply["to"]) == ("worker-1", 1, "spare-0"), reply
    new = await wait_ready_pid(daemon, "worker-1", other_than=old)
    assert new != old
    status = await served_by(daemon, "worker-1", "spare-0")
    assert spare_roles(status) == {"spare-0": "serving", "worker-1": "drained"}
    with pytest.raises(ControlError) as no_spare:
        await control.request(daemon.socket, "drain", host="worker-0")
    assert no_spare.value.code == Refusal.NO_FREE_SPARE
    with pytest.raises(ControlError) as not_drained:
        await control.request(daemon.socket, "undrain", host="worker-0")
    assert not_drained.value.code == Refusal.NOT_DRAINED
    assert await control.request(daemon.socket, "undrain", host="worker-1") == {"spare": "worker-1"}
    status = await daemon.status()
    assert spare_roles(status)["worker-1"] == "free"
    assert status["daemon"]["failover_counts"] == {"drain": 1}
    assert [e for e in events(daemon, "shard.failover") if e["reason"] == "drain"]
    assert await fault_run.stop(daemon) == 0


async def test_a_daemon_killed_mid_failover_comes_back_to_the_same_seats(
    doomed_sshd: OpenSsh, fault_run: FaultRun
) -> None:
    """The daemon is SIGKILLed once worker-0's shard runs on the spare: the next daemon reads
    the seats from the state file, adopts the spare's worker (same pid, no relaunch), keeps
    the lost machine fenced, and frees it once it answers again."""
    failover_config(fault_run, doomed_sshd)
    first = await fault_run.start(ready=2)
    victim = pid_of(await first.status(), "worker-0")
    take_away(doomed_sshd, victim, signal.SIGKILL)
    status = await served_by(first, "worker-0", "spare-0")
    moved = pid_of(status, "worker-0")
    state = fault_run.root / "ctl" / "supervisor-state.json"

    def seats_saved() -> bool:
        """The state file records worker-0 on spare-0."""
        try:
            saved = json.loads(state.read_text()).get("seats") or {}
        except (OSError, ValueError):
            return False
        return bool(saved.get("serving") == {"worker-0": "spare-0"})

    await poll_until(seats_saved, READY_S, "the seats saved")
    first.send_signal(signal.SIGKILL)
    assert await first.wait_exit() == -signal.SIGKILL

    again = await fault_run.start()
    status = await served_by(again, "worker-0", "spare-0")
    assert pid_of(status, "worker-0") == moved  # adopted where it runs, not launched again
    assert not events(again, "host.launch")
    assert spare_roles(status) == {"spare-0": "serving", "worker-0": "fenced"}
    doomed_sshd.start()
    await again.wait_status(
        lambda s: spare_roles(s).get("worker-0") == "free", READY_S, "worker-0 a free spare"
    )
    assert host_row(await again.status(), "worker-0")["machine"] == "spare-0"
    assert await fault_run.stop(again) == 0
