"""The control socket over real AF_UNIX sockets, with a small fake daemon behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from supervisor.control import (
    ControlServer,
    EventHub,
    Subscription,
    find_socket,
    follow_events,
    request,
    request_sync,
)
from supervisor.errors import ControlError, DaemonNotRunning
from supervisor.refusals import Refusal

NOBODY = 65534
# Generous: shared CI machines stall; no test waits this long when things work.
WAIT_S = 10.0

# Becoming another uid, or handing a file to one, takes root; CI and this machine run as root.
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


class FakeDaemon:
    """A `Commands` implementation that records calls and answers like the daemon would."""

    def __init__(self, *, max_queued: int = 1000) -> None:
        """Two configured hosts and an event hub whose queues hold ``max_queued`` events."""
        self.hub = EventHub(max_queued=max_queued)
        self.calls: list[tuple[str, str | None]] = []
        self.hosts = {"worker-0": "ready", "worker-1": "stopped"}
        self.status_extra: dict[str, Any] = {}
        self.server: ControlServer | None = None

    def status(self) -> dict[str, Any]:
        """Every host with its state and shard, plus ``status_extra`` in the daemon part."""
        self.calls.append(("status", None))
        hosts = {
            name: {"state": state, "shard": i} for i, (name, state) in enumerate(self.hosts.items())
        }
        return {"daemon": {"pid": os.getpid(), **self.status_extra}, "hosts": hosts}

    def host_status(self, host: str) -> dict[str, Any]:
        """One known host's state, as ``status HOST`` asks for it."""
        self._known(host)
        self.calls.append(("host_status", host))
        return {"daemon": {"pid": os.getpid()}, "host": host, "state": self.hosts[host]}

    def _known(self, host: str) -> None:
        """Raise as the daemon would for an unknown host; crash on the host named ``boom``."""
        if host == "boom":
            raise RuntimeError("the daemon tripped over boom")
        if host not in self.hosts:
            raise ControlError(f"unknown host {host!r}", code=Refusal.UNKNOWN_HOST)

    async def restart_host(self, host: str) -> dict[str, Any]:
        """Record the call; answer with the host and its new state."""
        self._known(host)
        self.calls.append(("restart_host", host))
        return {"host": host, "state": "stale"}

    async def stop_host(self, host: str) -> dict[str, Any]:
        """Record the call; answer with the host and its new state."""
        self._known(host)
        self.calls.append(("stop_host", host))
        return {"host": host, "state": "stopping"}

    async def start_host(self, host: str) -> dict[str, Any]:
        """Record the call; answer with the host and its new state."""
        self._known(host)
        self.calls.append(("start_host", host))
        return {"host": host, "state": "starting"}

    async def reload(self) -> dict[str, Any]:
        """Record the call; report a clean reload."""
        self.calls.append(("reload", None))
        return {"reloaded": True, "errors": []}

    async def stop(self) -> dict[str, Any]:
        """Record the call; close the control server first when one is attached."""
        self.calls.append(("stop", None))
        if self.server is not None:
            # As a daemon may: close the control server from inside the `stop` request.
            await self.server.aclose()
        return {"stopping": True}

    async def drain(self, host: str) -> dict[str, Any]:
        """Record the call; answer with the shard moved to a spare."""
        self._known(host)
        self.calls.append(("drain", host))
        return {"label": host, "shard": 0, "to": "spare-0"}

    async def undrain(self, host: str) -> dict[str, Any]:
        """Record the call; answer with the host back as a spare."""
        self._known(host)
        self.calls.append(("undrain", host))
        return {"spare": host}

    async def unfreeze(self) -> dict[str, Any]:
        """Record the call; report the fleet unfrozen."""
        self.calls.append(("unfreeze", None))
        return {"frozen": False}

    async def handover(self) -> dict[str, Any]:
        """Record the call; report the handover begun."""
        self.calls.append(("handover", None))
        return {"handing_over": True, "leader": "node-a pid 1", "epoch": 1}

    def subscribe(self) -> Subscription:
        """A subscription to this fake's hub."""
        return self.hub.subscribe()


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll an observable condition until it holds, or fail after WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        # The server exposes counts, not events, for these; a short poll is the observable.
        while not condition():  # noqa: ASYNC110 - see above
            await asyncio.sleep(0.01)  # wait-ok: polling a condition, not waiting out time


@contextlib.asynccontextmanager
async def raw_client(
    path: Path,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A bare connection, for requests our client would never send."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_reply(reader: asyncio.StreamReader) -> dict[str, Any]:
    """Read one complete JSON-object line."""
    async with asyncio.timeout(WAIT_S):
        line = await reader.readline()
    assert line.endswith(b"\n"), f"expected a full reply line, got {line!r}"
    reply = json.loads(line)
    assert isinstance(reply, dict)
    return reply


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> dict[str, Any]:
    """Send raw bytes and read one reply line."""
    writer.write(data)
    await writer.drain()
    return await read_reply(reader)


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the server still sends until it closes the connection."""
    async with asyncio.timeout(WAIT_S):
        return await reader.read()


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    """A socket path whose directory does not exist yet."""
    return tmp_path / "ctl" / "run.sock"


@pytest.fixture
def file_at_sock_path(sock_path: Path) -> Path:
    """A regular file where the socket should be."""
    sock_path.parent.mkdir(mode=0o700)
    sock_path.write_text("precious")
    return sock_path


def assert_missing(path: Path) -> None:
    """Fail unless nothing exists at ``path``."""
    assert not path.exists(), f"{path} should be gone"


@pytest.fixture
def daemon() -> FakeDaemon:
    """A fresh fake daemon."""
    return FakeDaemon()


@pytest.fixture
async def server(sock_path: Path, daemon: FakeDaemon) -> AsyncIterator[ControlServer]:
    """A started server for ``daemon``, closed after the test."""
    srv = ControlServer(sock_path, daemon)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.aclose()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other uids can traverse (pytest's tmp_path sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="ctl-"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


# The child imports everything while still root (the interpreter may live under /root), then
# becomes nobody for real before it touches the socket.
_AS_NOBODY = """
import asyncio, json, os, sys
from pathlib import Path
from supervisor.control import request_sync
from supervisor.errors import ControlError, DaemonNotRunning
asyncio.run(asyncio.sleep(0))  # wait-ok: loads the event loop's modules while root, no wait
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
try:
    print(json.dumps({"uid": os.getuid(), "reply": request_sync(Path(sys.argv[1]), "ping")}))
except ControlError as exc:
    print(json.dumps({"uid": os.getuid(), "error": str(exc), "code": exc.code}))
"""


async def ping_as_nobody(path: Path) -> dict[str, Any]:
    """Run our client as uid/gid 65534 in a child process and return what it saw."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _AS_NOBODY,
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert isinstance(result, dict)
    assert result["uid"] == NOBODY
    return result


# --- commands ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmd", "args", "expected", "call"),
    [
        (
            "restart-host",
            {"host": "worker-0"},
            {"host": "worker-0", "state": "stale"},
            ("restart_host", "worker-0"),
        ),
        (
            "stop-host",
            {"host": "worker-0"},
            {"host": "worker-0", "state": "stopping"},
            ("stop_host", "worker-0"),
        ),
        (
            "start-host",
            {"host": "worker-1"},
            {"host": "worker-1", "state": "starting"},
            ("start_host", "worker-1"),
        ),
        (
            "drain",
            {"host": "worker-0"},
            {"label": "worker-0", "shard": 0, "to": "spare-0"},
            ("drain", "worker-0"),
        ),
        ("undrain", {"host": "worker-1"}, {"spare": "worker-1"}, ("undrain", "worker-1")),
        ("reload", {}, {"reloaded": True, "errors": []}, ("reload", None)),
        ("stop", {}, {"stopping": True}, ("stop", None)),
        ("unfreeze", {}, {"frozen": False}, ("unfreeze", None)),
        (
            "handover",
            {},
            {"handing_over": True, "leader": "node-a pid 1", "epoch": 1},
            ("handover", None),
        ),
    ],
)
async def test_command_reaches_the_daemon_and_its_reply_comes_back(
    server: ControlServer,
    daemon: FakeDaemon,
    cmd: str,
    args: dict[str, Any],
    expected: dict[str, Any],
    call: tuple[str, str | None],
) -> None:
    """Each command calls its daemon method once, with its argument, and returns its dict."""
    reply = await request(server.path, cmd, **args)
    assert reply == expected
    assert daemon.calls == [call]


async def test_status_returns_the_daemon_view(server: ControlServer, daemon: FakeDaemon) -> None:
    """`status` returns the daemon's `{"daemon", "hosts"}` document unchanged."""
    reply = await request(server.path, "status")
    assert reply == {
        "daemon": {"pid": os.getpid()},
        "hosts": {
            "worker-0": {"state": "ready", "shard": 0},
            "worker-1": {"state": "stopped", "shard": 1},
        },
    }


async def test_status_of_one_host_asks_for_that_host_in_full(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """`status` with a host is `status HOST`: that host's detail; an unknown host is refused
    as ``unknown_host``, a host that is not a string as a ``bad_request``."""
    reply = await request(server.path, "status", host="worker-1")
    assert reply == {"daemon": {"pid": os.getpid()}, "host": "worker-1", "state": "stopped"}
    assert daemon.calls == [("host_status", "worker-1")]
    with pytest.raises(ControlError) as unknown:
        await request(server.path, "status", host="worker-9")
    assert unknown.value.code == Refusal.UNKNOWN_HOST
    with pytest.raises(ControlError) as bad:
        await request(server.path, "status", host=7)
    assert bad.value.code == Refusal.BAD_REQUEST


async def test_ping_answers_with_the_daemon_pid(server: ControlServer, daemon: FakeDaemon) -> None:
    """`ping` is answered by the server itself and names the serving process."""
    assert await request(server.path, "ping") == {"pid": os.getpid()}
    assert daemon.calls == []


async def test_several_requests_on_one_connection_are_answered_in_order(
    server: ControlServer,
) -> None:
    """Pipelined requests on one connection get one reply each, in request order."""
    async with raw_client(server.path) as (reader, writer):
        writer.write(
            b'{"cmd": "restart-host", "host": "worker-0"}\n'
            b'{"cmd": "nope"}\n'
            b'{"cmd": "stop-host", "host": "worker-1"}\n'
        )
        await writer.drain()
        replies = [await read_reply(reader) for _ in range(3)]
    assert replies[0] == {"ok": True, "host": "worker-0", "state": "stale"}
    assert (replies[1]["ok"], replies[1]["code"]) == (False, Refusal.UNKNOWN_COMMAND)
    assert replies[2] == {"ok": True, "host": "worker-1", "state": "stopping"}


async def test_request_without_final_newline_is_served_at_eof(server: ControlServer) -> None:
    """A last request cut off by EOF (`printf ... | socat`) is still answered."""
    async with raw_client(server.path) as (reader, writer):
        writer.write(b'{"cmd": "ping"}')
        writer.write_eof()
        reply = await read_reply(reader)
    assert reply == {"ok": True, "pid": os.getpid()}


async def test_mutating_command_is_logged_with_the_peer(server: ControlServer) -> None:
    """An operator action is logged with the command, the host and who asked."""
    with capture_logs() as logs:
        await request(server.path, "restart-host", host="worker-0")
    entries = [e for e in logs if e["event"] == "control.command"]
    assert len(entries) == 1
    assert entries[0]["cmd"] == "restart-host"
    assert entries[0]["host"] == "worker-0"
    assert entries[0]["peer_uid"] == os.geteuid()
    assert entries[0]["peer_pid"] == os.getpid()


# --- bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"{not json\n",
        b"\xff\xfe\n",
        b"[" * 50_000 + b"\n",
        b'["status"]\n',
        b"42\n",
        b"{}\n",
        b'{"cmd": 7}\n',
        b'{"cmd": "restart-host"}\n',
        b'{"cmd": "stop-host", "host": 3}\n',
        b'{"cmd": "start-host", "host": ""}\n',
        b'{"cmd": "restart-host", "host": null}\n',
        b'{"cmd": "drain"}\n',
        b'{"cmd": "undrain", "host": 5}\n',
        b'{"cmd": "status", "verbose": true}\n',
        b'{"cmd": "events", "since": 0}\n',
    ],
)
async def test_bad_request_gets_an_error_and_the_connection_keeps_serving(
    server: ControlServer, daemon: FakeDaemon, data: bytes
) -> None:
    """A malformed or invalid request gets a ``bad_request`` reply with a message, reaches
    no daemon method, and the same connection then serves a good request."""
    async with raw_client(server.path) as (reader, writer):
        bad = await exchange(reader, writer, data)
        good = await exchange(reader, writer, b'{"cmd": "ping"}\n')
    assert (bad["ok"], bad["code"]) == (False, Refusal.BAD_REQUEST)
    assert isinstance(bad["error"], str) and bad["error"]
    assert good == {"ok": True, "pid": os.getpid()}
    assert daemon.calls == []


async def test_unknown_command_reply_lists_the_known_commands(server: ControlServer) -> None:
    """An unknown command is refused as ``unknown_command``, its message naming it and every
    command that exists."""
    with pytest.raises(ControlError) as caught:
        await request(server.path, "restart-everything")
    assert caught.value.code == Refusal.UNKNOWN_COMMAND
    message = str(caught.value)
    known = [
        "drain",
        "events",
        "handover",
        "ping",
        "reload",
        "restart-host",
        "start-host",
        "status",
        "stop",
        "stop-host",
        "undrain",
        "unfreeze",
    ]
    assert all(name in message for name in ["restart-everything", *known])


async def test_oversized_request_gets_an_error_and_is_closed_while_others_are_served(
    server: ControlServer,
) -> None:
    """A line over the cap gets one error reply and its connection closes; other clients
    are unaffected."""
    async with raw_client(server.path) as (reader, writer):
        writer.write(b'{"cmd": "status", "pad": "' + b"x" * 200_000 + b'"}\n')
        reply = await read_reply(reader)
        assert await request(server.path, "ping") == {"pid": os.getpid()}
        rest = await read_to_eof(reader)
    assert (reply["ok"], reply["code"]) == (False, Refusal.BAD_REQUEST)
    assert rest == b""


async def test_idle_client_does_not_block_others_and_is_closed(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """A client that stalls mid-request holds no one up and is closed after the idle timeout."""
    srv = ControlServer(sock_path, daemon, idle_timeout_s=0.5)
    async with srv, raw_client(srv.path) as (reader, writer):
        writer.write(b'{"cmd": "sta')
        await writer.drain()
        assert await request(srv.path, "status", timeout_s=WAIT_S)
        reply = await read_reply(reader)
        assert await read_to_eof(reader) == b""
    assert (reply["ok"], reply["code"]) == (False, Refusal.IDLE_TIMEOUT)


async def test_at_the_connection_cap_the_idle_longest_makes_room(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """With every slot taken by clients that never send, new clients are served and the
    connections idle longest are closed to make room, with one warning for the episode."""
    srv = ControlServer(sock_path, daemon, max_connections=4)
    async with srv, contextlib.AsyncExitStack() as stack:
        with capture_logs() as logs:
            idle = [await stack.enter_async_context(raw_client(srv.path)) for _ in range(5)]
            assert await request(srv.path, "ping", timeout_s=WAIT_S) == {"pid": os.getpid()}
        assert [e["event"] for e in logs].count("control.connection_limit") == 1
        for reader, _ in idle[:2]:
            assert await read_to_eof(reader) == b""
        for reader, writer in idle[2:]:
            assert await exchange(reader, writer, b'{"cmd": "ping"}\n') == {
                "ok": True,
                "pid": os.getpid(),
            }
        assert srv.connection_count <= 4


async def test_at_the_connection_cap_with_none_idle_a_new_client_is_told_why(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """Every slot streaming events (never idle): a new client gets a "too many connections"
    error at once instead of waiting, and the subscribers keep their streams."""
    srv = ControlServer(sock_path, daemon, max_connections=2)
    async with srv, contextlib.AsyncExitStack() as stack:
        subscribers = [await stack.enter_async_context(raw_client(srv.path)) for _ in range(2)]
        for reader, writer in subscribers:
            assert await exchange(reader, writer, b'{"cmd": "events"}\n') == {"ok": True}
        with pytest.raises(ControlError) as refused:
            await request(srv.path, "ping", timeout_s=WAIT_S)
        assert refused.value.code == Refusal.BUSY
        daemon.hub.publish({"event": "host.state", "host": "worker-0"})
        for reader, _ in subscribers:
            assert (await read_reply(reader))["event"] == "host.state"


async def test_client_reports_a_daemon_whose_accept_queue_is_full(sock_path: Path) -> None:
    """A listener whose backlog is full refuses connections with EAGAIN: the client says so
    as a ControlError (the CLI's message), not an OSError traceback."""
    sock_path.parent.mkdir(mode=0o700)
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listener.bind(str(sock_path))
        listener.listen(0)
        for _ in range(4):  # fill the queue: one waits, the rest are refused
            queued = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            queued.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                queued.connect(str(sock_path))
        with pytest.raises(ControlError, match=str(sock_path)) as refused:
            await request(sock_path, "ping", timeout_s=WAIT_S)
        # Refused at the send, or left waiting for a reply: the kernel decides which.
        assert refused.value.code in (Refusal.UNREACHABLE, Refusal.NO_REPLY)


async def test_daemon_control_error_becomes_an_error_reply(server: ControlServer) -> None:
    """A ControlError raised by the daemon reaches the client with its code and message."""
    with pytest.raises(ControlError) as refused:
        await request(server.path, "restart-host", host="worker-9")
    assert refused.value.code == Refusal.UNKNOWN_HOST
    assert str(refused.value) == "unknown host 'worker-9'"  # as the daemon raised it


async def test_daemon_crash_becomes_internal_error_and_server_survives(
    server: ControlServer,
) -> None:
    """Any other exception from the daemon becomes an internal-error reply, is logged with
    its traceback, and the server goes on serving."""
    with capture_logs() as logs:
        with pytest.raises(ControlError) as caught:
            await request(server.path, "restart-host", host="boom")
        assert await request(server.path, "ping") == {"pid": os.getpid()}
    assert caught.value.code == Refusal.INTERNAL_ERROR
    assert "the daemon tripped over boom" in str(caught.value)
    failures = [e for e in logs if e["event"] == "control.handler_failed"]
    assert len(failures) == 1
    assert failures[0]["cmd"] == "restart-host"
    assert failures[0]["exc_info"] is True


async def test_reply_that_is_not_json_becomes_internal_error(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """A daemon reply JSON cannot carry (NaN) is an internal error, not a broken line."""
    daemon.status_extra = {"uptime_s": float("nan")}
    with pytest.raises(ControlError) as caught:
        await request(server.path, "status")
    assert caught.value.code == Refusal.INTERNAL_ERROR
    daemon.status_extra = {}
    assert "hosts" in await request(server.path, "status")


# --- socket, directory, and who may connect ---------------------------------------------


async def test_socket_is_0600_in_a_new_0700_directory(server: ControlServer) -> None:
    """The server creates a missing directory 0700 and the socket 0600."""
    st = os.stat(server.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700


async def test_socket_is_0600_even_under_a_permissive_umask(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """The socket mode does not depend on the process umask."""
    old = os.umask(0)
    try:
        async with ControlServer(sock_path, daemon) as srv:
            mode = stat.S_IMODE(os.stat(srv.path).st_mode)
    finally:
        os.umask(old)
    assert mode == 0o600


async def test_group_writable_directory_is_refused(tmp_path: Path, daemon: FakeDaemon) -> None:
    """An existing socket directory others can write to is refused, naming the directory."""
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o770)
    srv = ControlServer(directory / "run.sock", daemon)
    with pytest.raises(ControlError, match="group- or world-writable"):
        await srv.start()
    assert not (directory / "run.sock").exists()
    await srv.aclose()


@needs_root
async def test_directory_owned_by_another_uid_is_refused(
    tmp_path: Path, daemon: FakeDaemon
) -> None:
    """An existing socket directory owned by someone else is refused, naming the owner."""
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    with pytest.raises(ControlError, match=f"owned by uid {NOBODY}"):
        await ControlServer(directory / "run.sock", daemon).start()


async def test_second_server_on_the_same_path_refuses(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """A second daemon on the same socket refuses to start and the first keeps serving."""
    with pytest.raises(ControlError, match="already serves") as caught:
        await ControlServer(server.path, daemon).start()
    assert f"(pid {os.getpid()})" in str(caught.value)
    assert await request(server.path, "ping") == {"pid": os.getpid()}


async def test_socket_that_answers_is_never_replaced(sock_path: Path, daemon: FakeDaemon) -> None:
    """A live listener on the path (not holding our lock) makes start() refuse."""
    sock_path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(sock_path))
        other.listen()
        inode = os.stat(sock_path).st_ino
        with pytest.raises(ControlError, match="another daemon answers"):
            await ControlServer(sock_path, daemon).start()
        assert os.stat(sock_path).st_ino == inode


async def test_stale_socket_file_is_replaced(sock_path: Path, daemon: FakeDaemon) -> None:
    """A socket file nobody listens on is removed and the server binds in its place."""
    sock_path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(sock_path))
    with capture_logs() as logs:
        async with ControlServer(sock_path, daemon) as srv:
            assert await request(srv.path, "ping") == {"pid": os.getpid()}
    assert any(e["event"] == "control.stale_socket_removed" for e in logs)


async def test_non_socket_file_at_the_path_is_refused(
    file_at_sock_path: Path, daemon: FakeDaemon
) -> None:
    """A regular file where the socket should be is left alone and start() refuses."""
    before = os.stat(file_at_sock_path)
    with pytest.raises(ControlError, match="is not a socket"):
        await ControlServer(file_at_sock_path, daemon).start()
    after = os.stat(file_at_sock_path)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)


@needs_root
async def test_client_of_another_uid_gets_a_permission_error_reply(
    shared_dir: Path, daemon: FakeDaemon
) -> None:
    """Even when the file modes let it in, a client running as another uid is refused by its
    peer credentials with one error reply."""
    os.chmod(shared_dir, 0o711)  # noqa: S103 - nobody must traverse it to reach the socket
    async with ControlServer(shared_dir / "run.sock", daemon) as srv:
        os.chmod(srv.path, 0o666)  # noqa: S103 - the misconfiguration the peer check is for
        with capture_logs() as logs:
            result = await ping_as_nobody(srv.path)
    assert result["code"] == Refusal.PERMISSION_DENIED
    refused = [e for e in logs if e["event"] == "control.refused"]
    assert len(refused) == 1
    assert refused[0]["peer_uid"] == NOBODY


@needs_root
async def test_another_uid_cannot_reach_a_socket_in_the_private_directory(
    sock_path: Path, shared_dir: Path, daemon: FakeDaemon
) -> None:
    """With the default 0700 directory another uid cannot even connect."""
    os.chmod(shared_dir, 0o711)  # noqa: S103 - nobody must traverse it to reach the socket
    async with ControlServer(shared_dir / "ctl" / "run.sock", daemon) as srv:
        with capture_logs() as logs:
            result = await ping_as_nobody(srv.path)
    assert result["code"] == Refusal.UNREACHABLE
    assert not any(e["event"] == "control.refused" for e in logs)


@needs_root
async def test_another_uid_cannot_connect_to_the_0600_socket(
    shared_dir: Path, daemon: FakeDaemon
) -> None:
    """In a traversable directory, the socket's own 0600 mode keeps another uid out."""
    os.chmod(shared_dir, 0o711)  # noqa: S103 - nobody must traverse it to reach the socket
    async with ControlServer(shared_dir / "run.sock", daemon) as srv:
        with capture_logs() as logs:
            result = await ping_as_nobody(srv.path)
    assert result["code"] == Refusal.UNREACHABLE and str(srv.path) in result["error"]
    assert not any(e["event"] == "control.refused" for e in logs)


# --- client errors ----------------------------------------------------------------------


async def test_client_reports_a_missing_socket(sock_path: Path) -> None:
    """No socket file: DaemonNotRunning, saying where it looked (the CLI's exit code 3)."""
    with pytest.raises(DaemonNotRunning) as caught:
        await request(sock_path, "status")
    assert caught.value.code == Refusal.NO_DAEMON and str(sock_path) in str(caught.value)


def test_the_cli_finds_the_daemon_in_whichever_place_holds_its_socket(tmp_path: Path) -> None:
    """Of the places a daemon may have bound (its default moves with the user's runtime
    directory), the first holding a socket is the one asked; a plain file there is not a
    socket; with none, the place a daemon would bind now."""
    first, second, third = (tmp_path / name / "x.sock" for name in ("a", "b", "c"))
    for path in (first, second, third):
        path.parent.mkdir()
    default = tmp_path / "now.sock"
    assert find_socket((first, second, third), default) == default
    first.write_text("not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(third))
        assert find_socket((first, second, third), default) == third
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as earlier:
            earlier.bind(str(second))
            assert find_socket((first, second, third), default) == second


async def test_client_reports_a_stale_socket(sock_path: Path) -> None:
    """A socket file nobody listens on is DaemonNotRunning, reported as a stale socket."""
    sock_path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(sock_path))
    with pytest.raises(DaemonNotRunning) as caught:
        await request(sock_path, "status")
    assert caught.value.code == Refusal.NO_DAEMON and str(sock_path) in str(caught.value)


async def test_client_times_out_on_a_daemon_that_never_replies(sock_path: Path) -> None:
    """A listener that accepts but never answers produces a timeout error, not a hang."""
    sock_path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(str(sock_path))
        silent.listen()
        with pytest.raises(ControlError) as caught:
            await request(sock_path, "status", timeout_s=0.3)
    assert caught.value.code == Refusal.NO_REPLY


@needs_root
async def test_client_refuses_a_socket_owned_by_another_uid(server: ControlServer) -> None:
    """A socket file owned by someone other than us or root is not trusted with a command."""
    os.chown(server.path, NOBODY, NOBODY)
    with pytest.raises(ControlError, match=f"owned by uid {NOBODY}") as caught:
        await request(server.path, "stop")
    assert caught.value.code == Refusal.UNREACHABLE


async def test_client_refuses_a_path_that_is_not_a_socket(file_at_sock_path: Path) -> None:
    """A regular file at the socket path is reported as such."""
    with pytest.raises(ControlError) as caught:
        await request(file_at_sock_path, "status")
    assert caught.value.code == Refusal.UNREACHABLE


async def test_request_sync_talks_to_the_daemon(server: ControlServer) -> None:
    """The synchronous client (used by the CLI) gets the same reply from its own loop."""
    reply = await asyncio.to_thread(request_sync, server.path, "restart-host", host="worker-0")
    assert reply == {"host": "worker-0", "state": "stale"}


async def _outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What a client call came to: its reply, or its error's type, code and message."""
    try:
        return ("reply", await call())
    except ControlError as exc:
        return (type(exc).__name__, exc.code, str(exc))


@pytest.fixture
async def peer(sock_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Path]:
    """A socket at ``sock_path`` whose peer behaves as the test's parameter says: ``silent``
    (accepts, never answers), ``hangs up`` (closes at once), ``garbage`` (a line that is not
    JSON), ``no newline`` (a reply, then EOF without its newline)."""
    behaviour: str = request.param
    sock_path.parent.mkdir(mode=0o700)
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read the request, then do as the parameter says."""
        await reader.readline()
        if behaviour == "silent":
            await done.wait()
        elif behaviour == "garbage":
            writer.write(b"<html>\n")
        elif behaviour == "no newline":
            writer.write(b'{"ok": true, "pid": 7}')
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(sock_path))
    try:
        yield sock_path
    finally:
        done.set()
        server.close()


def _sync(path: Path, cmd: str, **args: Any) -> Callable[[], Any]:
    """The blocking client's call, run in a thread (the loop serves the other end)."""
    return lambda: asyncio.to_thread(request_sync, path, cmd, timeout_s=0.5, **args)


def _async(path: Path, cmd: str, **args: Any) -> Callable[[], Any]:
    """The asyncio client's call."""
    return lambda: request(path, cmd, timeout_s=0.5, **args)


@pytest.mark.parametrize(
    ("cmd", "args"),
    [("restart-host", {"host": "worker-0"}), ("restart-host", {"host": "worker-9"}), ("nope", {})],
)
async def test_the_blocking_client_answers_as_the_asyncio_one_from_a_daemon(
    server: ControlServer, cmd: str, args: dict[str, Any]
) -> None:
    """``request_sync`` (the CLI's, a blocking socket) gets the same reply, or the same
    refusal with the same code, as ``request``."""
    sync = await _outcome(_sync(server.path, cmd, **args))
    assert sync == await _outcome(_async(server.path, cmd, **args))
    assert sync[0] == "reply" or sync[1] in (Refusal.UNKNOWN_HOST, Refusal.UNKNOWN_COMMAND)


@pytest.mark.parametrize(
    ("peer", "code"),
    [
        ("silent", Refusal.NO_REPLY),
        ("hangs up", Refusal.NO_REPLY),
        ("garbage", Refusal.BAD_REPLY),
        ("no newline", None),
    ],
    indirect=["peer"],
)
async def test_the_blocking_client_fails_as_the_asyncio_one_on_a_broken_peer(
    peer: Path, code: str | None
) -> None:
    """Against a peer that never answers, hangs up, sends garbage or a last line with no
    newline, both clients come to the same outcome, by the same code."""
    sync = await _outcome(_sync(peer, "ping"))
    assert sync == await _outcome(_async(peer, "ping"))
    if code is None:
        assert sync == ("reply", {"pid": 7})
    else:
        assert sync[1] == code


async def test_the_blocking_client_fails_as_the_asyncio_one_without_a_daemon(
    sock_path: Path,
) -> None:
    """No socket, a stale one, a file that is not one: the same errors, by the same code."""
    sock_path.parent.mkdir(mode=0o700)
    found = [await _outcome(_sync(sock_path, "ping"))]
    assert found[0] == await _outcome(_async(sock_path, "ping"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(sock_path))
    found.append(await _outcome(_sync(sock_path, "ping")))
    assert found[1] == await _outcome(_async(sock_path, "ping"))
    sock_path.unlink()
    sock_path.write_text("precious")
    found.append(await _outcome(_sync(sock_path, "ping")))
    assert found[2] == await _outcome(_async(sock_path, "ping"))
    assert [f[1] for f in found] == [Refusal.NO_DAEMON, Refusal.NO_DAEMON, Refusal.UNREACHABLE]


# --- events -----------------------------------------------------------------------------


async def test_events_stream_delivers_events_in_order(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """After `{"ok": true}`, every published event arrives as one line, in publish order."""
    async with raw_client(server.path) as (reader, writer):
        assert await exchange(reader, writer, b'{"cmd": "events"}\n') == {"ok": True}
        assert daemon.hub.subscriber_count == 1
        for i in range(5):
            daemon.hub.publish({"event": "host.state", "host": f"worker-{i}", "seq": i})
        events = [await read_reply(reader) for _ in range(5)]
    assert [e["seq"] for e in events] == [0, 1, 2, 3, 4]
    assert events[0] == {"event": "host.state", "host": "worker-0", "seq": 0}


async def test_event_that_is_not_json_is_skipped_and_logged(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """An event JSON cannot carry is logged and skipped; the stream goes on."""
    async with raw_client(server.path) as (reader, writer):
        assert await exchange(reader, writer, b'{"cmd": "events"}\n') == {"ok": True}
        with capture_logs() as logs:
            daemon.hub.publish({"event": "broken", "value": float("inf")})
            daemon.hub.publish({"event": "fine"})
            assert await read_reply(reader) == {"event": "fine"}
    skipped = [e for e in logs if e["event"] == "control.event_unserializable"]
    assert [e["event_name"] for e in skipped] == ["broken"]


async def test_follow_events_yields_until_the_daemon_ends_the_stream(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """`follow_events` yields each event and returns when the daemon closes its hub."""
    received: list[dict[str, Any]] = []

    async def follow() -> None:
        """Collect every event until the stream ends."""
        async with contextlib.aclosing(follow_events(server.path)) as events:
            async for event in events:
                received.append(event)

    async with asyncio.timeout(WAIT_S), asyncio.TaskGroup() as tg:
        tg.create_task(follow())
        await wait_until(lambda: daemon.hub.subscriber_count == 1)
        daemon.hub.publish({"event": "fleet.frozen", "stale_hosts": 3})
        daemon.hub.publish({"event": "fleet.unfrozen"})
        daemon.hub.close()
    assert received == [{"event": "fleet.frozen", "stale_hosts": 3}, {"event": "fleet.unfrozen"}]


async def test_disconnecting_subscriber_is_cleaned_up(
    server: ControlServer, daemon: FakeDaemon
) -> None:
    """A subscriber that hangs up is unsubscribed and its connection task ends, with no event
    needed to notice."""
    async with raw_client(server.path) as (reader, writer):
        assert await exchange(reader, writer, b'{"cmd": "events"}\n') == {"ok": True}
        assert daemon.hub.subscriber_count == 1
    await wait_until(lambda: daemon.hub.subscriber_count == 0 and server.connection_count == 0)


async def test_subscriber_that_falls_behind_gets_a_dropped_line_then_the_end(
    sock_path: Path,
) -> None:
    """A burst larger than the subscriber's queue delivers what fit, one `dropped` line, and
    closes the stream."""
    daemon = FakeDaemon(max_queued=3)
    async with ControlServer(sock_path, daemon) as srv, raw_client(srv.path) as (reader, writer):
        assert await exchange(reader, writer, b'{"cmd": "events"}\n') == {"ok": True}
        with capture_logs() as logs:
            for i in range(10):
                daemon.hub.publish({"event": "tick", "seq": i})
        lines = (await read_to_eof(reader)).splitlines()
    events = [json.loads(line) for line in lines]
    assert [e.get("seq") for e in events[:3]] == [0, 1, 2]
    assert len(events) == 4
    assert events[3]["event"] == "dropped"
    assert daemon.hub.subscriber_count == 0
    assert [e["event"] for e in logs].count("control.subscriber_dropped") == 1


async def test_subscriber_that_never_reads_is_disconnected(sock_path: Path) -> None:
    """A subscriber whose socket stays full is cut off after the write timeout, so its
    events cannot pile up in our memory."""
    daemon = FakeDaemon()
    async with ControlServer(sock_path, daemon, write_timeout_s=0.3) as srv:
        async with raw_client(srv.path) as (reader, writer):
            assert await exchange(reader, writer, b'{"cmd": "events"}\n') == {"ok": True}
            with capture_logs() as logs:
                for i in range(200):
                    daemon.hub.publish({"event": "tick", "seq": i, "pad": "x" * 65536})
                await wait_until(lambda: srv.connection_count == 0)
        assert daemon.hub.subscriber_count == 0
    assert any(e["event"] == "control.client_too_slow" for e in logs)


async def test_hub_overflow_yields_what_fit_then_dropped_then_ends() -> None:
    """A subscription that overflows keeps its queued events, adds one `dropped`, then ends."""
    hub = EventHub(max_queued=2)
    subscription = hub.subscribe()
    for i in range(4):
        hub.publish({"seq": i})
    async with asyncio.timeout(WAIT_S):
        events = [event async for event in subscription]
    assert events[:2] == [{"seq": 0}, {"seq": 1}]
    assert events[2]["event"] == "dropped"
    assert len(events) == 3
    assert subscription.dropped
    assert hub.subscriber_count == 0


async def test_hub_publishes_a_copy_of_the_event() -> None:
    """Changing an event dict after publishing it does not change what subscribers get."""
    hub = EventHub()
    subscription = hub.subscribe()
    event = {"event": "host.state", "to": "ready"}
    hub.publish(event)
    event["to"] = "stale"
    subscription.close()
    async with asyncio.timeout(WAIT_S):
        assert [e async for e in subscription] == [{"event": "host.state", "to": "ready"}]


async def test_subscribing_to_a_closed_hub_ends_at_once() -> None:
    """After the hub closes, a new subscription yields nothing and is not tracked."""
    hub = EventHub()
    hub.close()
    subscription = hub.subscribe()
    hub.publish({"event": "late"})
    async with asyncio.timeout(WAIT_S):
        assert [e async for e in subscription] == []
    assert hub.subscriber_count == 0


# --- shutdown ---------------------------------------------------------------------------


async def test_aclose_ends_every_connection_and_removes_the_socket(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """aclose() closes idle and streaming clients, leaves no task running, and removes the
    socket file."""
    srv = ControlServer(sock_path, daemon)
    await srv.start()
    async with (
        raw_client(srv.path) as (idle_reader, _),
        raw_client(srv.path) as (ev_reader, ev_writer),
    ):
        assert await exchange(ev_reader, ev_writer, b'{"cmd": "events"}\n') == {"ok": True}
        await wait_until(lambda: srv.connection_count == 2)
        await srv.aclose()
        assert await read_to_eof(idle_reader) == b""
        assert await read_to_eof(ev_reader) == b""
    assert srv.connection_count == 0
    assert daemon.hub.subscriber_count == 0
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert_missing(sock_path)
    await srv.aclose()  # idempotent


async def test_aclose_keeps_a_socket_that_is_no_longer_ours(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """If the socket file was replaced under us, aclose() leaves the new one in place."""
    srv = ControlServer(sock_path, daemon)
    await srv.start()
    os.unlink(sock_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as newer:
        newer.bind(str(sock_path))
        inode = os.stat(sock_path).st_ino
        await srv.aclose()
        assert os.stat(sock_path).st_ino == inode


async def test_server_restarts_on_the_same_path_after_aclose(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """aclose() releases the socket and the lock, so the next daemon starts cleanly."""
    async with ControlServer(sock_path, daemon):
        pass
    async with ControlServer(sock_path, daemon) as again:
        assert await request(again.path, "ping") == {"pid": os.getpid()}


async def test_stop_reply_arrives_when_the_daemon_closes_the_server_inside_stop(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """A daemon that closes the control server while serving `stop` still gets its reply out,
    and nothing deadlocks."""
    srv = ControlServer(sock_path, daemon)
    daemon.server = srv
    await srv.start()
    try:
        assert await request(srv.path, "stop", timeout_s=WAIT_S) == {"stopping": True}
        await wait_until(lambda: srv.connection_count == 0)
        assert_missing(sock_path)
    finally:
        await srv.aclose()


async def test_a_connection_whose_command_closed_the_server_ends_after_its_reply(
    sock_path: Path, daemon: FakeDaemon
) -> None:
    """A client that keeps its connection open after `stop` closed the server reads the reply
    and then EOF, not a wait for the idle timeout; the server is then fully closed."""
    srv = ControlServer(sock_path, daemon, idle_timeout_s=3 * WAIT_S)
    daemon.server = srv
    await srv.start()
    try:
        async with raw_client(srv.path) as (reader, writer):
            assert await exchange(reader, writer, b'{"cmd": "stop"}\n') == {
                "ok": True,
                "stopping": True,
            }
            assert await read_to_eof(reader) == b""
        await wait_until(lambda: srv.connection_count == 0)
        assert_missing(sock_path)
    finally:
        await srv.aclose()
