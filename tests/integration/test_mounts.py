"""A hung or full run filesystem: real FUSE mounts whose server is stopped, a real full tmpfs."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Literal

import pytest

from supervisor import config as config_mod
from supervisor import runfiles, view
from supervisor.mounts import FilesystemCheck, check_filesystem
from supervisor.statusfiles import (
    ExitObserved,
    ExitRecord,
    Observation,
    SentinelObserved,
    StatusObserved,
    StatusProblem,
    StatusRecord,
)
from supervisor.watch import Watcher
from tests.conftest import bindfs_mount, mounted_tmpfs


async def test_filesystem_check_names_a_hung_mount_without_hanging(tmp_path: Path) -> None:
    """statvfs of a FUSE mount whose server is stopped never returns: the check gives up after
    its timeout, says the mount looks hung, and the event loop was never blocked."""
    with bindfs_mount(tmp_path) as (run, server):
        os.kill(server, signal.SIGSTOP)
        try:
            ticks = 0

            async def tick() -> None:
                """Count event-loop turns while the check waits."""
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)  # wait-ok: a heartbeat of the loop, not a wait

            async with asyncio.TaskGroup() as tasks:
                ticker = tasks.create_task(tick())
                check = await check_filesystem(run, timeout_s=0.5)
                ticker.cancel()
        finally:
            os.kill(server, signal.SIGCONT)
    assert check == FilesystemCheck(answered=False)
    assert "hung" in check.finding
    assert ticks > 5  # the loop kept running while statvfs hung


async def test_filesystem_check_tells_a_full_disk_from_a_healthy_one(tmp_path: Path) -> None:
    """A filled tmpfs is reported full; an ordinary directory answers with its free space."""
    healthy = await check_filesystem(tmp_path, timeout_s=10)
    assert healthy.answered and healthy.free_bytes and healthy.free_bytes > 1 << 20
    assert healthy.finding.startswith("the run root answers")
    with mounted_tmpfs(tmp_path / "small", "4m") as small:
        with (small / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        full = await check_filesystem(small, timeout_s=10)
    assert full.answered and full.free_bytes is not None and full.free_bytes < 1 << 20
    assert full.finding.startswith("the run filesystem is full")
    missing = await check_filesystem(tmp_path / "absent", timeout_s=10)
    assert missing.error is not None and "cannot be examined" in missing.finding


async def test_a_watcher_on_a_hung_mount_keeps_the_loop_turning(tmp_path: Path) -> None:
    """Built and started on a FUSE mount whose server is stopped, the watcher never blocks the
    event loop: its look at the filesystem hangs in its file thread, and it is not healthy."""
    with bindfs_mount(tmp_path) as (run, server):
        os.kill(server, signal.SIGSTOP)
        # Only if the loop itself hangs (the failure this test catches) does this ever fire:
        # it lets the test end, and fail, instead of hanging the run.
        rescue = threading.Timer(30, os.kill, (server, signal.SIGCONT))
        rescue.start()
        try:
            ticks = 0

            async def tick() -> None:
                """Count event-loop turns while the watcher starts."""
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)  # wait-ok: a heartbeat of the loop, not a wait

            def sink(batch: list[Observation]) -> None:
                """Nothing is read while the mount hangs."""

            async with asyncio.TaskGroup() as tasks:
                ticker = tasks.create_task(tick())
                # Never looked up before, so the kernel has to ask the stopped server.
                watcher = Watcher(
                    run / "run",
                    ["h1"],
                    mode="auto",
                    poll_interval_s=0.1,
                    debounce_ms=20,
                    rescan_interval_s=3600,
                )
                watching = tasks.create_task(watcher.run(sink))
                async with asyncio.timeout(20):
                    while ticks < 50:  # noqa: ASYNC110 (counting loop turns is the point)
                        await asyncio.sleep(0.01)  # wait-ok: a heartbeat of the loop
                still_stopped = _state_of(server) == "T"
                looked, healthy = watcher.mode, watcher.healthy(asyncio.get_running_loop().time())
                # Let the look return before the mount goes: umount fails while a lookup in
                # it is pending, so the file thread must be out of the mount first.
                os.kill(server, signal.SIGCONT)
                async with asyncio.timeout(20):
                    while watcher.mode is None:  # noqa: ASYNC110 (the watcher exposes state)
                        await asyncio.sleep(0.01)  # wait-ok: polling interval of a condition
                watching.cancel()
                ticker.cancel()
            reader = watcher._files._thread
            if reader is not None:
                await asyncio.to_thread(reader.join, 20)
        finally:
            rescue.cancel()
            os.kill(server, signal.SIGCONT)
    assert still_stopped, "the server was let go: the loop had been blocked until then"
    assert (looked, healthy) == (None, False)


def _state_of(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


@contextlib.contextmanager
def _hung_mount(tmp_path: Path) -> Iterator[Path]:
    """A FUSE mount whose server is stopped while in the block (let go after 60 s at most, so
    a test that hangs on it ends, and fails, instead of hanging the run)."""
    with bindfs_mount(tmp_path) as (mount, server):
        os.kill(server, signal.SIGSTOP)
        rescue = threading.Timer(60, os.kill, (server, signal.SIGCONT))
        rescue.start()
        try:
            yield mount
        finally:
            rescue.cancel()
            os.kill(server, signal.SIGCONT)


class Deliveries:
    """What a watcher delivers, and a wait for one observation among it."""

    def __init__(self) -> None:
        self.seen: list[Observation] = []
        self._changed = asyncio.Event()

    def sink(self, batch: list[Observation]) -> None:
        """Keep what the watcher delivers."""
        self.seen.extend(batch)
        self._changed.set()

    async def wait_for(self, wanted: Observation) -> None:
        """Wait until the watcher has delivered ``wanted``."""
        async with asyncio.timeout(20):
            while wanted not in self.seen:
                self._changed.clear()
                await self._changed.wait()


@contextlib.asynccontextmanager
async def watching(
    run: Path, hosts: list[str], mode: Literal["inotify", "poll"]
) -> AsyncIterator[tuple[Watcher, Deliveries]]:
    """A fast watcher of ``run`` running while in the block (cancelled at its end)."""
    deliveries = Deliveries()
    watcher = Watcher(
        run, hosts, mode=mode, poll_interval_s=0.1, debounce_ms=20, rescan_interval_s=3600
    )
    task = asyncio.create_task(watcher.run(deliveries.sink))
    try:
        yield watcher, deliveries
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def join_reader(watcher: Watcher) -> None:
    """Wait for the watcher's file thread to end: once the mount answers again it can."""
    reader = watcher._files._thread
    if reader is not None:
        await asyncio.to_thread(reader.join, 60)


@pytest.mark.parametrize(
    ("mode", "planted"),
    [("inotify", "ctl/h1.stop"), ("poll", "ctl/h1.stop"), ("poll", "status/h1.json")],
)
async def test_a_symlink_into_a_hung_mount_never_stops_the_watch(
    tmp_path: Path, mode: Literal["inotify", "poll"], planted: str
) -> None:
    """Whoever can write the run root plants a host's stop sentinel or status file as a
    symlink to a name on a hung mount: the watcher never follows it (a stat through it would
    hang its one file thread, and with it every host's heartbeats and exits), and the other
    hosts' files are still read."""
    run = tmp_path / "run"
    for sub in ("status", "ctl"):
        (run / sub).mkdir(parents=True)
    for host in ("h1", "h2"):
        runfiles.write_json_atomic(
            run / "status" / f"{host}.json", {"pid": 7, "heartbeat_at": 1.0}, root=None
        )
    with _hung_mount(tmp_path) as hung:
        async with watching(run, ["h1", "h2"], mode) as (watcher, deliveries):
            await deliveries.wait_for(StatusObserved("h2", StatusRecord(7, False, 1.0, None)))
            target = run / planted
            target.unlink(missing_ok=True)
            # Never looked up: the kernel must ask the stopped server.
            target.symlink_to(hung / "never-looked-up")
            fresh = StatusRecord(pid=8, ready=True, heartbeat_at=2.0, seq=2)
            runfiles.write_json_atomic(
                run / "status" / "h2.json",
                {"pid": 8, "ready": True, "heartbeat_at": 2.0, "seq": 2},
                root=None,
            )
            await deliveries.wait_for(StatusObserved("h2", fresh))
            if planted.endswith(".stop"):
                # A name under the sentinel's name is a sentinel, whatever it points to.
                await deliveries.wait_for(SentinelObserved("h1", True))
            else:
                await deliveries.wait_for(StatusObserved("h1", StatusProblem("a symbolic link")))
    await join_reader(watcher)


@pytest.mark.parametrize("mode", ["inotify", "poll"])
@pytest.mark.parametrize("swapped", ["status", "ctl"])
async def test_a_run_directory_swapped_for_a_symlink_into_a_hung_mount_never_stops_the_watch(
    tmp_path: Path, mode: Literal["inotify", "poll"], swapped: str
) -> None:
    """``status/`` or ``ctl/`` replaced by a symlink to a hung mount: the watcher never goes
    through it (the hosts' files there are missing), and the other directory is still read."""
    run = tmp_path / "run"
    for sub in ("status", "ctl"):
        (run / sub).mkdir(parents=True)
    runfiles.write_json_atomic(
        run / "status" / "h1.json", {"pid": 7, "heartbeat_at": 1.0}, root=None
    )
    with _hung_mount(tmp_path) as hung:
        async with watching(run, ["h1"], mode) as (watcher, deliveries):
            await deliveries.wait_for(StatusObserved("h1", StatusRecord(7, False, 1.0, None)))
            shutil.rmtree(run / swapped)
            (run / swapped).symlink_to(hung / "never-looked-up")
            if swapped == "ctl":
                runfiles.write_json_atomic(
                    run / "status" / "h1.json", {"pid": 8, "heartbeat_at": 2.0}, root=None
                )
                await deliveries.wait_for(StatusObserved("h1", StatusRecord(8, False, 2.0, None)))
            else:
                await deliveries.wait_for(StatusObserved("h1", StatusProblem("missing")))
                runfiles.write_json_atomic(run / "ctl" / "h1.exit.json", {"pid": 7}, root=None)
                await deliveries.wait_for(ExitObserved("h1", ExitRecord(7, None, None, None)))
    await join_reader(watcher)


@pytest.mark.parametrize("planted", ["ctl/h1.stop", "status", "ctl"])
async def test_the_offline_view_never_goes_through_a_symlink_into_a_hung_mount(
    tmp_path: Path, planted: str
) -> None:
    """What a standby daemon reads of the run (and ``status`` without a daemon): a stop
    sentinel, ``status/`` or ``ctl/`` planted as a symlink into a hung mount is not followed,
    so the read returns (a standby waiting on it forever would never take over)."""
    raw = {
        "run": {"root": str(tmp_path / "run")},
        "ssh": {"known_hosts": str(tmp_path / "known_hosts")},
        "hosts": [{"name": "h1", "shard": 0}, {"name": "h2", "shard": 1}],
    }
    cfg = config_mod.parse(raw, tmp_path / "rs.toml")
    run = cfg.run.root
    for sub in ("status", "ctl"):
        (run / sub).mkdir(parents=True)
    for host in ("h1", "h2"):
        runfiles.write_json_atomic(
            run / "status" / f"{host}.json",
            {"pid": 7, "ready": True, "heartbeat_at": 1.0},
            root=None,
        )
    with _hung_mount(tmp_path) as hung:
        target = run / planted
        if target.is_dir():
            shutil.rmtree(target)
        target.symlink_to(hung / "never-looked-up")
        async with asyncio.timeout(20):
            status = await asyncio.to_thread(view.offline_status, cfg)
            detail = await asyncio.to_thread(view.offline_host_detail, cfg, "h1")
    rows = status["hosts"]
    if planted == "status":
        assert rows["h1"]["verdict"] == rows["h2"]["verdict"] == "status_missing"
    else:
        assert rows["h1"]["status_pid"] == rows["h2"]["status_pid"] == 7
    assert rows["h1"]["stop_sentinel"] is (planted == "ctl/h1.stop")
    assert detail["stop_sentinel"] is (planted == "ctl/h1.stop")


def _exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` at once (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange):
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(a))


async def test_status_swapped_back_and_forth_with_a_symlink_into_a_hung_mount_never_blocks_the_loop(
    tmp_path: Path,
) -> None:
    """Whoever can write the run root swaps ``status/`` with a symlink into a hung mount over
    and over, each swap restarting the inotify watch: watchfiles adds its watches on the
    event loop holding the GIL, so a watch added by path through the symlink would freeze the
    whole process (every thread) until the mount answers. The loop keeps turning."""
    run = tmp_path / "run"
    for sub in ("status", "ctl"):
        (run / sub).mkdir(parents=True)
    with bindfs_mount(tmp_path) as (hung, server):
        os.kill(server, signal.SIGSTOP)
        # A thread could not let the server go while the GIL is held: another process does.
        rescue = await asyncio.create_subprocess_exec("sh", "-c", f"sleep 40; kill -CONT {server}")
        stop = threading.Event()
        other = run / ".other"
        other.symlink_to(hung / "never-looked-up")

        def swap() -> None:
            """Exchange status/ and the symlink until told to stop (an even count of swaps,
            so status/ ends as the directory)."""
            while not stop.is_set():
                _exchange(run / "status", other)
                _exchange(run / "status", other)

        swapper = threading.Thread(target=swap, daemon=True)
        watcher = Watcher(
            run, ["h1"], mode="inotify", poll_interval_s=0.1, debounce_ms=20, rescan_interval_s=3600
        )
        task = asyncio.create_task(watcher.run(lambda batch: None))
        loop = asyncio.get_running_loop()
        worst = 0.0
        try:
            swapper.start()
            last = end = loop.time()
            end += 15
            while last < end:
                await asyncio.sleep(0.01)  # wait-ok: a heartbeat of the loop, not a wait
                now = loop.time()
                worst, last = max(worst, now - last), now
        finally:
            stop.set()
            os.kill(server, signal.SIGCONT)
            rescue.kill()
            await rescue.wait()
            await asyncio.to_thread(swapper.join, 60)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        reader = watcher._files._thread
        if reader is not None:
            await asyncio.to_thread(reader.join, 60)
    # A watch added through the symlink freezes the process until the rescue, 40 s in: any
    # stall well short of that is the machine's load (6 s seen with three interpreters' tests
    # and this test's swapping thread on two cores), not the hung mount.
    assert worst < 20.0, f"the event loop stood still for {worst:.1f} s"
