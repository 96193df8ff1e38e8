"""Two daemons on one run: a leader and a standby, against the real sshd and the invariant
monitor (never two live workers on a shard, nothing left behind).

The standby takes over when the leader is SIGKILLed at random moments of a restart storm,
SIGTERMed with ``on_exit = "detach"``, loses its lock while still running (the lock file
replaced: it is then fenced), or hands over; adoption restarts nothing that was healthy.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor import control
from supervisor.errors import ControlError
from supervisor.refusals import Refusal
from tests import ports
from tests.faults.harness import (
    READY_S,
    FaultRun,
    Workload,
    events,
    kill,
    kill_storm,
)
from tests.system.daemonproc import DaemonProcess, all_ready, host_pids, poll_until

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOSTS = 3
SEED = 20261204
#: Fast leadership timings for tests (the defaults are 0.5 s and 5 s).
HA = {"poll_interval_s": 0.1, "check_interval_s": 0.5}


def configs(fault_run: FaultRun, *, hosts: int = HOSTS, **sections: Any) -> tuple[Path, Path]:
    """The same config twice, as on two nodes: ``[ha] standby = true``; on one machine the
    two daemons differ only in their control socket."""
    ha = {"standby": True, **HA, **sections.pop("ha", {})}
    raw = fault_run.raw(hosts, ha=ha, **sections)
    first = fault_run.write(raw)
    raw["control"]["socket"] = str(fault_run.tmp_path / "standby.sock")
    second = fault_run.write(raw, fault_run.tmp_path / "rs-b.toml")
    return first, second


async def standby_ready(daemon: DaemonProcess, hosts: int = HOSTS) -> dict[str, Any]:
    """Wait until ``daemon`` is a healthy standby: READY=1 with its standby status, and its
    connections to every host up with the agent started and the host probed."""
    await daemon.wait_notify("READY=1", READY_S)
    assert any(
        line.startswith("STATUS=standby, leader: ")
        for n in daemon.notifications
        for line in n.splitlines()
    ), daemon.notifications
    return await daemon.wait_status(
        lambda s: (
            s["daemon"].get("role") == "standby"
            and s["daemon"]["warm"] == {"hosts": hosts, "connected": hosts, "probed": hosts}
        ),
        READY_S,
        "a warm standby",
    )


def launches(daemon: DaemonProcess) -> list[dict[str, Any]]:
    """Every launch the daemon began."""
    return events(daemon, "host.launch")


async def test_sigterm_with_detach_hands_the_fleet_over_with_zero_restarts(
    fault_run: FaultRun,
) -> None:
    """The leader SIGTERMed with ``on_exit = "detach"``: the standby takes the lock, bumps the
    epoch, adopts every worker (same pids) without a launch, and is in charge; a SIGHUP it
    got while waiting is applied once it leads (a reload command is refused meanwhile)."""
    first, second = configs(fault_run, run={"on_exit": "detach"})
    leader = await fault_run.start(first, ready=HOSTS)
    before = host_pids(await leader.status())
    leader_status = await leader.status()
    assert leader_status["daemon"]["role"] == "leader"
    epoch = leader_status["daemon"]["epoch"]
    standby = await fault_run.start(second)
    view = await standby_ready(standby)
    assert view["daemon"]["leader"] == leader_status["daemon"]["leader"]
    assert view["daemon"]["epoch"] == epoch
    assert set(view["hosts"]) == set(before)
    # An edited config (on_exit = "stop", so the end of the test stops the workers) and a
    # SIGHUP to the standby: it reads the file once it leads, not before.
    raw = fault_run.raw(HOSTS, ha={"standby": True, **HA})
    raw["control"]["socket"] = str(fault_run.tmp_path / "standby.sock")
    fault_run.write(raw, second)
    standby.send_signal(signal.SIGHUP)
    with pytest.raises(ControlError) as refused:
        await control.request(standby.socket, "reload")
    assert refused.value.code == Refusal.NOT_LEADER

    leader.send_signal(signal.SIGTERM)
    assert await leader.wait_exit() == 0
    charge = await standby.wait_log("ha.in_charge", READY_S)
    fault_run.record("takeover after SIGTERM: lock free -> in charge", charge["since_lock_free_s"])
    status = await standby.wait_status(lambda s: all_ready(s, HOSTS), READY_S, "all ready")
    assert host_pids(status) == before
    assert status["daemon"]["role"] == "leader"
    assert status["daemon"]["epoch"] == epoch + 1
    assert (fault_run.root / "ctl" / "supervisor.epoch").read_text() == f"{epoch + 1}\n"
    assert launches(standby) == []
    assert charge["adopted"] == HOSTS
    reloaded = await standby.wait_log("config.reloaded", READY_S)
    assert reloaded["restarted"] == [] and launches(standby) == []
    assert (await standby.status())["daemon"]["on_exit"] == "stop"


async def test_leader_that_lost_its_lock_is_fenced_and_deposed(fault_run: FaultRun) -> None:
    """The lock file replaced under a running leader (its lock now guards nothing): the
    standby locks the new file and takes over. The old leader, asked to restart a host before
    its next check, is refused by the agent (fenced): the worker lives on, the old leader
    logs ``ha.deposed`` and exits 3; the new leader keeps every worker."""
    first, _ = configs(fault_run, ha={"check_interval_s": 30.0})
    leader = await fault_run.start(first, ready=HOSTS)
    before = host_pids(await leader.status())
    # The standby by flag and its own socket, on a config that says nothing of it.
    raw = fault_run.raw(HOSTS)
    plain = fault_run.write(raw, fault_run.tmp_path / "rs-plain.toml")
    socket = fault_run.tmp_path / "b.sock"
    standby = await fault_run.start(
        plain, args=["--standby", "--control-socket", str(socket)], socket=socket
    )
    await standby_ready(standby)
    # `status --control-socket` asks the standby: who leads, and the hosts from the files.
    asked = await asyncio.create_subprocess_exec(
        *_cli("status", "-c", str(plain), "--control-socket", str(socket)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(asked.communicate(), READY_S)
    assert asked.returncode == 0, err
    shown = out.decode()
    leader_pid = leader.process.pid  # type: ignore[union-attr]
    assert f"leader: {os.uname().nodename} pid {leader_pid}, epoch 1" in shown, shown
    assert all(f"worker-{i}" in shown for i in range(HOSTS)), shown

    lock = fault_run.root / "ctl" / "supervisor.lock"
    planted = lock.with_name("planted")
    planted.write_text("")
    os.replace(planted, lock)
    await standby.wait_log("ha.in_charge", READY_S)
    status = await standby.wait_status(lambda s: all_ready(s, HOSTS), READY_S, "all ready")
    assert host_pids(status) == before

    victim = "worker-0"
    proc = await asyncio.create_subprocess_exec(
        *_cli("restart-host", "-c", str(first), victim),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    await proc.communicate()
    fenced = await leader.wait_log("host.fenced", READY_S, host=victim, op="terminate")
    assert "epoch" in fenced["reason"]
    deposed = await leader.wait_log("ha.deposed", READY_S)
    assert deposed["epoch_on_disk"] in (None, status["daemon"]["epoch"])
    assert await leader.wait_exit() == 3
    status = await standby.status()
    assert host_pids(status) == before  # the fenced terminate killed nothing
    assert all(row["state"] == "ready" for row in status["hosts"].values())
    assert launches(standby) == []


async def test_leader_that_lost_its_lock_cannot_launch_either(fault_run: FaultRun) -> None:
    """As above, but the old leader is made to launch: a worker is killed, both daemons see
    its exit record, the old leader's relaunch is fenced by the agent (it logs
    ``host.fenced`` for the launch and exits 3) and only the new leader's worker runs."""
    first, second = configs(fault_run, ha={"check_interval_s": 30.0})
    leader = await fault_run.start(first, ready=HOSTS)
    before = host_pids(await leader.status())
    standby = await fault_run.start(second)
    await standby_ready(standby)
    lock = fault_run.root / "ctl" / "supervisor.lock"
    planted = lock.with_name("planted")
    planted.write_text("")
    os.replace(planted, lock)
    await standby.wait_log("ha.in_charge", READY_S)
    await standby.wait_status(lambda s: all_ready(s, HOSTS), READY_S, "all ready")

    victim = "worker-1"
    old_pid = before[victim]
    assert old_pid is not None
    kill(old_pid)
    fenced = await leader.wait_log("host.fenced", READY_S, host=victim, op="launch")
    assert "epoch" in fenced["reason"]
    assert await leader.wait_exit() == 3
    await leader.wait_log("ha.deposed", READY_S)
    status = await standby.wait_status(
        lambda s: all_ready(s, HOSTS) and s["hosts"][victim]["pid"] != old_pid,
        READY_S,
        "the victim replaced by the new leader",
    )
    new_pid = status["hosts"][victim]["pid"]
    assert [w.pid for w in fault_run.monitor.live() if w.host == victim] == [new_pid]
    assert [e["host"] for e in launches(standby)] == [victim]


async def test_handover_moves_the_fleet_with_zero_restarts(fault_run: FaultRun) -> None:
    """``reward-supervisor handover``: the leader detaches (whatever its on_exit) and
    releases the lock, the standby takes over and adopts every worker, the command names
    the new leader; the old leader exits 3 (systemd restarts it, as a standby)."""
    first, second = configs(fault_run)
    leader = await fault_run.start(first, ready=HOSTS)
    before = host_pids(await leader.status())
    standby = await fault_run.start(second, watchdog_usec=1_000_000)
    await standby_ready(standby)
    # A healthy standby pings the watchdog (systemd would kill a silent one).
    await standby.wait_notify("WATCHDOG=1", READY_S)
    with pytest.raises(ControlError) as refused:
        await control.request(standby.socket, "restart-host", host="worker-0")
    assert refused.value.code == Refusal.NOT_LEADER

    proc = await asyncio.create_subprocess_exec(
        *_cli("handover", "-c", str(first), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), READY_S)
    assert proc.returncode == 0, (out, err)
    result = json.loads(out)
    assert result["handed_over"] is True
    assert result["to"] == f"{os.uname().nodename} pid {standby.process.pid}"  # type: ignore[union-attr]
    assert await leader.wait_exit() == 3
    assert events(leader, "host.terminate") == []
    await standby.wait_log("ha.in_charge", READY_S)
    status = await standby.wait_status(lambda s: all_ready(s, HOSTS), READY_S, "all ready")
    assert host_pids(status) == before
    assert launches(standby) == []

    # Restarted by systemd, the old leader is now the standby.
    again = await fault_run.start(first)
    await standby_ready(again)
    assert await fault_run.stop(again) == 0  # a standby stops at once, touching nothing


async def test_leader_sigkilled_at_random_moments_of_a_restart_storm(
    fault_run: FaultRun,
) -> None:
    """Workers are killed at random while the leader is SIGKILLed at seeded random moments,
    three times; each time the standby takes over and the killed one comes back as the next
    standby. Never two workers on a shard (monitor), every task done exactly once."""
    rng = random.Random(SEED)
    first, second = configs(fault_run)
    work = Workload(fault_run.root, shards=HOSTS, total=1800, duration_s=10.0, seed=SEED).start()
    stop_storm = asyncio.Event()
    try:
        leader = await fault_run.start(first, ready=HOSTS)
        standby = await fault_run.start(second)
        await standby_ready(standby)
        paths = {id(leader): first, id(standby): second}
        async with asyncio.TaskGroup() as tg:
            storming = tg.create_task(kill_storm(fault_run, rng, stop_storm))
            for round_ in range(3):
                await asyncio.sleep(rng.uniform(0.2, 1.5))  # wait-ok: a random moment (seeded)
                leader.send_signal(signal.SIGKILL)
                assert await leader.wait_exit() == -signal.SIGKILL
                charge = await standby.wait_log("ha.in_charge", 2 * READY_S)
                fault_run.record(
                    f"round {round_}: lock free -> in charge", charge["since_lock_free_s"]
                )
                config = paths[id(leader)]
                leader, standby = standby, await fault_run.start(config)
                paths[id(standby)] = config
                await standby_ready(standby)
            stop_storm.set()
            killed = await storming
        assert killed >= 3
        await leader.wait_status(lambda s: all_ready(s, HOSTS), 4 * READY_S, "all ready")
        await work.wait_done()
        work.assert_all_done_once()
        await fault_run.stop(standby)  # the standby first: it must not take over a stopped fleet
    finally:
        stop_storm.set()
        work.close()


def _cli(*args: str) -> list[str]:
    """The CLI's argv."""
    return [sys.executable, "-m", "supervisor.cli", *args]


async def test_a_standby_stopped_as_it_takes_over_leaves_no_worker_behind(
    fault_run: FaultRun,
) -> None:
    """The leader SIGKILLed, and the standby SIGTERMed the moment it has taken the lock (its
    start-up as leader under way: files being read, hosts being adopted). With ``on_exit =
    "stop"`` every worker is found and stopped before it exits: none is left running."""
    first, second = configs(fault_run)
    leader = await fault_run.start(first, ready=HOSTS)
    standby = await fault_run.start(second)
    await standby_ready(standby)
    assert len(fault_run.monitor.live()) == HOSTS
    leader.send_signal(signal.SIGKILL)
    assert await leader.wait_exit() == -signal.SIGKILL
    await standby.wait_log("ha.leading", READY_S)
    standby.send_signal(signal.SIGTERM)
    assert await standby.wait_exit(READY_S) == 0
    assert events(standby, "daemon.stop_incomplete") == []
    assert launches(standby) == []
    await poll_until(lambda: not fault_run.monitor.live(), READY_S, "every worker stopped")


async def test_two_standbys_wait_and_exactly_one_takes_over(fault_run: FaultRun) -> None:
    """A leader and two standbys: the leader SIGKILLed, one standby takes over (epoch + 1),
    the other stays a standby and names the new leader; the fleet is adopted once."""
    first, second = configs(fault_run)
    raw = fault_run.raw(HOSTS, ha={"standby": True, **HA})
    raw["control"]["socket"] = str(fault_run.tmp_path / "third.sock")
    third = fault_run.write(raw, fault_run.tmp_path / "rs-c.toml")
    leader = await fault_run.start(first, ready=HOSTS)
    before = host_pids(await leader.status())
    epoch = (await leader.status())["daemon"]["epoch"]
    standbys = [await fault_run.start(second), await fault_run.start(third)]
    for standby in standbys:
        await standby_ready(standby)
    leader.send_signal(signal.SIGKILL)
    assert await leader.wait_exit() == -signal.SIGKILL

    def one_leads() -> bool:
        """Exactly one of the standbys has logged that it is in charge."""
        return sum(1 for s in standbys if events(s, "ha.in_charge")) >= 1

    await poll_until(one_leads, READY_S, "a standby in charge")
    [new] = [s for s in standbys if events(s, "ha.in_charge")]
    [other] = [s for s in standbys if s is not new]
    status = await new.wait_status(lambda s: all_ready(s, HOSTS), READY_S, "all ready")
    assert host_pids(status) == before
    assert status["daemon"]["epoch"] == epoch + 1
    assert launches(new) == []
    name = f"{os.uname().nodename} pid {new.process.pid}"  # type: ignore[union-attr]
    # (The holder's name is in the lock file a moment before the epoch is bumped; a
    # standby's view of the files is re-read every 2 s while it is asked.)
    view = await other.wait_status(
        lambda s: s["daemon"]["leader"] == name and s["daemon"]["epoch"] == epoch + 1,
        READY_S,
        "the other names the new leader and its epoch",
    )
    assert view["daemon"]["role"] == "standby"
    assert events(other, "ha.leading") == []
    assert await fault_run.stop(other) == 0


async def test_without_standby_a_second_daemon_exits_naming_the_leader(
    fault_run: FaultRun,
) -> None:
    """No ``[ha] standby``: a second daemon on a led run exits 1 at once, naming who holds
    the run lock and how to wait instead; the leader and its workers are untouched."""
    raw = fault_run.raw(HOSTS)
    first = fault_run.write(raw)
    raw["control"]["socket"] = str(fault_run.tmp_path / "second.sock")
    second = fault_run.write(raw, fault_run.tmp_path / "rs-2.toml")
    leader = await fault_run.start(first, ready=HOSTS)
    before = host_pids(await leader.status())
    other = await fault_run.start(second)
    assert await other.wait_exit(READY_S) == 1
    [refused] = events(other, "daemon.cannot_start")
    holder = f"{os.uname().nodename} pid {leader.process.pid}"  # type: ignore[union-attr]
    assert holder in refused["reason"] and "--standby" in refused["reason"], refused
    assert host_pids(await leader.status()) == before
    assert (await leader.status())["daemon"]["epoch"] == 1


async def test_a_host_unreachable_from_the_standby_does_not_hold_up_the_takeover(
    fault_run: FaultRun,
) -> None:
    """One host refuses connections: the standby's warm view knows it is down, so after the
    takeover that host is reported unreachable at once and the new leader is in charge
    without waiting out the start-up deadline (no ``daemon.ready_without``); the other
    hosts' workers are adopted."""
    raw = fault_run.raw(2, ha={"standby": True, **HA})
    raw["hosts"].append(
        {
            "name": "worker-2",
            "address": "127.0.0.5",
            "port": ports.reserve("127.0.0.5"),
            "shard": 2,
            "concurrency": 2,
        }
    )
    first = fault_run.write(raw)
    raw["control"]["socket"] = str(fault_run.tmp_path / "standby.sock")
    second = fault_run.write(raw, fault_run.tmp_path / "rs-b.toml")
    leader = await fault_run.start(first)
    ready = ("worker-0", "worker-1")
    status = await leader.wait_status(
        lambda s: all(s["hosts"][h]["state"] == "ready" for h in ready), READY_S, "two ready"
    )
    before = {h: status["hosts"][h]["pid"] for h in ready}
    standby = await fault_run.start(second)
    await standby.wait_status(
        lambda s: s["daemon"].get("warm") == {"hosts": 3, "connected": 2, "probed": 2},
        READY_S,
        "a warm standby, one host down",
    )
    leader.send_signal(signal.SIGKILL)
    assert await leader.wait_exit() == -signal.SIGKILL
    await standby.wait_log("ha.in_charge", READY_S)
    status = await standby.wait_status(
        lambda s: all(s["hosts"][h]["state"] == "ready" for h in ready), READY_S, "two ready"
    )
    assert {h: status["hosts"][h]["pid"] for h in ready} == before
    assert status["hosts"]["worker-2"]["ssh"] == "unreachable"
    assert events(standby, "daemon.ready_without") == []
    assert launches(standby) == []
