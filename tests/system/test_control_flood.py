"""Control-socket clients that open connections and never use them, as a leaking script
would: the daemon's file descriptors belong to its hosts, and its operator still gets in."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from tests.sshd import OpenSsh
from tests.system.daemonproc import Daemons, all_ready, fast_config, host_pids, write_config

pytestmark = [pytest.mark.system, pytest.mark.openssh]

#: The daemon's descriptor limit here: far above what two hosts need, far below the flood.
NOFILE = 256
FLOOD = 600


async def test_a_flood_of_idle_control_connections_leaves_status_and_workers_alone(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """600 control connections that never send, against a daemon limited to 256 fds:
    ``status`` is still answered and every worker keeps running under the same pid."""
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    daemon = await daemons.start(config, prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"])
    status = await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    pids = host_pids(status)
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            flood.append(sock)
            # A full accept backlog refuses the rest at once (EAGAIN): enough are held.
            with contextlib.suppress(BlockingIOError, ConnectionRefusedError):
                sock.connect(str(daemon.socket))
        status = await daemon.wait_status(
            lambda s: all_ready(s, 2), 30, "status answered during the flood"
        )
        assert host_pids(status) == pids
    finally:
        for sock in flood:
            sock.close()
    daemon.send_signal(15)
    assert await daemon.wait_exit(60) == 0
