"""An in-process SSH server on 127.0.0.1 that runs exec requests as local commands, as sshd does.

For ``reward-supervisor demo`` and fast tests: one listener per fake host, public-key login for
the current user only, exec channels only (no shell, pty, sftp or forwarding). It does not
replace the real OpenSSH server of the integration and system tiers.

What it copies from OpenSSH for a non-pty exec session: the command runs as ``/bin/sh -c
<command>`` in a new session (``setsid``) with the server's environment (``env`` requests are
dropped, as sshd drops names outside ``AcceptEnv``); the channel carries stdin, stdout and
stderr; ``exit-status``, or ``exit-signal`` when a signal killed the command, is sent once the
command has exited and every holder of its stdout and stderr has closed them; SSH ``signal``
requests go to the command's process group. When the channel or the connection closes, the
command is not killed: the server closes its ends of the pipes (the command sees EOF on stdin,
and SIGPIPE if it writes) and keeps reaping it. Unlike sshd, commands run in the server's
working directory, not in ``$HOME``; remote commands use absolute paths anyway.

Costs per session: three pipes and a pidfd on the event loop, no thread (a fleet of 1000 hosts
is one server on one loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import getpass
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import asyncssh
import structlog

log = structlog.get_logger()

LISTEN_ADDRESS: Final = "127.0.0.1"
SHELL: Final = "/bin/sh"

# Bytes read from a command's stdout or stderr at a time; the SSH channel splits them into
# packets anyway.
READ_CHUNK: Final = 65536
# Channel input waiting for a slow command's stdin: above this, stop reading the channel so
# the SSH window pushes back on the client instead of our memory growing.
STDIN_HIGH_WATER: Final = 256 * 1024
STDIN_LOW_WATER: Final = 64 * 1024
# Where pidfds are missing (Linux < 5.3), running children are polled with waitpid this often.
REAP_POLL_S: Final = 0.05
# On close, children whose channels are gone usually exit within milliseconds (the remote agent
# exits on EOF); wait this long for them so they are reaped, not left as zombies.
CHILD_EXIT_GRACE_S: Final = 2.0
# asyncssh#730: wait_closed() can hang on a peer that ignores the disconnect.
CLOSE_TIMEOUT_S: Final = 5.0


def _fd_above_stdio(fd: int) -> int:
    """``fd`` moved to a number above 2 (close-on-exec), so dup2 onto 0-2 cannot be a no-op."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def _pipe() -> tuple[int, int]:
    read_fd, write_fd = os.pipe()  # close-on-exec (PEP 446); dup2 clears it in the child
    return _fd_above_stdio(read_fd), _fd_above_stdio(write_fd)


@dataclass(slots=True)
class _Spawned:
    pid: int
    stdin: int
    stdout: int
    stderr: int


def _spawn(command: str) -> _Spawned:
    """Start ``/bin/sh -c command`` as a session leader with pipes on fds 0-2."""
    in_r, in_w = _pipe()
    out_r, out_w = _pipe()
    err_r, err_w = _pipe()
    try:
        pid = os.posix_spawn(
            SHELL,
            ["sh", "-c", command],
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            # sshd calls setsid() for non-pty sessions: the command leads its own session and
            # process group, and outlives the connection.
            setsid=True,
            # Python ignores SIGPIPE and ignored signals survive exec; sshd's children get the
            # default actions and an empty signal mask, and so do ours.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
            setsigmask=(),
        )
    except BaseException:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    for fd in (in_w, out_r, err_r):
        os.set_blocking(fd, False)
    return _Spawned(pid=pid, stdin=in_w, stdout=out_r, stderr=err_r)


class _Reaper:
    """Waits for spawned commands to exit, with one pidfd (or a shared poll) per child."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pidfds: dict[int, int] = {}
        self._callbacks: dict[int, Callable[[int], None]] = {}
        self._polled: set[int] = set()
        self._poll_handle: asyncio.TimerHandle | None = None
        self._empty = asyncio.Event()
        self._empty.set()

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> None:
        """Call ``on_exit(wait_status)`` once ``pid`` has exited and been reaped."""
        self._callbacks[pid] = on_exit
        self._empty.clear()
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._polled.add(pid)
            self._arm_poll()
            return
        self._pidfds[pid] = pidfd
        self._loop.add_reader(pidfd, self._try_reap, pid)

    def _arm_poll(self) -> None:
        if self._poll_handle is None and self._polled:
            self._poll_handle = self._loop.call_later(REAP_POLL_S, self._poll)

    def _poll(self) -> None:
        self._poll_handle = None
        for pid in list(self._polled):
            self._try_reap(pid)
        self._arm_poll()

    def _try_reap(self, pid: int) -> None:
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            # Someone else reaped it (a waitpid(-1) elsewhere in the process): status unknown.
            reaped, status = pid, 255 << 8
        if reaped == 0:
            return
        self._forget(pid)
        on_exit = self._callbacks.pop(pid, None)
        if not self._callbacks:
            self._empty.set()
        if on_exit is not None:
            on_exit(status)

    def _forget(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None:
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
        self._polled.discard(pid)

    async def wait_all(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every watched child to exit."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._empty.wait()

    def close(self) -> list[int]:
        """Stop watching; the pids still running (they go on running, unreaped)."""
        running = list(self._callbacks)
        for pid in running:
            self._forget(pid)
        self._callbacks.clear()
        self._empty.set()
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        return running


def _report_exit(chan: asyncssh.SSHServerChannel[bytes], status: int) -> None:
    """Send ``exit-status``, or ``exit-signal`` for a command killed by a signal; then close."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            name = signal.Signals(signum).name.removeprefix("SIG")
        except ValueError:
            chan.exit(128 + signum)  # a real-time signal has no SSH name; do what shells do
            return
        chan.exit_with_signal(name, os.WCOREDUMP(status))
    else:
        chan.exit(os.waitstatus_to_exitcode(status))


class _ExecSession(asyncssh.SSHServerSession[bytes]):
    """One exec channel bridged to one local ``/bin/sh -c`` process."""

    def __init__(self, reaper: _Reaper, host: str) -> None:
        self._reaper = reaper
        self._host = host
        self._loop = asyncio.get_running_loop()
        self._chan: asyncssh.SSHServerChannel[bytes] | None = None
        self._child: _Spawned | None = None
        self._status: int | None = None  # wait status once reaped
        self._stdin_buf = bytearray()
        self._stdin_eof = False
        self._stdin_writing = False
        self._input_paused = False
        self._open_outputs: set[int] = set()
        self._output_paused = False

    # -- requests ------------------------------------------------------------------------

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:
        self._chan = chan

    def pty_requested(
        self, term_type: str, term_size: tuple[int, int, int, int], term_modes: Mapping[int, int]
    ) -> bool:
        return False  # no pty: remote commands must not get SIGHUP when a channel closes

    def shell_requested(self) -> bool:
        return False

    def subsystem_requested(self, subsystem: str) -> bool:
        return False  # no sftp

    def exec_requested(self, command: str) -> bool:
        try:
            child = _spawn(command)
        except OSError as exc:
            log.warning("sshserver.spawn_failed", host=self._host, error=str(exc))
            return False
        self._child = child
        self._open_outputs = {child.stdout, child.stderr}
        self._reaper.watch(child.pid, self._child_exited)
        log.debug("sshserver.exec", host=self._host, pid=child.pid)
        return True

    def session_started(self) -> None:
        self._watch_outputs()

    def signal_received(self, signal_name: str) -> None:
        signum = getattr(signal, f"SIG{signal_name}", None)
        if (
            not isinstance(signum, signal.Signals)
            or self._child is None
            or self._status is not None
        ):
            return
        # Not reaped yet, so the pid cannot have been reused; like sshd, signal the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._child.pid, signum)

    # -- stdin: channel -> command -------------------------------------------------------

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if self._child is None or self._child.stdin < 0 or datatype is not None:
            return
        self._stdin_buf += data
        self._flush_stdin()

    def eof_received(self) -> bool:
        self._stdin_eof = True
        self._flush_stdin()
        return True  # keep the channel half open: output and the exit status still follow

    def _flush_stdin(self) -> None:
        child = self._child
        if child is None or child.stdin < 0:
            return
        while self._stdin_buf:
            try:
                written = os.write(child.stdin, self._stdin_buf)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the command closed its stdin; drop what it won't read
                self._close_stdin()
                return
            del self._stdin_buf[:written]
        if self._stdin_buf and not self._stdin_writing:
            self._loop.add_writer(child.stdin, self._flush_stdin)
            self._stdin_writing = True
        elif not self._stdin_buf and self._stdin_writing:
            self._loop.remove_writer(child.stdin)
            self._stdin_writing = False
        self._pace_input()
        if self._stdin_eof and not self._stdin_buf:
            self._close_stdin()

    def _pace_input(self) -> None:
        if self._chan is None:
            return
        # Flags first: resume_reading() delivers buffered data at once, re-entering
        # data_received() and this method, which must see the state it is really in.
        if not self._input_paused and len(self._stdin_buf) > STDIN_HIGH_WATER:
            self._input_paused = True
            self._chan.pause_reading()
        elif self._input_paused and len(self._stdin_buf) <= STDIN_LOW_WATER:
            self._input_paused = False
            self._chan.resume_reading()

    def _close_stdin(self) -> None:
        child = self._child
        if child is None or child.stdin < 0:
            return
        if self._stdin_writing:
            self._loop.remove_writer(child.stdin)
            self._stdin_writing = False
        os.close(child.stdin)
        child.stdin = -1
        self._stdin_buf.clear()
        if self._input_paused and self._chan is not None:
            self._input_paused = False
            self._chan.resume_reading()  # input is discarded from now on

    # -- stdout, stderr: command -> channel ----------------------------------------------

    def _watch_outputs(self) -> None:
        for fd in self._open_outputs:
            self._loop.add_reader(fd, self._read_output, fd)

    def _unwatch_outputs(self) -> None:
        for fd in self._open_outputs:
            self._loop.remove_reader(fd)

    def pause_writing(self) -> None:
        # The client's window is full: stop reading, so the command blocks on its pipe.
        if not self._output_paused:
            self._output_paused = True
            self._unwatch_outputs()

    def resume_writing(self) -> None:
        if self._output_paused:
            self._output_paused = False
            self._watch_outputs()

    def _read_output(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(fd)
            os.close(fd)
            self._open_outputs.discard(fd)
            self._maybe_finish()
            return
        chan, child = self._chan, self._child
        if chan is None or child is None:  # not reached: readers exist only while attached
            return
        datatype = asyncssh.EXTENDED_DATA_STDERR if fd == child.stderr else None
        try:
            chan.write(data, datatype)
        except OSError:  # the channel is closing; connection_lost detaches us
            return

    # -- exit ----------------------------------------------------------------------------

    def _child_exited(self, status: int) -> None:
        self._status = status
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        # sshd reports the exit once the command is gone and its output is drained: a
        # background job still holding stdout keeps the channel open, as with OpenSSH.
        chan = self._chan
        if chan is None or self._status is None or self._open_outputs:
            return
        if chan.is_closing():
            return
        with contextlib.suppress(OSError):
            _report_exit(chan, self._status)

    def connection_lost(self, exc: Exception | None) -> None:
        # The channel or the connection closed: stop bridging, keep the command running and
        # reaped, exactly like sshd with a non-pty session.
        child = self._child
        self._chan = None
        if child is None:
            return
        self._close_stdin()
        if not self._output_paused:
            self._unwatch_outputs()
        for fd in self._open_outputs:
            os.close(fd)
        self._open_outputs.clear()


class _HostServer(asyncssh.SSHServer):
    """The server side of one connection to fake host ``host``."""

    def __init__(self, owner: LocalSshServer, host: str) -> None:
        self._owner = owner
        self._host = host
        self._conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._owner._connections[self._host].add(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._owner._connections[self._host].discard(self._conn)

    def begin_auth(self, username: str) -> bool:
        return True  # authentication is always required

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        # asyncssh checks the signature afterwards; here: the right user and the right key.
        return username == self._owner.username and key.public_data == self._owner._client_public

    def session_requested(self) -> _ExecSession:
        return _ExecSession(self._owner._reaper_or_fail(), self._host)


class LocalSshServer:
    """SSH endpoints on 127.0.0.1, one per host name, that run commands on this machine.

    ``async with LocalSshServer(workdir, ["worker-0", ...]) as server:`` generates an ed25519
    host key and client key, writes ``workdir/id_ed25519`` (0600), ``id_ed25519.pub``,
    ``authorized_keys`` and ``known_hosts`` (``[127.0.0.1]:port key`` per host), and listens.
    Connect as ``server.username`` with ``client_keys=[server.client_key_path]`` and
    ``known_hosts=server.known_hosts_path`` to ``server.endpoints[host]``.
    """

    def __init__(self, workdir: Path, host_names: Sequence[str]) -> None:
        names = list(host_names)
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate host names in {names}")
        self.workdir = workdir
        self.host_names: tuple[str, ...] = tuple(names)
        self.username = getpass.getuser()
        self.client_key_path = workdir / "id_ed25519"
        self.known_hosts_path = workdir / "known_hosts"
        self.authorized_keys_path = workdir / "authorized_keys"
        #: host name -> (address, port); filled in on start.
        self.endpoints: dict[str, tuple[str, int]] = {}
        self._host_key: asyncssh.SSHKey | None = None
        self._client_public = b""
        self._acceptors: dict[str, asyncssh.SSHAcceptor] = {}
        self._connections: dict[str, set[asyncssh.SSHServerConnection]] = {
            name: set() for name in names
        }
        self._reaper: _Reaper | None = None

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

    def _reaper_or_fail(self) -> _Reaper:
        if self._reaper is None:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "server is closed")
        return self._reaper

    async def start(self) -> None:
        """Generate keys, write the key files and listen for every host."""
        if self._reaper is not None:
            raise RuntimeError("LocalSshServer already started")
        self._reaper = _Reaper(asyncio.get_running_loop())
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        self._client_public = client_key.public_data
        _write_private(self.client_key_path, client_key.export_private_key())
        public_line = client_key.export_public_key().decode().strip()
        (self.workdir / "id_ed25519.pub").write_text(public_line + "\n")
        self.authorized_keys_path.write_text(public_line + "\n")
        try:
            # One by one: a listen is a few synchronous syscalls, and a failure stays an
            # OSError instead of an ExceptionGroup.
            for name in self.host_names:
                await self._listen(name, 0)
        except BaseException:
            await self.aclose()
            raise
        self._write_known_hosts()
        log.info("sshserver.listening", hosts=len(self.host_names), address=LISTEN_ADDRESS)

    def _host_key_or_fail(self) -> asyncssh.SSHKey:
        if self._host_key is None:
            raise RuntimeError("LocalSshServer is not started")
        return self._host_key

    async def _listen(self, host: str, port: int) -> None:
        acceptor = await asyncssh.listen(
            host=LISTEN_ADDRESS,
            port=port,
            reuse_address=True,  # start_accepting() binds the same port again
            server_factory=functools.partial(_HostServer, self, host),
            server_host_keys=[self._host_key_or_fail()],
            config=None,
            encoding=None,
            allow_pty=False,
            line_editor=False,
            x11_forwarding=False,
            agent_forwarding=False,
            allow_scp=False,
            password_auth=False,
            kbdint_auth=False,
            host_based_auth=False,
            gss_host=None,
        )
        self._acceptors[host] = acceptor
        self.endpoints[host] = (LISTEN_ADDRESS, acceptor.get_port())

    def _write_known_hosts(self) -> None:
        host_public = self._host_key_or_fail().export_public_key().decode().strip()
        lines = [f"[{addr}]:{port} {host_public}\n" for addr, port in self.endpoints.values()]
        self.known_hosts_path.write_text("".join(lines))

    def connection_count(self, host: str) -> int:
        """Server-side connections to ``host`` open now (authenticated or not)."""
        return len(self._connections[host])

    def drop_connections(self, host: str) -> int:
        """Abort every connection to ``host`` without a goodbye; how many there were.

        Commands started over them keep running, as with sshd's connection process killed.
        """
        conns = list(self._connections[host])
        for conn in conns:
            conn.abort()
        if conns:
            log.info("sshserver.dropped", host=host, connections=len(conns))
        return len(conns)

    def accepting(self, host: str) -> bool:
        """Whether ``host`` accepts new connections."""
        return host in self._acceptors

    async def stop_accepting(self, host: str) -> None:
        """Refuse new connections to ``host`` (connection refused); open ones stay up."""
        if host not in self._connections:
            raise KeyError(host)
        acceptor = self._acceptors.pop(host, None)
        if acceptor is not None:
            acceptor.close()
            log.info("sshserver.stopped_accepting", host=host)

    async def start_accepting(self, host: str) -> None:
        """Accept connections to ``host`` again, on the same port; OSError if it was taken.

        Does nothing when ``host`` is accepting already or the server is closed.
        """
        if host not in self._connections:
            raise KeyError(host)
        if host in self._acceptors or self._reaper is None:
            return
        await self._listen(host, self.endpoints[host][1])
        log.info("sshserver.started_accepting", host=host)

    async def aclose(self) -> None:
        """Stop listening, close every connection, reap commands that exit soon; idempotent.

        Commands still running after CHILD_EXIT_GRACE_S are left running, unreaped.
        """
        reaper, self._reaper = self._reaper, None
        acceptors = list(self._acceptors.values())
        self._acceptors.clear()
        for acceptor in acceptors:
            acceptor.close()
        conns = [conn for conns in self._connections.values() for conn in conns]
        for conn in conns:
            conn.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                for conn in conns:
                    await conn.wait_closed()
                for acceptor in acceptors:
                    await acceptor.wait_closed()
        for conn in conns:
            conn.abort()
        if reaper is not None:
            await reaper.wait_all(CHILD_EXIT_GRACE_S)
            running = reaper.close()
            if running:
                log.warning("sshserver.children_left_running", pids=running)


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only, whatever the umask or an old file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)
