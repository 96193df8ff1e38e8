"""Fixtures of the system tier: daemons started by a test are killed with their workers."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor import agent
from tests.system.daemonproc import Daemons, kill_quietly


@pytest.fixture
async def daemons(tmp_path: Path) -> AsyncIterator[Daemons]:
    """Daemons started by the test; killed afterwards, with any worker they left behind
    (stopped ones are continued first so they can die)."""
    started = Daemons()
    yield started
    for daemon in started:
        await daemon.aclose()
    for pidfile in tmp_path.rglob("ctl/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pidfile.read_text().strip())
            # A pidfile outlives its worker, and its number may now be another process's
            # (another test run's daemon, at three interpreters at once): only a process
            # whose command line names this test's directory is one of ours.
            if not any(str(tmp_path) in arg for arg in agent.cmdline(pid)):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            kill_quietly(pid)
