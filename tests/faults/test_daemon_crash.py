"""The supervisor itself dies (SIGKILL) in the middle of a restart storm, again and again."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import (
    READY_S,
    FaultRun,
    Workload,
    events,
    host_row,
    kill_storm,
    wall,
)
from tests.system.daemonproc import DaemonProcess, all_ready

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOSTS = 3
ROUNDS = 4
SEED = 20261202
# Log timestamps lag the core's clock reading a little; history instants are converted
# between clocks through a wall-minus-monotonic offset read twice.
SLACK_S = 0.1


def history(root: Path) -> dict[str, Any]:
    """``ctl/supervisor-state.json`` as the next daemon will read it."""
    hosts: dict[str, Any] = json.loads((root / "ctl" / "supervisor-state.json").read_text())[
        "hosts"
    ]
    return hosts


async def until_some_host_cools_down(daemon: DaemonProcess, root: Path) -> str:
    """Wait until a host waits out a cooldown of 3 s more, persisted; its name."""
    found: list[str] = []

    def persisted(s: dict[str, Any]) -> bool:
        """A host cools down for 3 s more and its ``next_restart_at`` is on disk."""
        for name, row in s["hosts"].items():
            if row["state"] == "cooling_down" and (row["next_restart_in_s"] or 0) > 3.0:
                saved = history(root).get(name, {})
                if saved.get("next_restart_at") is not None:
                    found.append(name)
                    return True
        return False

    await daemon.wait_status(persisted, 4 * READY_S, "a persisted cooldown over 3 s")
    return found[0]


async def test_sigkilled_daemon_in_a_restart_storm_is_replaced_safely(
    fault_run: FaultRun,
) -> None:
    """Workers are killed at random while the daemon is SIGKILLed at random moments and
    started again, four times: never two workers on a shard (monitor), restart counts never
    go back, a persisted cooldown is honoured by the next daemon, the last daemon adopts every
    live worker without a launch, and every task gets exactly one result."""
    rng = random.Random(SEED)
    # Cooldowns up to 4 s: long enough that one is still running when the next daemon looks.
    fault_run.write(fault_run.raw(HOSTS, health={"backoff_max_s": 4.0}))
    work = Workload(fault_run.root, shards=HOSTS, total=2400, duration_s=12.0, seed=SEED).start()
    stop_storm = asyncio.Event()
    try:
        daemon = await fault_run.start(ready=HOSTS)
        async with asyncio.TaskGroup() as tg:
            storming = tg.create_task(kill_storm(fault_run, rng, stop_storm))
            for round_ in range(ROUNDS):
                await asyncio.sleep(rng.uniform(0.2, 1.5))  # wait-ok: a random moment (seeded)
                saved_restarts = {h: v["restarts"] for h, v in _history_or_empty(fault_run)}
                daemon.send_signal(signal.SIGKILL)
                assert await daemon.wait_exit() == -signal.SIGKILL
                before = {h: v["restarts"] for h, v in _history_or_empty(fault_run)}
                assert all(before[h] >= n for h, n in saved_restarts.items())
                daemon = await fault_run.start()
                status = await daemon.wait_status(
                    lambda s: len(s["hosts"]) == HOSTS, READY_S, f"round {round_}: answering"
                )
                for name, count in before.items():
                    assert host_row(status, name)["restarts"] >= count, (round_, name)

            # A kill that lands in a cooldown: the next daemon must wait it out.
            cooling = await until_some_host_cools_down(daemon, fault_run.root)
            stop_storm.set()
            daemon.send_signal(signal.SIGKILL)
            assert await daemon.wait_exit() == -signal.SIGKILL
            killed = await storming
        assert killed >= ROUNDS
        saved = history(fault_run.root)
        live_before = {w.host: w.pid for w in fault_run.monitor.live()}
        started_at = time.monotonic()
        final = await fault_run.start()
        status = await final.wait_status(
            lambda s: all_ready(s, HOSTS), 4 * READY_S, "every host ready after the storm"
        )
        fault_run.recovered("last daemon after the storm: every host ready", started_at)

        # The cooldown of the host killed mid-backoff was kept across the daemon's death.
        deadline = saved[cooling]["next_restart_at"]
        first_launch = events(final, "host.launch", host=cooling)
        if cooling not in live_before:  # (its worker may have been relaunched just in time)
            assert first_launch, events(final, "host.state", host=cooling)
            assert wall(first_launch[0]) >= deadline - SLACK_S, (deadline, first_launch[0])
            probe = events(final, "host.probe", host=cooling)[0]
            if wall(probe) < deadline - SLACK_S:  # it found the host in the middle of the wait
                deferred = events(final, "host.state", host=cooling, to="cooling_down")
                assert deferred and deferred[0]["reason"].endswith("restart deferred (backoff)")
        # Every worker alive when the last daemon started was adopted, not replaced.
        for host, pid in live_before.items():
            assert host is not None
            assert host_row(status, host)["pid"] == pid, (host, pid, status["hosts"][host])
            assert events(final, "host.launch", host=host) == []
        for host in status["hosts"]:
            assert host_row(status, host)["restarts"] >= saved[host]["restarts"]

        await work.wait_done()
        work.assert_all_done_once()
    finally:
        stop_storm.set()
        work.close()


def _history_or_empty(fault_run: FaultRun) -> list[tuple[str, dict[str, Any]]]:
    """The saved history's hosts, or nothing if no daemon has saved one yet."""
    try:
        return list(history(fault_run.root).items())
    except (FileNotFoundError, ValueError):
        return []
