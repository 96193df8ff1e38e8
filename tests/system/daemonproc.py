"""``reward-supervisor run`` as a real subprocess, with a datagram socket as NOTIFY_SOCKET.

The harness keeps every stdout line (parsed as JSON, or recorded as bad) and every sd_notify
datagram, and offers waits on observable conditions with deadlines; nothing sleeps blindly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor import control
from supervisor.config import load
from supervisor.demo.worker import argv_template
from supervisor.errors import ControlError
from supervisor.seedimport import render_toml
from tests.sshd import OpenSsh

_NOTIFY_NUMBERS = itertools.count()
#: How long a status reply waits for the log lines logged before it, at most.
LOG_CATCH_UP_S = 10.0

# The reference worker heartbeating fast, so tests see changes in fractions of a second.
FAST_WORKER_ARGV = argv_template(heartbeat_interval_s=0.2)
FAST_HEALTH = {
    "heartbeat_stale_s": 3.0,
    "ready_timeout_s": 30.0,
    "restart_cooldown_s": 0.5,
    "backoff_max_s": 2.0,
    "stop_grace_s": 5.0,
    "kill_after_grace": True,
}


def fast_config(
    openssh: OpenSsh, root: Path, hosts: int, socket_dir: Path, **sections: Mapping[str, Any]
) -> dict[str, Any]:
    """A raw config for ``hosts`` fast-beating reference workers on the OpenSSH fixture;
    ``sections`` are merged into the config's tables key by key."""
    raw = openssh.config_dict(root, hosts, argv=FAST_WORKER_ARGV, health=FAST_HEALTH)
    # A short private path (sun_path is 108 bytes; a mount may be world-writable).
    raw["control"]["socket"] = str(socket_dir / "control.sock")
    for name, value in sections.items():
        raw.setdefault(name, {}).update(value)
    return raw


def write_config(path: Path, raw: Mapping[str, Any]) -> Path:
    """Write ``raw`` (a config as TOML would parse it) to ``path`` as TOML."""
    path.write_text(render_toml(raw), encoding="utf-8")
    return path


class DaemonProcess:
    """One ``reward-supervisor run -c CONFIG`` child process and what it says."""

    def __init__(
        self,
        config_path: Path,
        workdir: Path,
        *,
        args: Sequence[str] = (),
        control_socket: Path | None = None,
    ) -> None:
        self.config_path = config_path
        self.workdir = workdir
        #: More arguments of ``run`` (``--standby``, ``--control-socket PATH``: then pass
        #: ``control_socket`` too, the one the daemon will answer on).
        self.args = tuple(args)
        # Read once: a test may break the file later to exercise a failed reload.
        self.socket = control_socket or load(config_path).control.socket
        self.lines: list[dict[str, Any]] = []
        self.bad_lines: list[str] = []
        self.notifications: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        # Short: an AF_UNIX path stops at 107 bytes and the test's directory is already long.
        self._notify_path = workdir / f"n{next(_NOTIFY_NUMBERS)}.sock"
        self._notify: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()

    async def start(self, *, watchdog_usec: int | None = None, prefix: Sequence[str] = ()) -> None:
        """Spawn the daemon with NOTIFY_SOCKET (and WATCHDOG_USEC) pointing at us; ``prefix``
        is a command that execs the rest (``prlimit --nofile=N:N --``)."""
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self._notify_path))
        self._notify.setblocking(False)
        env = dict(os.environ)
        env["NOTIFY_SOCKET"] = str(self._notify_path)
        env.pop("WATCHDOG_PID", None)
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        else:
            env.pop("WATCHDOG_USEC", None)
        self.process = await asyncio.create_subprocess_exec(
            *prefix,
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            "-c",
            str(self.config_path),
            "--log-format",
            "json",
            *self.args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        loop = asyncio.get_running_loop()
        loop.add_reader(self._notify.fileno(), self._on_datagram)
        self._tasks.append(asyncio.create_task(self._read_stdout()))

    def _on_datagram(self) -> None:
        """Drain every datagram waiting on the notify socket."""
        assert self._notify is not None
        with contextlib.suppress(BlockingIOError):
            while True:
                self.notifications.append(self._notify.recv(65536).decode())
                self._changed.set()

    async def _read_stdout(self) -> None:
        """Keep every stdout line, parsed as JSON or recorded as bad."""
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            text = raw.decode(errors="replace").rstrip("\n")
            try:
                parsed = json.loads(text)
            except ValueError:
                self.bad_lines.append(text)
            else:
                if isinstance(parsed, dict):
                    self.lines.append(parsed)
                else:
                    self.bad_lines.append(text)
            self._changed.set()

    # --- waiting ------------------------------------------------------------------------

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait until ``predicate()`` holds (re-checked on output and every 50 ms)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    self._fail_if_exited(what)
                    self._changed.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {what}\n{self.tail()}"
            ) from None

    async def wait_notify(self, text: str, timeout_s: float = 60.0, *, after: int = 0) -> int:
        """Index of the first datagram at or after ``after`` containing the line ``text``."""
        found: list[int] = []

        def seen() -> bool:
            """Record the first matching datagram's index."""
            for i in range(after, len(self.notifications)):
                if text in self.notifications[i].splitlines():
                    found.append(i)
                    return True
            return False

        await self.wait_until(seen, timeout_s, f"notify {text!r}")
        return found[0]

    async def wait_log(self, event: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        """The first log line with ``event`` and the given field values."""
        match: list[dict[str, Any]] = []

        def seen() -> bool:
            """Record the first matching log line."""
            for line in self.lines:
                if line.get("event") == event and all(line.get(k) == v for k, v in fields.items()):
                    match.append(line)
                    return True
            return False

        await self.wait_until(seen, timeout_s, f"log event {event} {fields}")
        return match[0]

    async def status(self) -> dict[str, Any]:
        """The daemon's ``status`` reply over the control socket, returned once every line the
        daemon logged before the reply has been read (it writes its log from a thread of its
        own, so a line can reach us after a reply it precedes)."""
        reply: dict[str, Any] = await control.request(self.socket, "status")
        await self._read_log_up_to(reply)
        return reply

    async def _read_log_up_to(self, reply: Mapping[str, Any]) -> None:
        """Wait (at most ``LOG_CATCH_UP_S``) until we hold the lines logged before ``reply``."""
        row = reply.get("daemon") or {}
        logged = row.get("log_lines")
        if not isinstance(logged, int):
            return  # a standby's or an older daemon's reply: nothing to wait for
        wanted = logged - int(row.get("log_lines_dropped") or 0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LOG_CATCH_UP_S):
                while len(self.lines) < wanted and self.process is not None:
                    if self.process.returncode is not None:
                        return
                    self._changed.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await self._changed.wait()

    async def wait_status(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
    ) -> dict[str, Any]:
        """Poll ``status`` until ``predicate(status)`` holds; return that status."""
        last: dict[str, Any] = {}
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    self._fail_if_exited(what)
                    # KeyError: the control socket answers while the daemon still reads its
                    # run directory, before it has any host; such a status is "not yet".
                    with contextlib.suppress(ControlError, KeyError):
                        last = await self.status()
                        if predicate(last):
                            return last
                    await asyncio.sleep(0.05)  # wait-ok: polling interval of a deadline loop
        except TimeoutError:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {what}\nlast status: "
                f"{json.dumps(last.get('hosts', {}), indent=1)[:3000]}\n{self.tail()}"
            ) from None

    def _fail_if_exited(self, what: str) -> None:
        """Stop waiting at once when the daemon has already exited."""
        if self.process is not None and self.process.returncode is not None:
            code = self.process.returncode
            raise AssertionError(f"daemon exited ({code}) while waiting for {what}\n{self.tail()}")

    async def wait_exit(self, timeout_s: float = 60.0) -> int:
        """The exit code, once the process has exited."""
        assert self.process is not None
        try:
            async with asyncio.timeout(timeout_s):
                code = await self.process.wait()
        except TimeoutError:
            raise AssertionError(
                f"daemon did not exit within {timeout_s}s\n{self.tail()}"
            ) from None
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return code

    def send_signal(self, signum: int) -> None:
        """Deliver a real signal to the daemon."""
        assert self.process is not None
        self.process.send_signal(signum)

    async def aclose(self) -> None:
        """Kill the daemon if still running and release the notify socket."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._notify is not None:
            asyncio.get_running_loop().remove_reader(self._notify.fileno())
            self._notify.close()
            self._notify = None

    def tail(self, lines: int = 30) -> str:
        """The last output lines, for failure messages."""
        shown = [json.dumps(x) for x in self.lines[-lines:]] + self.bad_lines[-10:]
        return "daemon output:\n" + "\n".join(shown)


class Daemons(list[DaemonProcess]):
    """The daemons of one test; ``start`` spawns one and remembers it for cleanup."""

    async def start(self, config: Path, **kwargs: Any) -> DaemonProcess:
        """Run ``reward-supervisor run -c config`` as a subprocess."""
        daemon = DaemonProcess(config, config.parent)
        self.append(daemon)
        await daemon.start(**kwargs)
        return daemon


async def poll_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Re-check ``predicate`` every 50 ms until it holds; fail after ``timeout_s``."""
    ticker = asyncio.Event()  # never set: each wait is a 50 ms tick bounded by timeout
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await ticker.wait()
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def host_pids(status: Mapping[str, Any]) -> dict[str, int | None]:
    """Host name → current worker pid, from a status reply."""
    return {name: row.get("pid") for name, row in status["hosts"].items()}


def all_ready(status: Mapping[str, Any], n: int | None = None) -> bool:
    """Every host (and exactly ``n`` hosts, if given) is ready."""
    hosts = status.get("hosts", {})
    if n is not None and len(hosts) != n:
        return False
    return bool(hosts) and all(row.get("state") == "ready" for row in hosts.values())


def kill_quietly(pid: int | None) -> None:
    """SIGKILL ``pid`` if it still exists (test cleanup)."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
