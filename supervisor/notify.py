"""systemd's notify protocol (sd_notify(3)): datagrams to ``$NOTIFY_SOCKET``, written directly.

Does nothing when the variable is unset; never raises on a delivery failure (it logs).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from typing import Final, Protocol

import structlog

_log = structlog.get_logger()

# PID 1 reads its notify socket promptly; a full queue means systemd is wedged, and a
# daemon must not block its event loop waiting for it for longer than this.
SEND_TIMEOUT_S: Final = 1.0
_FIELD_NAME: Final = re.compile(r"^[A-Z][A-Z0-9_]*$")


class NotifierProtocol(Protocol):
    """What the daemon needs from a notifier (``Notifier(environ={})`` is a silent one)."""

    enabled: bool

    def ready(self) -> None: ...

    def reloading(self) -> None: ...

    def stopping(self) -> None: ...

    def status(self, text: str) -> None: ...

    def watchdog(self) -> None: ...

    def watchdog_interval_s(self) -> float | None: ...


class Notifier:
    """Sends ``KEY=VALUE`` messages to the service manager, if there is one.

    Each message uses a fresh ``AF_UNIX`` datagram socket, as systemd's own reference
    implementation does: messages are rare (a watchdog ping every few seconds, a status on
    change), a socket costs microseconds, and nothing is held that could go stale when the
    manager re-creates its socket or leak when the daemon forgets to close it.
    """

    enabled: bool

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = _address(raw)
        self.enabled = self._address is not None
        if raw and self._address is None:
            _log.warning("notify.unsupported_socket", socket=raw)
        self._watchdog_usec = _positive_int(env.get("WATCHDOG_USEC"))
        self._watchdog_pid = _positive_int(env.get("WATCHDOG_PID"))
        self._watchdog_pid_set = "WATCHDOG_PID" in env
        self._last_status: str | None = None
        self._failing = False

    def send(self, **fields: str) -> None:
        """Send one datagram ``K=V\\n...``; a no-op when there is no manager.

        Delivery errors are logged once per outage and never raised. Field names must be
        upper-case protocol keys (``ValueError`` otherwise: that is a bug in the caller);
        a newline in a value would start a new field, so it becomes a space.
        """
        self._send(fields)

    def _send(self, fields: Mapping[str, str]) -> bool:
        for name in fields:
            if not _FIELD_NAME.match(name):
                raise ValueError(f"not an sd_notify field name: {name!r}")
        if self._address is None:
            return False
        payload = "".join(f"{k}={_one_line(v)}\n" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.connect(self._address)
                sock.sendall(payload)
        except OSError as exc:  # includes TimeoutError
            if not self._failing:
                self._failing = True
                _log.warning(
                    "notify.failed", socket=_printable(self._address), error=str(exc) or "timeout"
                )
            return False
        if self._failing:
            self._failing = False
            _log.info("notify.recovered", socket=_printable(self._address))
        return True

    def ready(self) -> None:
        """Startup (or a reload) is complete."""
        self.send(READY="1")

    def reloading(self) -> None:
        """A reload began; ``READY=1`` must follow when it is done."""
        # Type=notify-reload (systemd >= 253) requires the timestamp, or `systemctl reload`
        # waits for its timeout.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(RELOADING="1", MONOTONIC_USEC=str(usec))

    def stopping(self) -> None:
        """Shutdown began."""
        self.send(STOPPING="1")

    def status(self, text: str) -> None:
        """One line for ``systemctl status``; identical text is not sent again."""
        line = _one_line(text)
        if line == self._last_status:
            return
        if self._send({"STATUS": line}):
            self._last_status = line

    def watchdog(self) -> None:
        """The watchdog keep-alive ping."""
        self.send(WATCHDOG="1")

    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of ``WATCHDOG_USEC``; ``None`` if the watchdog is not ours."""
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid_set and self._watchdog_pid != os.getpid():
            return None  # set for another process (we inherited it)
        return self._watchdog_usec / 2 / 1_000_000


def _address(raw: str) -> str | bytes | None:
    if raw.startswith("/"):
        return raw
    if raw.startswith("@") and len(raw) > 1:
        return b"\0" + os.fsencode(raw[1:])  # Linux abstract namespace
    return None  # unset, or a form we don't speak (vsock:)


def _positive_int(raw: str | None) -> int | None:
    if raw is None or not re.fullmatch(r"[0-9]+", raw.strip()):
        return None
    value = int(raw)
    return value if value > 0 else None


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def _printable(address: str | bytes) -> str:
    return address if isinstance(address, str) else "@" + os.fsdecode(address[1:])
