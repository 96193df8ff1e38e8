"""SIGHUP with a config file that is hostile to the reader itself: nested past Python's
recursion limit, a named pipe, a device. The daemon keeps its config and its workers, says
why, applies the next valid file, and still stops on SIGTERM."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.sshd import OpenSsh
from tests.system.daemonproc import (
    Daemons,
    all_ready,
    fast_config,
    host_pids,
    write_config,
)

pytestmark = [pytest.mark.system, pytest.mark.openssh]


def nested(path: Path) -> None:
    """Arrays nested 10 000 deep: valid TOML as far as it goes, and tomllib recurses."""
    path.write_text("x = " + "[" * 10_000 + "]" * 10_000 + "\n", encoding="utf-8")


def fifo(path: Path) -> None:
    """A named pipe nobody writes: opening it for reading blocks."""
    path.unlink()
    os.mkfifo(path)


def device(path: Path) -> None:
    """A symlink to ``/dev/zero``: reading it never ends."""
    path.unlink()
    path.symlink_to("/dev/zero")


@pytest.mark.parametrize(
    ("plant", "reason"),
    [(nested, "nested too deeply"), (fifo, "not a regular file"), (device, "not a regular file")],
    ids=["nested", "fifo", "dev-zero"],
)
async def test_a_config_the_reader_chokes_on_fails_the_reload_and_nothing_else(
    openssh: OpenSsh,
    tmp_path: Path,
    daemons: Daemons,
    plant: Callable[[Path], None],
    reason: str,
) -> None:
    """A SIGHUP onto a config nested too deeply, a FIFO or /dev/zero fails that reload at
    once with the reason, keeps every worker, leaves later reloads working, and SIGTERM
    still ends the daemon with exit 0."""
    config = write_config(tmp_path / "rs.toml", fast_config(openssh, tmp_path / "run", 2, tmp_path))
    good = config.read_text()
    daemon = await daemons.start(config)
    status = await daemon.wait_status(lambda s: all_ready(s, 2), 60, "2 ready")
    pids = host_pids(status)

    plant(config)
    daemon.send_signal(signal.SIGHUP)
    failed = await daemon.wait_log("config.reload_failed", timeout_s=20)
    assert any(reason in e for e in failed["errors"]), failed["errors"]
    status = await daemon.status()
    assert host_pids(status) == pids
    assert status["daemon"]["last_reload_errors"] == failed["errors"]

    config.unlink()
    config.write_text(good, encoding="utf-8")
    daemon.send_signal(signal.SIGHUP)
    await daemon.wait_status(lambda s: s["daemon"]["reloads"] == 1, 20, "the valid reload")

    daemon.send_signal(signal.SIGTERM)
    assert await daemon.wait_exit(60) == 0
