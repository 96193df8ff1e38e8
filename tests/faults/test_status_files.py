"""Garbage in status files is an observation, never a crash and never a restart by itself."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.harness import (
    HEALTH,
    FaultRun,
    events,
    hold_for,
    host_row,
    pid_of,
    wait_event,
)
from tests.system.daemonproc import DaemonProcess

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: Each bad file is written again until the daemon has read it (the worker overwrites it
#: with a good heartbeat every 0.2 s); one attempt waits this long for the log line.
ATTEMPT_S = 1.0
ATTEMPTS = 20


def in_place(data: bytes) -> Callable[[Path], None]:
    """Write ``data`` over the file in place, as a writer that does not rename would."""

    def write(path: Path) -> None:
        with path.open("wb") as f:
            f.write(data)

    return write


def replaced(data: bytes) -> Callable[[Path], None]:
    """Replace the file with one holding ``data`` (temp file + rename)."""

    def write(path: Path) -> None:
        tmp = path.with_name(".garbage.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    return write


def symlink_to(target: Path) -> Callable[[Path], None]:
    """Replace the file with a symlink to ``target``."""

    def write(path: Path) -> None:
        tmp = path.with_name(".garbage.lnk")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, path)

    return write


def fifo(path: Path) -> None:
    """Replace the file with a named pipe nobody writes to."""
    tmp = path.with_name(".garbage.fifo")
    tmp.unlink(missing_ok=True)
    os.mkfifo(tmp)
    os.replace(tmp, path)


def deleted(path: Path) -> None:
    """Remove the file."""
    path.unlink(missing_ok=True)


BINARY = bytes(random.Random(6).randrange(128, 256) for _ in range(512))

GARBAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("partial write", in_place(b'{"ready": true, "heartbeat_at": 17'), "not JSON"),
    ("empty", in_place(b""), "empty"),
    ("not JSON", replaced(b"heartbeat: yes\n"), "not JSON"),
    ("binary", replaced(BINARY), "not UTF-8"),
    ("10 MB", replaced(b"{" + b" " * (10 * 1024 * 1024) + b"}"), "too big"),
    ("JSON but no pid", replaced(b'{"ready": true, "heartbeat_at": 1.5}'), "missing pid"),
    ("symlink to a device", symlink_to(Path("/dev/zero")), "a symbolic link"),
    ("symlink to nowhere", symlink_to(Path("/nonexistent/status.json")), "a symbolic link"),
    ("named pipe", fifo, "not a regular file"),
    ("deleted", deleted, "missing"),
]


async def plant(
    daemon: DaemonProcess, status: Path, write: Callable[[Path], None], reason: str
) -> int:
    """Write garbage until the daemon reports reading it; the log's length before that."""
    for _ in range(ATTEMPTS):
        mark = len(daemon.lines)
        write(status)
        try:
            await wait_event(
                daemon, "status.problem", after=mark, timeout_s=ATTEMPT_S, reason=reason
            )
        except AssertionError:
            continue  # the worker's next heartbeat overtook our garbage: again
        return mark
    raise AssertionError(f"the daemon never reported {reason!r} in {ATTEMPTS} attempts")


async def test_garbage_status_files_never_restart_a_healthy_worker(fault_run: FaultRun) -> None:
    """Partial, empty, non-JSON, binary, 10 MB, fieldless, symlinked, piped or deleted status
    files are each reported as a status problem and forgotten at the worker's next good
    heartbeat: no state change, no restart, the daemon keeps serving."""
    fault_run.write(fault_run.raw(1))
    daemon = await fault_run.start(ready=1)
    pid = pid_of(await daemon.status(), "worker-0")
    status = fault_run.root / "status" / "worker-0.json"
    begin = len(daemon.lines)
    for what, write, reason in GARBAGE:
        mark = await plant(daemon, status, write, reason)
        try:
            await wait_event(daemon, "status.recovered", after=mark)
        except AssertionError as exc:
            raise AssertionError(f"no recovery after {what}: {exc}") from None
    after = await daemon.status()
    assert host_row(after, "worker-0")["state"] == "ready"
    assert pid_of(after, "worker-0") == pid
    assert host_row(after, "worker-0")["restarts"] == 0
    assert events(daemon, "host.state")[1:] == []
    assert not [line for line in daemon.lines[begin:] if line.get("level") == "error"]
    assert fault_run.monitor.pids_seen(0) == [pid]


async def test_status_directory_removed_and_recreated_is_watched_again(
    fault_run: FaultRun,
) -> None:
    """``status/`` deleted and made again under a running worker: the watch is rebuilt and
    the worker's heartbeats count again, so it is never declared stale."""
    fault_run.write(fault_run.raw(1))
    daemon = await fault_run.start(ready=1)
    pid = pid_of(await daemon.status(), "worker-0")
    status_dir = fault_run.root / "status"
    mark = len(daemon.lines)
    removed_at = time.monotonic()
    shutil.rmtree(status_dir)
    status_dir.mkdir()
    await wait_event(daemon, "watch.restarted", after=mark)
    fault_run.recovered("status/ replaced: watch rebuilt", removed_at)

    def fresh_and_same() -> None:
        """No state change and no other worker."""
        assert events(daemon, "host.state")[1:] == []
        assert fault_run.monitor.pids_seen(0) == [pid]

    # Past the stale threshold: only heartbeats seen through the new watch keep it ready.
    await hold_for(float(HEALTH["heartbeat_stale_s"]) + 1.0, fresh_and_same)
    row = host_row(await daemon.status(), "worker-0")
    assert (row["state"], row["pid"], row["restarts"]) == ("ready", pid, 0)
    assert row["heartbeat_age_s"] < float(HEALTH["heartbeat_stale_s"])
