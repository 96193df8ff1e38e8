"""Child processes of the benchmarks: the fleet simulator, and the daemon's log as data.

The daemon runs as ``reward-supervisor run`` (``tests/system/daemonproc.py``'s harness), so
what is measured is the product as systemd runs it, in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ROOT, iso_to_epoch
from tests.system.daemonproc import DaemonProcess

#: The working directory of spawned modules. ``python -m`` puts it first on ``sys.path``,
#: before ``PYTHONPATH``, so an A/B (``bench/ab.py``) points it at a directory without a
#: ``supervisor`` package of its own: otherwise the old arm would import the new code.
CHILD_CWD: Path = ROOT


async def spawn_module(
    module: str, args: list[str], *, limit: int = 1 << 16
) -> asyncio.subprocess.Process:
    """``python -m module args`` from ``CHILD_CWD``, its stdin and stdout piped to us."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        cwd=CHILD_CWD,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=limit,
    )


class SimProcess:
    """``python -m bench.fleetsim``: commands in on stdin, events out on stdout."""

    def __init__(
        self,
        workdir: Path,
        hosts: int,
        *,
        agents: str,
        watch: str,
        stale_s: float,
        fresh: bool = False,
        startup_delay_s: float | None = None,
        work: bool = False,
    ):
        self.args = [
            "--workdir",
            str(workdir),
            "--hosts",
            str(hosts),
            "--agents",
            agents,
            "--watch",
            watch,
            "--stale",
            str(stale_s),
        ]
        if fresh:
            self.args.append("--fresh")  # no workers: the daemon launches every host
        if startup_delay_s is not None:
            self.args += ["--startup-delay", str(startup_delay_s)]
        if work:
            self.args.append("--work")  # heartbeats carry the worker's figures
        self.events: list[dict[str, Any]] = []
        self.process: asyncio.subprocess.Process | None = None
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> dict[str, Any]:
        """Start the simulator; its ``ready`` event (with the daemon's config path)."""
        self.process = await spawn_module("bench.fleetsim", self.args, limit=1 << 20)
        self._reader = asyncio.create_task(self._read())
        return await self.wait_event(lambda e: e["event"] == "ready", 600, "simulator ready")

    @property
    def pid(self) -> int:
        """The simulator's pid."""
        assert self.process is not None
        return self.process.pid

    async def _read(self) -> None:
        """Collect the simulator's events as they arrive."""
        assert self.process is not None
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))
                self._changed.set()

    async def send(self, **command: Any) -> None:
        """One command line."""
        assert self.process is not None
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()

    async def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
    ) -> dict[str, Any]:
        """The first event (ever) matching ``predicate``."""
        async with asyncio.timeout(timeout_s):
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                if self.process is not None and self.process.returncode is not None:
                    raise RuntimeError(f"simulator exited while waiting for {what}")
                self._changed.clear()
                await self._changed.wait()

    async def wait_host_event(self, event: str, host: str, timeout_s: float) -> dict[str, Any]:
        """The first ``event`` about ``host``."""
        return await self.wait_event(
            lambda e: e.get("event") == event and e.get("host") == host, timeout_s, event
        )

    async def aclose(self) -> None:
        """Quit (the simulator kills its workers), or kill it."""
        if self.process is None:
            return
        if self.process.returncode is None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.send(cmd="quit")
            try:
                async with asyncio.timeout(60):
                    await self.process.wait()
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class LogIndex:
    """The daemon's JSON log lines, looked up by event and host without rescanning."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self._seen = 0
        self.by_event: dict[str, list[dict[str, Any]]] = {}

    def update(self) -> None:
        """Index the lines that arrived since the last call."""
        lines = self.daemon.lines
        for line in lines[self._seen :]:
            self.by_event.setdefault(str(line.get("event")), []).append(line)
        self._seen = len(lines)

    def find(
        self, event: str, after: float = 0.0, **fields: Any
    ) -> tuple[float, dict[str, Any]] | None:
        """The first line of ``event`` with these field values stamped after ``after``."""
        self.update()
        for line in self.by_event.get(event, []):
            if all(line.get(k) == v for k, v in fields.items()):
                t = iso_to_epoch(line["timestamp"])
                if t >= after:
                    return t, line
        return None

    async def wait(
        self, event: str, timeout_s: float, after: float = 0.0, **fields: Any
    ) -> tuple[float, dict[str, Any]]:
        """``find``, waiting for it (re-checked on every new line)."""
        found: list[tuple[float, dict[str, Any]]] = []

        def seen() -> bool:
            """Whether the line has arrived (kept in ``found``)."""
            hit = self.find(event, after, **fields)
            if hit is not None:
                found.append(hit)
            return hit is not None

        await self.daemon.wait_until(seen, timeout_s, f"{event} {fields}")
        return found[0]

    def count(self, event: str, **fields: Any) -> int:
        """Lines of ``event`` with these field values."""
        self.update()
        return sum(
            1
            for line in self.by_event.get(event, [])
            if all(line.get(k) == v for k, v in fields.items())
        )


async def stop_daemon(daemon: DaemonProcess) -> None:
    """SIGTERM the daemon, give it a minute to exit (it stops its workers first), and
    release its pipes."""
    with contextlib.suppress(ProcessLookupError):
        daemon.send_signal(signal.SIGTERM)
    with contextlib.suppress(AssertionError):
        await daemon.wait_exit(60)
    await daemon.aclose()
