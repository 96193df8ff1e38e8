"""TCP ports for test servers, safe with many test processes at once (``./dev test`` runs
several interpreters, each with pytest-xdist workers).

A port from ``bind(port 0)`` comes from the kernel's ephemeral range and is free only at that
moment: once released, another process's ``bind(0)`` may get it, and so may any outgoing
connection as its source port, before our server binds it (or while a fault test has its
sshd stopped). So ports here come from below the ephemeral range, where neither happens, and
each is claimed with an ``flock`` on a file under ``LOCK_DIR`` that this process holds until it
exits: no other test process on the machine is handed the same port.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
from pathlib import Path

LOCK_DIR = Path("/tmp/reward-supervisor-test-ports")
#: Below the usual ephemeral range (32768-60999) and above the well-known and registered
#: ports most services use.
LOWEST = 20000
#: Claims held by this process: closing one would release its port to others.
_HELD: list[int] = []


def _ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(address: str, port: int) -> bool:
    """Nothing is bound to ``address:port`` (TCP)."""
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _claim(port: int) -> int | None:
    """The held lock fd for ``port``, or None when another process holds it."""
    LOCK_DIR.mkdir(mode=0o755, exist_ok=True)
    fd = os.open(LOCK_DIR / f"{port}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def reserve(*addresses: str) -> int:
    """A TCP port free on every one of ``addresses`` and claimed by this process for its life."""
    top = _ephemeral_floor()
    if top <= LOWEST:
        raise RuntimeError(f"the ephemeral range starts at {top}: no room below it for tests")
    ports = list(range(LOWEST, top))
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        fd = _claim(port)
        if fd is None:
            continue
        if all(_bindable(address, port) for address in addresses):
            _HELD.append(fd)
            return port
        os.close(fd)
    raise RuntimeError(f"no port in {LOWEST}-{top - 1} is free on {', '.join(addresses)}")
