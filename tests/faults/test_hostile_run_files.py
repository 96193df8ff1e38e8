"""A live daemon and hostile files in its run directory: a planted run lock, a state file that
is a FIFO or holds impossible values, a stop sentinel that is a symlink, and a bounded,
seeded fuzz of exit records. The daemon never follows, never blocks, never crashes.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor import control
from supervisor.config import load
from supervisor.layout import layout_of
from tests.faults.harness import FaultRun, events, host_row, pid_of
from tests.integration.test_hostile_files import Victim, plant_fifo, plant_symlink
from tests.system.daemonproc import DaemonProcess

pytestmark = [pytest.mark.faults, pytest.mark.system, pytest.mark.openssh]

#: Generous: the machines are shared and noisy.
WAIT_S = 60.0
#: Exit records the fuzz writes: enough shapes of each kind, small enough to stay quick.
FUZZ_CASES = 60
FUZZ_SEED = 16


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
async def test_a_planted_run_lock_stops_start_up_and_names_it(
    fault_run: FaultRun, plant: str
) -> None:
    """``ctl/supervisor.lock`` planted as a symlink to a victim or as a FIFO: the daemon
    exits 1 at once with ``daemon.cannot_start`` naming the lock; the victim is unchanged."""
    config = fault_run.write(fault_run.raw(1))
    lock = fault_run.root / "ctl" / "supervisor.lock"
    victim = Victim.create(fault_run.tmp_path / "victim")
    if plant == "symlink":
        plant_symlink(lock, victim.path)
    else:
        plant_fifo(lock)
    daemon = DaemonProcess(config, fault_run.tmp_path)
    fault_run.daemons.append(daemon)
    await daemon.start()
    assert await daemon.wait_exit(WAIT_S) == 1
    [line] = events(daemon, "daemon.cannot_start")
    assert line["reason"].startswith(f"{lock}: ")
    victim.assert_unchanged()


async def test_state_file_fifo_then_impossible_values_never_hold_up_start(
    fault_run: FaultRun,
) -> None:
    """A FIFO as ``supervisor-state.json`` is reported (naming it) and start-up reaches READY;
    the stop then writes a real state file over it. A state file whose worker-0 entry has a
    NaN and a far-future time and whose worker-1 entry is valid: worker-0's is skipped with
    one problem, worker-1's restart count carries over."""
    config = fault_run.write(fault_run.raw(2))
    state = layout_of(load(config)).state_file
    plant_fifo(state)
    daemon = await fault_run.start(ready=2)
    [unreadable] = events(daemon, "history.unreadable")
    assert unreadable["path"] == str(state) and "not a regular file" in unreadable["reason"]
    assert await fault_run.stop(daemon) == 0
    assert state.is_file() and not state.is_symlink()

    saved = json.loads(state.read_text())
    saved["hosts"]["worker-0"].update(next_restart_at=math.nan, restart_times=[1e300])
    saved["hosts"]["worker-1"].update(restarts=3)
    state.write_text(json.dumps(saved))  # json writes NaN, as a careless writer would
    daemon = await fault_run.start(ready=2)
    [bad] = events(daemon, "history.bad_entry")
    assert (bad["host"], bad["path"]) == ("worker-0", str(state))
    assert "restart_times holds 1e+300" in bad["problem"]
    status = await daemon.status()
    assert (host_row(status, "worker-0")["restarts"], host_row(status, "worker-1")["restarts"]) == (
        0,
        3,
    )


async def test_stop_host_writes_its_sentinel_over_a_planted_symlink(fault_run: FaultRun) -> None:
    """``stop-host`` with ``ctl/worker-0.stop`` planted as a symlink to a victim: the host
    stops, the sentinel is a file of its own, the victim keeps its bytes."""
    config = fault_run.write(fault_run.raw(1))
    daemon = await fault_run.start(ready=1)
    sentinel = layout_of(load(config)).stop_sentinel("worker-0")
    victim = Victim.create(fault_run.tmp_path / "victim")
    plant_symlink(sentinel, victim.path)
    socket = Path(load(config).control.socket)
    await control.request(socket, "stop-host", host="worker-0", timeout_s=WAIT_S)
    await daemon.wait_status(
        lambda s: host_row(s, "worker-0")["state"] == "stopped", WAIT_S, "worker-0 stopped"
    )
    assert sentinel.is_file() and not sentinel.is_symlink()
    victim.assert_unchanged()


def garbage_exit_records(rng: random.Random, avoid: set[int]) -> list[bytes]:
    """Seeded exit-record contents: random bytes, ids of every wrong type and size, nesting
    past the recursion limit, a line past the 64 KiB cap, NUL and invalid UTF-8, and valid
    records naming pids that are no worker's."""

    def bogus_pid() -> int:
        """A pid no worker of this test has."""
        while (pid := rng.choice([1, 2, rng.randrange(3, 1 << 22), (1 << 31) - 1])) in avoid:
            pass
        return pid

    makers: list[Callable[[], bytes]] = [
        lambda: rng.randbytes(rng.randrange(0, 2048)),
        lambda: json.dumps(
            {"pid": rng.choice([1.5, -7, 0, "12", True, None, [3], {"a": 1}])}
        ).encode(),
        lambda: b'{"pid": 1e999, "exit_code": 1}',
        lambda: b'{"pid": ' + b"9" * 4000 + b"}",
        lambda: b'{"pid": ' + b"9" * 5000 + b"}",
        lambda: b"[" * rng.randrange(1000, 200_000),
        lambda: b'{"pid": 5, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        lambda: b'{"pid": 3, "pad": "' + b"x" * (70 * 1024) + b'"}',
        lambda: b'{"pid": 4\x00, "exit_code": 1}\xff\xfe',
        lambda: json.dumps(
            {
                "pid": bogus_pid(),
                "exit_code": rng.choice([0, 1, -1, 10**300, "x", None, 1.5]),
                "signal": rng.choice([9, 15, 0, 10**300, -3, "KILL", None]),
                "exited_at": rng.choice([math.nan, math.inf, 1e308, -5, "now", None]),
            }
        ).encode(),
    ]
    return [rng.choice(makers)() for _ in range(FUZZ_CASES)]


def read_since_written(path: Path) -> Callable[[], bool]:
    """Whether ``path`` (written with an access time of 0) has been read since."""
    return lambda: path.stat().st_atime_ns > 0


async def test_exit_record_fuzz_never_disturbs_the_daemon_or_the_workers(
    fault_run: FaultRun,
) -> None:
    """A seeded stream of garbage exit records for both hosts, each read by the daemon before
    the next is written: the daemon keeps answering, both hosts stay ready with the same
    workers, nothing restarts and no state changes."""
    config = fault_run.write(fault_run.raw(2))
    daemon = await fault_run.start(ready=2)
    before = await daemon.status()
    pids = {pid_of(before, h) for h in ("worker-0", "worker-1")}
    run = layout_of(load(config))
    begin = len(daemon.lines)
    rng = random.Random(FUZZ_SEED)
    for i, data in enumerate(garbage_exit_records(rng, pids)):
        path = run.exit_record(f"worker-{i % 2}")
        tmp = path.with_name(f".fuzz-{i}.tmp")
        tmp.write_bytes(data)
        # An access time of 0: a read by the daemon sets it to now, which the wait sees.
        os.utime(tmp, ns=(0, tmp.stat().st_mtime_ns))
        os.replace(tmp, path)
        await daemon.wait_until(
            read_since_written(path), WAIT_S, f"the daemon to read fuzz case {i} ({data[:40]!r})"
        )
    after = await daemon.status()
    for host in ("worker-0", "worker-1"):
        row = host_row(after, host)
        assert (row["state"], row["restarts"]) == ("ready", 0), row
    assert {pid_of(after, h) for h in ("worker-0", "worker-1")} == pids
    later = daemon.lines[begin:]
    assert [line for line in later if line.get("event") == "host.state"] == []
    assert [line for line in later if line.get("level") == "error"] == []


async def test_a_name_that_is_not_utf_8_never_stops_the_daemon(fault_run: FaultRun) -> None:
    """Names of any bytes made in ``ctl/`` and ``status/`` while the daemon watches them by
    inotify (watchfiles cannot decode such a name, and raised out of the watcher, ending the
    daemon): the watch is restarted, the daemon keeps serving, the worker stays ready and its
    heartbeats are still seen."""
    config = fault_run.write(fault_run.raw(1, watch={"mode": "inotify"}))
    daemon = await fault_run.start(ready=1)
    pid = pid_of(await daemon.status(), "worker-0")
    run = layout_of(load(config))
    assert daemon.process is not None
    begin = len(daemon.lines)
    for where in (run.ctl, run.status_dir):
        failed = len(events(daemon, "watch.failed"))
        fd = os.open(os.fsencode(where) + b"/\xff.stop", os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)

        def failed_or_ended(failed: int = failed) -> bool:
            """The watch failed once more, or the daemon ended."""
            return (
                len(events(daemon, "watch.failed")) > failed
                or daemon.process is None
                or daemon.process.returncode is not None
            )

        def resumed(failed: int = failed) -> bool:
            """The watch ran again after that failure."""
            return len(events(daemon, "watch.resumed")) > failed

        await daemon.wait_until(
            failed_or_ended, WAIT_S, f"the watcher to fail over a name in {where} it cannot decode"
        )
        assert daemon.process.returncode is None, "the daemon ended"
        await daemon.wait_until(resumed, WAIT_S, "the watch to run again")
    await daemon.wait_status(
        lambda s: (
            (h := host_row(s, "worker-0"))["heartbeat_age_s"] is not None
            and h["heartbeat_age_s"] < 1.0
        ),
        WAIT_S,
        "a fresh heartbeat of worker-0 seen after the watch restarted",
    )
    status = await daemon.status()
    assert (host_row(status, "worker-0")["state"], pid_of(status, "worker-0")) == ("ready", pid)
    assert [line for line in daemon.lines[begin:] if line.get("event") == "host.state"] == []
