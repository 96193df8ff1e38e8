"""Not root by default: a daemon started as root, logging in to hosts as root, says so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sshd import OpenSsh
from tests.system.daemonproc import Daemons, fast_config, write_config

pytestmark = [pytest.mark.system, pytest.mark.openssh]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root case needs root; CI runs as root")
async def test_a_root_daemon_logging_in_as_root_warns_at_start(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """Both warnings come before the daemon touches the run directory, and name the hosts
    reached as root."""
    raw = fast_config(openssh, tmp_path / "run", 2, tmp_path, ssh={"username": "root"})
    daemon = await daemons.start(write_config(tmp_path / "rs.toml", raw))
    as_root = await daemon.wait_log("daemon.running_as_root", 60)
    login = await daemon.wait_log("ssh.root_login", 60)
    await daemon.wait_log("control.listening", 60)
    assert as_root["level"] == login["level"] == "warning"
    assert login["hosts"] == ["worker-0", "worker-1"]
    events = [line["event"] for line in daemon.lines]
    assert events.index("ssh.root_login") < events.index("control.listening")
