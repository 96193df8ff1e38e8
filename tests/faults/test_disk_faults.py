"""The run directory refuses writes: one host's log path is unusable; the filesystem is full."""

from __future__ import annotations

import errno
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import mounted_tmpfs
from tests.faults.harness import (
    HEALTH,
    READY_S,
    FaultRun,
    Workload,
    events,
    hold_for,
    host_row,
    kill,
    pid_of,
    wait_event,
)
from tests.system.daemonproc import DaemonProcess, all_ready, poll_until

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]


@pytest.mark.parametrize("kind", ["log", "pid"])
async def test_unwritable_host_file_fails_only_that_host_with_a_clear_error(
    fault_run: FaultRun, kind: str
) -> None:
    """``ctl/worker-1.log`` (checked before the worker starts) or ``ctl/worker-1.pid``
    (written after) is a directory: every launch of worker-1 fails with an error naming the
    path and the cause and is retried with backoff, the first failure included; a worker
    started but not recorded is killed, never left running beside the next; worker-0 runs
    untouched; once the path is usable the host comes up."""
    fault_run.write(fault_run.raw(2))
    path = fault_run.root / "ctl" / f"worker-1.{kind}"
    path.mkdir(parents=True)
    daemon = await fault_run.start()
    await wait_event(daemon, "host.launch_failed", host="worker-1", count=3)
    failure = events(daemon, "host.launch_failed", host="worker-1")[0]
    assert "Is a directory" in failure["reason"] and str(path) in failure["reason"], failure
    assert failure["uncertain"] is False
    if kind == "pid":
        assert "it was killed" in failure["reason"], failure
    await poll_until(lambda: fault_run.monitor.live_on(1) == [], READY_S, "nothing left")
    status = await daemon.wait_status(
        lambda s: host_row(s, "worker-0")["state"] == "ready", READY_S, "worker-0 ready"
    )
    keep = pid_of(status, "worker-0")
    assert "Is a directory" in (host_row(status, "worker-1")["last_error"] or "")
    assert events(daemon, "host.state", host="worker-0")[1:] == []

    path.rmdir()
    fixed_at = time.monotonic()
    status = await daemon.wait_status(lambda s: all_ready(s, 2), READY_S, "worker-1 up")
    fault_run.recovered(f"{kind} path usable again: host up (within its backoff)", fixed_at)
    assert pid_of(status, "worker-0") == keep
    assert fault_run.monitor.live_on(1) == [pid_of(status, "worker-1")]
    assert path.is_file()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for this test (root only), unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "small-fs", "16m") as mount_point:
        yield mount_point


def fill(path: Path) -> int:
    """Write zeros to ``path`` until the filesystem refuses; the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            block = bytes(chunk)
            while True:
                try:
                    written += f.write(block) or 0
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    return written


async def fill_until_frozen(fault_run: FaultRun, daemon: DaemonProcess, filler: Path) -> None:
    """Fill the run's filesystem and wait until the fleet freezes (and says so on STATUS=)."""
    assert fill(filler) > 0
    frozen = await daemon.wait_log("fleet.frozen", timeout_s=READY_S)
    assert "suspect the shared filesystem" in frozen["reason"]
    # At least the threshold (2 of 3) fell silent together; the third may follow later.
    assert len(frozen["hosts"]) >= 2, frozen
    # The daemon looks at the run root itself and names the cause it can see.
    finding = await daemon.wait_log("fleet.freeze_finding", timeout_s=READY_S)
    assert finding["finding"].startswith("the run filesystem is full"), finding
    await daemon.wait_until(
        lambda: any(
            n.startswith("STATUS=FROZEN (the run filesystem is full") for n in daemon.notifications
        ),
        READY_S,
        "STATUS=FROZEN naming the full disk",
    )


async def test_full_run_filesystem_freezes_restarts_and_loses_nothing(
    tmpfs: Path, fault_run: FaultRun
) -> None:
    """The run root's filesystem fills up under three busy workers: their heartbeats stop
    together, the fleet freezes (loudly) instead of restarting anyone, the daemon stays up;
    when space returns it thaws, every host is ready and every task gets its result."""
    root = tmpfs / "run"
    fault_run.write(fault_run.raw(3, root=root))
    daemon = await fault_run.start(ready=3)
    status = await daemon.status()
    pids = {h: pid_of(status, h) for h in ("worker-0", "worker-1", "worker-2")}
    work = Workload(root, shards=3, total=1500, duration_s=6.0).start()
    filler = tmpfs / "filler"
    try:
        mark = len(daemon.lines)
        filled_at = time.monotonic()
        await fill_until_frozen(fault_run, daemon, filler)
        fault_run.recovered("disk full: fleet frozen", filled_at)

        def held() -> None:
            """No launch or terminate since the disk filled; the same three workers live."""
            assert not [
                line
                for line in daemon.lines[mark:]
                if line.get("event") in ("host.launch", "host.terminate")
            ]
            assert {w.host: w.pid for w in fault_run.monitor.live()} == pids

        # Well past the stale threshold: nobody is restarted while the disk is full.
        await hold_for(5.0, held)
        assert (await daemon.status())["daemon"]["frozen"] is True

        filler.unlink()
        freed_at = time.monotonic()
        await daemon.wait_log("fleet.thawed", timeout_s=READY_S)
        fault_run.recovered("disk space back: fleet thawed", freed_at)
        await daemon.wait_status(lambda s: all_ready(s, 3), READY_S, "ready again")
        await work.wait_done()
    finally:
        work.close()
        filler.unlink(missing_ok=True)
    assert work.full, "the producer never met the full disk: the fault did not happen"
    work.assert_all_done_once()
    daemon.send_signal(signal.SIGTERM)
    assert await daemon.wait_exit() == 0


async def test_host_that_resumes_just_after_a_thaw_is_not_restarted(
    tmpfs: Path, fault_run: FaultRun
) -> None:
    """After a full-disk freeze, a worker whose heartbeat comes back a moment after the
    fleet thaws (here: it was stopped meanwhile and is continued at the thaw) keeps its pid."""
    root = tmpfs / "run"
    fault_run.write(fault_run.raw(3, root=root))
    daemon = await fault_run.start(ready=3)
    status = await daemon.status()
    pids = {h: pid_of(status, h) for h in ("worker-0", "worker-1", "worker-2")}
    filler = tmpfs / "filler"
    late = pids["worker-2"]
    try:
        mark = len(daemon.lines)
        await fill_until_frozen(fault_run, daemon, filler)
        kill(late, signal.SIGSTOP)

        def held() -> None:
            """Nothing restarted while the disk is full."""
            assert events(daemon, "host.launch")[3:] == []

        await hold_for(float(HEALTH["heartbeat_stale_s"]) + 0.5, held)
        filler.unlink()
        await wait_event(daemon, "fleet.thawed", after=mark)
        kill(late, signal.SIGCONT)
        await daemon.wait_status(lambda s: all_ready(s, 3), READY_S, "ready again")
    finally:
        kill(late, signal.SIGCONT)
        filler.unlink(missing_ok=True)
    assert fault_run.monitor.pids_seen(2) == [late]
    assert events(daemon, "host.launch")[3:] == []
