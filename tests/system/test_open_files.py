"""The daemon's limit on open files, as systemd leaves it (a low soft limit under a high hard
one): raised at start, and a limit too low for the fleet said before it bites."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from supervisor.config import OPEN_FILES_SPARE
from tests.sshd import OpenSsh
from tests.system.daemonproc import Daemons, all_ready, fast_config, write_config

pytestmark = [pytest.mark.system, pytest.mark.openssh]


def soft_open_file_limit(pid: int) -> int:
    """The soft "Max open files" of a running process, from /proc."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open-file limit in /proc/{pid}/limits")


async def test_the_daemon_raises_a_low_soft_limit_to_the_hard_one(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """Under systemd's kind of limits (a low soft one under a high hard one) the daemon
    raises its soft limit to the hard one, says so in ``daemon.starting``, and warns of nothing."""
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    assert hard > 2 + OPEN_FILES_SPARE
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    daemon = await daemons.start(config, prefix=["prlimit", f"--nofile=128:{hard}", "--"])
    await daemon.wait_log("daemon.starting", 60, open_file_limit=hard)
    assert daemon.process is not None
    assert soft_open_file_limit(daemon.process.pid) == hard
    await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    assert not [x for x in daemon.lines if x.get("event") == "daemon.open_file_limit_low"]
    daemon.send_signal(15)
    assert await daemon.wait_exit(60) == 0


async def test_a_limit_too_low_for_the_fleet_is_warned_at_start_and_the_fleet_still_runs(
    openssh: OpenSsh, tmp_path: Path, daemons: Daemons
) -> None:
    """A hard limit below hosts + the spare is one warning at start naming what is needed;
    the fleet still starts."""
    limit = OPEN_FILES_SPARE  # two hosts need two more
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    daemon = await daemons.start(config, prefix=["prlimit", f"--nofile={limit}:{limit}", "--"])
    warning = await daemon.wait_log("daemon.open_file_limit_low", 60)
    assert (warning["limit"], warning["needed"], warning["hosts"]) == (
        limit,
        2 + OPEN_FILES_SPARE,
        2,
    )
    await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    daemon.send_signal(15)
    assert await daemon.wait_exit(60) == 0
