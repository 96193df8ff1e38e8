"""The least any supervisor can do to notice every heartbeat of a fleet: the scale floor.

    python -m bench.floor --part watch|read|core --mode inotify|poll --root RUN_ROOT
    python -m bench.floor --part ssh --config DAEMON_TOML

Runs until stdin closes (or SIGTERM), doing one part of what the design requires of a
supervisor and nothing else, in one thread where it can:

- ``watch``: in ``inotify`` mode watchfiles' ``awatch`` on ``status/`` with the daemon's
  settings (debounce 50 ms, step 10 ms, not recursive) but no filter; in ``poll`` mode one
  listing of ``status/`` a second;
- ``read``: the same, and each changed heartbeat file opened, read and parsed with
  ``json.loads``: a heartbeat counts only when its ``heartbeat_at`` or ``seq`` changed
  (DESIGN.md §4), so every rewrite must be read;
- ``core``: ``read``, and each heartbeat read then stepped through its host's state machine
  (``health.step``, the host ready and steady): reading plus the least the core adds to
  it, without the daemon's hardened reads, reader thread and bookkeeping;
- ``ssh``: one asyncssh connection to every host of the daemon's config, with its
  keepalive settings and ciphers, held open and idle (the daemon keeps one per host).

No state machine (but in ``core``), no logging, no second thread of our own.
``bench/scale.py`` runs it against the same simulated fleet as the daemon and measures its
CPU the same way, so the report can say how far above this floor the daemon is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time

import asyncssh
from watchfiles import awatch

from bench.bench_core import POLICY, ready_host
from supervisor import config as configuration
from supervisor import health
from supervisor.remote import connect_options

#: The parts, each measured on its own: watching status/, watching and reading each changed
#: heartbeat, the same with each heartbeat stepped through the core, holding the fleet's SSH
#: connections.
PARTS = ("watch", "read", "core", "ssh")
#: The daemon's debounce (config ``[watch] debounce_ms``), and the step it derives from it.
DEBOUNCE_MS = 50
STEP_MS = 10


def read_heartbeat(path: str) -> object:
    """Open, read and parse one status file; None for a file that vanished or is partial."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        return json.loads(data)
    except ValueError:
        return None


class Core:
    """Each host's state machine, stepped with every heartbeat read (``--part core``)."""

    def __init__(self) -> None:
        """No host seen yet."""
        self.hosts: dict[str, health.Host] = {}

    def beat(self, path: str, status: object) -> None:
        """Step the host of ``path`` (ready on its first heartbeat) with ``status``."""
        if not isinstance(status, dict):
            return
        pid, at, seq = status.get("pid"), status.get("heartbeat_at"), status.get("seq")
        if not (isinstance(pid, int) and isinstance(at, int | float)):
            return  # not a heartbeat the simulator writes
        event = health.HeartbeatSeen(
            pid=pid,
            ready=True,
            remote_heartbeat_at=float(at),
            remote_seq=seq if isinstance(seq, int) else None,
        )
        now = time.monotonic()
        host = self.hosts.get(path)
        if host is None:
            host = ready_host(path, now, pid=event.pid)
        self.hosts[path], _ = health.step(host, event, now, POLICY)  # as built


async def watch_inotify(status: str, core: Core | None, read: bool, stop: asyncio.Event) -> None:
    """watchfiles on ``status/``; each changed heartbeat file read (``read``), and stepped
    through ``core``."""
    async for changes in awatch(
        status,
        watch_filter=None,
        debounce=DEBOUNCE_MS,
        step=STEP_MS,
        stop_event=stop,
        recursive=False,
        force_polling=False,
    ):
        if read:
            for _change, path in changes:
                if path.endswith(".json") and not path.rpartition("/")[2].startswith("."):
                    found = read_heartbeat(path)
                    if core is not None:
                        core.beat(path, found)


async def watch_poll(status: str, core: Core | None, read: bool, stop: asyncio.Event) -> None:
    """One listing of ``status/`` a second; each file with a new inode read (``read``), and
    stepped through ``core``."""
    inodes: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    due = loop.time()
    while not stop.is_set():
        with os.scandir(status) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(".") or not name.endswith(".json"):
                    continue
                inode = entry.inode()
                if inodes.get(name) != inode:
                    inodes[name] = inode
                    if read:
                        found = read_heartbeat(entry.path)
                        if core is not None:
                            core.beat(entry.path, found)
        due += 1.0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, due - loop.time())):
                await stop.wait()


async def hold_connections(config_path: str, stop: asyncio.Event) -> None:
    """One idle connection per host of the daemon's config until ``stop``; "ready" once all
    are up."""
    cfg = configuration.load(config_path)
    handshakes = asyncio.Semaphore(cfg.ssh.max_concurrent_handshakes)  # as the daemon does
    # The keepalive each connection of the daemon uses (spread over the fleet, where the
    # supervisor imported has that).
    spread = getattr(configuration, "fleet_ssh", None)
    ssh = cfg.ssh if spread is None else spread(cfg.ssh, len(cfg.hosts))

    async def connect(host: configuration.HostConfig) -> asyncssh.SSHClientConnection:
        """One connection, opened as the daemon opens it."""
        async with handshakes:
            return await asyncssh.connect(host.address, host.port, **connect_options(host, ssh))

    conns = await asyncio.gather(*(connect(host) for host in cfg.hosts))
    try:
        print(json.dumps({"event": "ready", "connections": len(conns)}), flush=True)
        await stop.wait()
    finally:
        for conn in conns:
            conn.close()
        await asyncio.gather(*(conn.wait_closed() for conn in conns))


async def main_async(args: argparse.Namespace) -> None:
    """Do the part until stdin closes or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def stop_on_eof() -> None:
        """The parent closing our stdin ends the run (a pipe read on the loop: cancellable)."""
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await reader.read()
        stop.set()

    async with asyncio.TaskGroup() as tg:
        eof = tg.create_task(stop_on_eof())
        if args.part == "ssh":
            await hold_connections(args.config, stop)
        else:
            watch = watch_inotify if args.mode == "inotify" else watch_poll
            print(json.dumps({"event": "ready"}), flush=True)
            core = Core() if args.part == "core" else None
            read = args.part in ("read", "core")
            await watch(os.path.join(args.root, "status"), core, read, stop)
        eof.cancel()


def main() -> None:
    """Parse arguments and do the part."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS, required=True, help="what to do")
    parser.add_argument("--root", help="watch, read: the run root whose status/ to watch")
    parser.add_argument("--mode", choices=("inotify", "poll"), help="watch, read: how")
    parser.add_argument("--config", help="ssh: the daemon's config (hosts, keys, keepalive)")
    args = parser.parse_args()
    if args.part == "ssh" and not args.config:
        parser.error("--part ssh needs --config")
    if args.part != "ssh" and not (args.root and args.mode):
        parser.error(f"--part {args.part} needs --root and --mode")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
