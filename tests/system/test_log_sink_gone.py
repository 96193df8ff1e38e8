"""The daemon's log reader goes away (the pipe its stdout feeds is closed: a log shipper
that died, `run | tee` with tee killed): supervision and a stop work as before."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor import control
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    all_ready,
    fast_config,
    host_pids,
    kill_quietly,
    pid_alive,
    poll_until,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]


async def read_until_ready(stdout: asyncio.StreamReader) -> None:
    """Read the daemon's JSON lines until ``daemon.ready``."""
    async with asyncio.timeout(60):
        while line := await stdout.readline():
            if json.loads(line).get("event") == "daemon.ready":
                return
    raise AssertionError("the daemon's output ended before daemon.ready")


async def status_when(
    socket: Path, predicate: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """The daemon's status once ``predicate`` holds of it (asked every 50 ms, for 60 s)."""
    found: dict[str, Any] = {}
    ticker = asyncio.Event()  # never set: each wait is a 50 ms tick

    async def holds() -> bool:
        """Ask for the status; whether ``predicate`` holds of it."""
        nonlocal found
        found = await control.request(socket, "status")
        return predicate(found)

    try:
        async with asyncio.timeout(60):
            while not await holds():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await ticker.wait()
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}: {found}") from None
    return found


async def test_sigterm_stops_the_fleet_after_the_log_reader_is_gone(
    openssh: OpenSsh, tmp_path: Path
) -> None:
    """With its stdout's reader gone, the daemon replaces a killed worker, and SIGTERM
    stops both workers and ends it with 0 (it exited at once before, or ignored the stop)."""
    raw = fast_config(openssh, tmp_path / "run", 2, tmp_path)
    config = write_config(tmp_path / "rs.toml", raw)
    socket = Path(raw["control"]["socket"])
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "supervisor.cli",
        "run",
        "-c",
        str(config),
        "--log-format",
        "json",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pids: dict[str, int | None] = {}
    try:
        assert process.stdout is not None
        await read_until_ready(process.stdout)
        status = await status_when(socket, lambda s: all_ready(s, 2), "2 ready")
        pids = host_pids(status)
        # The reader goes: every line the daemon writes from now on meets a broken pipe.
        transport = process._transport  # type: ignore[attr-defined]
        transport.get_pipe_transport(1).close()
        # A worker killed now is still replaced, and says so in lines nobody reads.
        victim = pids["worker-0"]
        assert victim is not None
        kill_quietly(victim)

        # The lines are written (and found undeliverable) from the daemon's writer thread, a
        # moment after the status that shows their effect: wait for the count as well.
        status = await status_when(
            socket,
            lambda s: (
                all_ready(s, 2)
                and host_pids(s)["worker-0"] not in (None, victim)
                and s["daemon"]["log_lines_dropped"] > 0
            ),
            "worker-0 replaced and the lines about it dropped",
        )
        pids = host_pids(status)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            code = await process.wait()
        assert code == 0
        workers = [pid for pid in pids.values() if pid is not None]
        assert len(workers) == 2
        await poll_until(lambda: not any(map(pid_alive, workers)), 30, "the workers stopped")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pid in pids.values():
            kill_quietly(pid)
        # And a replacement started after the last status this test kept (it failed before),
        # if that pid is still one of this test's workers (pids are reused here).
        for pidfile in (tmp_path / "run" / "ctl").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().split()[0])
                if str(tmp_path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    kill_quietly(pid)
