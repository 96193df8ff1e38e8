"""A launch that comes while the shepherd of a dead worker still holds the shard (sweeping its
session, writing its exit record) waits for it, where a live worker's holder refuses at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor import agent

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, sys.argv[2].encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


def hold(lock: Path, worker_pid: int) -> subprocess.Popen[str]:
    """Another process holding ``lock`` as a shepherd of ``worker_pid`` would, until its stdin
    closes."""
    record = json.dumps({"pid": worker_pid, "host": "w0", "boot_id": agent.boot_id()})
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), record],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def release(child: subprocess.Popen[str]) -> None:
    """Let the holder go and wait for it."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.close()
    child.wait(timeout=30)
    child.stdout.close()


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def test_the_lock_of_a_dead_worker_s_shepherd_is_waited_for(tmp_path: Path) -> None:
    """The holder's worker is dead: the lock is taken as soon as the holder lets go."""
    lock = tmp_path / "shard-0.lock"
    child = hold(lock, dead_pid())
    fd = os.open(lock, os.O_RDWR)
    taken: list[float] = []
    started = time.monotonic()

    def take() -> None:
        """Take the lock, and note when."""
        agent._take_shard_lock(fd)
        taken.append(time.monotonic())

    waiter = threading.Thread(target=take)
    waiter.start()
    release(child)
    waiter.join(timeout=agent.LOCK_HANDOVER_S + 30)
    os.close(fd)
    assert taken and taken[0] - started < agent.LOCK_HANDOVER_S


def test_the_lock_of_a_live_worker_s_shepherd_is_refused_at_once(tmp_path: Path) -> None:
    """The holder's worker lives: no wait, the lock's error at once."""
    lock = tmp_path / "shard-0.lock"
    child = hold(lock, os.getpid())
    fd = os.open(lock, os.O_RDWR)
    try:
        started = time.monotonic()
        with pytest.raises(OSError, match=r"unavailable|denied"):
            agent._take_shard_lock(fd)
        assert time.monotonic() - started < agent.LOCK_HANDOVER_S
    finally:
        os.close(fd)
        release(child)
