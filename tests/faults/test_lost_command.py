"""The lost command: a start-host answered, and its host stopped for good after it.

Chaos runs once ended with a host ``stopped`` ("stop sentinel present") for minutes after
the final ``start-host`` had answered success, each time with a stop-host issued near a
daemon restart. The cause: stop-host writes ``ctl/HOST.stop`` and start-host removes it, each
in a thread of its own, and the fleet core issued the removal while the write was still
under way; the removal could finish first, start-host was answered, and the write landing
after it stopped the host again with nothing left to start it. The core now runs one
sentinel operation per host at a time, in the commands' order (``fleet._sentinel_command``).

Here: stop-host and start-host sent together, start-host last, round after round, with the
daemon SIGKILLed and started again between rounds; after every round the last command wins.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

from supervisor import control
from supervisor.errors import ControlError
from tests.faults.harness import READY_S, FaultRun, host_row
from tests.system.daemonproc import DaemonProcess, all_ready

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

HOSTS = 2
TARGET = "worker-0"
ROUNDS = 6
#: Pairs of stop-host/start-host sent at once in a round.
PAIRS = 4
#: How long the host is watched after the last start-host, to see that it stays up: the
#: original failure kept it stopped for 60 s and more.
WATCH_S = 3.0


async def command(daemon: DaemonProcess, cmd: str) -> dict[str, Any] | None:
    """``cmd`` for TARGET on the daemon's socket; None if it was refused (a daemon starting
    or stopping refuses, as the CLI would report)."""
    try:
        reply: dict[str, Any] = await control.request(daemon.socket, cmd, host=TARGET)
    except ControlError:
        return None
    return reply


async def start_host_answered(daemon: DaemonProcess) -> None:
    """Send start-host until the daemon answers it with success (it refuses while the host
    is still joining after a restart)."""
    deadline = time.monotonic() + READY_S
    while await command(daemon, "start-host") is None:
        assert time.monotonic() < deadline, "start-host never answered"
        await asyncio.sleep(0.05)  # wait-ok: a retry's pause, not a wait for a condition


async def burst(daemon: DaemonProcess) -> None:
    """PAIRS stop-host and start-host sent at once, each stop-host's start-host right behind
    it, and a last start-host answered with success."""
    async with asyncio.TaskGroup() as tg:
        for _ in range(PAIRS):
            tg.create_task(command(daemon, "stop-host"))
            tg.create_task(command(daemon, "start-host"))
    await start_host_answered(daemon)


async def stays_up(daemon: DaemonProcess, fault_run: FaultRun, round_: int) -> None:
    """After the last start-host: TARGET reaches ready, no sentinel is on disk, and it is not
    stopped again while watched."""
    sentinel = fault_run.root / "ctl" / f"{TARGET}.stop"
    await daemon.wait_status(
        lambda s: host_row(s, TARGET)["state"] == "ready", READY_S, f"round {round_}: ready"
    )
    watched_until = time.monotonic() + WATCH_S
    while time.monotonic() < watched_until:
        row = host_row(await daemon.status(), TARGET)
        assert row["state"] not in ("stopping", "stopped"), (round_, row)
        assert not sentinel.exists(), (round_, row)
        await asyncio.sleep(0.1)  # wait-ok: the watch's sampling interval


async def test_the_last_start_host_wins_over_stop_hosts_in_flight_around_daemon_restarts(
    fault_run: FaultRun,
) -> None:
    """stop-host and start-host sent together, start-host answered last, round after round
    with a daemon SIGKILL and restart between rounds (and a stop-host right before each
    kill): after each round the host runs, stays running, and no stop sentinel is left."""
    fault_run.write(fault_run.raw(HOSTS))
    daemon = await fault_run.start(ready=HOSTS)
    for round_ in range(ROUNDS):
        await burst(daemon)
        await stays_up(daemon, fault_run, round_)
        # A stop-host issued near the restart: sent, and the daemon killed at once.
        stop = asyncio.create_task(command(daemon, "stop-host"))
        await asyncio.sleep(0)  # wait-ok: let the request go out before the kill
        daemon.send_signal(signal.SIGKILL)
        assert await daemon.wait_exit() == -signal.SIGKILL
        await stop
        daemon = await fault_run.start()
        await daemon.wait_status(lambda s: len(s["hosts"]) == HOSTS, READY_S, "answering")
    await burst(daemon)
    await stays_up(daemon, fault_run, ROUNDS)
    status = await daemon.wait_status(lambda s: all_ready(s, HOSTS), READY_S, "all ready")
    assert host_row(status, TARGET)["state"] == "ready"
