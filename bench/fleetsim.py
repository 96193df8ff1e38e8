"""A simulated fleet of N worker hosts on this machine, for the scale benchmark.

    python -m bench.fleetsim --workdir DIR --hosts N [--agents inproc|real] [--watch MODE]
                             [--fresh [--startup-delay S]]

What is real and what is simulated (the report repeats this):

- SSH: one asyncssh listener per host on 127.0.0.1 (its own port, its own known_hosts line),
  ed25519 host key, public-key login: the daemon's side is the product's own code, unchanged:
  connection, keepalives, agent channel, probe/launch/terminate requests.
- The agent: with ``--agents real`` each host runs the real ``agent.py`` as a python process
  (``LocalSshServer``), which costs ~8 MB and ~40 ms of CPU per host on this one machine. With
  ``--agents inproc`` (the default) the server answers the agent protocol itself, calling the
  very functions of ``supervisor/agent.py`` (probe, launch through the real shepherd,
  terminate) in a thread pool of this process: the daemon cannot tell the difference.
- Workers: one ``sleep`` process per host, with the pidfile and launch record (pid, start time,
  boot id) a shepherd would have written, so the probe adopts it. A heartbeat writer in this
  process rewrites every host's ``status/<host>.json`` once per interval (temp file + rename,
  staggered evenly, no fsync), with the pid the host's pidfile names: after the daemon replaces
  a worker (a real shepherd launching ``sleep``), the new pid heartbeats.
- ``--work``: each heartbeat also carries the AReaL worker's own figures of its work
  (``completed`` growing by 3 a beat, ``errors``, ``inflight``, ``queue_depth``,
  ``concurrency``, ``rss_gib``), as the fleet page and the ``reward_worker_*`` series show
  them; without it a heartbeat is the seed's fields alone.
- ``--fresh``: no worker, pidfile, launch record or status file at start (not even the run
  root's directories), so the daemon launches every host itself (the real shepherd starts
  ``sleep`` and writes the pidfile), as on a fleet's first start. The in-process agent's
  launcher is started before ``ready``, as a real agent starts its own when it starts. A
  worker's first heartbeat is written ``--startup-delay`` seconds (default 0.05: the
  reference worker takes ~65 ms from spawn to ready) after its spawn (``launched_at`` of the
  launch record, which the shepherd stamps right after the spawn and writes after the
  pidfile), not at its next slot; it then beats in its slot once per interval. Only a
  host's first worker is timed so: replacements start beating at their next slot, as
  without ``--fresh``.

stdin takes JSON commands, one per line; stdout reports JSON events, one per line:

- ``{"cmd": "exit", "host": H}``: SIGKILL H's worker and write its exit record as a shepherd
  would; reports ``exit_written`` with the wall time of the rename (``t``) and of the kill
  (``killed``). The simulated agents watch every worker they found or launched and push its
  exit, as the real agent does (where the agent module has ``ExitWatch``).
- ``{"cmd": "silence", "host": H}``: stop H's heartbeats until its pid changes; reports
  ``silenced`` with the wall time of H's last write.
- a new pid's first heartbeat reports ``first_beat`` with the wall time of the rename (with
  ``--fresh``, a host's first worker's also ``launched_at`` from its launch record).
- ``{"cmd": "stats"}`` reports ``stats`` (writes, writer lateness); ``{"cmd": "quit"}`` ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from bench.common import percentile, raise_nofile, read_json, start_time, write_atomic
from supervisor import agent
from supervisor.remote import agent_program
from supervisor.seedimport import render_toml

try:
    from supervisor.demo.sshserver import LocalSshServer
except ImportError:  # an A/B's old arm, from before the demo subpackage
    LocalSshServer = importlib.import_module("supervisor.sshserver").LocalSshServer  # type: ignore[misc]

# Heartbeat writes are grouped into ticks of this length; a host's write lands in its slot.
TICK_S = 0.01
# Threads answering agent requests; probes take microseconds, launches ~0.1 s, terminates as
# long as the worker takes to die.
AGENT_THREADS = 64
# The fake worker a replacement launch starts: sleep, with the host name as $0 so `ps` shows it.
WORKER_ARGV = ["/bin/sh", "-c", "exec sleep 1000000", "{host}"]


def _emit(event: str, **fields: Any) -> None:
    """One JSON event line on stdout, flushed at once."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


# --- SSH endpoints with the agent answered in-process -----------------------------------


#: Every simulated host's agent watches its workers and pushes their exits, as the real
#: agent does, with one watch (one thread, no limit: a real agent keeps 64, enough for its one
#: host) for the whole fleet; None where the agent module
#: has none (an older checkout's, in bench/ab.py's old arm): no pushes, as its agent.
EXITS: Any = agent.ExitWatch(limit=1 << 20) if hasattr(agent, "ExitWatch") else None


class _AgentSession(asyncssh.SSHServerSession[bytes]):
    """The agent's protocol on one exec channel, served by this process."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._chan: asyncssh.SSHServerChannel[bytes] | None = None
        self._buffer = b""
        self._loop = asyncio.get_running_loop()

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:
        """Keep the channel to answer on."""
        self._chan = chan

    def exec_requested(self, command: str) -> bool:
        # Only the agent is served; the daemon runs nothing else over SSH.
        """Accept the agent command only."""
        return command.endswith(" agent") and " -c " in command

    def session_started(self) -> None:
        """Greet as the agent does."""
        hello: Any = agent.hello()
        # A typed message since the protocol module; a plain dict in an A/B's old arm.
        if dataclasses.is_dataclass(hello) and not isinstance(hello, type):
            hello = dataclasses.asdict(hello)
        self._send({"hello": hello})

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        """Answer each complete request line in the thread pool."""
        self._buffer += data
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            try:
                request = json.loads(line)
            except ValueError as exc:
                request = {"op": "bad request", "error": str(exc)}
            future = asyncio.get_running_loop().run_in_executor(self._pool, agent.answer, request)
            future.add_done_callback(lambda f, r=request: self._answered(r, f.result()))

    def _answered(self, request: Any, reply: dict[str, Any]) -> None:
        """Send the reply, then watch what it launched or found (as the agent does)."""
        self._send(reply)
        if EXITS is None:
            return
        target = agent.watch_target(request, reply)
        if target is not None:
            EXITS.watch(*target, self._push)

    def _push(self, line: str) -> None:
        """A pushed exit line, from the watch's thread."""
        self._loop.call_soon_threadsafe(self._send_line, line)

    def _send_line(self, line: str) -> None:
        if self._chan is not None and not self._chan.is_closing():
            self._chan.write(line.encode())

    def eof_received(self) -> bool:
        """End the channel as the agent ends at EOF."""
        if self._chan is not None:
            self._chan.exit(0)  # the agent exits at EOF
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop answering."""
        self._chan = None

    def _send(self, message: dict[str, Any]) -> None:
        """One response line, unless the channel is closing."""
        if self._chan is not None and not self._chan.is_closing():
            self._chan.write((json.dumps(message, separators=(",", ":")) + "\n").encode())


class _Server(asyncssh.SSHServer):
    """An SSH server accepting the daemon's key and serving the agent."""

    def __init__(self, client_public: bytes, pool: ThreadPoolExecutor) -> None:
        self._client_public = client_public
        self._pool = pool

    def begin_auth(self, username: str) -> bool:
        """Every user must authenticate."""
        return True

    def public_key_auth_supported(self) -> bool:
        """Public-key login is the only method."""
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        """Only the daemon's client key logs in."""
        return key.public_data == self._client_public

    def session_requested(self) -> _AgentSession:
        """A session answers the agent protocol."""
        return _AgentSession(self._pool)


class InprocFleet:
    """One listener per host; the agent protocol answered by this process."""

    def __init__(self, workdir: Path, names: list[str]) -> None:
        self.workdir = workdir
        self.names = names
        self.client_key_path = workdir / "id_ed25519"
        self.known_hosts_path = workdir / "known_hosts"
        self.endpoints: dict[str, tuple[str, int]] = {}
        self._acceptors: list[asyncssh.SSHAcceptor] = []
        self._pool = ThreadPoolExecutor(AGENT_THREADS, thread_name_prefix="agent")

    async def start(self) -> None:
        """Keys, one listener per host and the known_hosts file naming them all."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        fd = os.open(self.client_key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(client_key.export_private_key())
        public = client_key.public_data
        for name in self.names:
            acceptor = await asyncssh.listen(
                host="127.0.0.1",
                port=0,
                server_factory=lambda: _Server(public, self._pool),
                server_host_keys=[host_key],
                config=None,
                encoding=None,
                allow_pty=False,
                x11_forwarding=False,
                agent_forwarding=False,
                allow_scp=False,
                password_auth=False,
                kbdint_auth=False,
                host_based_auth=False,
                gss_host=None,
                backlog=1024,
            )
            self._acceptors.append(acceptor)
            self.endpoints[name] = ("127.0.0.1", acceptor.get_port())
        line = host_key.export_public_key().decode().strip()
        self.known_hosts_path.write_text(
            "".join(f"[{a}]:{p} {line}\n" for a, p in self.endpoints.values())
        )

    async def aclose(self) -> None:
        """Close the listeners and the thread pool."""
        for acceptor in self._acceptors:
            acceptor.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


# --- workers and heartbeats -------------------------------------------------------------


@dataclass
class SimHost:
    """One simulated host: its worker pid and heartbeat state."""

    name: str
    shard: int
    pid: int | None = None
    child: subprocess.Popen[bytes] | None = None
    pid_sig: tuple[int, int] | None = None
    seq: int = 0
    silenced: bool = False
    last_write: float = 0.0
    first_beat_pending: bool = False
    #: --fresh: no first worker's heartbeat written yet; the slot writer leaves it alone.
    awaiting_first: bool = False
    #: --fresh: the first worker's ``launched_at``, for its ``first_beat`` event.
    launched_at: float | None = None
    writes: int = 0
    #: Wall time of the last ``exit`` command's SIGKILL: the crash.
    killed_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Fleet:
    """The hosts, their fake workers and the heartbeat writer."""

    def __init__(
        self,
        root: Path,
        names: list[str],
        interval_s: float,
        startup_delay_s: float = 0.0,
        *,
        work: bool = False,
    ) -> None:
        self.root = root
        self.work = work
        self.hosts = [SimHost(name, i) for i, name in enumerate(names)]
        self.by_name = {h.name: h for h in self.hosts}
        self.interval_s = interval_s
        self.startup_delay_s = startup_delay_s
        #: --fresh: hosts whose first launch record has not appeared yet.
        self.pending: list[SimHost] = []
        self.lateness: list[float] = []
        self.writes = 0
        self._boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()

    def status_path(self, host: SimHost) -> Path:
        """``status/<host>.json``."""
        return self.root / "status" / f"{host.name}.json"

    def pidfile(self, host: SimHost) -> Path:
        """``ctl/<host>.pid``."""
        return self.root / "ctl" / f"{host.name}.pid"

    def spawn_workers(self) -> None:
        """A ``sleep`` per host, recorded as a shepherd would record a launched worker."""
        for d in ("ctl", "status", "outbox", "inbox"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        for host in self.hosts:
            argv = ["sleep", "1000000"]
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
            host.child, host.pid = child, child.pid
            record = {
                "pid": child.pid,
                "start_time": start_time(child.pid),
                "boot_id": self._boot_id,
                "argv": argv,
                "host": host.name,
                "shard": host.shard,
                "shepherd_pid": os.getpid(),
                "launched_at": time.time(),
            }
            ctl = self.root / "ctl"
            write_atomic(ctl / f"{host.name}.launch.json", json.dumps(record).encode())
            write_atomic(self.pidfile(host), f"{child.pid}\n".encode())
            host.pid_sig = _sig(self.pidfile(host))
            self.beat(host)

    def expect_launches(self) -> None:
        """--fresh: no worker anywhere; every host waits for the daemon to launch its first."""
        for host in self.hosts:
            host.awaiting_first = True
        self.pending = list(self.hosts)

    def watch_first_launches(self, loop: asyncio.AbstractEventLoop) -> None:
        """Schedule the first heartbeat of each pending host whose launch record has
        appeared, at its ``launched_at`` + the start-up delay (a real worker beats once it
        is up, not in a slot). Looked at every tick: the delay absorbs the tick's lag."""
        still: list[SimHost] = []
        for host in self.pending:
            record = read_json(self.root / "ctl" / f"{host.name}.launch.json")
            if record is None:
                still.append(host)
                continue
            host.launched_at = float(record["launched_at"])
            delay = max(0.0, host.launched_at + self.startup_delay_s - time.time())
            loop.call_later(delay, self._first_beat, host)
        self.pending = still

    def _first_beat(self, host: SimHost) -> None:
        """The first worker's ready heartbeat; its slot writes the next ones."""
        host.awaiting_first = False
        self.beat(host)

    def beat(self, host: SimHost) -> None:
        """Write one heartbeat for ``host`` (if its worker lives and it is not silenced)."""
        if host.awaiting_first:
            return  # --fresh: its first worker is not up yet
        sig = _sig(self.pidfile(host))
        if sig != host.pid_sig:
            host.pid_sig = sig
            pid = _read_pid(self.pidfile(host))
            if pid is not None and pid != host.pid:
                host.pid, host.silenced, host.first_beat_pending = pid, False, True
        if host.silenced or host.pid is None or not _alive(host.pid):
            return
        host.seq += 1
        status = {
            "ready": True,
            "heartbeat_at": time.time(),
            "pid": host.pid,
            "seq": host.seq,
            "host": host.name,
            "shard": host.shard,
        }
        if self.work:
            # A healthy worker: it takes every waiting task up to its 8 slots (so no backlog
            # with slots free) and finishes 3 a beat.
            queue = (host.seq + host.shard) % 12
            status.update(
                completed=3 * host.seq,
                errors=host.seq // 50,
                inflight=min(queue, 8),
                queue_depth=queue,
                concurrency=8,
                rss_gib=1.5,
            )
        write_atomic(self.status_path(host), json.dumps(status).encode())
        host.last_write = time.time()
        self.writes += 1
        if host.first_beat_pending:
            host.first_beat_pending = False
            extra = {} if host.launched_at is None else {"launched_at": host.launched_at}
            host.launched_at = None
            _emit("first_beat", host=host.name, pid=host.pid, t=host.last_write, **extra)

    async def heartbeats(self) -> None:
        """Every host once per interval, host i at offset i/N of it."""
        loop = asyncio.get_running_loop()
        ticks = max(1, round(self.interval_s / TICK_S))
        slots: list[list[SimHost]] = [[] for _ in range(ticks)]
        for i, host in enumerate(self.hosts):
            slots[i * ticks // len(self.hosts)].append(host)
        start = loop.time()
        n = 0
        while True:
            due = start + n * TICK_S
            await asyncio.sleep(max(0.0, due - loop.time()))  # wait-ok: the writer's schedule
            self.lateness.append(loop.time() - due)
            if len(self.lateness) > 100_000:
                del self.lateness[:50_000]
            if self.pending:
                self.watch_first_launches(loop)
            for host in slots[n % ticks]:
                self.beat(host)
            n += 1
            if n % ticks == 0:
                for host in self.hosts:
                    if host.child is not None and host.child.poll() is not None:
                        host.child = None  # reaped: a terminated sleep is not left a zombie

    def kill_and_record_exit(self, host: SimHost) -> float:
        """SIGKILL the host's worker and write its exit record; the wall time of the rename."""
        pid = host.pid
        if pid is None:
            raise RuntimeError(f"{host.name} has no worker")
        killed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if host.child is not None and host.child.pid == pid:
            host.child.wait()
            host.child = None
        host.killed_at = killed_at
        record = {
            "pid": pid,
            "start_time": 0,
            "exit_code": None,
            "signal": 9,
            "exited_at": time.time(),
            "host": host.name,
            "shard": host.shard,
        }
        write_atomic(self.root / "ctl" / f"{host.name}.exit.json", json.dumps(record).encode())
        return time.time()

    def kill_all(self) -> None:
        """Every worker this fleet has or the daemon launched for it."""
        for host in self.hosts:
            for pid in {host.pid, _read_pid(self.pidfile(host))}:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if host.child is not None:
                host.child.wait()


def _sig(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of ``path``, or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def _read_pid(path: Path) -> int | None:
    """The pid in a pidfile, or None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 : data.rindex(b")") + 3] not in (b"Z", b"X")


# --- config and main --------------------------------------------------------------------


def daemon_config(
    workdir: Path,
    root: Path,
    endpoints: dict[str, tuple[str, int]],
    *,
    client_key: Path,
    known_hosts: Path,
    watch: str,
    stale_s: float,
) -> dict[str, Any]:
    """The daemon's config for this fleet: product defaults except where a line says why."""
    return {
        "run": {
            "root": str(root),
            "experiment": "bench",
            "trial": "scale",
            "run_id": "run-1",
            "reward_fn": "supervisor.demo.worker.exact_match",
            # Shutdown leaves the fake workers to us: stopping 1000 is not what we measure.
            "on_exit": "detach",
        },
        "worker": {"argv": WORKER_ARGV, "python": sys.executable},
        # Short enough that a stale sample costs seconds, long enough for the poll mode's
        # minimum (two intervals + 1 s).
        "health": {"heartbeat_stale_s": stale_s, "ready_timeout_s": 60.0},
        "ssh": {
            "username": os.environ.get("USER") or "root",
            "client_keys": [str(client_key)],
            "known_hosts": str(known_hosts),
            "connect_timeout_s": 60.0,
        },
        "control": {"socket": str(workdir / "control.sock")},
        "watch": {"mode": watch},
        "hosts": [
            {"name": name, "address": addr, "port": port, "shard": i, "concurrency": 1}
            for i, (name, (addr, port)) in enumerate(endpoints.items())
        ],
    }


async def _commands(fleet: Fleet, done: asyncio.Event) -> None:
    """Execute stdin's commands until ``quit`` or EOF, then set ``done``."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        cmd = command.get("cmd")
        if cmd == "quit":
            break
        if cmd == "stats":
            lateness = fleet.lateness
            _emit(
                "stats",
                writes=fleet.writes,
                late_p50_ms=1000 * percentile(lateness, 50),
                late_p99_ms=1000 * percentile(lateness, 99),
            )
            continue
        host = fleet.by_name[command["host"]]
        if cmd == "exit":
            t = fleet.kill_and_record_exit(host)
            _emit("exit_written", host=host.name, pid=host.pid, t=t, killed=host.killed_at)
        elif cmd == "silence":
            host.silenced = True
            _emit("silenced", host=host.name, pid=host.pid, last_beat=host.last_write)
    done.set()


async def main_async(args: argparse.Namespace) -> None:
    """Serve the fleet, write the daemon's config, heartbeat until told to quit."""
    raise_nofile()
    workdir: Path = args.workdir
    names = [f"sim-{i:04d}" for i in range(args.hosts)]
    agent._SOURCE[:] = [agent_program()]  # for op_launch's launcher and shepherd
    server: InprocFleet | LocalSshServer
    if args.agents == "real":
        server = LocalSshServer(workdir / "ssh", names)
        await server.start()
        client_key, known_hosts = server.client_key_path, server.known_hosts_path
    else:
        server = InprocFleet(workdir / "ssh", names)
        await server.start()
        client_key, known_hosts = server.client_key_path, server.known_hosts_path
    root = workdir / "run"
    fleet = Fleet(root, names, args.interval, args.startup_delay, work=args.work)
    try:
        if args.fresh:
            fleet.expect_launches()
            with agent._LAUNCHER_LOCK:
                agent.start_launcher(sys.executable)  # as a real agent does when it starts
        else:
            fleet.spawn_workers()
        config = daemon_config(
            workdir,
            root,
            server.endpoints,
            client_key=client_key,
            known_hosts=known_hosts,
            watch=args.watch,
            stale_s=args.stale,
        )
        config_path = workdir / "rs.toml"
        config_path.write_text(render_toml(config), encoding="utf-8")
        done = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            beats = tg.create_task(fleet.heartbeats())
            tg.create_task(_commands(fleet, done))
            _emit(
                "ready",
                config=str(config_path),
                hosts=len(names),
                pid=os.getpid(),
                fresh=args.fresh,
                startup_delay_s=args.startup_delay,
            )
            await done.wait()
            beats.cancel()
    finally:
        fleet.kill_all()
        await server.aclose()


def main() -> None:
    """Parse arguments and run the simulator."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--agents", choices=("inproc", "real"), default="inproc")
    parser.add_argument("--watch", choices=("auto", "inotify", "poll"), default="inotify")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--stale", type=float, default=5.0, help="heartbeat_stale_s")
    parser.add_argument(
        "--fresh", action="store_true", help="no workers at start: the daemon launches all"
    )
    parser.add_argument(
        "--work", action="store_true", help="heartbeats carry the worker's figures of its work"
    )
    parser.add_argument(
        "--startup-delay",
        type=float,
        default=0.05,
        help="--fresh: a first worker's pidfile -> its first ready heartbeat (s)",
    )
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
