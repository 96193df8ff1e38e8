"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from supervisor.notify import Notifier

RECV_TIMEOUT_S = 10.0


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket, as systemd's notify socket; yields it and its path."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(RECV_TIMEOUT_S)
        yield sock, str(path)


def _recv(sock: socket.socket) -> bytes:
    """The next datagram (waits up to RECV_TIMEOUT_S)."""
    return sock.recv(65536)


def test_ready_arrives_as_one_datagram(manager: tuple[socket.socket, str]) -> None:
    """ready() sends exactly READY=1 and a newline."""
    sock, path = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    notifier.ready()
    assert _recv(sock) == b"READY=1\n"


def test_each_message_arrives_exactly(manager: tuple[socket.socket, str]) -> None:
    """stopping, watchdog and custom fields arrive byte for byte, one datagram each, in order."""
    sock, path = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    notifier.stopping()
    notifier.watchdog()
    notifier.send(STATUS="3/4 hosts ready", X_SUPERVISOR_HOSTS="4")
    assert _recv(sock) == b"STOPPING=1\n"
    assert _recv(sock) == b"WATCHDOG=1\n"
    assert _recv(sock) == b"STATUS=3/4 hosts ready\nX_SUPERVISOR_HOSTS=4\n"


def test_reloading_carries_the_monotonic_clock(manager: tuple[socket.socket, str]) -> None:
    """reloading() sends RELOADING=1 with MONOTONIC_USEC read from CLOCK_MONOTONIC at the time."""
    sock, path = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = _recv(sock).decode().splitlines()
    assert lines[0] == "RELOADING=1"
    name, _, value = lines[1].partition("=")
    assert name == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert len(lines) == 2


def test_status_is_one_line_and_not_resent_when_unchanged(
    manager: tuple[socket.socket, str],
) -> None:
    """An unchanged STATUS is not sent again, and a multi-line text is sent as one line."""
    sock, path = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    notifier.status("starting")
    notifier.status("starting")
    notifier.status("2 ready\n1 stale")
    notifier.status("2 ready\n1 stale")
    notifier.ready()  # a marker: whatever came before it arrived before it
    assert _recv(sock) == b"STATUS=starting\n"
    assert _recv(sock) == b"STATUS=2 ready 1 stale\n"
    assert _recv(sock) == b"READY=1\n"


def test_abstract_namespace_socket_is_reached() -> None:
    """An "@name" NOTIFY_SOCKET means the Linux abstract namespace (a leading NUL byte)."""
    name = f"reward-supervisor-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(RECV_TIMEOUT_S)
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert _recv(sock) == b"READY=1\n"


def test_without_notify_socket_nothing_is_sent_and_nothing_fails() -> None:
    """With NOTIFY_SOCKET unset every call is a silent no-op."""
    with capture_logs() as captured:
        notifier = Notifier({})
        notifier.ready()
        notifier.reloading()
        notifier.status("x")
        notifier.watchdog()
        notifier.stopping()
    assert not notifier.enabled
    assert captured == []


def test_default_environment_is_the_process_environment(
    manager: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an environ argument the process environment's NOTIFY_SOCKET is used."""
    sock, path = manager
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    Notifier().ready()
    assert _recv(sock) == b"READY=1\n"


def test_a_vanished_socket_is_logged_once_and_recovery_noticed(tmp_path: Path) -> None:
    """Sending to a socket that went away never raises, logs one failure, then logs recovery."""
    path = tmp_path / "notify.sock"
    notifier = Notifier({"NOTIFY_SOCKET": str(path)})
    with capture_logs() as captured:
        notifier.watchdog()
        notifier.status("down")
        notifier.watchdog()
    assert [(e["event"], e["log_level"]) for e in captured] == [("notify.failed", "warning")]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(RECV_TIMEOUT_S)
        with capture_logs() as captured:
            notifier.status("down")  # not sent before, so it is sent now
        assert _recv(sock) == b"STATUS=down\n"
    assert [e["event"] for e in captured] == ["notify.recovered"]


def test_a_manager_that_stops_reading_does_not_block_forever(
    manager: tuple[socket.socket, str],
) -> None:
    """When the manager's queue is full a send gives up after its timeout, logged, not raised."""
    sock, path = manager
    notifier = Notifier({"NOTIFY_SOCKET": path})
    deadline = time.monotonic() + 60
    with capture_logs() as captured:
        while not captured:
            assert time.monotonic() < deadline, "the receive queue never filled"
            notifier.watchdog()
    # Only the last send met the full queue: it waited SEND_TIMEOUT_S, gave up and said so.
    assert [e["event"] for e in captured] == ["notify.failed"]
    assert _recv(sock) == b"WATCHDOG=1\n"


def test_unsupported_socket_forms_disable_notification() -> None:
    """A vsock or relative NOTIFY_SOCKET is not spoken: disabled, with a warning."""
    with capture_logs() as captured:
        notifier = Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})
        notifier.ready()
    assert not notifier.enabled
    assert [e["event"] for e in captured] == ["notify.unsupported_socket"]


def test_invalid_field_names_are_a_caller_bug() -> None:
    """A lower-case or empty field name raises ValueError even when notification is off."""
    with pytest.raises(ValueError, match="ready"):
        Notifier({}).send(ready="1")


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_and_only_for_us(
    environ: dict[str, str], interval: float | None
) -> None:
    """The ping interval is WATCHDOG_USEC/2, only when WATCHDOG_PID is unset or our pid."""
    assert Notifier(environ).watchdog_interval_s() == interval
