"""The operator control socket: a JSON-lines server on AF_UNIX, and an event hub.

This module owns the socket and its permissions; it decides nothing about hosts: every
command is delegated to the daemon through the ``Commands`` protocol. A refusal goes out as
``{"ok": false, "code": ..., "error": ...}`` (``refusals.Refusal``). The client and the wire
format are ``client.py`` (``request``, ``request_sync``, ``follow_events`` are also here).
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, Self

import structlog

from supervisor.client import encode_line
from supervisor.client import find_socket as find_socket
from supervisor.client import follow_events as follow_events
from supervisor.client import request as request
from supervisor.client import request_sync as request_sync
from supervisor.errors import ControlError
from supervisor.refusals import Refusal

log = structlog.get_logger()

# A request is a command and a host name; 64 KiB is generous and bounds what one client can
# make us buffer.
MAX_REQUEST_BYTES: Final = 64 * 1024
# An operator at `socat` may pause between commands; a forgotten connection must not hold a
# task forever.
IDLE_TIMEOUT_S: Final = 60.0
# A client that stops reading is dropped rather than pinning replies in our memory.
WRITE_TIMEOUT_S: Final = 10.0
# Events come in bursts (a fleet-wide freeze is one event per host); a subscriber this far
# behind is not watching and gets dropped rather than growing our memory.
EVENT_QUEUE_MAX: Final = 1000
# Connecting to a live local socket takes microseconds; a listener that does not accept within
# this is hung but still ours to respect.
PROBE_TIMEOUT_S: Final = 2.0
# How long a closing connection may take to flush its last reply before it is aborted.
CLOSE_TIMEOUT_S: Final = 2.0
# An operator's commands, a `status --watch`, an `events` and a few scripts at once. Each
# connection is a file descriptor the daemon's hosts need (a script leaking connections would
# otherwise take them all, and accept() would then stall every client): past this, the
# connection idle longest is closed to make room, or the new one is refused when none is idle.
MAX_CONNECTIONS: Final = 64

_UCRED: Final = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
_SOCKET_MODE: Final = 0o600
_DIR_MODE: Final = 0o700


class EventSubscription(Protocol):
    """A stream of daemon events for one subscriber; iterate it, close it when done."""

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    def close(self) -> None:
        """Stop the stream and release the subscriber's queue; idempotent."""


class Commands(Protocol):
    """What the daemon does for the control socket; each method serves one command.

    Methods raise ControlError with an operator-facing message (e.g. "unknown host 'x'");
    any other exception is a daemon bug and is reported as an internal error.
    ``stop()`` must return once shutdown is under way, not when it has finished: the reply
    goes out over a server that the shutdown closes.
    """

    def status(self) -> dict[str, Any]:
        """``{"daemon": {...}, "hosts": {NAME: {...}}}`` (DESIGN §7)."""
        ...

    def host_status(self, host: str) -> dict[str, Any]:
        """``{"daemon": {...}, "host": NAME, ...}``: one host in full (``status HOST``)."""
        ...

    async def restart_host(self, host: str) -> dict[str, Any]:
        """Restart ``host``'s worker now, whatever its state."""
        ...

    async def stop_host(self, host: str) -> dict[str, Any]:
        """Stop ``host``'s worker and keep it stopped."""
        ...

    async def start_host(self, host: str) -> dict[str, Any]:
        """Start a stopped or failed host again."""
        ...

    async def reload(self) -> dict[str, Any]:
        """Re-read the config and reconcile: ``{"reloaded": bool, "errors": [...]}``."""
        ...

    async def drain(self, host: str) -> dict[str, Any]:
        """Move ``host``'s shard to a free spare and keep ``host`` out of service."""
        ...

    async def undrain(self, host: str) -> dict[str, Any]:
        """A drained ``host`` goes back to the pool as a spare."""
        ...

    async def stop(self) -> dict[str, Any]:
        """Begin stopping every worker, then the daemon."""
        ...

    async def unfreeze(self) -> dict[str, Any]:
        """Lift a fleet-wide restart freeze."""
        ...

    async def handover(self) -> dict[str, Any]:
        """Leave every worker running and give the run lock to a standby."""
        ...

    def subscribe(self) -> EventSubscription:
        """A new subscription to the daemon's events (``EventHub.subscribe`` fits)."""
        ...


# --------------------------------------------------------------------------------------
# Events


class Subscription:
    """One subscriber's bounded queue of events, filled by an ``EventHub``."""

    def __init__(self, hub: EventHub | None, max_queued: int) -> None:
        self._hub = hub
        self._max_queued = max_queued
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._ended = hub is None
        self._overflowed = False
        self._announced_drop = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> dict[str, Any]:
        """The next event; after an overflow, what was queued, one ``dropped`` event, the end."""
        while True:
            if self._queue:
                return self._queue.popleft()
            if self._overflowed and not self._announced_drop:
                self._announced_drop = True
                return {
                    "event": "dropped",
                    "reason": f"subscriber fell more than {self._max_queued} events behind",
                }
            if self._ended:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    @property
    def dropped(self) -> bool:
        """True once this subscriber fell too far behind and was cut off."""
        return self._overflowed

    def close(self) -> None:
        """Stop receiving events; queued ones are still yielded, then iteration ends."""
        self._end()

    def _offer(self, event: dict[str, Any]) -> None:
        if len(self._queue) >= self._max_queued:
            self._overflowed = True
            self._end()
            return
        self._queue.append(event)
        self._wakeup.set()

    def _end(self) -> None:
        self._ended = True
        self._wakeup.set()
        if self._hub is not None:
            self._hub._discard(self)
            self._hub = None


class EventHub:
    """Fans daemon events out to subscribers, each with its own bounded queue.

    ``publish`` never blocks and never grows memory without bound: a subscriber whose queue
    is full is cut off with a final ``{"event": "dropped", ...}``.
    """

    def __init__(self, *, max_queued: int = EVENT_QUEUE_MAX) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, not {max_queued}")
        self._max_queued = max_queued
        self._subscribers: set[Subscription] = set()
        self._closed = False

    @property
    def subscriber_count(self) -> int:
        """How many subscribers are currently receiving events."""
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        """A new subscriber; after ``close()`` it is born ended."""
        if self._closed:
            return Subscription(None, self._max_queued)
        subscription = Subscription(self, self._max_queued)
        self._subscribers.add(subscription)
        return subscription

    def publish(self, event: Mapping[str, Any]) -> None:
        """Queue a copy of ``event`` for every subscriber; never blocks. Call from the loop."""
        for subscription in list(self._subscribers):
            subscription._offer(dict(event))
            if subscription.dropped:
                log.warning("control.subscriber_dropped", queued_max=self._max_queued)

    def close(self) -> None:
        """End every subscription after what it has queued; later subscribers end at once."""
        self._closed = True
        for subscription in list(self._subscribers):
            subscription.close()

    def _discard(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)


# --------------------------------------------------------------------------------------
# Server


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """Who is at the other end of a connection, as the kernel saw it at connect time."""

    pid: int
    uid: int
    gid: int


Handler = Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]


class _Connection:
    """One client's streams, with bounded writes and a close that cannot hang."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, write_timeout_s: float
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._write_timeout_s = write_timeout_s
        # Waiting for a request since this loop time; None while serving one, or streaming.
        self.idle_since: float | None = asyncio.get_running_loop().time()

    def peer(self) -> PeerCredentials:
        sock = self.writer.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        pid, uid, gid = _UCRED.unpack(raw)
        return PeerCredentials(pid=pid, uid=uid, gid=gid)

    async def send(self, message: Mapping[str, Any]) -> None:
        await self.send_raw(encode_line(message))

    async def send_raw(self, data: bytes) -> None:
        """Write one line; raises TimeoutError if the client does not take it in time."""
        self.writer.write(data)
        async with asyncio.timeout(self._write_timeout_s):
            await self.writer.drain()

    async def wait_eof(self) -> None:
        """Return when the client hangs up; whatever it sends meanwhile is discarded."""
        while await self.reader.read(4096):
            pass

    async def close(self, *, linger: bool) -> None:
        """Flush and close; abort if that takes over ``CLOSE_TIMEOUT_S``.

        With ``linger``, shut only our side first and wait for the client to hang up: a
        client that is still writing (a refused peer, an oversized request) then reads our
        last reply instead of a reset. Cancelled midway, it aborts the transport, so no
        socket outlives its task.
        """
        graceful = False
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if linger and not self.writer.is_closing():
                    self.writer.write_eof()
                    await self.wait_eof()
                self.writer.close()
                await self.writer.wait_closed()
                graceful = True
        except (TimeoutError, ConnectionError):
            pass
        finally:
            if not graceful:
                self.writer.transport.abort()


class ControlServer:
    """Serves the ``Commands`` of one daemon on a private Unix socket.

    ``start()`` returns once the socket is bound; connections are served by tasks the server
    owns until ``aclose()``. Only our own uid and root are served.
    """

    def __init__(
        self,
        path: Path,
        commands: Commands,
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._path = Path(path)
        self._commands = commands
        self._idle_timeout_s = idle_timeout_s
        self._write_timeout_s = write_timeout_s
        self._max_request_bytes = max_request_bytes
        self._max_connections = max_connections
        self._euid = os.geteuid()
        self._server: asyncio.Server | None = None
        self._lock_fd: int | None = None
        self._socket_id: tuple[int, int] | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._closing = False
        self._at_limit = False  # the connection limit was hit, and said so, lately
        self._handlers: dict[str, Handler] = {
            "ping": self._cmd_ping,
            "status": self._cmd_status,
            "restart-host": self._cmd_restart_host,
            "stop-host": self._cmd_stop_host,
            "start-host": self._cmd_start_host,
            "reload": self._cmd_reload,
            "stop": self._cmd_stop,
            "unfreeze": self._cmd_unfreeze,
            "handover": self._cmd_handover,
            "drain": self._cmd_drain,
            "undrain": self._cmd_undrain,
        }
        # `events` takes over its connection, so it is dispatched apart from the table.
        self._known = sorted([*self._handlers, "events"])

    @property
    def path(self) -> Path:
        """Where the socket lives."""
        return self._path

    @property
    def lock_path(self) -> Path:
        """The file whose flock says a daemon owns this socket; never deleted (see ``start``)."""
        return _lock_path(self._path)

    @property
    def connection_count(self) -> int:
        """Connections being served right now."""
        return len(self._connections)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind the socket and start serving.

        Raises ControlError when the directory is unsafe, another daemon owns or answers on
        the socket, or binding fails. A socket file nobody answers on is replaced.
        """
        if self._server is not None or self._closing:
            raise ControlError(f"control server for {self._path} was already started or closed")
        _prepare_directory(self._path.parent, self._euid)
        self._lock_fd = _acquire_lock(self._path)
        sock: socket.socket | None = None
        try:
            await _remove_if_stale(self._path)
            sock = _bind(self._path)
            st = os.stat(self._path)
            self._socket_id = (st.st_dev, st.st_ino)
            self._server = await asyncio.start_unix_server(
                self._on_connect, sock=sock, limit=self._max_request_bytes
            )
        except BaseException:
            if sock is not None:
                sock.close()
                self._unlink_if_ours()
            os.close(self._lock_fd)
            self._lock_fd = None
            raise
        log.info("control.listening", path=str(self._path))

    async def aclose(self) -> None:
        """Stop listening, end every connection, remove the socket if it is still ours.

        Idempotent. A connection task that calls this (``stop`` from a client) is neither
        cancelled nor awaited: it sends its reply, then closes its connection itself.
        """
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        current = asyncio.current_task()
        inside = current in self._connections
        tasks = [task for task in self._connections if task is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None and not inside:
            # Since Python 3.12.1 this waits for every connection to close, the caller's own
            # included, which closes only after its reply: from inside, it would wait forever.
            await self._server.wait_closed()
        self._unlink_if_ours()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        log.info("control.closed", path=str(self._path))

    def _unlink_if_ours(self) -> None:
        # A newer daemon may have replaced the file; deleting its socket would orphan it.
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._socket_id:
            os.unlink(self._path)

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, so the connection task is ours to track and cancel, not asyncio's.
        if self._closing:
            writer.transport.abort()
            return
        if len(self._connections) >= self._max_connections:
            if not self._at_limit:
                # Once per episode: a leaking client hits the limit a thousand times a
                # second, and journald's rate limit would then drop our other lines.
                self._at_limit = True
                log.warning("control.connection_limit", max_connections=self._max_connections)
            if self._make_room():
                self._accept(reader, writer)
                return
            # A best-effort word on why; the transport flushes it, then closes.
            writer.write(
                encode_line(
                    _error(
                        Refusal.BUSY,
                        f"too many connections (over {self._max_connections}); try again",
                    )
                )
            )
            writer.close()
            return
        self._accept(reader, writer)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(reader, writer, self._write_timeout_s)
        task = asyncio.get_running_loop().create_task(self._serve_connection(connection))
        self._connections[task] = connection
        task.add_done_callback(self._forget)

    def _make_room(self) -> bool:
        """Close the connection idle longest, freeing its descriptor now; False if none is."""
        idle = [(c.idle_since, t) for t, c in self._connections.items() if c.idle_since is not None]
        if not idle:
            return False
        _, task = min(idle, key=lambda pair: pair[0])
        conn = self._connections[task]
        conn.idle_since = None  # not chosen again; tracked until its task has ended
        log.debug("control.idle_connection_closed", reason="connection limit reached")
        conn.writer.transport.abort()
        task.cancel()
        return True

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)
        if len(self._connections) <= self._max_connections // 2:
            self._at_limit = False

    async def _serve_connection(self, conn: _Connection) -> None:
        """Task root of one connection: nothing it raises may reach the server."""
        peer = PeerCredentials(pid=0, uid=-1, gid=-1)
        linger = True
        try:
            peer = conn.peer()
            if peer.uid not in (self._euid, 0):
                log.warning("control.refused", peer_pid=peer.pid, peer_uid=peer.uid)
                await conn.send(
                    _error(
                        Refusal.PERMISSION_DENIED,
                        f"permission denied: uid {peer.uid} is not allowed",
                    )
                )
                return
            await self._serve_requests(conn, peer)
        except TimeoutError:
            log.info("control.client_too_slow", peer_pid=peer.pid, peer_uid=peer.uid)
            conn.writer.transport.abort()
        except ConnectionError:
            log.debug("control.client_gone", peer_pid=peer.pid, peer_uid=peer.uid)
        except Exception:  # task root: one broken connection must not stop the server
            log.exception("control.connection_failed", peer_pid=peer.pid, peer_uid=peer.uid)
        except asyncio.CancelledError:
            # The server is closing: flush what we said, but wait for no client to hang up.
            linger = False
            raise
        finally:
            await conn.close(linger=linger)

    async def _serve_requests(self, conn: _Connection, peer: PeerCredentials) -> None:
        while True:
            last = False
            conn.idle_since = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(self._idle_timeout_s):
                    line = await conn.reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                # EOF; a last request without its newline (`printf ... | socat`) still counts.
                if not exc.partial.strip():
                    return
                line, last = exc.partial, True
            except asyncio.LimitOverrunError:
                message = f"request over {self._max_request_bytes} bytes; closing"
                await conn.send(_error(Refusal.BAD_REQUEST, message))
                return
            except TimeoutError:
                message = f"idle for {self._idle_timeout_s:g}s; closing"
                await conn.send(_error(Refusal.IDLE_TIMEOUT, message))
                return
            finally:
                conn.idle_since = None
            if not line.strip():
                continue
            try:
                cmd, request = _parse_request(line, self._known)
            except ControlError as exc:
                await conn.send(_error(exc.code, str(exc)))
                continue
            if cmd == "events":
                if await self._cmd_events(request, conn):
                    return
                continue
            await conn.send_raw(await self._run(cmd, request, peer))
            if last or self._closing:
                # Closed while this command ran (``stop`` closes the server): its reply was
                # this connection's last word.
                return

    async def _run(self, cmd: str, request: Mapping[str, Any], peer: PeerCredentials) -> bytes:
        """Run one handler and encode its reply; every failure becomes an error reply."""
        if cmd not in ("ping", "status"):
            host = request.get("host")
            log.info(
                "control.command",
                cmd=cmd,
                host=host[:100] if isinstance(host, str) else None,
                peer_pid=peer.pid,
                peer_uid=peer.uid,
            )
        try:
            result = await self._handlers[cmd](request)
            return encode_line({"ok": True} | {k: v for k, v in result.items() if k != "ok"})
        except ControlError as exc:
            return encode_line(_error(exc.code, str(exc)))
        except Exception as exc:  # a daemon bug must not take the control socket down
            log.exception("control.handler_failed", cmd=cmd)
            return encode_line(_internal_error(exc))

    # --- one handler per command ----------------------------------------------------------

    async def _cmd_ping(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Check that the daemon answers.

        Request:  {"cmd": "ping"}
        Response: {"ok": true, "pid": 4242}
        """
        _expect_args("ping", request)
        return {"pid": os.getpid()}

    async def _cmd_status(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The daemon's view of every host (DESIGN §7), or of one host in full.

        Request:  {"cmd": "status"}
        Response: {"ok": true, "daemon": {"pid": 4242, ...},
                   "hosts": {"worker-0": {"state": "ready", "shard": 0, "pid": 31337,
                             "ssh": "connected", "heartbeat_age_s": 0.8, "restarts": 0,
                             "last_reason": null}}}
        Request:  {"cmd": "status", "host": "worker-0"}
        Response: {"ok": true, "daemon": {...}, "host": "worker-0", "state": "ready", ...,
                   "progress": {...}, "restart": {...}, "last_exit": {...}|null,
                   "evidence": {...}|null}
        """
        _expect_args("status", request, "host")
        if "host" in request:
            return self._commands.host_status(_host_arg("status", request))
        return self._commands.status()

    async def _cmd_restart_host(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Restart one host's worker now.

        Request:  {"cmd": "restart-host", "host": "worker-0"}
        Response: {"ok": true, "host": "worker-0", "state": "stale"}
                  {"ok": false, "code": "unknown_host", "error": "unknown host 'worker-9'"}
        """
        return await self._commands.restart_host(_host_arg("restart-host", request))

    async def _cmd_stop_host(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Stop one host's worker and keep it stopped.

        Request:  {"cmd": "stop-host", "host": "worker-0"}
        Response: {"ok": true, "host": "worker-0", "state": "stopping"}
        """
        return await self._commands.stop_host(_host_arg("stop-host", request))

    async def _cmd_start_host(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Start a stopped or failed host again.

        Request:  {"cmd": "start-host", "host": "worker-0"}
        Response: {"ok": true, "host": "worker-0", "state": "starting"}
        """
        return await self._commands.start_host(_host_arg("start-host", request))

    async def _cmd_reload(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Re-read the config and reconcile, as SIGHUP does.

        Request:  {"cmd": "reload"}
        Response: {"ok": true, "reloaded": true, "errors": []}
                  {"ok": true, "reloaded": false, "errors": ["c.toml: hosts[1].shard: required"]}
        """
        _expect_args("reload", request)
        return await self._commands.reload()

    async def _cmd_stop(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Stop every worker, then the daemon; the reply comes before the socket closes.

        Request:  {"cmd": "stop"}
        Response: {"ok": true, "stopping": true}
        """
        _expect_args("stop", request)
        return await self._commands.stop()

    async def _cmd_drain(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Move a host's shard to a free spare (``[[spares]]``); the host stays out.

        Request:  {"cmd": "drain", "host": "worker-0"}
        Response: {"ok": true, "label": "worker-0", "shard": 0, "to": "spare-0"}
                  {"ok": false, "code": "no_free_spare", "error": "no spare is free (...)"}
        """
        return await self._commands.drain(_host_arg("drain", request))

    async def _cmd_undrain(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Give a drained host back to the pool, as a spare.

        Request:  {"cmd": "undrain", "host": "worker-0"}
        Response: {"ok": true, "spare": "worker-0"}
        """
        return await self._commands.undrain(_host_arg("undrain", request))

    async def _cmd_unfreeze(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Lift a fleet-wide restart freeze now.

        Request:  {"cmd": "unfreeze"}
        Response: {"ok": true, "frozen": false}
        """
        _expect_args("unfreeze", request)
        return await self._commands.unfreeze()

    async def _cmd_handover(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Detach from every worker and release the run lock for a standby to take; the
        reply comes before the socket closes.

        Request:  {"cmd": "handover"}
        Response: {"ok": true, "handing_over": true, "leader": "node-a pid 4242", "epoch": 3}
        """
        _expect_args("handover", request)
        return await self._commands.handover()

    async def _cmd_events(self, request: Mapping[str, Any], conn: _Connection) -> bool:
        """Stream events until the client hangs up; the connection serves nothing else.

        Returns False, having sent an error reply, when the stream never started.

        Request:  {"cmd": "events"}
        Response: {"ok": true}
                  then one line per event as it happens, e.g.
                  {"event": "host.state", "host": "worker-0", "from": "ready", "to": "stale", ...}
                  and, if the client falls behind, a last {"event": "dropped", "reason": "..."}
        """
        try:
            _expect_args("events", request)
            subscription = self._commands.subscribe()
        except ControlError as exc:
            await conn.send(_error(exc.code, str(exc)))
            return False
        except Exception as exc:  # a daemon bug must not take the control socket down
            log.exception("control.handler_failed", cmd="events")
            await conn.send(_internal_error(exc))
            return False
        try:
            await conn.send({"ok": True})
            pump = asyncio.create_task(self._pump(subscription, conn))
            hangup = asyncio.create_task(conn.wait_eof())
            try:
                await asyncio.wait({pump, hangup}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                pump.cancel()
                hangup.cancel()
                pumped, _ = await asyncio.gather(pump, hangup, return_exceptions=True)
            # The pump's TimeoutError (client not reading) goes to the task root; a hangup
            # during the pump is the normal end and needs no report.
            if isinstance(pumped, Exception) and not isinstance(pumped, ConnectionError):
                raise pumped
        finally:
            subscription.close()
        return True

    async def _pump(self, subscription: EventSubscription, conn: _Connection) -> None:
        async for event in subscription:
            try:
                data = encode_line(event)
            except (TypeError, ValueError):
                log.exception("control.event_unserializable", event_name=event.get("event"))
                continue
            await conn.send_raw(data)


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _prepare_directory(directory: Path, euid: int) -> None:
    """Create the socket's directory 0700, or check that an existing one is private to us."""
    try:
        directory.mkdir(mode=_DIR_MODE, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ControlError(f"cannot create socket directory {directory}: {exc.strerror}") from exc
    else:
        # mkdir's mode passes through the umask, which may take the owner's bits away too.
        os.chmod(directory, _DIR_MODE)
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise ControlError(f"cannot use socket directory {directory}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"socket directory {directory} is not a directory")
    # Whoever can write the directory can swap our socket for theirs and hear every command.
    if st.st_uid != euid:
        raise ControlError(
            f"socket directory {directory} is owned by uid {st.st_uid}, not by us (uid {euid});"
            " refusing to put the control socket there"
        )
    if st.st_mode & 0o022:
        raise ControlError(
            f"socket directory {directory} is group- or world-writable"
            f" (mode {stat.S_IMODE(st.st_mode):04o}); refusing to put the control socket there:"
            " use a private directory such as /run/reward-supervisor"
        )


def _acquire_lock(path: Path) -> int:
    """Take the flock that makes us the only daemon on ``path``; returns the held fd.

    The probe-then-replace of a stale socket is a race between two daemons starting at once;
    the lock closes it. The lock file is never deleted: unlinking a lock file lets a third
    process lock a fresh inode while a second still holds the old one.
    """
    lock = _lock_path(path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ControlError(f"cannot open lock file {lock}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise ControlError(
            f"another reward-supervisor{holder} already serves {path} (it holds {lock});"
            " refusing to start a second daemon on the same run"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    # The pid is for operators reading the file; the lock itself is the flock.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _read_holder(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return f" (pid {text})" if text.isdigit() else ""


async def _remove_if_stale(path: Path) -> None:
    """Remove a socket file nobody answers on; refuse if something does, or if not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.setblocking(False)
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await asyncio.get_running_loop().sock_connect(probe, str(path))
    except ConnectionRefusedError:
        os.unlink(path)
        log.warning("control.stale_socket_removed", path=str(path))
        return
    except TimeoutError:
        pass  # it exists and does not accept: hung, but alive
    except OSError as exc:
        raise ControlError(
            f"cannot tell whether {path} is in use ({exc.strerror});"
            " remove it by hand if no daemon runs"
        ) from exc
    finally:
        probe.close()
    raise ControlError(
        f"another daemon answers on {path}; refusing to start a second one on the same run"
    )


def _bind(path: Path) -> socket.socket:
    """A socket bound at ``path`` with mode 0600 from its first instant."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        # Linux gives the new file the socket inode's mode minus the umask, so a 0600 socket
        # inode binds a 0600 file with no window, without touching the process-wide umask
        # that other threads share.
        os.fchmod(sock.fileno(), _SOCKET_MODE)
        sock.bind(str(path))
        # The umask may have taken the owner's bits; make sure they are there.
        os.chmod(path, _SOCKET_MODE)
    except OSError as exc:
        sock.close()
        raise ControlError(f"cannot bind control socket {path}: {exc.strerror}") from exc
    return sock


def _parse_request(line: bytes, known: list[str]) -> tuple[str, dict[str, Any]]:
    try:
        request = json.loads(line)
    except ValueError as exc:
        raise _bad_request(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise _bad_request("malformed JSON: nested too deeply") from None
    if not isinstance(request, dict):
        raise _bad_request(
            f'a request must be a JSON object such as {{"cmd": "status"}},'
            f" not {_json_type(request)}"
        )
    cmd = request.get("cmd")
    if cmd is None:
        raise _bad_request(f"request has no 'cmd'; known commands: {', '.join(known)}")
    if not isinstance(cmd, str):
        raise _bad_request(f"'cmd' must be a string, not {_json_type(cmd)}")
    if cmd not in known:
        raise ControlError(
            f"unknown command {_show(cmd)}; known commands: {', '.join(known)}",
            code=Refusal.UNKNOWN_COMMAND,
        )
    return cmd, request


def _expect_args(cmd: str, request: Mapping[str, Any], *allowed: str) -> None:
    extra = sorted(set(request) - {"cmd", *allowed})
    if extra:
        names = ", ".join(_show(name) for name in extra)
        raise _bad_request(f"{cmd}: unexpected argument {names}")


def _host_arg(cmd: str, request: Mapping[str, Any]) -> str:
    _expect_args(cmd, request, "host")
    host = request.get("host")
    if host is None:
        raise _bad_request(f'{cmd} needs a host: {{"cmd": "{cmd}", "host": "worker-0"}}')
    if not isinstance(host, str) or not host:
        raise _bad_request(f"{cmd}: 'host' must be a non-empty string, not {_show(host)}")
    return host


def _bad_request(message: str) -> ControlError:
    return ControlError(message, code=Refusal.BAD_REQUEST)


def _error(code: str, message: str) -> dict[str, Any]:
    """A refusal on the wire: its code for programs, its message for people."""
    return {"ok": False, "code": str(code), "error": message}


def _internal_error(exc: Exception) -> dict[str, Any]:
    return _error(Refusal.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}")


def _show(value: object, limit: int = 60) -> str:
    """``value`` as JSON, shortened: error messages must not echo a 64 KiB request back."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)
