"""A run root whose filesystem hangs (a FUSE mount whose server is stopped, as a hard NFS
mount whose server died): the daemon still stops when told to."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tests.conftest import bindfs_mount
from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    Daemons,
    all_ready,
    fast_config,
    host_pids,
    kill_quietly,
    pid_alive,
    poll_until,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]

#: Far inside the unit's TimeoutStopSec (120 s), far above what the stop may take here: the
#: worker's stop (its grace, 5 s, and the wait for it) and three bounded waits of 5 s.
STOP_DEADLINE_S = 75


async def test_sigterm_ends_the_daemon_while_its_run_root_hangs(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """The run root's FUSE server stopped under a running fleet: SIGTERM still ends the
    daemon well inside the unit's TimeoutStopSec (120 s), its stuck file operations
    abandoned and said so, instead of the process living as long as the mount hangs;
    ``daemon.stopped`` is still its last line."""
    with bindfs_mount(tmp_path) as (mount, server):
        raw = fast_config(openssh, mount / "run", 1, tmp_path, watch={"mode": "poll"})
        daemon = await daemons.start(write_config(tmp_path / "rs.toml", raw))
        status = await daemon.wait_status(lambda s: all_ready(s, 1), 60, "1 ready")
        [worker] = host_pids(status).values()
        assert worker is not None
        os.kill(server, signal.SIGSTOP)
        # Only if the test itself fails to end does this fire: the mount must be let go.
        rescue = threading.Timer(STOP_DEADLINE_S + 30, os.kill, (server, signal.SIGCONT))
        rescue.start()
        try:
            # The hang is under way: the worker's heartbeat writes block in the mount.
            await daemon.wait_log("host.state", 30, to="stale")
            daemon.send_signal(signal.SIGTERM)
            code = await daemon.wait_exit(STOP_DEADLINE_S)
        finally:
            rescue.cancel()
            if daemon.process is not None and daemon.process.returncode is None:
                daemon.process.kill()
                await daemon.process.wait()
            os.kill(server, signal.SIGCONT)
            # Its stop was cut short by the hang: it beats on in the mount, which must go.
            kill_quietly(worker)
            await poll_until(lambda: not pid_alive(worker), 30, "the worker gone")
    events = [line.get("event") for line in daemon.lines]
    forced = [line for line in daemon.lines if line.get("event") == "daemon.exit_forced"]
    assert forced, daemon.tail()
    assert forced[0]["stuck_threads"] >= 1
    assert code == forced[0]["exit_code"]
    # Said when it is so: after the threads were given up, as the process's last line.
    assert events[-1] == "daemon.stopped", daemon.tail()
    assert events.index("daemon.exit_forced") < len(events) - 1
