"""The control socket's client: one request and its reply, or the event stream; and the
wire format both ends speak (one JSON object a line). No server and no logging here, and
``request_sync`` (the CLI's) no event loop either: asyncio is imported by the asyncio calls
alone, so that a command that only asks the daemon imports none of them (``control.py`` is
the server).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from supervisor.errors import ControlError, DaemonNotRunning
from supervisor.refusals import Refusal

if TYPE_CHECKING:
    import asyncio

# A `status` reply grows with the fleet (about 200 bytes a host); the client's cap only guards
# against a runaway peer, not a big fleet.
MAX_REPLY_BYTES: Final = 64 * 1024 * 1024


def encode_line(message: Mapping[str, Any]) -> bytes:
    """One message as a line of the wire format, both ways: JSON, UTF-8, a newline."""
    # NaN and Infinity are not JSON; other readers of the socket (jq) would choke on them.
    text = json.dumps(message, allow_nan=False, ensure_ascii=False) + "\n"
    # A lone surrogate (a request's or a host's "\ud800") cannot be UTF-8; as the escape it
    # came in as it stays valid JSON (surrogates only ever occur inside JSON strings), where
    # a strict encode would fail the whole reply.
    return text.encode("utf-8", "backslashreplace")


async def request(path: Path, cmd: str, *, timeout_s: float = 10.0, **args: Any) -> dict[str, Any]:
    """Send one command to the daemon at ``path``; return its reply without the ``ok`` key.

    Raises DaemonNotRunning (no socket, or a stale one), or ControlError naming the socket and
    the reason: a socket we may not use, no reply within ``timeout_s``, or the daemon's own
    error message, with its code.
    """
    import asyncio

    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await _connect(path)
            try:
                await _send_request(path, writer, {"cmd": cmd, **args})
                line = await _read_line(path, reader)
            finally:
                await _close_quietly(writer)
    except TimeoutError:
        raise _no_reply(f"no reply from the daemon at {path} within {timeout_s:g}s") from None
    if line is None:
        raise _no_reply(f"the daemon at {path} closed the connection without replying")
    return _unwrap(path, line)


def find_socket(candidates: Sequence[Path], default: Path) -> Path:
    """The first of ``candidates`` (where a daemon may have its socket) that holds a socket;
    ``default`` (where a daemon would put it now) when none does."""
    for path in candidates:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                return path
    return default


def request_sync(path: Path, cmd: str, *, timeout_s: float = 10.0, **args: Any) -> dict[str, Any]:
    """``request`` for synchronous callers (the CLI) over a blocking socket: the same checks,
    wire and errors, and no event loop to import and start. It blocks: not for a loop."""
    deadline = time.monotonic() + timeout_s
    late = f"no reply from the daemon at {path} within {timeout_s:g}s"
    _check_socket(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except TimeoutError:
            raise _no_reply(late) from None
        except OSError as exc:
            raise _connect_failed(path, exc) from None
        try:
            sock.sendall(encode_line({"cmd": cmd, **args}))
        except TimeoutError:
            raise _no_reply(late) from None
        except ConnectionError:
            pass  # the daemon may have answered and hung up already (it refused us): read why
        except OSError as exc:
            raise _send_failed(path, exc) from None
        line = _read_line_sync(path, sock, deadline, late)
    if line is None:
        raise _no_reply(f"the daemon at {path} closed the connection without replying")
    return _unwrap(path, line)


def _read_line_sync(path: Path, sock: socket.socket, deadline: float, late: str) -> bytes | None:
    """One reply line by ``deadline``, or None at a clean end of stream."""
    data = bytearray()
    while True:
        sock.settimeout(max(0.0, deadline - time.monotonic()) or 1e-6)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise _no_reply(late) from None
        except OSError as exc:
            raise _no_reply(f"connection to the daemon at {path} broke: {exc}") from None
        if not chunk:
            return bytes(data) if data.strip() else None
        end = chunk.find(b"\n")
        if end >= 0:
            return bytes(data + chunk[: end + 1])
        data += chunk
        if len(data) > MAX_REPLY_BYTES:
            raise _too_long(path)


async def follow_events(
    path: Path, *, timeout_s: float = 10.0, on_subscribed: Callable[[], None] | None = None
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the daemon's events as they happen, until the daemon ends the stream.

    Connecting and the first reply are bounded by ``timeout_s``; waiting for events is not.
    Wrap it in ``contextlib.aclosing`` so stopping early closes the connection at once.
    ``on_subscribed`` runs once the daemon has confirmed the subscription: from then on no
    event is missed.
    Raises ControlError as ``request`` does, and if the stream breaks.
    """
    import asyncio

    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await _connect(path)
    except TimeoutError:
        raise _no_reply(f"no answer from the daemon at {path} within {timeout_s:g}s") from None
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await _send_request(path, writer, {"cmd": "events"})
                first = await _read_line(path, reader)
        except TimeoutError:
            raise _no_reply(f"no reply from the daemon at {path} within {timeout_s:g}s") from None
        if first is None:
            raise _no_reply(f"the daemon at {path} closed the connection without replying")
        _unwrap(path, first)
        if on_subscribed is not None:
            on_subscribed()
        while (line := await _read_line(path, reader)) is not None:
            event = _decode(path, line)
            yield event
    finally:
        await _close_quietly(writer)


def _check_socket(path: Path) -> None:
    """Refuse a path that is not a socket we may trust with a command (before connecting)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DaemonNotRunning(f"daemon not running? no socket at {path}") from None
    except PermissionError:
        raise _unreachable(
            f"permission denied: cannot reach {path}; the socket is not ours"
            " (run as the daemon's user or root)"
        ) from None
    except OSError as exc:
        raise _unreachable(f"cannot reach {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise _unreachable(f"{path} is not a socket")
    euid = os.geteuid()
    # Whoever owns the socket hears our commands; only trust ourselves and root.
    if st.st_uid not in (euid, 0):
        raise _unreachable(
            f"socket {path} is owned by uid {st.st_uid}, not by us (uid {euid}) or root;"
            " refusing to talk to it"
        )


def _connect_failed(path: Path, exc: OSError) -> ControlError:
    """What a failed connect to ``path`` means for the caller."""
    if isinstance(exc, FileNotFoundError):
        return DaemonNotRunning(f"daemon not running? no socket at {path}")
    if isinstance(exc, ConnectionRefusedError):
        return DaemonNotRunning(f"daemon not running (stale socket {path})")
    if isinstance(exc, PermissionError):
        return _unreachable(
            f"permission denied connecting to {path}; the socket is not ours"
            " (run as the daemon's user or root)"
        )
    return _unreachable(f"cannot connect to {path}: {exc.strerror or exc}")


def _send_failed(path: Path, exc: OSError) -> ControlError:
    # ENOTCONN: a daemon whose accept queue is full refuses a unix connect with EAGAIN,
    # which asyncio's connect takes for "in progress" and then for success.
    return _unreachable(
        f"cannot send to the daemon at {path}: {exc.strerror or exc} (is it accepting connections?)"
    )


def _too_long(path: Path) -> ControlError:
    return ControlError(
        f"the daemon at {path} sent a line over {MAX_REPLY_BYTES} bytes", code=Refusal.BAD_REPLY
    )


async def _connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    import asyncio

    _check_socket(path)
    try:
        return await asyncio.open_unix_connection(path, limit=MAX_REPLY_BYTES)
    except OSError as exc:
        raise _connect_failed(path, exc) from None


async def _send_request(
    path: Path, writer: asyncio.StreamWriter, message: Mapping[str, Any]
) -> None:
    try:
        writer.write(encode_line(message))
        await writer.drain()
    except ConnectionError:
        pass  # the daemon may have answered and hung up already (it refused us): read why
    except OSError as exc:
        raise _send_failed(path, exc) from None


async def _read_line(path: Path, reader: asyncio.StreamReader) -> bytes | None:
    """One reply line, or None at a clean end of stream."""
    import asyncio

    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return exc.partial if exc.partial.strip() else None
    except asyncio.LimitOverrunError:
        raise _too_long(path) from None
    except OSError as exc:
        raise _no_reply(f"connection to the daemon at {path} broke: {exc}") from None


def _decode(path: Path, line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        message = None
    if not isinstance(message, dict):
        raise ControlError(
            f"the daemon at {path} sent a malformed reply: {line[:80]!r}", code=Refusal.BAD_REPLY
        )
    return message


def _unwrap(path: Path, line: bytes) -> dict[str, Any]:
    reply = _decode(path, line)
    if reply.get("ok") is not True:
        message = str(reply.get("error") or f"the daemon at {path} refused the request")
        raise ControlError(message, code=_code_of(reply))
    return {k: v for k, v in reply.items() if k != "ok"}


#: A code is a short lower-case identifier; anything else a reply calls one is not kept.
MAX_CODE_CHARS: Final = 40


def _code_of(reply: Mapping[str, Any]) -> str:
    """The refusal's code as the daemon sent it (a newer daemon's may be new to us), or
    ``failed`` when it sent none (an older daemon) or something that is not a code."""
    code = reply.get("code")
    if (
        isinstance(code, str)
        and 0 < len(code) <= MAX_CODE_CHARS
        and code.isascii()
        and code.replace("_", "").isalpha()
        and code.islower()
    ):
        return code
    return Refusal.FAILED


def _no_reply(message: str) -> ControlError:
    return ControlError(message, code=Refusal.NO_REPLY)


def _unreachable(message: str) -> ControlError:
    return ControlError(message, code=Refusal.UNREACHABLE)


async def _close_quietly(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):  # what broke the exchange was reported, if it mattered
        await writer.wait_closed()
